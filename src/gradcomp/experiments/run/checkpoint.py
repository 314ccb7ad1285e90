"""Resumable checkpoints of `gradcomp train`: every rank's state, written atomically, checked when loaded.

Layout of a checkpoint directory (``--checkpoint DIR``)::

    DIR/latest                      "step-000120": the newest complete checkpoint (replaced atomically)
    DIR/step-000120/rank-0000.pt    one file per rank (torch.save of a dict, see ``WorkerCheckpoints``)
    DIR/step-000120/rank-0001.pt
    DIR/step-000120/manifest.json   written last, by rank 0: step, world size, the configuration's
                                    fingerprint, every rank file's size and SHA-256

What a rank file holds: the replica's parameters and buffers, the optimizer state, the exchange's state
(the scheme's: error-feedback residuals, momentum, PowerSGD's Q's and errors, LGC's autoencoder, the
server compressor's residual; with ``--local-steps`` also the anchor and the pending count), the number of
steps done (the data position: a worker's batch is a pure function of (seed, epoch, step), see
``runner.Batches``, so the step is all that is needed to continue the data order), torch / numpy / python
RNG states (and the CUDA one on a GPU), the byte counters and the time split (so the bits and seconds
reported at the end cover the whole run), and the loss and accuracy curves recorded so far. The
compressors draw their randomness from generators seeded by (seed, step, slot), so they carry no generator
state. A resumed run therefore gives the same parameters, bit for bit, as an uninterrupted one.

Writing (every ``--checkpoint-every`` steps and after the last step): each rank serialises its state, writes
it to a temporary name, fsyncs it and ``os.replace``s it into place; the ranks then exchange their files'
sizes and digests (through the process group, or the simulated cluster's rendezvous: not booked on the byte
counters); rank 0 writes the manifest and only then moves ``latest`` to the new directory, and finally
prunes old ones (``--checkpoint-keep K`` newest, 0 keeps all). A crash at any point leaves ``latest`` on
the previous complete checkpoint. A write that fails on any rank (disk full, permissions) raises
``CheckpointError`` on every rank.

Loading (``--resume DIR`` with DIR a checkpoint directory or one ``step-NNNNNN`` in it, or
``--resume-if-present`` with the ``--checkpoint`` directory): every rank reads the manifest, compares the
configuration (``fingerprint``: compressor and its parameters, feedback, granularity, topology, server
compressor, world size, local steps, DDP, model, dataset, seed, batch size, lr, momentum, weight decay) and
refuses a checkpoint of another configuration with a ``ConfigError`` naming every difference; it then checks
its file's size and digest against the manifest (a truncated or corrupted file is a ``CheckpointError``
saying so), loads it and restores everything. ``--steps`` / ``--epochs`` may differ (a run can be
extended; not under a cosine schedule, whose rates depend on the run's length: ``_schedule_span``), as may the
device (but CPU and GPU do not compute bit-identically). The command line checks the same before any worker
starts (``check_before_launch``: the configuration, the step against ``--steps``, every file's size and SHA-256).
A directory whose ``latest`` pointer is gone still holds its complete step directories: it is never taken for an
empty one (``holds_checkpoint``), and the error names the newest to resume from.

Resuming into the same directory from a checkpoint that is not the newest one drops the newer ones (they
belong to the abandoned continuation). A fresh run refuses a ``--checkpoint`` directory that already holds a
checkpoint, so two runs are never mixed.

A worker lost mid-run is simulated by the tests (tests/faults/crash_injection.py), and by
``scripts/torchrun_restart.sh``, which kills one of two workers under ``torchrun --max-restarts 1``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from gradcomp.errors import ConfigError, GradcompError
from gradcomp.experiments.run.report import make_output_dir, write_atomic

if TYPE_CHECKING:
    from gradcomp.experiments.run.config import TrainConfig
    from gradcomp.transport.base import Transport

# runner imports this module, so its types are not imported back (tests/test_imports.py: no circles at all)
Curves = Any  # a gradcomp.experiments.run.runner.Curves

FORMAT = 1
LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


class CheckpointError(GradcompError):
    """A checkpoint could not be written, found or read (missing, truncated, corrupted)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:04d}.pt"


