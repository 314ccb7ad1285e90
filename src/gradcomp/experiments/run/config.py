"""A training run's configuration, ``TrainConfig``, and every check of it that can be made before a worker starts.

``TrainConfig.validate`` refuses, with a ``ConfigError`` naming the option, what the workers would otherwise
fail on only after they have started: numbers out of range, options that do not go together, a method the
chosen optimizer or exchange cannot carry, per-tensor limits on the real model's slots, and more workers than
GPUs. The learning-rate schedule (``lr_at``) and the compressors (``build_compressors``) are built from it here
too, so that every worker builds the same ones.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from gradcomp.errors import ConfigError
from gradcomp.experiments.run.data import Dataset, load_dataset
from gradcomp.experiments.run.models import build_model
from gradcomp.netmodel import NetworkModel, parse_bandwidth, parse_latency
from gradcomp.registry import make
from gradcomp.train.aggregator import GRANULARITIES, GradientAggregator
from gradcomp.train.exchange import TOPOLOGIES, build_scheme
from gradcomp.train.local_steps import check_compressors

# Seconds a worker waits at a collective for the others before a stopped or hung worker is reported. The longest
# normal wait in `gradcomp train` is a few seconds (rank 0 evaluating the
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
    # the length of the run whose first `steps` steps this run is: the schedule (warm-up, cosine) is that run's
    # (gradcomp plan's pilots: the first steps of the run planned for); None: this run's own length
    schedule_steps: int | None = None
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
        """Everything that can be checked before a worker starts; raises ConfigError.

        The checks run in a fixed order (the cheap ones on the options first, the model's slots last), so that
        of several mistakes the same one is named every time.
        """
        if self.steps is not None and self.steps < 1:  # (first: the warm-up's check below speaks of the steps)
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        self._check_optimizer()
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.local_steps is not None and self.local_steps < 1:
            raise ConfigError(f"local_steps must be >= 1, got {self.local_steps}")
        self._check_outer_and_dense()
        self._check_numbers()
        if self.save_path is not None:
            from gradcomp.experiments.run.report import check_output_file

            check_output_file(self.save_path, "--save")  # rank 0 writes it only after training
        self._check_communication()
        if self.device == "cuda":
            self._check_gpus()
        compressor, server = self.build_compressors()
        if self.local_steps is not None:
            check_compressors(compressor, server)  # no majority vote (worker or server side) with local steps
        scheme = build_scheme(compressor, topology=self.topology, server_compressor=server)
        self.network()
        self._check_on_the_model(compressor, server, scheme)

    def _check_numbers(self) -> None:
        """The sizes, rates and time-outs given as numbers: in range and finite, and a latency only with a bandwidth."""
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

    def _check_communication(self) -> None:
        """How the gradients travel: granularity, topology, device, DDP's options and the server compressor's."""
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

    def _check_on_the_model(self, compressor: Any, server: Any, scheme: Any) -> None:
        """The per-tensor limits (k larger than a layer, ...) on the real model's slots, and the batch size on the
        real data set, checked here so that no worker starts with them wrong; FSDP's own refusals with --fsdp."""
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
            check_fsdp_method(compressor, model, self.workers)
            return
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
        if self.schedule_steps is not None and (
                isinstance(self.schedule_steps, bool) or not isinstance(self.schedule_steps, int)
                or self.steps is None or self.schedule_steps < self.steps):
            raise ConfigError(f"schedule_steps must be a whole number >= the run's steps ({self.steps}), "
                              f"got {self.schedule_steps!r}")
        length = self.schedule_steps if self.schedule_steps is not None else self.steps
        if length is not None and self.warmup_steps >= length:
            raise ConfigError(f"--warmup-steps {self.warmup_steps} leaves no step of the {length} to train at "
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
        if self.optimizer not in EXCHANGING_OPTIMIZERS and self.warmup_compressor != "none":
            raise ConfigError("--warmup-compressor is 1-bit Adam's and 0/1 Adam's (what their dense steps send): give "
                              "--optimizer onebit_adam or zero_one_adam, or --dense-steps N for a compressor's fp32 "
                              "warm-up")
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
            raise ConfigError(f"unknown --outer-optimizer {self.outer_optimizer!r}; "
                              f"valid: {', '.join(OUTER_OPTIMIZERS)}")
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
