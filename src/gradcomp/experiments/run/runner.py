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

import dataclasses
import functools
import hashlib
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradcomp.errors import ConfigError
from gradcomp.experiments.run.checkpoint import WorkerCheckpoints
from gradcomp.experiments.run.config import EXCHANGING_OPTIMIZERS, TrainConfig
from gradcomp.experiments.run.data import Dataset, TextDataset, evaluate, evaluate_text, shard_indices
from gradcomp.experiments.run.models import build_model
from gradcomp.experiments.run.report import human_bits
from gradcomp.experiments.run.summary import summarize
from gradcomp.train.aggregator import GradientAggregator
from gradcomp.train.local_steps import LocalUpdateExchange
from gradcomp.transport.base import ByteCounter, Transport
from gradcomp.transport.sim import SimulatedCluster

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
                           local_step_clipper=cfg.local_step_clipper, warmup_compressor=cfg.warmup_compressor,
                           **adam)
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
    replica = _set_up(cfg, transport, device, register_hook)
    batches = Batches(replica.data, cfg, replica.transport.rank)
    total = batches.total_steps()
    lead = replica.transport.rank == 0
    curves = Curves(total, cfg)
    checkpoints = WorkerCheckpoints(
        cfg, replica.transport, device, model=replica.model, optimizer=replica.optimizer,
        stateful=replica.exchange_state(), exchange=replica.exchange, curves=curves, per_epoch=batches.per_epoch,
        total=total,
    )
    start, compute_s, loss = checkpoints.resume()  # 0, 0.0, nan unless the run resumes
    progress = Progress(total, cfg.progress and lead, cfg.label(), initial=start)
    if before_training is not None:
        before_training()
    for step in range(start, total):
        loss, compute_s = _train_step(cfg, replica, batches, step, total, device, compute_s)
        curves.record(step, loss, replica.model, replica.data, evaluate_now=lead and replica.in_sync())
        progress.update(loss, replica.transport.counter)
        checkpoints.after_step(step + 1, compute_s, loss)  # --checkpoint: every N steps and after the last
        if after_step is not None:
            after_step(step, replica.model, replica.exchange)
    replica.end_identical()
    progress.close()
    if replica.hook is not None:
        replica.hook.close()
    if lead and cfg.save_path:
        save_checkpoint(cfg, replica.model, replica.aggregator)
    final = evaluation(replica.model, replica.data) if lead else {}
    return _statistics(cfg, replica, total=total, per_epoch=batches.per_epoch, curves=curves,
                       resumed_from=checkpoints.resumed_from, compute_s=compute_s, loss=loss, final=final)


class _SyncedBuffers:
    """The buffers every replica takes from rank 0 (``synced_buffers``), and the bytes their broadcasts cost."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers
        self.bytes_up = self.bytes_down = 0

    def broadcast(self, transport: Transport) -> None:
        """Rank 0's buffers on every replica (``broadcast_buffers``), the bytes added to the counts; none: nothing."""
        if self.buffers:
            up, down = broadcast_buffers(self.buffers, transport)
            self.bytes_up, self.bytes_down = self.bytes_up + up, self.bytes_down + down


@dataclass
class _Replica:
    """One worker's replica and what exchanges for it: the state ``run_worker``'s steps share."""

    data: Dataset
    model: nn.Module
    optimizer: torch.optim.Optimizer
    buffers: _SyncedBuffers
    compressor: Any
    trained: nn.Module  # what the steps call: the model, or its DDP wrapper
    transport: Transport  # with --ddp the hook's own, so that the hook's bytes are what this worker reports
    exchange: Any  # whose compress_s / communicate_s are this worker's
    hook: Any = None  # DDP's communication hook (--ddp)
    aggregator: Any = None  # the GradientAggregator, or the hook; None where the optimizer exchanges
    delayed: LocalUpdateExchange | None = None  # --local-steps
    exchanging: bool = False  # the optimizer's step() exchanges (1-bit Adam, 0/1 Adam)

    def exchange_state(self) -> Any:
        """What a checkpoint saves of the exchange: the local-step exchange's, the aggregator's, or nothing."""
        if self.delayed is not None:
            return self.delayed
        return self.aggregator if self.aggregator is not None else _NoState()

    def in_sync(self) -> bool:
        """Whether the replicas are the same now: no local steps pending, no 0/1 Adam local steps either."""
        return (self.delayed is None or self.delayed.pending == 0) and not (self.exchanging and self.optimizer.pending)

    def end_identical(self) -> None:
        """The exchanges still owed after the last step, so that the replicas end identical."""
        if self.delayed is not None:
            self.delayed.sync()  # a last, shorter round
        if self.exchanging:
            self.optimizer.finish()  # 0/1 Adam: the same
        self.buffers.broadcast(self.transport)  # the last step's running statistics too


