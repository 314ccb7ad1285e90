"""`gradcomp train`: data-parallel training with a compressor, on real worker processes or a simulated cluster.

Three ways to run the same training:

- spawned: ``launch`` starts W worker processes itself (torch.multiprocessing, gloo on 127.0.0.1, a free port);
- torchrun: when RANK / WORLD_SIZE are set, this process is one worker of an existing launch (gloo, or NCCL
  with ``--device cuda``);
- simulated (``--simulate``): one process, W threads of a ``SimulatedCluster``, each running the same
  ``run_worker`` loop with its own replica; they take turns between collectives.

With ``local_steps`` n (communication delay) workers exchange their accumulated weight update every n
local optimizer steps instead of a gradient every step (``LocalUpdateExchange``); n = 1 exchanges each
step's update, which carries the local momentum (as SBC does), unlike the default gradient exchange.

Every worker holds a replica initialised from the same seed and reads its own disjoint shard of each epoch's
shared permutation. The result dict (also ``--json``) carries the bits each worker sent and received as
counted by the transport, the time split, and the test accuracy of the (identical) replicas.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradcomp.errors import ConfigError
from gradcomp.experiments.run.checkpoint import WorkerCheckpoints
from gradcomp.experiments.run.data import Dataset, TextDataset, evaluate, evaluate_text, load_dataset, shard_indices
from gradcomp.experiments.run.models import TEXT_MODELS, build_model
from gradcomp.experiments.run.report import human_bits
from gradcomp.netmodel import NetworkModel, parse_bandwidth, parse_latency
from gradcomp.registry import make
from gradcomp.train.aggregator import GRANULARITIES, GradientAggregator
from gradcomp.train.exchange import TOPOLOGIES, build_scheme
from gradcomp.train.local_steps import LocalUpdateExchange, check_compressors
from gradcomp.transport.base import ByteCounter, Transport
from gradcomp.transport.sim import SimulatedCluster

# Seconds a worker waits at a collective for the others. It was 900 s: a stopped or hung worker was then reported
# after a quarter of an hour. The longest normal wait in `gradcomp train` is a few seconds (rank 0 evaluating the
# test set while the others wait for the next step, a worker importing torch on a busy machine); 120 s leaves a
# wide margin for that and still reports a stuck worker within two minutes.
DEFAULT_TIMEOUT_S = 120.0

OPTIMIZERS: tuple[str, ...] = ("sgd", "adamw", "onebit_adam", "zero_one_adam")
# the optimizers that exchange themselves (train/onebit_adam.py, train/zero_one_adam.py): no compressor, no hook
EXCHANGING_OPTIMIZERS: tuple[str, ...] = ("onebit_adam", "zero_one_adam")
ADAM_FAMILY: tuple[str, ...] = ("adamw", *EXCHANGING_OPTIMIZERS)
OUTER_OPTIMIZERS: tuple[str, ...] = ("sgd", "nesterov")
# the share of the run's steps that 1-bit Adam and 0/1 Adam run dense (their freeze step) when none is given
DEFAULT_FREEZE_FRACTION = 0.15
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine", "step")


def launched_by_torchrun() -> bool:
    """Whether this process is one worker of a launch that set RANK and WORLD_SIZE (torchrun, or the like)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


FSDP_REFUSALS = (  # what --fsdp does not carry: (test on the config and the server compressor, message)
    (lambda c, s: c.simulate, "--fsdp needs real workers (a torch.distributed process group): drop --simulate"),
    (lambda c, s: c.ddp, "give --fsdp or --ddp, not both"),
    (lambda c, s: c.local_steps is not None, "--fsdp exchanges gradients inside backward: no --local-steps"),
    (lambda c, s: c.topology != "auto" or s is not None, "--fsdp compresses FSDP's reduce-scatter (every rank owns "
     "1/W of every parameter): it takes no --topology or --server-compressor"),
    (lambda c, s: c.checkpoint_dir is not None or c.resume_dir is not None, "--fsdp does not write or read the "
     "runner's checkpoints (gradcomp.compress_fsdp's state has state_dict for your own loop)"),
    (lambda c, s: c.weight_decay_in_gradient,
     "--fsdp with a method that applies momentum itself takes no --weight-decay"),
)


@contextlib.contextmanager
def _naming(name: str, option: str):
    """A method's ConfigError (a parameter out of range: "density must lie in (0, 1]") prefixed with the option
    and method it came from, where it does not name the method itself."""
    try:
        yield
    except ConfigError as exc:
        if exc.args and isinstance(exc.args[0], str) and repr(name) not in exc.args[0]:
            raise ConfigError(f"{option} {name}: {exc.args[0]}") from None
        raise


