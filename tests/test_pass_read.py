"""The DDP hook's one read per backward pass for methods whose messages the wire decodes (device path forced on CPU
tensors, 2 gloo ranks, several buckets): every bucket's checks (checksum, headers, positions, padding) and its
aggregate's finiteness wait on the device and are read with the pass's verdicts at its last bucket
(``wire.device.hold_for_the_pass``). The counts: tests/test_sync_count.py. Here, what that must not change and
what it does change:

- the gradients and the method's state are bit for bit those of a read per bucket;
- a corrupted message is still refused with WireError, on the rank that received it, now at the end of the pass;
- an aggregate of finite messages that overflows float32 abandons the pass on every rank (a read per bucket rescues
  it by adding the messages divided by W; at the pass's end its buckets have been handed to DDP already).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from wire_paths import device_path

pytestmark = pytest.mark.timeout(200)

METHODS = {
    "topk-ef": lambda: gradcomp.make("topk", density=0.25, error_feedback=True),
    "signum": lambda: gradcomp.make("signum"),
    "cnat": lambda: gradcomp.make("cnat"),
    "terngrad_shared": lambda: gradcomp.make("terngrad_shared"),
    "local_topk": lambda: gradcomp.make("local_topk", density=0.25),
    "sbc": lambda: gradcomp.make("sbc", density=0.25),  # sizes that vary: only the data checks wait for the pass
    "threshold-ef": lambda: gradcomp.make("threshold", threshold=0.01, error_feedback=True),
}
STEPS = 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@contextlib.contextmanager
def _read_per_bucket():
    """The hook without its pass's holding: every exchange reads its own checks, as before."""
    from gradcomp.train import comm_thread

    held = comm_thread.holding_for_the_pass
    comm_thread.holding_for_the_pass = lambda checks: contextlib.nullcontext()
    try:
        yield
    finally:
        comm_thread.holding_for_the_pass = held


def _train(label: str, rank: int) -> dict:
    model = _net()
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets
    state = gradcomp.register_ddp_hook(ddp, METHODS[label](), nonfinite="raise")  # (the read path)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    buckets = set()
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(step, rank)
        F.cross_entropy(ddp(x), y).backward()
        buckets.add(len(state._slots()))
        opt.step()
    out = {"params": _flat(model.parameters()), "grads": _flat(p.grad for p in model.parameters()),
           "state": state.state_dict()["exchange"]}
    state.close(timeout=20)
    return out


def _corrupted(rank: int) -> dict:
    """Rank 1 receives a corrupted copy of rank 0's message in the first bucket of step 1's pass."""
    from distributed import corrupting
    from gradcomp.schemes import single_round

    aggregate, calls = single_round.aggregate_buffers, []
    single_round.aggregate_buffers = corrupting(aggregate, rank, calls)
    try:
        model = _net()
        ddp = DDP(model, bucket_cap_mb=0.001)
        state = gradcomp.register_ddp_hook(ddp, gradcomp.make("topk", density=0.25))
        errors = []
        for step in range(2):
            x, y = _batch(step, rank)
            try:
                F.cross_entropy(ddp(x), y).backward()
            except RuntimeError as exc:
                errors.append((step, str(exc)))
        state.close(timeout=20)
    finally:
        single_round.aggregate_buffers = aggregate
    return {"errors": errors, "buckets_in_step_1": calls.count(1), "failure": repr(state.failure)}


def _overflow(rank: int) -> list:
    """Gradients of 3e38 (finite) on both ranks: their sum is not a float32."""
    out = []
    for per_bucket in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(40, 64), nn.Linear(64, 10))
        ddp = DDP(model, bucket_cap_mb=0.001)
        state = gradcomp.register_ddp_hook(ddp, gradcomp.make("topk", density=0.1), nonfinite="raise")
        with _read_per_bucket() if per_bucket else contextlib.nullcontext():
            try:
                (sum(p.sum() for p in ddp.parameters()) * 3e38 + 0 * ddp(torch.ones(1, 40)).sum()).backward()
                out.append(("applied", bool(all(torch.isfinite(p.grad).all() for p in model.parameters()))))
            except gradcomp.NonFiniteGradientError:
                out.append(("raised", True))
        state.close(timeout=20)
    return out


def _worker(rank: int, world: int) -> dict:
    out = {}
    for label in METHODS:
        out[(label, "pass")] = _train(label, rank)
        with _read_per_bucket():
            out[(label, "bucket")] = _train(label, rank)
    out["corrupted"] = _corrupted(rank)
    out["overflow"] = _overflow(rank)
    return out


@pytest.fixture(scope="module")
def runs():
    with pytest.MonkeyPatch.context() as patch:
        device_path(patch)  # the GPU's code on CPU tensors
        patch.setenv("GRADCOMP_KERNELS", "0")
        yield run_workers(_worker, 2, timeout=180)


@pytest.mark.parametrize("label", list(METHODS))
def test_one_read_per_pass_changes_no_bit(runs, label):
    from distributed import same

    for r in runs:
        held, read = r[(label, "pass")], r[(label, "bucket")]
        assert torch.equal(held["params"], read["params"]) and torch.equal(held["grads"], read["grads"]), label
        assert same(held["state"], read["state"]), label
    assert torch.equal(runs[0][(label, "pass")]["params"], runs[1][(label, "pass")]["params"])


def test_a_corrupted_message_is_refused_at_the_end_of_the_pass_on_every_rank(runs):
    rank0, rank1 = runs[0]["corrupted"], runs[1]["corrupted"]
    assert rank1["buckets_in_step_1"] >= 2  # the corrupted bucket was not the pass's last: its read was held
    (step, error), = rank1["errors"]
    assert step == 1 and "WireError" in error and "checksum mismatch" in error, error
    assert rank1["failure"].startswith("WireError")
    (step, error), = rank0["errors"]  # rank 0 received nothing bad, and learns of it at the same pass
    assert step == 1 and "another worker refused a message" in error, error
    assert rank0["failure"].startswith("WireError")


def test_an_aggregate_that_overflows_abandons_the_pass_on_every_rank(runs):
    for r in runs:
        assert r["overflow"] == [("raised", True), ("applied", True)], r["overflow"]


def test_only_an_aggregate_that_is_the_workers_result_holds_its_checks(monkeypatch):
    """A server's or a shard's aggregate is sent on: its checks are read at once, or a corruption would travel to
    workers that never see them. An all-gather's (``final=True``) waits for the pass's read."""
    from gradcomp.schemes.single_round import aggregate_buffers, encode_slots
    from gradcomp.wire.device import DeviceChecks, holding_for_the_pass

    device_path(monkeypatch)
    monkeypatch.setenv("GRADCOMP_KERNELS", "0")
    compressor, slots = gradcomp.make("topk", density=0.1), [gradcomp.Slot("w", 0, 3000)]
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    bad = encode_slots(compressor, slots, [compressor.compress(x, slots[0], 0)]).clone()
    bad[-1] ^= 4
    held = DeviceChecks()
    with holding_for_the_pass(held):
        with pytest.raises(gradcomp.WireError, match="checksum"):
            aggregate_buffers(compressor, slots, [bad], 0, torch.device("cpu"))
        assert not held.pending
        aggregate_buffers(compressor, slots, [bad], 0, torch.device("cpu"), final=True)
    assert held.pending
    with pytest.raises(gradcomp.WireError, match="checksum mismatch"):
        held.read_after([])
