"""The DDP hook with DDP(find_unused_parameters=True): unused branches and parameters frozen mid-training.

With ``find_unused_parameters=True`` DDP all-reduces its map of used parameters on its own process group once
the last bucket is ready, from the autograd thread, while the hook's thread may still be exchanging earlier
buckets. On one shared group the two sequences of collectives interleave differently on different ranks and
the job hangs (a review saw it in 8 of 9 runs); the hook therefore runs on a process group of its own.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp

CAP = 0.01  # MB: the model below falls into several buckets
STEPS = 10
FREEZE_AT = 4


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(20, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 10)
        self.extra = nn.Linear(64, 10)  # used only on some steps, by some ranks

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        y = self.c(h)
        return y + self.extra(h) if use_extra else y


def _method(name: str):
    if name == "topk":
        return gradcomp.make("topk", density=0.1, error_feedback=True)
    return gradcomp.make("powersgd", rank=2)


def _train(rank: int, name: str, freeze: bool | str) -> dict:
    """``freeze``: True freezes ``a.weight`` at step FREEZE_AT; "before the hook" between wrapping the model in DDP
    and registering the hook (DDP's buckets then still hold it)."""
    torch.manual_seed(0)
    model = Branchy()
    ddp = DDP(model, bucket_cap_mb=CAP, find_unused_parameters=True)
    frozen = None
    if freeze == "before the hook":
        model.a.weight.requires_grad_(False)
        frozen = model.a.weight.detach().clone()
    state = gradcomp.register_ddp_hook(ddp, _method(name))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        if freeze is True and step == FREEZE_AT:
            model.a.weight.requires_grad_(False)
            frozen = model.a.weight.detach().clone()
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)
        optimizer.zero_grad()
        # the branch is used by rank 0 on even steps and by rank 1 on every third: unused on some ranks only,
        # on every rank, or on none
        use_extra = step % 2 == 0 if rank == 0 else step % 3 == 0
        nn.functional.cross_entropy(ddp(x, use_extra), y).backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = {
        "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
        "steps": state.step,
        "buckets": len(state.bucket_sizes),
        "own_group": state.transport.group is not ddp.process_group,
        "frozen_moved": None if frozen is None else not torch.equal(frozen, model.a.weight.detach()),
    }
    state.close()
    return out


def _unused_and_frozen(rank: int, world: int) -> dict:
    runs = {f"{name}-unused": _train(rank, name, freeze=False) for name in ("topk", "powersgd")}
    runs["topk-frozen"] = _train(rank, "topk", freeze=True)
    # a ConfigError "DDP bucket 1 holds parameters the hook was not registered with" before 2026-12-05
    runs["powersgd-frozen-before-the-hook"] = _train(rank, "powersgd", freeze="before the hook")
    # an explicit group is used as given; DDP's own group is refused with find_unused_parameters=True
    torch.manual_seed(0)
    ddp = DDP(Branchy(), bucket_cap_mb=CAP, find_unused_parameters=True)
    try:
        gradcomp.register_ddp_hook(ddp, _method("topk"), process_group=ddp.process_group)
    except gradcomp.ConfigError as exc:
        runs["refused"] = str(exc)
    group = dist.new_group(backend="gloo")
    state = gradcomp.register_ddp_hook(ddp, _method("topk"), process_group=group)
    runs["explicit"] = state.transport.group is group
    state.close()
    return runs


@pytest.fixture(scope="module")
def unused_runs():
    # a hang (the hook's collectives interleaved with DDP's on one group) fails here instead of hanging
    return run_workers(_unused_and_frozen, 2, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["topk-unused", "powersgd-unused", "topk-frozen", "powersgd-frozen-before-the-hook"])
def test_find_unused_parameters_finishes_with_identical_replicas(unused_runs, label):
    runs = [r[label] for r in unused_runs]
    assert all(r["own_group"] for r in runs), "the hook must not share DDP's process group"
    assert len({r["digest"] for r in runs}) == 1, f"{label}: replicas diverged"
    assert all(r["steps"] == STEPS for r in runs)
    assert all(r["buckets"] >= 2 for r in runs), runs


@pytest.mark.slow
def test_parameter_frozen_mid_training_no_longer_moves(unused_runs):
    assert [r["topk-frozen"]["frozen_moved"] for r in unused_runs] == [False, False]


@pytest.mark.slow
def test_parameter_frozen_after_wrapping_before_the_hook_trains_and_stays(unused_runs):
    """A backbone frozen after DDP wrapped the model but before the hook was registered stays in DDP's buckets:
    the hook gives it a slot of its own, it does not move, and the rest trains with identical replicas."""
    assert [r["powersgd-frozen-before-the-hook"]["frozen_moved"] for r in unused_runs] == [False, False]


@pytest.mark.slow
def test_explicit_group_is_used_and_ddps_own_is_refused(unused_runs):
    for r in unused_runs:
        assert "find_unused_parameters" in r["refused"], r
        assert r["explicit"] is True