@dataclass
class TrainConfig:
    compressor: str = "none"
    params: dict[str, Any] = field(default_factory=dict)
    error_feedback: bool | None = None  # None: the compressor's default (on for sbc / stc)
    # a feedback policy instead (gradcomp.feedback.FEEDBACK_POLICIES); the momentum policies take the
    # optimizer's momentum (feedback_momentum, set by hand_momentum_to_method)
    feedback: str | None = None
    feedback_momentum: float | None = None
    granularity: str = "layer"
    topology: str = "auto"
    server_compressor: str | None = None
    server_params: dict[str, Any] = field(default_factory=dict)
    server_error_feedback: bool = True
    workers: int = 4
    # None: exchange gradients every step; n >= 1: exchange the accumulated weight update every n local
    # optimizer steps (communication delay; n = 1 sends each step's update, momentum included)
    local_steps: int | None = None
    # with local steps: the outer optimizer applied to the averaged update (DiLoCo: nesterov, lr 0.7, momentum
    # 0.9; sgd with lr 1 and momentum 0 is plain averaging)
    outer_optimizer: str = "sgd"
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    # the first dense_steps steps exchange dense fp32 gradients (torch PowerSGD's start_iter), then the method
    dense_steps: int = 0
    # 1-bit Adam's freeze step / 0/1 Adam's variance freeze step (None: DEFAULT_FREEZE_FRACTION of the steps)
    freeze_step: int | None = None
    warmup_compressor: str = "none"  # 1-bit Adam: what its warm-up's gradients go through (fp32 by default)
    var_update_scaler: int = 16  # 0/1 Adam's kappa
    local_step_scaler: int = 50  # 0/1 Adam: its local-step interval doubles every this many steps
    local_step_clipper: int = 16  # 0/1 Adam: ... to at most this many local steps
    epochs: float = 1.0
    steps: int | None = None
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9  # SGD's; AdamW has none (its first moment is beta1)
    weight_decay: float = 0.0  # SGD: L2 added to the gradient; AdamW: decoupled decay of the weights
    optimizer: str = "sgd"  # sgd or adamw
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's
    eps: float = 1e-8  # AdamW's
    # the learning rate at each step: lr · warm-up · schedule (lr_at); a pure function of the step, so a resumed
    # run needs no scheduler state
    lr_schedule: str = "constant"  # constant, cosine (to 0 at the last step) or step (x lr_gamma every lr_step_size)
    warmup_steps: int = 0  # linear warm-up from lr/warmup_steps to lr over the first warmup_steps steps
    lr_step_size: int | None = None
    lr_gamma: float = 0.1
    context: int = 128  # the window of a language model, in bytes (text datasets only)
    # True when the method applies momentum itself (set by hand_momentum_to_method): weight decay is then added
    # to each gradient before the exchange, so it goes through the method's momentum and error accumulation as
    # in SGD with momentum, instead of being added by the optimizer after the exchange
    weight_decay_in_gradient: bool = False
    dataset: str = "mnist"
    data_root: str | None = None
    model: str = "cnn"
    seed: int = 0
    simulate: bool = False
    device: str = "cpu"
    eval_every: int = 0
    save_path: str | None = None
    bandwidth: str | float | None = None  # price the measured collectives on this network, e.g. "1Gbit"
    latency: str | float = 0.0  # per-message latency for that model, e.g. "50us"
    progress: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    ddp: bool = False  # train a DistributedDataParallel model with gradcomp's communication hook
    bucket_cap_mb: float | None = None  # DDP's bucket size (None: DDP's default, 25 MB)
    fsdp: bool = False  # train an FSDP2 model whose reduce-scatter is compressed (experiments/run/fsdp_run.py)
    # resumable checkpoints (gradcomp.experiments.run.checkpoint): every rank's state into checkpoint_dir every
    # checkpoint_every steps and after the last one; resume_dir (or, with resume_if_present, checkpoint_dir
    # when it holds one) is loaded on every rank before training
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    checkpoint_keep: int = 2  # the newest K checkpoints are kept; 0 keeps all
    resume_dir: str | None = None
    resume_if_present: bool = False

    def validate(self) -> None:
        """Everything that can be checked before a worker starts; raises ConfigError."""
        if self.steps is not None and self.steps < 1:  # (first: the warm-up's check below speaks of the steps)
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        self._check_optimizer()
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.local_steps is not None and self.local_steps < 1:
            raise ConfigError(f"local_steps must be >= 1, got {self.local_steps}")
        self._check_outer_and_dense()
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.epochs > 0:
            raise ConfigError(f"epochs must be > 0, got {self.epochs}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        # numbers that would otherwise fail only inside the workers (torch's SGD, the process group, the loop)
        for option, value in (("--lr", self.lr), ("--epochs", self.epochs)):
            if not math.isfinite(value):
                raise ConfigError(f"{option} must be a finite number, got {value}")
        for option, value in (("--momentum", self.momentum), ("--weight-decay", self.weight_decay)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{option} must be a number >= 0, got {value}")
        if self.feedback_momentum is not None and not (math.isfinite(self.feedback_momentum)
                                                       and self.feedback_momentum >= 0):
            raise ConfigError(f"the feedback policy's momentum must be >= 0, got {self.feedback_momentum}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"--timeout must be a positive number of seconds, got {self.timeout_s}")
        if self.eval_every < 0:
            raise ConfigError(f"--eval-every must be >= 0 (0: no accuracy curve), got {self.eval_every}")
        if self.bandwidth is None and parse_latency(self.latency, "--latency") != 0:
            raise ConfigError(
                f"--latency {self.latency} prices messages only together with a bandwidth: give --bandwidth too"
            )
        if self.save_path is not None:
            from gradcomp.experiments.run.report import check_output_file

            check_output_file(self.save_path, "--save")  # rank 0 writes it only after training
        if self.granularity not in GRANULARITIES:
            raise ConfigError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.topology not in TOPOLOGIES:
            raise ConfigError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        if self.ddp and self.simulate:
            raise ConfigError("--ddp needs real workers (a torch.distributed process group): drop --simulate")
        if self.ddp and self.local_steps is not None:
            raise ConfigError("--ddp exchanges gradients inside backward: it cannot take --local-steps")
        if self.ddp and self.granularity != "layer":
            raise ConfigError("--ddp compresses every parameter of a bucket as its own slot: use --granularity layer")
        if self.bucket_cap_mb is not None and not self.ddp:
            raise ConfigError("--bucket-cap-mb sets DDP's bucket size: it needs --ddp")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ConfigError(f"--bucket-cap-mb must be a positive size in MB, got {self.bucket_cap_mb}")
        if self.server_compressor is None and self.server_params:
            raise ConfigError(
                "--server-param needs --server-compressor (with --topology ps): without a server compressor "
                f"{', '.join(sorted(self.server_params))} would be ignored"
            )
        if self.server_compressor is None and not self.server_error_feedback:
            raise ConfigError("--no-server-error-feedback needs --server-compressor: without one there is no server "
                              "residual to turn off")
        if self.device == "cuda":
            self._check_gpus()
        compressor, server = self.build_compressors()
        if self.local_steps is not None:
            check_compressors(compressor, server)  # no majority vote (worker or server side) with local steps
        scheme = build_scheme(compressor, topology=self.topology, server_compressor=server)
        self.network()
        # per-tensor limits (k larger than a layer, ...) checked on the real model's slots, before any worker
        data = self.load_data()
        share = data.train_x.shape[0] // self.workers
        if self.batch_size > share:
            raise ConfigError(
                f"--batch-size {self.batch_size} is more than each worker's share of the training set: "
                f"{data.train_x.shape[0]} examples of {self.dataset} over {self.workers} workers are {share} each"
            )
        model = build_model(self.model, data, self.seed)
        if self.fsdp:  # FSDP2 with a compressed reduce-scatter (experiments/run/fsdp_run.py, docs/fsdp.md)
            from gradcomp.train.fsdp import check_fsdp_method

            for refused, message in FSDP_REFUSALS:
                if refused(self, server):
                    raise ConfigError(message)
            return check_fsdp_method(compressor, model, self.workers)
        scheme.bind(0, self.workers)  # a sharded scheme checks shards, which depend on W
        scheme.check_slots(GradientAggregator.slots_for(list(model.named_parameters()), self.granularity))

    def load_data(self) -> Dataset:
        return load_dataset(self.dataset, self.data_root, context=self.context)

    def _check_optimizer(self) -> None:
        """The optimizer and its learning-rate schedule: names, numbers, and the methods AdamW cannot take."""
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"unknown --lr-schedule {self.lr_schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be a whole number >= 0, got {self.warmup_steps!r}")
        if self.steps is not None and self.warmup_steps >= self.steps:
            raise ConfigError(f"--warmup-steps {self.warmup_steps} leaves no step of the {self.steps} to train at "
                              "the full learning rate: give fewer warm-up steps or more --steps")
        if self.lr_schedule == "step":
            if self.lr_step_size is None:
                raise ConfigError("--lr-schedule step needs --lr-step-size N (multiply the learning rate by "
                                  "--lr-gamma every N steps)")
        if self.lr_step_size is not None:
            if self.lr_schedule != "step":
                raise ConfigError(f"--lr-step-size applies to --lr-schedule step, not {self.lr_schedule}")
            if isinstance(self.lr_step_size, bool) or not isinstance(self.lr_step_size, int) or self.lr_step_size < 1:
                raise ConfigError(f"--lr-step-size must be a whole number >= 1, got {self.lr_step_size!r}")
        if not (math.isfinite(self.lr_gamma) and 0 < self.lr_gamma <= 1):
            raise ConfigError(f"--lr-gamma must be in (0, 1], got {self.lr_gamma}")
        if self.optimizer in EXCHANGING_OPTIMIZERS:
            self._check_exchanging_optimizer()
        if self.optimizer in ADAM_FAMILY:
            b1, b2 = self.betas
            if not all(math.isfinite(b) and 0 <= b < 1 for b in (b1, b2)):
                raise ConfigError(f"AdamW's betas must be in [0, 1), got {b1}, {b2}")
            if not (math.isfinite(self.eps) and self.eps > 0):
                raise ConfigError(f"--eps must be > 0, got {self.eps}")
            if self.momentum != 0:
                raise ConfigError("--momentum is SGD's; AdamW's first-moment decay is --beta1")
            if self.feedback in ("momentum_correction", "momentum_masking"):
                raise ConfigError(
                    f"--feedback {self.feedback} takes the optimizer's momentum into the worker (DGC), and AdamW "
                    "has no momentum to hand over: use --optimizer sgd, or --feedback residual with AdamW")
            compressor, _ = self.build_compressors()
            if getattr(compressor, "owns_momentum", False):
                raise ConfigError(
                    f"{self.compressor} applies momentum on the worker before compressing (its paper's update is "
                    "SGD with that momentum); under AdamW the optimizer would apply Adam's moments on top of it, "
                    "an update no paper defines: use --optimizer sgd with it, or a method without its own "
                    "momentum (e.g. signsgd with error feedback) with AdamW")
        if self.optimizer not in EXCHANGING_OPTIMIZERS and self.freeze_step is not None:
            raise ConfigError("--freeze-step is 1-bit Adam's and 0/1 Adam's: give --optimizer onebit_adam or "
                              "zero_one_adam")
        if self.optimizer != "onebit_adam" and self.warmup_compressor != "none":
            raise ConfigError("--warmup-compressor is 1-bit Adam's (what its dense warm-up sends): give --optimizer "
                              "onebit_adam, or --dense-steps N for a compressor's fp32 warm-up")
        if self.optimizer not in ADAM_FAMILY and (tuple(self.betas) != (0.9, 0.999) or self.eps != 1e-8):
            raise ConfigError("--beta1 / --beta2 / --eps are AdamW's: give --optimizer adamw")

    def _check_exchanging_optimizer(self) -> None:
        """1-bit Adam and 0/1 Adam exchange the momentum themselves: no compressor, hook or local steps of ours."""
        name = self.optimizer
        given = [option for option, used in (
            ("--compressor", self.compressor != "none" or bool(self.params)),
            ("--error-feedback / --feedback", bool(self.error_feedback) or self.feedback not in (None, "none")),
            ("--topology", self.topology != "auto"), ("--server-compressor", self.server_compressor is not None),
            ("--local-steps", self.local_steps is not None), ("--ddp", self.ddp), ("--fsdp", self.fsdp),
            ("--dense-steps", self.dense_steps != 0), ("--granularity model", self.granularity != "layer"),
        ) if used]
        if given:
            raise ConfigError(
                f"--optimizer {name} compresses its own momentum (signs with worker and server error feedback, "
                f"after a dense warm-up): it takes no {', '.join(given)}. Its warm-up is --freeze-step, and what "
                "the warm-up sends, --warmup-compressor"
            )
        if self.steps is None:
            raise ConfigError(f"--optimizer {name} needs --steps (its freeze step is a share of the run's steps)")
        freeze = self.resolved_freeze_step()
        if isinstance(freeze, bool) or not isinstance(freeze, int) or freeze < 1:
            raise ConfigError(f"--freeze-step must be a whole number >= 1, got {freeze!r}")
        if freeze >= self.steps:
            raise ConfigError(
                f"--freeze-step {freeze} is not before the run's last step ({self.steps} steps): "
                f"{name} would never compress; give a freeze step below {self.steps}, or use --optimizer adamw"
            )
        if name == "onebit_adam":
            from gradcomp.train.compressed_adam import DENSE_COMPRESSORS

            if self.warmup_compressor not in DENSE_COMPRESSORS:
                raise ConfigError(f"--warmup-compressor must be one of {', '.join(DENSE_COMPRESSORS)} (unbiased or "
                                  "near-lossless, so AdamW's moments see the gradient's own statistics), got "
                                  f"{self.warmup_compressor!r}")
        if name == "zero_one_adam":
            for option, value in (("--var-update-scaler", self.var_update_scaler),
                                  ("--local-step-scaler", self.local_step_scaler),
                                  ("--local-step-clipper", self.local_step_clipper)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ConfigError(f"{option} must be a whole number >= 1, got {value!r}")

    def resolved_freeze_step(self) -> int | None:
        """The freeze step 1-bit Adam / 0/1 Adam use: the one given, or 15 % of the steps (at least 1)."""
        if self.freeze_step is not None or self.steps is None:
            return self.freeze_step
        return max(1, round(DEFAULT_FREEZE_FRACTION * self.steps))

    def _check_outer_and_dense(self) -> None:
        """DiLoCo's outer optimizer needs local steps; --dense-steps needs an exchange it can swap for a dense one."""
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ConfigError(f"unknown --outer-optimizer {self.outer_optimizer!r}; valid: {', '.join(OUTER_OPTIMIZERS)}")
        outer = (self.outer_optimizer, self.outer_lr, self.outer_momentum) != ("sgd", 1.0, 0.0)
        if outer and self.local_steps is None:
            raise ConfigError("--outer-optimizer / --outer-lr / --outer-momentum apply to the averaged update of local "
                              "steps: give --local-steps H too (DiLoCo: --local-steps 32 --outer-optimizer nesterov)")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ConfigError(f"--outer-lr must be a finite number > 0, got {self.outer_lr}")
        if not (math.isfinite(self.outer_momentum) and 0 <= self.outer_momentum < 1):
            raise ConfigError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        dense = self.dense_steps
        if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
            raise ConfigError(f"--dense-steps must be a whole number >= 0, got {dense!r}")
        if dense:
            if self.steps is not None and dense >= self.steps:
                raise ConfigError(f"--dense-steps {dense} leaves none of the {self.steps} steps to the method")
            for option, used in (("--fsdp", self.fsdp), ("--local-steps", self.local_steps)):
                if used:
                    raise ConfigError(f"--dense-steps swaps the per-step gradient exchange for a dense one: "
                                      f"not with {option}")

    def lr_at(self, step: int, total: int) -> float:
        """The learning rate of 0-based ``step`` of ``total``: lr · linear warm-up · the schedule's factor."""
        factor = 1.0
        if step < self.warmup_steps:
            factor = (step + 1) / self.warmup_steps
        after = max(0, step - self.warmup_steps)
        if self.lr_schedule == "cosine":
            span = max(1, total - self.warmup_steps)
            factor *= 0.5 * (1 + math.cos(math.pi * min(after, span) / span))
        elif self.lr_schedule == "step":
            factor *= self.lr_gamma ** (after // self.lr_step_size)
        return self.lr * factor

    def _check_gpus(self) -> None:
        """NCCL gives every worker process a GPU of its own: refuse a run that would put two on one GPU.

        NCCL itself refuses (``Duplicate GPU detected``), but only once the workers have joined the group. The
        simulated cluster runs every worker in this process, on one GPU. Under torchrun the processes of this
        machine are ``LOCAL_WORLD_SIZE`` (checked before this one joins the group); a launcher that sets
        ``RANK`` and ``WORLD_SIZE`` but not ``LOCAL_WORLD_SIZE`` is not second-guessed (NCCL still checks);
        otherwise gradcomp's launcher starts ``workers`` processes here.
        """
        if not torch.cuda.is_available():
            raise ConfigError("device cuda asked for, but torch sees no CUDA device")
        if self.simulate:
            return
        launched = launched_by_torchrun()
        if launched:
            text = os.environ.get("LOCAL_WORLD_SIZE")
            if text is None:
                return
            try:
                local = int(text)
            except ValueError:
                raise ConfigError(f"LOCAL_WORLD_SIZE must be a whole number, got {text!r}") from None
            asked = f"LOCAL_WORLD_SIZE={local} (processes started on this machine)"
        else:
            local, asked = self.workers, f"--workers {self.workers}"
        gpus = torch.cuda.device_count()
        if local > gpus:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            where = f"{gpus} GPU(s) visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            fix = f"at most {gpus} process(es) per machine" if launched else (
                f"--workers {gpus} or fewer, or --simulate (every worker in one process on one GPU)"
            )
            raise ConfigError(
                f"{asked} with --device cuda needs one GPU per worker (NCCL refuses two ranks on one GPU), "
                f"but there are {where}; to fix: {fix}, or --device cpu (gloo)"
            )

    def hand_momentum_to_method(self) -> str | None:
        """A method that applies momentum itself (signum, ...) gets the optimizer's momentum set to 0.

        Returns the sentence that says so, or None when nothing changed.
        """
        compressor, _ = self.build_compressors()
        if not getattr(compressor, "owns_momentum", False):
            return None
        said = []
        if self.momentum != 0:
            before, self.momentum = self.momentum, 0.0
            if self.feedback in ("momentum_correction", "momentum_masking"):
                self.feedback_momentum = before
                said.append(
                    f"--feedback {self.feedback} keeps the momentum on the worker: the optimizer's momentum "
                    f"{before:g} moves into it (optimizer momentum 0)"
                )
            else:
                said.append(
                    f"{self.compressor} applies momentum on the worker itself; the optimizer's momentum "
                    f"{before:g} is set to 0 (give the method's own momentum parameter instead)"
                )
        if self.weight_decay != 0 and not self.weight_decay_in_gradient:
            self.weight_decay_in_gradient = True
            said.append(
                f"weight decay {self.weight_decay:g} is added to each gradient before the exchange, so that it "
                "goes through the method's momentum as in SGD with momentum"
            )
        return "; ".join(said) or None

    def build_compressors(self):
        params, error_feedback = dict(self.params), self.error_feedback
        if "error_feedback" in params:  # --param error_feedback=... is the same as --(no-)error-feedback
            given = params.pop("error_feedback")
            if error_feedback is not None and given != error_feedback:
                raise ConfigError("--param error_feedback contradicts --error-feedback / --no-error-feedback")
            error_feedback = given
        if self.feedback is not None:
            if error_feedback is not None:
                raise ConfigError("give --feedback or --error-feedback / --param error_feedback, not both")
            momentum = self.feedback_momentum if self.feedback_momentum is not None else self.momentum
            with _naming(self.compressor, "--compressor"):
                compressor = make(self.compressor, feedback=self.feedback, feedback_momentum=momentum, **params)
        else:
            with _naming(self.compressor, "--compressor"):
                compressor = make(self.compressor, error_feedback=error_feedback, **params)
        server = None
        if self.server_compressor is not None:
            with _naming(self.server_compressor, "--server-compressor"):
                server = make(self.server_compressor, error_feedback=self.server_error_feedback, **self.server_params)
        return compressor, server

    def network(self) -> NetworkModel | None:
        if self.bandwidth is None:
            return None
        return NetworkModel(parse_bandwidth(self.bandwidth, "--bandwidth"), parse_latency(self.latency, "--latency"))

    def uses_error_feedback(self) -> bool:
        from gradcomp.feedback import ErrorFeedback, MomentumCorrection

        method = self.build_compressors()[0]
        # a method that owns its rounds may build error feedback in (PowerSGD's error_feedback parameter)
        return isinstance(method, (ErrorFeedback, MomentumCorrection)) or bool(getattr(method, "error_feedback", False))

    def label(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params.items())
        text = f"{self.compressor}({args})" if args else self.compressor
        if self.feedback not in (None, "none"):
            return f"{text} + {self.feedback.replace('_', ' ')}"
        return text + (" + error feedback" if self.uses_error_feedback() else "")


# -- one worker's training loop ------------------------------------------------------------------------------


class Batches:
    """The worker's batch for each step: its shard of the epoch's shared permutation, cut into batches."""

    def __init__(self, data: Dataset, cfg: TrainConfig, rank: int):
        self.data, self.cfg, self.rank = data, cfg, rank
        self.per_epoch = (data.train_x.shape[0] // cfg.workers) // cfg.batch_size
        if self.per_epoch < 1:
            raise ConfigError(
                f"{data.train_x.shape[0]} training examples cannot give each of {cfg.workers} workers "
                f"a batch of {cfg.batch_size}"
            )
        self._epoch, self._indices = -1, None

    def total_steps(self) -> int:
        if self.cfg.steps is not None:
            return self.cfg.steps
        return max(1, math.ceil(self.cfg.epochs * self.per_epoch))

    def get(self, step: int, device: torch.device):
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            n = self.data.train_x.shape[0]
            self._indices = shard_indices(n, self.rank, self.cfg.workers, epoch, self.cfg.seed)
            self._epoch = epoch
        rows = self._indices[i * self.cfg.batch_size : (i + 1) * self.cfg.batch_size]
        return self.data.train_x[rows].to(device), self.data.train_y[rows].to(device)


def make_optimizer(model: nn.Module, cfg: TrainConfig, transport: Transport | None = None) -> torch.optim.Optimizer:
    """The run's optimizer; 1-bit Adam and 0/1 Adam exchange over ``transport`` themselves."""
    adam = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if cfg.optimizer == "onebit_adam":
        from gradcomp.train.onebit_adam import OneBitAdam

        return OneBitAdam(model, transport, freeze_step=cfg.resolved_freeze_step(),
                          warmup_compressor=cfg.warmup_compressor, **adam)
    if cfg.optimizer == "zero_one_adam":
        from gradcomp.train.zero_one_adam import ZeroOneAdam

        return ZeroOneAdam(model, transport, var_freeze_step=cfg.resolved_freeze_step(),
                           var_update_scaler=cfg.var_update_scaler, local_step_scaler=cfg.local_step_scaler,
                           local_step_clipper=cfg.local_step_clipper, **adam)
    if cfg.optimizer == "adamw":  # decoupled weight decay; the gradient it sees is the exchanged one
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
    weight_decay = 0.0 if cfg.weight_decay_in_gradient else cfg.weight_decay  # else added twice
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def synced_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The buffers that must agree across replicas (BatchNorm's running statistics and batch counts)."""
    return [b for b in model.buffers()]


def broadcast_buffers(buffers: list[torch.Tensor], transport: Transport) -> tuple[int, int]:
    """Make every replica's buffers rank 0's, as DDP does before each forward; returns (bytes up, bytes down).

    Each dtype's buffers travel as one flat tensor through ``transport.broadcast`` (a worker sending to its
    peers), so the bytes are counted by the transport like every other message; the difference of the
    counter before and after is what the buffers cost, reported apart from the gradient bytes.
    """
    if not buffers:
        return 0, 0
    before_up, before_down = transport.counter.bytes_up, transport.counter.bytes_down
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    for group in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in group])
        flat = transport.broadcast(flat, root=0, peer=True)
        offset = 0
        for b in group:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
    return transport.counter.bytes_up - before_up, transport.counter.bytes_down - before_down


def add_weight_decay_to_gradients(model: nn.Module, weight_decay: float) -> list:
    """Make every parameter's gradient g + weight_decay·p as backward computes it (``weight_decay_in_gradient``).

    A tensor hook runs before the gradient is accumulated into ``.grad``, so both the aggregator (after
    backward) and DDP's communication hook (inside backward) exchange the decayed gradient. Returns the hook
    handles.
    """
    handles = []
    for p in model.parameters():
        if p.requires_grad:
            handles.append(p.register_hook(lambda g, p=p: g.add(p.detach(), alpha=weight_decay)))
    return handles


def loss_of(output: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    """Cross-entropy: per image for a classifier's (B, classes), per byte for a language model's (B, T, vocab)."""
    if output.dim() == 3:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), yb.reshape(-1).long())
    return F.cross_entropy(output, yb)


def compute_gradients(model: nn.Module, xb, yb) -> float:
    model.zero_grad(set_to_none=False)
    loss = loss_of(model(xb), yb)
    loss.backward()
    return float(loss.detach())


def evaluation(model: nn.Module, data: Dataset) -> dict[str, float]:
    """The final (or periodic) evaluation: test accuracy, and for a language model validation bits per byte."""
    if isinstance(data, TextDataset):
        accuracy, bits = evaluate_text(model, data.test_x, data.test_y)
        return {"accuracy": accuracy, "bits_per_byte": bits}
    return {"accuracy": evaluate(model, data.test_x, data.test_y)}


def buffer_digest(model: nn.Module) -> str | None:
    """A short hash of every buffer's exact bytes (None for a model without buffers)."""
    buffers = list(model.buffers())
    if not buffers:
        return None
    h = hashlib.sha256()
    for b in buffers:
        h.update(b.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def parameter_digest(model: nn.Module) -> str:
    """A short hash of every parameter's exact bytes: equal digests mean bit-identical replicas."""
    h = hashlib.sha256()
    for p in model.parameters():
        raw = p.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8)
        h.update(raw.numpy().tobytes())
    return h.hexdigest()[:16]


def save_checkpoint(cfg: TrainConfig, model: nn.Module, aggregator: GradientAggregator) -> None:
    """``--save``: the trained model with the lead worker's compressor state (residuals) and the run's configuration.

    An export of the final model, not a resumable checkpoint (no optimizer state, one rank): resumable
    checkpoints are ``--checkpoint DIR`` (gradcomp.experiments.run.checkpoint).
    """
    torch.save(
        {"model": model.state_dict(), "aggregator": aggregator.state_dict(), "config": dataclasses.asdict(cfg)},
        cfg.save_path,
    )


class Progress:
    def __init__(self, total: int, enabled: bool, label: str, initial: int = 0):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=label, unit="step", dynamic_ncols=True, leave=True)

    def update(self, loss: float, counter: ByteCounter) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", up=human_bits(8 * counter.bytes_up), refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Curves:
    """Training loss every few steps, and test accuracy every ``eval_every`` steps."""

    def __init__(self, total: int, cfg: TrainConfig):
        self.every = max(1, total // 50)
        self.eval_every = cfg.eval_every
        self.loss: list[tuple[int, float]] = []
        self.accuracy: list[tuple[int, float]] = []
        self.val_loss: list[tuple[int, float]] = []  # language models: validation bits per byte
        self._due = False  # an evaluation is due at the next step where the replicas are the same

    def record(self, step: int, loss: float, model: nn.Module, data: Dataset, evaluate_now: bool) -> None:
        """``evaluate_now``: the replicas are the same (no local steps pending) and this is the lead worker. An
        evaluation due at a step where they are not (local steps, 0/1 Adam) is made at the next step where they
        are, and recorded at that step."""
        if step % self.every == 0:
            self.loss.append((step, loss))
        if self.eval_every and (step + 1) % self.eval_every == 0:
            self._due = True
        if evaluate_now and self._due:
            self._due = False
            result = evaluation(model, data)
            self.accuracy.append((step + 1, result["accuracy"]))
            if "bits_per_byte" in result:
                self.val_loss.append((step + 1, result["bits_per_byte"]))


def run_worker(
    cfg: TrainConfig,
    transport: Transport,
    device: torch.device,
    *,
    register_hook=None,
    before_training=None,
    after_step=None,
) -> dict[str, Any]:
    """Train one replica over ``transport``; returns this worker's local statistics.

    ``register_hook`` (with ``cfg.ddp``) replaces ``register_ddp_hook`` (torch's own hooks, ``gradcomp race``);
    ``before_training()`` is called once, after the set-up (data, model, optimizer, DDP's constructor with its
    broadcast of the parameters, the hook, a resumed checkpoint) and before the first step; ``after_step(step,
    model, exchange)`` at the end of every step (both: ``gradcomp race``'s clock, wire counters and evaluation;
    the exchange for its compression clock).
    """
    data = cfg.load_data()
    model = build_model(cfg.model, data, cfg.seed).to(device)
    optimizer = make_optimizer(model, cfg, transport)
    exchanging = cfg.optimizer in EXCHANGING_OPTIMIZERS  # the optimizer's step() exchanges
    buffers = synced_buffers(model)
    buffer_up = buffer_down = 0
    if cfg.weight_decay_in_gradient:
        add_weight_decay_to_gradients(model, cfg.weight_decay)
    compressor, server = cfg.build_compressors()
    if cfg.ddp:
        # DistributedDataParallel with gradcomp's hook: the exchange runs inside backward, bucket by bucket,
        # on the hook's own transport (so the hook's bytes are what this worker reports)
        from gradcomp.train.ddp_hook import register_ddp_hook

        ddp_options = {} if cfg.bucket_cap_mb is None else {"bucket_cap_mb": cfg.bucket_cap_mb}
        # buffers (BatchNorm) are broadcast below through the hook's transport, so that their bytes are counted
        import inspect

        no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in
                   inspect.signature(nn.parallel.DistributedDataParallel).parameters else "broadcast_buffers")
        trained = nn.parallel.DistributedDataParallel(model, **{no_sync: False}, **ddp_options)
        # (the command line stops at a non-finite gradient, with the typed error, where a user's loop may skip it)
        register = register_hook or functools.partial(register_ddp_hook, nonfinite="raise", dense_steps=cfg.dense_steps)
        hook = register(trained, compressor, topology=cfg.topology, server_compressor=server)
        exchange, transport, aggregator = hook.exchange, hook.transport, hook
    elif exchanging:  # 1-bit Adam / 0/1 Adam: its state (moments and residuals) is the optimizer's
        trained, hook, aggregator = model, None, None
        exchange = optimizer  # its compress_s / communicate_s add up its exchanges'
    else:
        trained, hook = model, None
        aggregator = GradientAggregator(
            model, compressor, transport, granularity=cfg.granularity, topology=cfg.topology, server_compressor=server,
            dense_steps=cfg.dense_steps,  # the first steps through a dense fp32 all-reduce (counted like the rest)
        )
        exchange = aggregator.exchange
    delayed = None
    if cfg.local_steps is not None:
        delayed = LocalUpdateExchange(aggregator, cfg.local_steps, outer_optimizer=cfg.outer_optimizer,
                                      outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum)
    batches = Batches(data, cfg, transport.rank)
    total = batches.total_steps()
    lead = transport.rank == 0
    curves = Curves(total, cfg)
    checkpoints = WorkerCheckpoints(
        cfg, transport, device, model=model, optimizer=optimizer,
        stateful=delayed if delayed is not None else aggregator if aggregator is not None else _NoState(),
        exchange=exchange, curves=curves, per_epoch=batches.per_epoch, total=total,
    )
    start, compute_s, loss = checkpoints.resume()  # 0, 0.0, nan unless the run resumes
    progress = Progress(total, cfg.progress and lead, cfg.label(), initial=start)
    if before_training is not None:
        before_training()
    for step in range(start, total):
        started = time.perf_counter()
        xb, yb = batches.get(step, device)
        if buffers:  # rank 0's buffers on every replica before the forward pass, as DDP does
            up, down = broadcast_buffers(buffers, transport)
            buffer_up, buffer_down = buffer_up + up, buffer_down + down
        set_lr(optimizer, cfg.lr_at(step, total))
        loss = compute_gradients(trained, xb, yb)  # with --ddp, backward also runs the hook's exchanges
        compute_s += time.perf_counter() - started
        if delayed is None and hook is None and not exchanging:
            aggregator.step()  # exchange gradients every step
        started = time.perf_counter()
        optimizer.step()
        compute_s += time.perf_counter() - started
        if delayed is not None:
            delayed.after_local_step()  # exchange the accumulated update every local_steps steps
        synced = (delayed is None or delayed.pending == 0) and not (exchanging and optimizer.pending)
        curves.record(step, loss, model, data, evaluate_now=lead and synced)
        progress.update(loss, transport.counter)
        checkpoints.after_step(step + 1, compute_s, loss)  # --checkpoint: every N steps and after the last
        if after_step is not None:
            after_step(step, model, exchange)
    if delayed is not None:
        delayed.sync()  # a last, shorter round so the replicas end identical
    if exchanging:
        optimizer.finish()  # 0/1 Adam: the same
    if buffers:  # the last step's running statistics too, so the replicas end identical
        up, down = broadcast_buffers(buffers, transport)
        buffer_up, buffer_down = buffer_up + up, buffer_down + down
    progress.close()
    if hook is not None:
        hook.close()
    if lead and cfg.save_path:
        save_checkpoint(cfg, model, aggregator)
    final = evaluation(model, data) if lead else {}
    return {
        "rank": transport.rank,
        "steps": total,
        "syncs": delayed.syncs if delayed is not None else getattr(optimizer, "syncs", total),
        "epochs": total / batches.per_epoch,
        "compute_s": compute_s,
        "compress_s": exchange.compress_s,
        "communicate_s": exchange.communicate_s,
        "time_overlapped": hook is not None,
        "counter": transport.counter.as_dict(),
        "digest": parameter_digest(model),
        "buffer_digest": buffer_digest(model),
        "buffer_bytes_up": buffer_up,
        "buffer_bytes_down": buffer_down,
        "num_buffer_elements": sum(b.numel() for b in buffers),
        "resumed_from_step": checkpoints.resumed_from,
        "final_loss": loss,
        "test_accuracy": final.get("accuracy"),
        "val_bits_per_byte": final.get("bits_per_byte"),
        "val_loss_curve": curves.val_loss,
        "corpus": data.describe() if isinstance(data, TextDataset) else None,
        "loss_curve": curves.loss,
        "accuracy_curve": curves.accuracy,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "paper_compression": _paper_compression(compressor, model, cfg),
        "method_report": compressor.report() if hasattr(compressor, "report") else None,
    }


class _NoState:
    """The checkpoint's exchange state where the optimizer holds it all (1-bit Adam, 0/1 Adam)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ConfigError("the checkpoint holds an exchange's state, but this run's optimizer holds its own")


def _paper_compression(method: Any, model: nn.Module, cfg: TrainConfig) -> float | None:
    """The compression factor as the method's paper defines it (sketched SGD: 2d / (sketch + P·k + k)), if any."""
    rule = getattr(method, "paper_compression", None)
    if rule is None:
        return None
    return float(rule(GradientAggregator.slots_for(list(model.named_parameters()), cfg.granularity)))


# -- the simulated cluster -----------------------------------------------------------------------------------


def run_simulated(cfg: TrainConfig, device: torch.device | None = None) -> dict[str, Any]:
    """The same training with W simulated workers in this process; returns the summary dict.

    Every simulated worker runs ``run_worker`` — its own replica, optimizer and compressor state — in its own
    thread of a SimulatedCluster; workers take turns between collectives, so this is the real training loop
    on an in-process transport.
    """
    device = device or torch.device("cpu")
    started = time.perf_counter()
    cfg.load_data()  # parse once; the workers share the cached tensors
    threads = torch.get_num_threads()
    # the intra-op thread count of a spawned worker: float reductions (conv backward) then round alike and
    # the simulated run gives the same model as the spawned one, bit for bit where the protocol allows
    torch.set_num_threads(worker_threads(cfg.workers))
    try:
        with SimulatedCluster(cfg.workers, timeout=cfg.timeout_s) as cluster:
            stats = cluster.run(lambda transport: run_worker(cfg, transport, device))
    finally:
        torch.set_num_threads(threads)
    return summarize(cfg, stats, time.perf_counter() - started, backend="simulated")


def worker_threads(workers: int) -> int:
    """torch threads per spawned worker: the machine's cores shared out."""
    return max(1, (os.cpu_count() or 1) // workers)


# -- summary -------------------------------------------------------------------------------------------------


def summarize(cfg: TrainConfig, stats: list[dict[str, Any]], wall_time_s: float, backend: str) -> dict[str, Any]:
    """One result dict from every worker's local statistics (bits are per-worker means of measured counts)."""
    workers = len(stats)
    lead = stats[0]
    counters = [ByteCounter(**s["counter"]) for s in stats]
    num_parameters = lead["num_parameters"]
    steps = lead["steps"]
    # gradient (or update) bits: what the transport counted, less the buffers' broadcast (reported apart)
    buffer_up = [8 * s.get("buffer_bytes_up", 0) for s in stats]
    buffer_down = [8 * s.get("buffer_bytes_down", 0) for s in stats]
    bits_up = [8 * c.bytes_up - b for c, b in zip(counters, buffer_up)]
    bits_down = [8 * c.bytes_down - b for c, b in zip(counters, buffer_down)]
    # fp32 all-reduce hands the transport 4 bytes per parameter; under FSDP the reference is its fp32
    # reduce-scatter, counted as gradcomp's all-to-all is (the chunks that leave the rank): (W - 1) / W of that
    dense_bits = 32 * num_parameters * steps * ((workers - 1) / workers if cfg.fsdp else 1)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    up, down = mean(bits_up), mean(bits_down)
    echoed = ("compressor", "feedback", "feedback_momentum", "granularity", "topology", "server_compressor",
              "local_steps", "batch_size", "lr", "momentum", "optimizer", "weight_decay", "lr_schedule", "warmup_steps",
              "dataset", "model", "seed", "simulate", "ddp", "fsdp")  # the configuration, as given
    return {
        **{key: getattr(cfg, key) for key in echoed}, "params": dict(cfg.params),
        "server_params": dict(cfg.server_params), "error_feedback": cfg.uses_error_feedback(),
        **({"betas": list(cfg.betas), "eps": cfg.eps} if cfg.optimizer in ADAM_FAMILY else {}),
        **({"freeze_step": cfg.resolved_freeze_step()} if cfg.optimizer in EXCHANGING_OPTIMIZERS else {}),
        **({"warmup_compressor": cfg.warmup_compressor} if cfg.optimizer == "onebit_adam" else {}),
        **({"outer_optimizer": cfg.outer_optimizer, "outer_lr": cfg.outer_lr, "outer_momentum": cfg.outer_momentum}
           if cfg.local_steps is not None else {}),
        "dense_steps": cfg.dense_steps,
        **({"lr_step_size": cfg.lr_step_size, "lr_gamma": cfg.lr_gamma} if cfg.lr_schedule == "step" else {}),
        "workers": workers, "steps": steps, "syncs": lead["syncs"], "epochs": lead["epochs"],
        "num_parameters": num_parameters, "backend": backend,
        "test_accuracy": lead["test_accuracy"],
        "val_bits_per_byte": lead.get("val_bits_per_byte"),
        "val_perplexity": None if lead.get("val_bits_per_byte") is None else 2 ** lead["val_bits_per_byte"],
        "corpus": lead.get("corpus"),
        "buffer_bits_up_per_worker": mean(buffer_up),
        "buffer_bits_down_per_worker": mean(buffer_down),
        "num_buffer_elements": lead.get("num_buffer_elements", 0),
        "final_loss": lead["final_loss"],
        "bits_up_per_worker": up,
        "bits_down_per_worker": down,
        "bits_up_by_worker": bits_up,
        "bits_down_by_worker": bits_down,
        "dense_bits_per_worker": dense_bits,
        "compression_ratio_up": dense_bits / up if up else math.inf,
        "compression_ratio_down": dense_bits / down if down else math.inf,
        "paper_compression": lead.get("paper_compression"),
        "method_report": lead.get("method_report"),
        "padding_bits": mean([8 * c.padding_bytes for c in counters]),
        "control_bits": mean([8 * (c.up_control + c.down_control) for c in counters]),
        "control_bits_up": mean([8 * c.up_control for c in counters]),
        "control_bits_down": mean([8 * c.down_control for c in counters]),
        "setup_bits": mean([8 * c.setup_bytes for c in counters]),  # once per run: the slot check, not a step's
        "server_bits_in": sum(8 * c.server_in for c in counters),
        "server_bits_out": sum(8 * c.server_out for c in counters),
        "wall_time_s": wall_time_s,
        "compute_s": mean([s["compute_s"] for s in stats]),
        "compress_s": mean([s["compress_s"] for s in stats]),
        "communicate_s": mean([s["communicate_s"] for s in stats]),
        # --ddp: compress and communicate are the hook's thread's, overlapping the loop's own time (compute_s, which
        # holds backward's wait for the hook); elsewhere the three follow one another
        "time_overlapped": bool(lead.get("time_overlapped", False)),
        **_modelled_network(cfg, counters, workers),
        # FSDP keeps one sharded copy: its ranks' digests are of the same gathered parameters, equal by
        # construction, so nothing is claimed (None) rather than a check that cannot fail
        "replicas_identical": None if cfg.fsdp else len({(s["digest"], s.get("buffer_digest")) for s in stats}) == 1,
        "parameter_digest": lead["digest"],
        "resumed_from_step": lead.get("resumed_from_step"),
        "loss_curve": lead["loss_curve"],
        "accuracy_curve": lead["accuracy_curve"],
        "val_loss_curve": lead.get("val_loss_curve", []),
        "torch_version": torch.__version__,
    }


def _modelled_network(cfg: TrainConfig, counters: list[ByteCounter], workers: int) -> dict[str, Any]:
    """What the run's collectives would cost on ``cfg``'s network (alpha-beta model), per worker on average."""
    network = cfg.network()
    if network is None:
        return {}
    seconds = [network.seconds(c.ops, workers) for c in counters]
    return {
        "network": {"bandwidth_bps": network.bandwidth_bps, "latency_s": network.latency_s},
        "modelled_communicate_s": sum(seconds) / len(seconds),
    }


# -- the command-line options shared by train, sweep and race ------------------------------------------------


def add_training_options(p: argparse.ArgumentParser, *, epochs: float | None = 1.0) -> None:
    """The model, data and optimizer options shared by ``train``, ``sweep`` and ``race``.

    Defaults that depend on the model are None here and filled in by :func:`resolve_training_defaults`.
    """
    if epochs is not None:
        p.add_argument("--epochs", type=float, default=epochs, help="passes over the training set")
        p.add_argument("--steps", type=int, default=None,
                       help="stop after this many steps (overrides --epochs; default for the transformer: "
                            f"{TRANSFORMER_DEFAULTS['steps']})")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"per worker (default: 32) for images; {TRANSFORMER_DEFAULTS['batch_size']} windows for the transformer")
    p.add_argument("--optimizer", default=None, choices=list(OPTIMIZERS),
                   help="default: sgd, adamw for the transformer; onebit_adam (1-bit Adam) and zero_one_adam "
                        "(0/1 Adam) exchange their compressed momentum themselves (docs/adam.md)")
    p.add_argument("--freeze-step", type=int, default=None, metavar="N",
                   help="onebit_adam / zero_one_adam: steps of dense AdamW (0/1 Adam: of variance updates) before "
                        f"the variance freezes (default {round(100 * DEFAULT_FREEZE_FRACTION)} %% of --steps)")
    p.add_argument("--warmup-compressor", default="none", metavar="NAME",
                   help="onebit_adam: what its warm-up's gradients go through: none (fp32, the paper's), fp16, bf16, "
                        "cnat or natural_dithering")
    p.add_argument("--var-update-scaler", type=int, default=16, metavar="K",
                   help="zero_one_adam: variance updates per doubling of their interval (the paper's kappa)")
    p.add_argument("--local-step-scaler", type=int, default=50, metavar="N",
                   help="zero_one_adam: its local steps between syncs double every N steps after the freeze")
    p.add_argument("--local-step-clipper", type=int, default=16, metavar="H",
                   help="zero_one_adam: at most H local steps between syncs")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default: 0.05) with sgd; {TRANSFORMER_DEFAULTS['lr']:g} with adamw")
    p.add_argument("--momentum", type=float, default=None, help="SGD momentum, >= 0 (default: 0.9); SGD only")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="SGD: L2 added to the gradient; AdamW: decoupled weight decay; >= 0")
    p.add_argument("--beta1", type=float, default=None, help="AdamW's first-moment decay (default 0.9)")
    p.add_argument("--beta2", type=float, default=None, help="AdamW's second-moment decay (default 0.999)")
    p.add_argument("--eps", type=float, default=None, help="AdamW's epsilon (default 1e-8)")
    p.add_argument("--lr-schedule", default=None, choices=["constant", "cosine", "step"],
                   help="learning rate after the warm-up: constant, cosine (to 0 at the last step), step "
                        "(x --lr-gamma every --lr-step-size steps); default constant, cosine for the transformer")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help=f"linear warm-up steps (default 0; for the transformer 10 %% of the steps, at most "
                        f"{TRANSFORMER_DEFAULTS['warmup_steps']})")
    p.add_argument("--lr-step-size", type=int, default=None, metavar="N", help="with --lr-schedule step")
    p.add_argument("--lr-gamma", type=float, default=0.1, help="with --lr-schedule step: the factor every N steps")
    p.add_argument("--dataset", default=None,
                   help="mnist, digits (needs scikit-learn), synthetic, or pystdlib (text: the Python standard "
                        "library's source; the default for the transformer)")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="directory with MNIST-format IDX files (mnist), or of *.py files (pystdlib)")
    p.add_argument("--model", default="cnn",
                   help="cnn, mlp, convnet (1.2M parameters on MNIST), resnet (ResNet-20 with BatchNorm), "
                        "transformer (byte-level language model, 1.3M parameters) or transformer_tiny")
    p.add_argument("--context", type=int, default=None, metavar="BYTES",
                   help="the transformer's context (default 128)")