def _set_up(cfg: TrainConfig, transport: Transport, device: torch.device, register_hook) -> _Replica:
    """The replica (from ``cfg.seed``, so every worker starts from the same one), its optimizer and its exchange.

    With ``cfg.ddp`` the exchange is the DDP hook's, inside backward; with 1-bit Adam / 0/1 Adam the optimizer's
    step; else a GradientAggregator after backward; with local steps, a LocalUpdateExchange around that.
    """
    data = cfg.load_data()
    model = build_model(cfg.model, data, cfg.seed).to(device)
    optimizer = make_optimizer(model, cfg, transport)
    exchanging = cfg.optimizer in EXCHANGING_OPTIMIZERS  # the optimizer's step() exchanges
    buffers = _SyncedBuffers(synced_buffers(model))
    if cfg.weight_decay_in_gradient:
        add_weight_decay_to_gradients(model, cfg.weight_decay)
    compressor, server = cfg.build_compressors()
    trained, hook = model, None
    if cfg.ddp:
        trained, hook = _ddp_with_hook(cfg, model, compressor, server, register_hook)
        exchange, transport, aggregator = hook.exchange, hook.transport, hook
    elif exchanging:  # 1-bit Adam / 0/1 Adam: its state (moments and residuals) is the optimizer's
        aggregator = None
        exchange = optimizer  # its compress_s / communicate_s add up its exchanges'
    else:
        aggregator = GradientAggregator(
            model, compressor, transport, granularity=cfg.granularity, topology=cfg.topology, server_compressor=server,
            dense_steps=cfg.dense_steps,  # the first steps through a dense fp32 all-reduce (counted like the rest)
        )
        exchange = aggregator.exchange
    delayed = None
    if cfg.local_steps is not None:
        delayed = LocalUpdateExchange(aggregator, cfg.local_steps, outer_optimizer=cfg.outer_optimizer,
                                      outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum)
    return _Replica(data, model, optimizer, buffers, compressor, trained, transport, exchange, hook=hook,
                    aggregator=aggregator, delayed=delayed, exchanging=exchanging)


def _ddp_with_hook(cfg: TrainConfig, model: nn.Module, compressor: Any, server: Any, register_hook) -> tuple:
    """``model`` wrapped in DistributedDataParallel with gradcomp's hook (or ``register_hook``'s); (wrapper, hook).

    The exchange runs inside backward, bucket by bucket, on the hook's own transport. DDP's own buffer
    broadcast is turned off: the buffers (BatchNorm) go through the hook's transport, so that their bytes are
    counted.
    """
    from gradcomp.train.ddp_hook import register_ddp_hook

    ddp_options = {} if cfg.bucket_cap_mb is None else {"bucket_cap_mb": cfg.bucket_cap_mb}
    import inspect

    no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in
               inspect.signature(nn.parallel.DistributedDataParallel).parameters else "broadcast_buffers")
    trained = nn.parallel.DistributedDataParallel(model, **{no_sync: False}, **ddp_options)
    # (the command line stops at a non-finite gradient, with the typed error, where a user's loop may skip it)
    register = register_hook or functools.partial(register_ddp_hook, nonfinite="raise", dense_steps=cfg.dense_steps)
    return trained, register(trained, compressor, topology=cfg.topology, server_compressor=server)


def _train_step(cfg: TrainConfig, replica: _Replica, batches: Batches, step: int, total: int,
                device: torch.device, compute_s: float) -> tuple[float, float]:
    """One step of ``total``: the batch, forward and backward, the exchange that is due, the optimizer's step.

    Returns the loss and ``compute_s`` with this step's time added: the batch, forward and backward, and the
    optimizer's step, but not an aggregator's exchange between them (its own clock counts that).
    """
    started = time.perf_counter()
    xb, yb = batches.get(step, device)
    replica.buffers.broadcast(replica.transport)  # rank 0's buffers on every replica first, as DDP does
    set_lr(replica.optimizer, cfg.lr_at(step, cfg.schedule_steps or total))
    loss = compute_gradients(replica.trained, xb, yb)  # with --ddp, backward also runs the hook's exchanges
    compute_s += time.perf_counter() - started
    if replica.delayed is None and replica.hook is None and not replica.exchanging:
        replica.aggregator.step()  # exchange gradients every step
    started = time.perf_counter()
    replica.optimizer.step()
    compute_s += time.perf_counter() - started
    if replica.delayed is not None:
        replica.delayed.after_local_step()  # exchange the accumulated update every local_steps steps
    return loss, compute_s


def _statistics(cfg: TrainConfig, replica: _Replica, *, total: int, per_epoch: int, curves: Curves,
                resumed_from: int | None, compute_s: float, loss: float, final: dict[str, float]) -> dict[str, Any]:
    """This worker's local statistics, as ``run_worker`` returns them and ``summarize`` reads them."""
    model, delayed, buffers = replica.model, replica.delayed, replica.buffers
    return {
        "rank": replica.transport.rank,
        "steps": total,
        "syncs": delayed.syncs if delayed is not None else getattr(replica.optimizer, "syncs", total),
        "epochs": total / per_epoch,
        "compute_s": compute_s,
        "compress_s": replica.exchange.compress_s,
        "communicate_s": replica.exchange.communicate_s,
        "time_overlapped": replica.hook is not None,
        "counter": replica.transport.counter.as_dict(),
        "digest": parameter_digest(model),
        "buffer_digest": buffer_digest(model),
        "buffer_bytes_up": buffers.bytes_up,
        "buffer_bytes_down": buffers.bytes_down,
        "num_buffer_elements": sum(b.numel() for b in buffers.buffers),
        "resumed_from_step": resumed_from,
        "final_loss": loss,
        "test_accuracy": final.get("accuracy"),
        "val_bits_per_byte": final.get("bits_per_byte"),
        "val_loss_curve": curves.val_loss,
        "corpus": replica.data.describe() if isinstance(replica.data, TextDataset) else None,
        "loss_curve": curves.loss,
        "accuracy_curve": curves.accuracy,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "paper_compression": _paper_compression(replica.compressor, model, cfg),
        "method_report": replica.compressor.report() if hasattr(replica.compressor, "report") else None,
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