# -- the configuration a checkpoint belongs to -------------------------------------------------------------

_FEEDBACK_KEYS = ("error_feedback", "feedback", "feedback_momentum")


def _describe(name: str, method: Any) -> str:
    params = {k: v for k, v in method.params().items() if k not in _FEEDBACK_KEYS}
    return f"{name}({', '.join(f'{k}={v}' for k, v in params.items())})"


def _feedback(method: Any) -> str:
    from gradcomp.feedback import ErrorFeedback, MomentumCorrection

    if isinstance(method, MomentumCorrection):
        return f"{method.policy}(momentum={method.momentum:g})"
    if isinstance(method, ErrorFeedback):
        return "error feedback"
    if getattr(method, "error_feedback", False):
        return "error feedback (built into the method)"
    return "none"


def fingerprint(cfg: TrainConfig, world_size: int) -> dict[str, str]:
    """What must be equal for a checkpoint to continue this run: readable strings, compared key by key."""
    from gradcomp.train.exchange import build_scheme

    method, server = cfg.build_compressors()
    scheme = build_scheme(method, topology=cfg.topology, server_compressor=server)
    if server is None:
        server_text = "none"
    else:
        server_text = _describe(server.name, server) + (" + error feedback" if _feedback(server) != "none" else "")
    exchange = "gradient aggregator"
    if cfg.ddp:
        exchange = "DDP hook" + (f" (bucket cap {cfg.bucket_cap_mb:g} MB)" if cfg.bucket_cap_mb is not None else "")
    return {
        "compressor": _describe(method.name, method),
        "feedback": _feedback(method),
        "granularity": cfg.granularity,
        "topology": str(getattr(scheme, "topology", cfg.topology)),
        "server compressor": server_text,
        "world size": str(world_size),
        "local steps": "none" if cfg.local_steps is None else str(cfg.local_steps) + (
            "" if (cfg.outer_optimizer, cfg.outer_lr, cfg.outer_momentum) == ("sgd", 1.0, 0.0)
            else f" outer={cfg.outer_optimizer} lr={cfg.outer_lr!r} momentum={cfg.outer_momentum!r}"),
        **({"dense steps": str(cfg.dense_steps)} if cfg.dense_steps else {}),
        "exchange": exchange,
        "model": cfg.model,
        "dataset": cfg.dataset,
        "seed": str(cfg.seed),
        "batch size": str(cfg.batch_size),
        "lr": repr(float(cfg.lr)),
        "momentum": repr(float(cfg.momentum)),
        "weight decay": repr(float(cfg.weight_decay)),
        # recorded only when not SGD at a constant rate, so checkpoints written before these options still match
        **({"optimizer": _optimizer_text(cfg),
            "lr schedule": _schedule_text(cfg.lr_schedule, cfg.warmup_steps, cfg.lr_step_size, cfg.lr_gamma)
                           + _schedule_span(cfg),
            "context": str(cfg.context)}
           if (cfg.optimizer, cfg.lr_schedule, cfg.warmup_steps) != ("sgd", "constant", 0) else {}),
    }


def _optimizer_text(cfg: TrainConfig) -> str:
    if cfg.optimizer == "sgd":
        return cfg.optimizer
    text = f"{cfg.optimizer} betas={tuple(cfg.betas)} eps={cfg.eps!r}"
    if cfg.optimizer == "onebit_adam":
        text += f" freeze={cfg.resolved_freeze_step()}"
    elif cfg.optimizer == "zero_one_adam":
        text += (f" freeze={cfg.resolved_freeze_step()} kappa={cfg.var_update_scaler} "
                 f"local={cfg.local_step_scaler}/{cfg.local_step_clipper}")
    if cfg.warmup_compressor != "none":
        text += f" warmup={cfg.warmup_compressor}"
    return text


def _schedule_text(schedule: str, warmup: int, step: int | None, gamma: float) -> str:
    return f"{schedule} warmup={warmup} step={step} gamma={gamma!r}"