# what `--model transformer` (and transformer_tiny) runs with unless told otherwise: sized so that one 4-worker
# run takes about 10 minutes on a 2-core machine (docs/workloads.md)
TRANSFORMER_DEFAULTS = {"steps": 300, "batch_size": 16, "optimizer": "adamw", "lr": 2e-3, "lr_schedule": "cosine",
                        "warmup_steps": 30, "context": 128}


def resolve_training_defaults(args: argparse.Namespace) -> dict:
    """TrainConfig keyword arguments from the shared training options, with the model's defaults filled in."""
    text = isinstance(args.model, str) and args.model.strip().lower() in TEXT_MODELS
    d = TRANSFORMER_DEFAULTS if text else {"batch_size": 32, "optimizer": "sgd", "lr_schedule": "constant",
                                           "warmup_steps": 0, "context": 128}
    optimizer = args.optimizer or d["optimizer"]
    if optimizer in ADAM_FAMILY and args.momentum is not None:
        raise ConfigError(f"--momentum is SGD's; {optimizer}'s first-moment decay is --beta1")
    if optimizer not in ADAM_FAMILY and any(v is not None for v in (args.beta1, args.beta2, args.eps)):
        raise ConfigError("--beta1 / --beta2 / --eps are AdamW's: give --optimizer adamw")
    out = {
        "batch_size": args.batch_size if args.batch_size is not None else d["batch_size"],
        "optimizer": optimizer,
        "lr": args.lr if args.lr is not None else (0.05 if optimizer == "sgd" else TRANSFORMER_DEFAULTS["lr"]),
        "momentum": (0.9 if args.momentum is None else args.momentum) if optimizer == "sgd" else 0.0,
        "weight_decay": args.weight_decay,
        "betas": (0.9 if args.beta1 is None else args.beta1, 0.999 if args.beta2 is None else args.beta2),
        "eps": 1e-8 if args.eps is None else args.eps,
        "lr_schedule": args.lr_schedule or d["lr_schedule"],
        "warmup_steps": d["warmup_steps"] if args.warmup_steps is None else args.warmup_steps,
        "lr_step_size": args.lr_step_size,
        "lr_gamma": args.lr_gamma,
        "dataset": args.dataset or ("pystdlib" if text else "mnist"),
        "data_root": args.data,
        "model": args.model,
        "context": d["context"] if args.context is None else args.context,
        "freeze_step": getattr(args, "freeze_step", None),
        "warmup_compressor": getattr(args, "warmup_compressor", "none"),
        "var_update_scaler": getattr(args, "var_update_scaler", 16),
        "local_step_scaler": getattr(args, "local_step_scaler", 50),
        "local_step_clipper": getattr(args, "local_step_clipper", 16),
    }
    if hasattr(args, "epochs"):
        out["steps"] = args.steps if (args.steps is not None or not text) else TRANSFORMER_DEFAULTS["steps"]
        out["epochs"] = args.epochs
    steps = out.get("steps", getattr(args, "steps", None))
    if text and args.warmup_steps is None and steps is not None:  # the default warm-up: 10 % of the steps
        out["warmup_steps"] = min(d["warmup_steps"], steps // 10)
    return out
