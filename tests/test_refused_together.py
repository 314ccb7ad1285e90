"""A message corrupted on its way to one rank: every rank raises WireError at that step, and nothing of it is applied.

Two gloo ranks; the rank that receives the corrupted copy (one bit of a container message's body flipped as the
collective hands it over, the sender's copy untouched) is the only one whose checks can see it. Every rank must
still stop at the same step (``train.agreement.settle``), with the method's state as it was before the step, and the
replicas must stay identical when the caller catches the error and goes on. Each method and topology runs on the
host path and on the device path (the GPU's code on CPU tensors).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradcomp
from gradcomp.wire.format import MAGIC
from gradcomp.wire.bits import set_device_path_on_cpu

# label: (method, its parameters, topology, the rank that receives the corrupted message)
CASES = {
    "topk": ("topk", {"density": 0.2, "error_feedback": True}, "auto", 1),
    "signum": ("signum", {}, "auto", 1),
    "qsgd": ("qsgd", {}, "auto", 1),
    "cnat-sharded": ("cnat", {}, "sharded", 1),  # refused in the first of two rounds: the second still runs
    "topk-ps-gather": ("topk", {"density": 0.2}, "ps", 0),  # the server refuses a worker's message
    "topk-ps-broadcast": ("topk", {"density": 0.2}, "ps-compressed", 1),  # a worker refuses the server's
    "threshold": ("threshold", {"threshold": 0.01, "error_feedback": True}, "auto", 1),
    "sbc": ("sbc", {"density": 0.2}, "auto", 1),
    "stc": ("stc", {"density": 0.2}, "auto", 1),
    "dgc": ("dgc", {"density": 0.2}, "auto", 1),
    "local_topk": ("local_topk", {"density": 0.2}, "auto", 1),
    "terngrad_shared": ("terngrad_shared", {}, "auto", 1),
    "lgc-topk": ("lgc", {"density": 0.2, "dense_steps": 1, "topk_steps": 3}, "auto", 1),  # the leader's positions
    "lgc-compressed": ("lgc", {"density": 0.2, "dense_steps": 0, "topk_steps": 1}, "auto", 1),
}
PATHS = ("host", "device")


def _corrupt(transport, armed: list) -> None:
    """From the moment ``armed[0]`` is set, the first container message that this rank receives from another rank,
    through any collective, arrives with one bit of its body flipped (then ``armed[0]`` is cleared)."""

    def bad(t: torch.Tensor) -> torch.Tensor:
        if not armed[0] or t.dtype != torch.uint8 or t.numel() <= 20 or bytes(t[:2].tolist()) != MAGIC:
            return t
        armed[0] = False
        t = t.clone()
        t[-1] ^= 4
        return t

    rank = transport.rank
    all_gather, all_to_all = transport._all_gather, transport._all_to_all
    gather, broadcast = transport._gather, transport._broadcast
    transport._all_gather = lambda t: [x if i == rank else bad(x) for i, x in enumerate(all_gather(t))]

    def to_all(t):
        out = all_to_all(t)
        chunks = list(out.view(transport.world_size, -1))
        return torch.cat([c if i == rank else bad(c) for i, c in enumerate(chunks)])

    transport._all_to_all = to_all
    transport._gather = lambda t, root: None if (got := gather(t, root)) is None else [
        x if i == rank else bad(x) for i, x in enumerate(got)]
    transport._broadcast = lambda t, root: broadcast(t, root) if root == rank else bad(broadcast(t, root))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 24, generator=g), torch.randint(0, 4, (8,), generator=g)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _aggregator(rank: int, label: str, corrupt: bool = True) -> dict:
    """Three steps; in step 1 the receiver gets a corrupted message (or, ``corrupt=False``, every rank skips step 1
    without exchanging anything: the run in which the refused step never happened)."""
    from gradcomp.transport.dist import DistTransport

    name, params, topology, receiver = CASES[label]
    armed = [False]
    transport = DistTransport()
    if rank == receiver and corrupt:
        _corrupt(transport, armed)
    model = _net()
    options = {"topology": topology}
    if topology == "ps-compressed":
        options = {"topology": "ps", "server_compressor": gradcomp.make(name, **params)}
    aggregator = gradcomp.GradientAggregator(model, gradcomp.make(name, **params), transport, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    errors, before, after = [], None, None
    for step in range(3):
        x, y = _batch(step, rank)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if step == 1:
            armed[0], before = True, copy.deepcopy(aggregator.state_dict())
            if not corrupt:
                continue
        try:
            aggregator.step()
        except gradcomp.WireError as exc:
            errors.append((step, str(exc)))
            after = aggregator.state_dict()
            continue
        optimizer.step()
    return {"errors": errors, "restored": (before, after), "params": _flat(model.parameters()),
            "corrupted": rank == receiver and not armed[0], "state": aggregator.state_dict()}


def _hook(rank: int) -> dict:
    """The DDP hook on the host path: the corrupted bucket is not the pass's last."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    armed, errors = [False], []
    model = _net()
    ddp = DDP(model, bucket_cap_mb=0.0005)
    state = gradcomp.register_ddp_hook(ddp, gradcomp.make("topk", density=0.2))
    if rank == 1:
        _corrupt(state.transport, armed)
    for step in range(2):
        x, y = _batch(step, rank)
        armed[0] = step == 1
        try:
            F.cross_entropy(ddp(x), y).backward()
        except RuntimeError as exc:
            errors.append((step, str(exc)))
    state.close(timeout=20)
    return {"errors": errors, "failure": repr(state.failure)}