def _schedule_span(cfg: TrainConfig) -> str:
    """A cosine schedule decays to 0 at the run's last step, so its rates depend on the run's length: a run of 4
    steps continued to 8 follows neither the 4-step nor the 8-step schedule. The other schedules do not."""
    if cfg.lr_schedule != "cosine":
        return ""
    return f" over {cfg.steps} steps" if cfg.steps is not None else f" over {cfg.epochs!r} epochs"


# The keys recorded only away from SGD at a constant rate: a side that did not record one had these values
# (None: not compared then: the context of a model that reads none)
# (TrainConfig's defaults, written as fingerprint writes them)
_UNRECORDED = {"optimizer": "sgd", "lr schedule": _schedule_text("constant", 0, None, 0.1), "context": None}


def differences(saved: dict[str, str], wanted: dict[str, str]) -> list[str]:
    out = []
    for key in list(saved) + [k for k in wanted if k not in saved]:
        a, b = saved.get(key), wanted.get(key)
        if (a is None or b is None) and key in _UNRECORDED:
            if _UNRECORDED[key] is None:
                continue
            a, b = a or _UNRECORDED[key], b or _UNRECORDED[key]
        a, b = a or "(not recorded)", b or "(not recorded)"
        if a != b:
            out.append(f"{key}: the checkpoint was made with {a}, this run asks for {b}")
    return out


def check_fingerprint(step_dir: Path, manifest: dict[str, Any], cfg: TrainConfig, world_size: int) -> None:
    diff = differences(manifest["fingerprint"], fingerprint(cfg, world_size))
    if diff:
        raise ConfigError(
            f"checkpoint {step_dir} belongs to another configuration ({'; '.join(diff)}); its state would not fit "
            "this run: resume with the checkpoint's configuration, or start without --resume"
        )


# -- finding and reading checkpoints ---------------------------------------------------------------------


def _step_of(path: Path) -> int | None:
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The step directory that ``path`` names: ``path/latest``'s target, or ``path`` itself if it is one."""
    p = Path(path).expanduser()
    if p.is_file():
        raise CheckpointError(
            f"{p} is a file, not a checkpoint directory (a --save file holds the final model only and cannot be "
            "resumed): resume from a --checkpoint directory"
        )
    if not p.is_dir():
        raise CheckpointError(f"no checkpoint at {p}: the directory does not exist")
    latest = p / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        if _STEP_DIR.match(name) is None:
            raise CheckpointError(f"{latest} is corrupted: it holds {name[:60]!r}, not a step-NNNNNN directory name")
        target = p / name
        if not (target / MANIFEST).is_file():
            raise CheckpointError(f"{latest} names {name}, which is missing or incomplete (no {MANIFEST})")
        return target
    if (p / MANIFEST).is_file():
        return p
    complete = _complete_steps(p)
    if complete:
        raise CheckpointError(
            f"{p} has lost its '{LATEST}' pointer but holds {len(complete)} complete checkpoint"
            f"{'s' if len(complete) > 1 else ''}, the newest {complete[-1].name}: resume from it with --resume "
            f"{complete[-1]}"
        )
    raise CheckpointError(f"{p} holds no checkpoint (neither a '{LATEST}' pointer nor a {MANIFEST})")


def _complete_steps(root: Path) -> list[Path]:
    """``root``'s step directories that hold a manifest (written last: the checkpoint is complete), oldest first."""
    if not root.is_dir():
        return []
    steps = [(n, d) for d in root.iterdir() if (n := _step_of(d)) is not None and (d / MANIFEST).is_file()]
    return [d for _, d in sorted(steps)]


def holds_checkpoint(root: Path) -> bool:
    """Whether ``root`` holds a checkpoint: its ``latest`` pointer, or a complete step directory without one."""
    return (root / LATEST).exists() or bool(_complete_steps(root))


def read_manifest(step_dir: Path) -> dict[str, Any]:
    path = step_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{step_dir} is incomplete: it has no {MANIFEST}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is truncated or corrupted: {exc}") from None
    needed = {"format", "step", "world_size", "fingerprint", "files"}
    if not isinstance(manifest, dict) or not needed <= set(manifest):
        raise CheckpointError(f"{path} is not a gradcomp checkpoint manifest (it needs {sorted(needed)})")
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"{path} has format {manifest['format']!r}; this gradcomp reads format {FORMAT}")
    return manifest


