"""The DDP communication hook on gloo, with DDP's bucketing forced to make several buckets."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.experiments.data import load_dataset, shard_indices
from gradcomp.experiments.models import build_model


def _train(rank: int, world: int, compressor: str, params: dict, ef: bool, hook: bool, steps: int = 30):
    data = load_dataset("synthetic")
    model = build_model("mlp", data, seed=0)
    # bucket_cap_mb small enough that DDP makes several buckets for this ~10k-parameter MLP
    ddp = DDP(model, bucket_cap_mb=0.001)
    state = gradcomp.register_ddp_hook(ddp, gradcomp.make(compressor, error_feedback=ef, **params)) if hook else None
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    rows = shard_indices(data.num_train, rank, world, epoch=0, seed=0)
    losses = []
    for step in range(steps):
        batch = rows[step * 16 : (step + 1) * 16]
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(data.train_x[batch]), data.train_y[batch])
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
        "params": flat if rank == 0 else None,
        "losses": losses,
        "steps_seen": state.step if state else None,
        "bytes_up": state.transport.counter.bytes_up if state else None,
        "buckets": len(state.bucket_sizes) if state else None,
    }


def _runs(rank: int, world: int) -> dict:
    return {
        "plain": _train(rank, world, "none", {}, False, hook=False),
        "none": _train(rank, world, "none", {}, False, hook=True),
        "topk": _train(rank, world, "topk", {"density": 0.05}, True, hook=True),
        "randomk": _train(rank, world, "randomk", {"density": 0.1}, True, hook=True),
    }


@pytest.fixture(scope="module")
def ddp_runs():
    return run_workers(_runs, 2, timeout=300)


@pytest.mark.slow
def test_hook_runs_with_several_buckets_on_gloo(ddp_runs):
    assert ddp_runs[0]["topk"]["buckets"] > 1
    for label in ("none", "topk", "randomk"):
        assert ddp_runs[0][label]["digest"] == ddp_runs[1][label]["digest"], f"{label}: replicas diverged"
        assert ddp_runs[0][label]["steps_seen"] == 30


@pytest.mark.slow
def test_uncompressed_hook_matches_ddp_allreduce(ddp_runs):
    torch.testing.assert_close(ddp_runs[0]["none"]["params"], ddp_runs[0]["plain"]["params"], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_compressed_hook_learns_and_sends_fewer_bits(ddp_runs):
    for label in ("topk", "randomk"):
        losses = ddp_runs[0][label]["losses"]
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, f"{label} did not learn: {losses}"
        assert ddp_runs[0][label]["bytes_up"] < ddp_runs[0]["none"]["bytes_up"] / 5


def _nan_worker(rank: int, world: int) -> str:
    data = load_dataset("synthetic")
    model = build_model("mlp", data, seed=0)
    ddp = DDP(model)
    gradcomp.register_ddp_hook(ddp, gradcomp.make("topk", density=0.1))
    x = data.train_x[:8].clone()
    x[0, 0, 0, 0] = float("nan")  # on every rank: a rank that raised alone would leave its peers waiting
    try:
        F.cross_entropy(ddp(x), data.train_y[:8]).backward()
    except gradcomp.NonFiniteGradientError as exc:
        message = str(exc)
    else:
        message = "no error"
    dist.barrier()
    return message


@pytest.mark.slow
def test_hook_reports_nan_gradient_with_parameter_name():
    messages = run_workers(_nan_worker, 2, timeout=120)
    for message in messages:
        assert "non-finite" in message and "net." in message and "weight" in message, message
