"""``gradcomp train --fsdp``: one worker's training loop with an FSDP2 model (``fully_shard``) whose gradient
reduce-scatter is compressed by ``gradcomp.compress_fsdp``.

The model is the same as without ``--fsdp`` (``build_model``, the same seed); every child module of the
top level that holds parameters (SmallCNN: ``features`` and ``classifier``) is one FSDP module, then the
model itself. Parameters, gradients and the optimizer's state are sharded; the data, the batches, the
optimizer (SGD) and the step count are those of the DDP / aggregator runs, so a ``--fsdp`` run and a
plain one of the same settings see the same examples.

Evaluation: an FSDP forward is a collective (it all-gathers the parameters), so rank 0 cannot evaluate
alone. Every rank gathers the full parameters (``full_tensor``) into a plain copy of the model, and rank 0
evaluates the copy. The replica digest is that gathered copy's.

Not carried (refused before a worker starts, by ``TrainConfig.validate``): ``--simulate``, ``--ddp``,
``--local-steps``, a topology or a server compressor (the reduce-scatter is the topology), methods that own
their rounds (``gradcomp.train.fsdp.check_fsdp_method``), ``--checkpoint`` / ``--resume`` (the compressor's state
has ``state_dict``, but the runner's checkpoint format is per replica, not per shard), and a method that applies
momentum itself together with weight decay (the decay would have to enter the sharded gradient before the
exchange).

``launch`` calls ``run_fsdp_worker`` instead of ``runner.run_worker`` when ``cfg.fsdp`` is set (this module
uses the runner's batches and helpers, so the runner cannot import it).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

from gradcomp.experiments.run.data import evaluate, load_dataset
from gradcomp.experiments.run.models import build_model
from gradcomp.transport.base import Transport


def shard_model(model: nn.Module, world_size: int, device: torch.device) -> nn.Module:
    """``fully_shard`` every top-level child that holds parameters, then the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def gathered_copy(model: nn.Module, template: nn.Module) -> nn.Module:
    """A plain model holding the FSDP model's full parameters (a collective: every rank calls it)."""
    plain = copy.deepcopy(template)
    with torch.no_grad():
        for target, p in zip(plain.parameters(), model.parameters()):
            target.copy_(p.full_tensor())
    return plain


def run_fsdp_worker(cfg: Any, transport: Transport, device: torch.device, *, compress: bool = True) -> dict[str, Any]:
    """Train one rank's shard; returns the same statistics as ``runner.run_worker`` (plus the median step time
    and the residual's bytes). ``compress=False``: FSDP's own reduce-scatter (the baseline of docs/fsdp.md;
    no bytes are counted then)."""
    from gradcomp.experiments.run.runner import (
        Batches,
        Curves,
        Progress,
        compute_gradients,
        make_optimizer,
        parameter_digest,
    )
    from gradcomp.train.fsdp import compress_fsdp
    from gradcomp.transport.base import ByteCounter

    data = load_dataset(cfg.dataset, cfg.data_root)
    template = build_model(cfg.model, data, cfg.seed)
    model = shard_model(copy.deepcopy(template).to(device), transport.world_size, device)
    compressor, _ = cfg.build_compressors()
    state = compress_fsdp(model, compressor, nonfinite="raise") if compress else None  # the CLI stops at a NaN
    counter = state.counter if state is not None else ByteCounter()
    optimizer = make_optimizer(model, cfg)
    batches = Batches(data, cfg, transport.rank)
    total = batches.total_steps()
    lead = transport.rank == 0
    curves = Curves(total, cfg)
    progress = Progress(total, cfg.progress and lead, cfg.label() + " (FSDP)")
    compute_s, loss, step_s = 0.0, float("nan"), []
    for step in range(total):
        started = time.perf_counter()
        xb, yb = batches.get(step, device)
        loss = compute_gradients(model, xb, yb)  # backward runs the compressed reduce-scatters
        optimizer.step()
        step_s.append(time.perf_counter() - started)
        compute_s += step_s[-1]
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            plain = gathered_copy(model, template)  # on every rank; rank 0 evaluates it
            curves.record(step, loss, plain, data, evaluate_now=lead)
        else:
            curves.record(step, loss, model, data, evaluate_now=False)
        progress.update(loss, counter)
    progress.close()
    plain = gathered_copy(model, template)
    exchange_s, compress_s = counter.seconds, state.compress_s if state is not None else 0.0
    return {
        "rank": transport.rank,
        "steps": total,
        "syncs": total,
        "epochs": total / batches.per_epoch,
        "compute_s": compute_s - exchange_s - compress_s,
        "compress_s": compress_s,
        "communicate_s": exchange_s,
        "counter": counter.as_dict(),
        "digest": parameter_digest(plain),
        "resumed_from_step": None,
        "final_loss": loss,
        "test_accuracy": evaluate(plain, data.test_x, data.test_y) if lead else None,
        "loss_curve": curves.loss,
        "accuracy_curve": curves.accuracy,
        "num_parameters": sum(p.numel() for p in template.parameters()),
        "paper_compression": None,
        "method_report": None,
        "fsdp_residual_bytes": state.residual_bytes() if state is not None else 0,
        "median_step_s": sorted(step_s)[len(step_s) // 2] if step_s else None,
    }