def read_rank_file(step_dir: Path, manifest: dict[str, Any], rank: int, device: torch.device) -> dict[str, Any]:
    """One rank's state, after its size and SHA-256 were checked against the manifest."""
    name = rank_file_name(rank)
    path = step_dir / name
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(
            f"{step_dir} holds no state for rank {rank} (it was written by {manifest['world_size']} workers)"
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path} could not be read: {exc}") from None
    if len(data) != entry["bytes"]:
        what = "truncated" if len(data) < entry["bytes"] else "longer than written"
        raise CheckpointError(
            f"checkpoint file {path} is {what}: {len(data)} bytes, the manifest says {entry['bytes']}"
        )
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupted: its SHA-256 does not match the manifest's")
    try:
        state = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except Exception as exc:  # whatever torch.load raises, the file is unusable
        raise CheckpointError(f"checkpoint file {path} could not be loaded: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("rank") != rank:
        raise CheckpointError(f"checkpoint file {path} is not rank {rank}'s state of format {FORMAT}")
    if state.get("step") != manifest["step"]:
        raise CheckpointError(
            f"checkpoint file {path} is of step {state.get('step')}, the manifest of {manifest['step']}"
        )
    return state


# -- options ---------------------------------------------------------------------------------------------


def check_options(cfg: TrainConfig) -> None:
    """The checkpoint options alone; ConfigError."""
    every, keep = cfg.checkpoint_every, cfg.checkpoint_keep
    if every is not None and cfg.checkpoint_dir is None:
        raise ConfigError("--checkpoint-every needs --checkpoint DIR: where the checkpoints go")
    if every is not None and every < 1:
        raise ConfigError(f"--checkpoint-every must be a number of steps >= 1, got {every}")
    if keep < 0:
        raise ConfigError(f"--checkpoint-keep must be >= 0 (0 keeps every checkpoint), got {keep}")
    if cfg.resume_if_present and cfg.checkpoint_dir is None:
        raise ConfigError("--resume-if-present resumes from the --checkpoint directory: give --checkpoint DIR")
    if cfg.resume_if_present and cfg.resume_dir is not None:
        raise ConfigError("give --resume DIR or --resume-if-present, not both")
    if cfg.checkpoint_dir is not None:
        make_output_dir(Path(cfg.checkpoint_dir).expanduser(), "--checkpoint")


def resume_target(cfg: TrainConfig) -> Path | None:
    """The step directory this run continues from, or None for a fresh start.

    A ``--checkpoint`` directory that already holds a checkpoint is refused unless the run continues from one
    of its own checkpoints: its older step directories would otherwise be mixed with, or pruned by, this run.
    """
    root = Path(cfg.checkpoint_dir).expanduser() if cfg.checkpoint_dir is not None else None
    target = None
    held = root is not None and holds_checkpoint(root)
    if cfg.resume_dir is not None:
        target = find_checkpoint(cfg.resume_dir)
    elif held and cfg.resume_if_present:
        target = find_checkpoint(root)
    if held and not _inside(target, root):
        if (root / LATEST).exists():
            how = f"continue it with --resume {root} (or --resume-if-present)"
        else:  # (its 'latest' pointer is gone: name the newest complete checkpoint)
            how = f"its '{LATEST}' pointer is gone: continue it with --resume {_complete_steps(root)[-1]}"
        raise ConfigError(
            f"--checkpoint {root} already holds a checkpoint of another run; {how}, or give another directory"
        )
    return target


def resume_hint(cfg: TrainConfig) -> str:
    """'; the checkpoint of step N in DIR is intact: ...' when a failed run left one to continue from, else ''."""
    if cfg.checkpoint_dir is None:
        return ""
    root = Path(cfg.checkpoint_dir).expanduser()
    try:
        target = find_checkpoint(root)
        manifest = read_manifest(target)
        check_files(target, manifest)
    except (CheckpointError, OSError):
        return ""
    return f"; the checkpoint of step {manifest['step']} in {root} is intact: continue with --resume {root}"


def _inside(target: Path | None, root: Path) -> bool:
    """Whether ``target`` is one of ``root``'s step directories."""
    return target is not None and _step_of(target) is not None and target.parent.resolve() == root.resolve()


def check_before_launch(cfg: TrainConfig) -> None:
    """What the command line checks before any worker starts: options, and the resumed checkpoint's config. A
    ``--checkpoint`` folder that these checks made (to prove it writable) is removed again when they refuse the
    run: a refused command leaves nothing behind."""
    root = Path(cfg.checkpoint_dir).expanduser() if cfg.checkpoint_dir is not None else None
    made = root is not None and not root.exists()
    try:
        _check_before_launch(cfg)
    except Exception:
        if made and root.is_dir() and not any(root.iterdir()):
            root.rmdir()
        raise


def _check_before_launch(cfg: TrainConfig) -> None:
    check_options(cfg)
    target = resume_target(cfg)
    if target is not None:
        world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else cfg.workers
        manifest = read_manifest(target)
        check_fingerprint(target, manifest, cfg, world)
        if cfg.steps is not None and int(manifest["step"]) > cfg.steps:  # (with --epochs the workers check it)
            raise ConfigError(
                f"checkpoint {target} is at step {manifest['step']}, past this run's {cfg.steps} steps: give "
                f"--steps {manifest['step']} or more"
            )
        check_files(target, manifest)


def check_files(step_dir: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is present with its size and SHA-256 (each rank checks its own again on load).

    A missing, truncated or corrupted rank file is reported here, before any worker starts, instead of by whichever
    worker reads it first. The price: the launcher reads every rank's file once more before a resume.
    """
    check_file_sizes(step_dir, manifest)
    for name, entry in sorted(manifest["files"].items()):
        path = step_dir / name
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {path} could not be read: {exc.strerror or exc}") from None
        if digest.hexdigest() != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is corrupted: its SHA-256 does not match the manifest's")


def check_file_sizes(step_dir: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is present with its size."""
    for name, entry in sorted(manifest["files"].items()):
        path = step_dir / name
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {path} could not be read: {exc.strerror or exc}") from None
        if size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "longer than written"
            raise CheckpointError(f"checkpoint file {path} is {what}: {size} bytes, the manifest says {entry['bytes']}")


# -- one worker's side -----------------------------------------------------------------------------------


def _gather(transport: Transport, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, outside the byte counters (a rendezvous, or all_gather_object)."""
    from gradcomp.transport.sim import SimTransport

    if isinstance(transport, SimTransport):
        return list(transport.cluster.rendezvous(transport.rank, obj, list))
    from gradcomp.transport.dist import DistTransport

    if isinstance(transport, DistTransport):
        import torch.distributed as dist

        out: list[Any] = [None] * transport.world_size
        dist.all_gather_object(out, obj, group=transport.group)
        return out
    if transport.world_size == 1:
        return [obj]
    raise ConfigError(f"checkpoints need a simulated or torch.distributed transport, not {type(transport).__name__}")


def _numpy_rng() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}  # fmt: skip


def _set_numpy_rng(state: dict[str, Any]) -> None:
    keys = state["keys"].cpu().numpy().astype(np.uint32)
    np.random.set_state((state["name"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"]))


class WorkerCheckpoints:
    """One worker's checkpoints: ``resume()`` before the loop, ``after_step()`` after every step.

    ``stateful`` is what carries the exchange's state: the GradientAggregator, the DDP hook's state, or the
    LocalUpdateExchange (which holds the aggregator). Without checkpoint options every call does nothing.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        transport: Transport,
        device: torch.device,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        stateful: Any,
        exchange: Any,
        curves: Curves,
        per_epoch: int,
        total: int,
    ):
        self.cfg, self.transport, self.device = cfg, transport, device
        self.model, self.optimizer, self.stateful, self.exchange = model, optimizer, stateful, exchange
        self.curves, self.per_epoch, self.total = curves, per_epoch, total
        self.rank, self.world_size = transport.rank, transport.world_size
        self.root = Path(cfg.checkpoint_dir).expanduser() if cfg.checkpoint_dir is not None else None
        self.every = cfg.checkpoint_every
        self.resumed_from: int | None = None

    @property
    def active(self) -> bool:
        cfg = self.cfg
        return (
            cfg.checkpoint_dir is not None
            or cfg.resume_dir is not None
            or cfg.checkpoint_every is not None
            or cfg.resume_if_present
        )

    # -- resume ----------------------------------------------------------------------------------------------

    def resume(self) -> tuple[int, float, float]:
        """Load this rank's state if the run resumes; returns (first step, compute seconds so far, last loss)."""
        if not self.active:
            return 0, 0.0, math.nan
        check_options(self.cfg)
        target, error, restored = None, None, (0, 0.0, math.nan)
        try:
            target = resume_target(self.cfg)
            if target is not None:
                manifest = read_manifest(target)
                check_fingerprint(target, manifest, self.cfg, self.world_size)
                state = read_rank_file(target, manifest, self.rank, self.device)
                restored = self._restore(target, state)
        except (GradcompError, OSError) as exc:
            error = exc
        # every rank learns whether every rank could load: none goes on alone into a collective
        reports = _gather(self.transport, (str(target), None if error is None else f"{type(error).__name__}: {error}"))
        if error is not None:
            raise error
        failed = [(r, msg) for r, (_, msg) in enumerate(reports) if msg is not None]
        if failed:
            rank, msg = failed[0]
            raise CheckpointError(f"rank {rank} could not resume: {msg}")
        if len({path for path, _ in reports}) != 1:
            raise CheckpointError(f"the ranks found different checkpoints: {sorted({p for p, _ in reports})}")
        if self.root is not None:
            cleared = None
            if self.rank == 0:
                try:
                    self._clear_abandoned(target)
                except OSError as exc:
                    cleared = f"rank 0 could not tidy {self.root}: {exc}"
            # nobody writes into the directory before it is tidied, and nobody goes on if that failed
            cleared = _gather(self.transport, cleared)[0]
            if cleared is not None:
                raise CheckpointError(cleared)
        if target is not None:
            self.resumed_from = restored[0]
            if self.rank == 0:
                print(f"gradcomp: resuming from {target} (step {restored[0]} of {self.total})", file=sys.stderr)
        return restored

    def _restore(self, target: Path, state: dict[str, Any]) -> tuple[int, float, float]:
        step = int(state["step"])
        if step > self.total:
            raise ConfigError(
                f"checkpoint {target} is at step {step}, past this run's {self.total} steps (--steps/--epochs)"
            )
        data = state["data"]
        if data["per_epoch"] != self.per_epoch:
            raise ConfigError(
                f"checkpoint {target} was made with {data['per_epoch']} batches per epoch, this run has "
                f"{self.per_epoch} (another training set?)"
            )
        try:
            self.model.load_state_dict(state["model"])
            _restore_optimizer(self.optimizer, state["optimizer"])
            self.stateful.load_state_dict(state["exchange"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise CheckpointError(
                f"checkpoint {target}, rank {self.rank}: its state does not fit this run: {exc}"
            ) from None
        counter = self.transport.counter
        for key, value in state["counter"].items():
            setattr(counter, key, {k: list(v) for k, v in value.items()} if key == "ops" else value)
        self.exchange.compress_s = float(state["timing"]["compress_s"])
        self.curves.loss = [tuple(x) for x in state["curves"]["loss"]]
        self.curves.accuracy = [tuple(x) for x in state["curves"]["accuracy"]]
        # the process-wide RNGs: once per process (simulated workers share them)
        if not self.cfg.simulate or self.rank == 0:
            rng = state["rng"]
            torch.set_rng_state(rng["torch"].cpu())
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"].cpu(), self.device)
            random.setstate(_python_rng(rng["python"]))
            _set_numpy_rng(rng["numpy"])
        return step, float(state["timing"]["compute_s"]), float(state["loss"])

    def _clear_abandoned(self, target: Path | None) -> None:
        """Rank 0, before training: step directories of the checkpoint root that this run will not continue."""
        assert self.root is not None
        resumed_here = _inside(target, self.root)
        keep_up_to = _step_of(target) if resumed_here and target is not None else -1
        if not self.root.is_dir():
            return
        for child in self.root.iterdir():
            step = _step_of(child)
            if step is not None and child.is_dir() and step > keep_up_to:
                shutil.rmtree(child, ignore_errors=True)
        latest = self.root / LATEST
        if resumed_here and target is not None and (not latest.is_file() or latest.read_text().strip() != target.name):
            write_atomic(latest, (target.name + "\n").encode())

    # -- save ------------------------------------------------------------------------------------------------

    def after_step(self, done: int, compute_s: float, loss: float) -> None:
        """After step ``done - 1`` (so ``done`` steps are complete): write a checkpoint when one is due."""
        if self.root is None:
            return
        if done == self.total or (self.every is not None and done % self.every == 0):
            self.save(done, compute_s, loss)

    def state(self, done: int, compute_s: float, loss: float) -> dict[str, Any]:
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": _numpy_rng()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        epoch, batch = divmod(done, self.per_epoch)
        return {
            "format": FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "step": done,
            "data": {"epoch": epoch, "batch": batch, "per_epoch": self.per_epoch},
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "exchange": self.stateful.state_dict(),
            "counter": self.transport.counter.as_dict(),
            "timing": {"compute_s": compute_s, "compress_s": self.exchange.compress_s},
            "curves": {"loss": list(self.curves.loss), "accuracy": list(self.curves.accuracy)},
            "loss": loss,
            "rng": rng,
        }

    def save(self, done: int, compute_s: float, loss: float) -> Path:
        assert self.root is not None
        step_dir = self.root / step_dir_name(done)
        name = rank_file_name(self.rank)
        buffer = io.BytesIO()
        torch.save(self.state(done, compute_s, loss), buffer)
        data = buffer.getvalue()
        try:
            step_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(step_dir / name, data)
            report: dict[str, Any] = {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        except OSError as exc:
            report = {"error": f"rank {self.rank} could not write {step_dir / name}: {exc}"}
        reports = _gather(self.transport, report)
        self._raise_failures(reports, done)
        commit: dict[str, Any] = {}
        if self.rank == 0:
            try:
                self._commit(step_dir, done, reports)
            except OSError as exc:
                commit = {"error": f"rank 0 could not complete {step_dir}: {exc}"}
        self._raise_failures(_gather(self.transport, commit)[:1], done)
        return step_dir

    def _raise_failures(self, reports: list[dict[str, Any]], done: int) -> None:
        errors = [r["error"] for r in reports if "error" in r]
        if errors:
            latest = self.root / LATEST if self.root is not None else None
            kept = f"; {latest} still names the previous checkpoint" if latest is not None and latest.exists() else ""
            raise CheckpointError(f"the checkpoint of step {done} was not written ({'; '.join(errors)}){kept}")

    def _commit(self, step_dir: Path, done: int, reports: list[dict[str, Any]]) -> None:
        """Rank 0, once every rank's file is in place: the manifest, then ``latest``, then pruning."""
        assert self.root is not None
        manifest = {
            "format": FORMAT,
            "step": done,
            "world_size": self.world_size,
            "fingerprint": fingerprint(self.cfg, self.world_size),
            "files": {r["file"]: {"bytes": r["bytes"], "sha256": r["sha256"]} for r in reports},
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__,
            "config": dataclasses.asdict(self.cfg),
        }
        write_atomic(step_dir / MANIFEST, json.dumps(manifest, indent=1, default=str).encode())
        write_atomic(self.root / LATEST, (step_dir.name + "\n").encode())
        self._prune(done)

    def _prune(self, done: int) -> None:
        keep = self.cfg.checkpoint_keep
        complete, incomplete = [], []
        for child in self.root.iterdir() if self.root is not None else []:
            step = _step_of(child)
            if step is None or not child.is_dir() or step == done:
                continue
            (complete if (child / MANIFEST).is_file() and step < done else incomplete).append((step, child))
        doomed = incomplete + (sorted(complete)[: max(0, len(complete) - (keep - 1))] if keep > 0 else [])
        for _, child in doomed:
            shutil.rmtree(child, ignore_errors=True)


def _restore_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    optimizer.load_state_dict(state)


def _python_rng(state: Any) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