def _worker(rank: int, world: int) -> dict:
    out = {}
    for path in PATHS:
        set_device_path_on_cpu(True) if path == "device" else "0"
        os.environ["GRADCOMP_KERNELS"] = "0" if path == "device" else os.environ.get("GRADCOMP_KERNELS", "1")
        for label in CASES:
            out[(label, path)] = _aggregator(rank, label)
            out[(label, path, "never")] = _aggregator(rank, label, corrupt=False)
    set_device_path_on_cpu(False)
    out["hook"] = _hook(rank)
    return out


@pytest.fixture(scope="module")
def runs():
    from distributed import run_workers

    return run_workers(_worker, 2, timeout=240)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("label", list(CASES))
def test_every_rank_refuses_the_step_and_nothing_of_it_is_applied(runs, label, path):
    from distributed import same

    receiver = CASES[label][3]
    assert runs[receiver][(label, path)]["corrupted"], "no container message reached the receiver"
    for rank, run in enumerate(runs):
        result = run[(label, path)]
        (step, error), = result["errors"]
        assert step == 1, (rank, error)
        if rank == receiver:
            assert "another worker" not in error and "every worker stops" in error, error
        else:
            assert "another worker refused a message it received at exchange 1" in error, error
        before, after = result["restored"]
        assert same(before, after), (rank, "the method's state moved in the refused step")
        never = run[(label, path, "never")]  # the refused step undone exactly: as if it had never happened
        assert torch.equal(result["params"], never["params"]) and same(result["state"], never["state"]), rank
    assert torch.equal(runs[0][(label, path)]["params"], runs[1][(label, path)]["params"])


def test_the_ddp_hook_refuses_the_pass_on_every_rank_on_the_host_path(runs):
    receiver, other = runs[1]["hook"], runs[0]["hook"]
    (step, error), = receiver["errors"]
    assert step == 1 and "checksum mismatch" in error, error
    (step, error), = other["errors"]
    assert step == 1 and "another worker refused a message" in error, error
    assert other["failure"].startswith("WireError")


def test_a_coordinate_beyond_its_part_is_noted_inside_refusing_later_and_made_harmless():
    """Local top-k's range check of the gathered coordinates (host path), a check after the checksum passed: WireError
    outside; inside a step that keeps its refusals, the fault noted and every coordinate clamped into its part."""
    from gradcomp.schemes.accumulation import split_indices
    from gradcomp.wire.refusals import Refusals, refusing_later

    field = torch.tensor([1, 2, 9, 0])
    with pytest.raises(gradcomp.WireError, match="part 1 holds coordinate 9, beyond its 5"):
        split_indices(field, [2, 2], [5, 5], "x")
    refusals = Refusals()
    with refusing_later(refusals):
        parts = split_indices(field, [2, 2], [5, 5], "x")
    assert refusals.messages == ["x: part 1 holds coordinate 9, beyond its 5"]
    assert [p.tolist() for p in parts] == [[1, 2], [4, 0]]
