"""``nonfinite="propagate"`` of the DDP hook and of GradientAggregator (gloo, CPU, 2 ranks; the host path and the
device path forced on CPU tensors): a NaN / Inf gradient on one rank raises nothing; after that backward pass (and
``step()``) every rank holds NaN gradients, the same on every rank, the method's state is back where it was before
the pass, and a user who skips the optimizer step on non-finite gradients trains on with identical replicas. (That
the methods that only all-reduce then read nothing from the device: tests/test_sync_count.py.)
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers, same
from test_gradscaler import _net, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.errors import ConfigError
from wire_paths import device_path

pytestmark = pytest.mark.timeout(200)

BAD_STEP, BAD_RANK, STEPS = 2, 1, 4
METHODS = {
    "none": lambda: gradcomp.make("none"),  # the hook's direct all-reduce
    "fp16": lambda: gradcomp.make("fp16"),
    "randomk": lambda: gradcomp.make("randomk", density=0.25),  # stateless, through the thread's exchange
    "topk-ef": lambda: gradcomp.make("topk", density=0.25, error_feedback=True),  # gathered, with residuals
    "powersgd": lambda: gradcomp.make("powersgd"),  # all-reduces with state (Q, residuals)
}


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _run(rank: int, label: str, driver: str = "hook") -> dict:
    model = _net()
    if driver == "hook":
        ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets
        state = gradcomp.register_ddp_hook(ddp, METHODS[label](), nonfinite="propagate")
    else:
        ddp, state = model, gradcomp.GradientAggregator(model, METHODS[label](), nonfinite="propagate")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank)
        loss = F.cross_entropy(ddp(x), y)
        if step == BAD_STEP and rank == BAD_RANK:
            loss = loss * float("inf")  # this rank's gradients are not finite
        before_params, before_state = _flat(model.parameters()), state.state_dict()["exchange"]
        loss.backward()  # raises nothing
        if driver == "aggregator":
            assert state.step() is None  # raises nothing, and says nothing: the gradients do
        grads = _flat(p.grad for p in model.parameters())
        finite = bool(torch.isfinite(grads).all())
        if finite:  # the user's own check
            opt.step()
        steps.append({
            "finite": finite, "grads": grads, "moved": not torch.equal(before_params, _flat(model.parameters())),
            "state_unchanged": same(before_state, state.state_dict()["exchange"]),
        })
    out = {"steps": steps, "params": _flat(model.parameters()), "failure": repr(getattr(state, "failure", None))}
    if driver == "hook":
        state.close(timeout=20)
    return out


def _worker(rank: int, world: int) -> dict:
    return {(driver, label): _run(rank, label, driver) for driver in ("hook", "aggregator") for label in METHODS}


@pytest.fixture(scope="module", params=["host", "device"])
def runs(request):
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "device":
            device_path(patch)  # the GPU's code on CPU tensors: the stateless ones read nothing
            patch.setenv("GRADCOMP_KERNELS", "0")
        yield run_workers(_worker, 2, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["hook", "aggregator"])
@pytest.mark.parametrize("label", list(METHODS))
def test_a_non_finite_gradient_on_one_rank_reaches_every_rank_as_nan_and_nothing_raises(runs, label, driver):
    per_rank = [r[driver, label] for r in runs]
    for rank, run in enumerate(per_rank):
        assert run["failure"] == "None", (rank, run["failure"])
        for step, s in enumerate(run["steps"]):
            assert s["finite"] == (step != BAD_STEP), (rank, step)  # every rank sees it, the good one too
            assert s["moved"] == (step != BAD_STEP), (rank, step)
        assert per_rank[rank]["steps"][BAD_STEP]["state_unchanged"], rank  # the pass's state put back
    a, b = (r["steps"][BAD_STEP]["grads"] for r in per_rank)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))  # the same NaN
    assert torch.equal(per_rank[0]["params"], per_rank[1]["params"])  # replicas identical, training went on


def test_an_unknown_nonfinite_policy_is_refused_before_anything_is_sent(tmp_path):
    if dist.is_initialized():  # pragma: no cover - another test left one
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = DDP(_net())
        with pytest.raises(ConfigError, match="nonfinite must be one of"):
            gradcomp.register_ddp_hook(ddp, gradcomp.make("none"), nonfinite="ignore")
        with pytest.raises(ConfigError, match="nonfinite must be one of"):
            gradcomp.GradientAggregator(_net(), gradcomp.make("none"), nonfinite="ignore")
        del ddp
    finally:
        gc.collect()  # the DDP model freed while the group exists (tests/test_race_worker_clock.py says why)
        dist.destroy_process_group()


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


@pytest.mark.parametrize("label", ["powersgd", "randomk-ef", "true_topk", "sketch"])
def test_restore_where_puts_the_state_back_only_where_the_flag_says_and_refuses_a_moved_layout(label):
    """``GradientExchange.restore_where`` (what the hook runs instead of reading a pass's verdict, under a scaler or
    ``nonfinite="propagate"``): True puts back the snapshot exactly, False leaves the state as it is, and a state
    whose layout moved since the snapshot (a slot's first step) is refused, unchanged. PowerSGD, true top-k and
    sketched SGD (one ``SlotState``) do it in place, their tensors keeping their identity; random-k with error
    feedback through the generic path (``state_dict`` / ``load_state_dict``). Either way the scheme works on from
    the state put back: the undone step, taken again, gives the same results and the same state as the first time."""
    from gradcomp.train.exchange import GradientExchange

    make = {"powersgd": lambda: gradcomp.make("powersgd", start_iter=0),
            "randomk-ef": lambda: gradcomp.make("randomk", density=0.25, error_feedback=True),
            "true_topk": lambda: gradcomp.make("true_topk", density=0.25, min_size=1),
            "sketch": lambda: gradcomp.make("sketch", density=0.25, min_size=1)}[label]
    shapes = [(24, 12), (16, 24), (12, 24)]
    grads = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(shapes)]
    slots = [gradcomp.Slot(name, i, g.numel(), g.shape) for i, (name, g) in enumerate(zip("wvu", grads))]

    def live(ex) -> list[int]:
        state = getattr(ex.scheme, "state", None) or getattr(getattr(ex.scheme, "memory", None), "state", None)
        return [id(t) for field in state._fields.values() for t in field.values()] if state is not None else []

    def worker(t):
        ex = GradientExchange(make(), t)
        ex.exchange(slots[:2], grads[:2], 0)
        before = ex.snapshot()
        first = ex.exchange(slots[:2], [2 * x for x in grads[:2]], 1)
        after, ids = ex.snapshot(), live(ex)
        assert not _same_state(before, after)  # the step moved the state
        assert ex.restore_where(before, torch.tensor([False])) and _same_state(ex.snapshot(), after)
        assert ex.restore_where(before, torch.tensor([True])) and _same_state(ex.snapshot(), before)
        assert live(ex) == ids  # in place where the state is one SlotState (empty list otherwise)
        again = ex.exchange(slots[:2], [2 * x for x in grads[:2]], 1)  # the undone step, taken again
        assert all(torch.equal(a, b) for a, b in zip(first, again)) and _same_state(ex.snapshot(), after)
        assert ex.restore_where(before, torch.tensor([True]))
        ex.exchange(slots, grads, 2)  # a third slot: its state appears
        moved = ex.snapshot()
        assert not ex.restore_where(before, torch.tensor([True]))
        assert _same_state(ex.snapshot(), moved)
        return bool(ids)

    with gradcomp.SimulatedCluster(2, timeout=60) as cluster:
        assert cluster.run(worker) == [label != "randomk-ef"] * 2


def test_a_pass_handed_on_is_nan_in_every_bucket_where_the_flags_say_and_untouched_elsewhere():
    """The hook's unread end of a pass (``_CommThread._pass_handed_on``): any flag True fills every bucket of the
    pass with NaN and restores the state; all False changes nothing; a refused restore leaves the flags to be
    read."""
    from types import SimpleNamespace

    from gradcomp.train.comm_thread import _CommThread

    restored = []

    def restore_where(snapshot, bad):
        restored.append(bool(bad))
        return snapshot != "moved"

    exchange = SimpleNamespace(restore_where=restore_where)
    for flags, moved, want in [((False, True), False, "nan"), ((False, False), False, "kept"),
                               ((True,), True, "refused")]:
        worker = _CommThread(exchange, propagate=True)
        buffers = [torch.ones(3), torch.full((2,), 2.0)]
        worker._snapshot = "moved" if moved else {}
        worker._pass_flags = [torch.tensor([f]) for f in flags]
        worker._pass_buckets = [(b, True, []) for b in buffers]
        handed_on = worker._pass_handed_on()
        assert handed_on == (want != "refused")
        assert restored[-1] == any(flags)
        if want == "nan":
            assert all(b.isnan().all() for b in buffers) and worker._pass_flags == []
        else:
            assert torch.equal(buffers[0], torch.ones(3)) and torch.equal(buffers[1], torch.full((2,), 2.0))
        if want == "refused":
            assert len(worker._pass_flags) == 1  # left for _pass_abandoned to read
    assert not _CommThread(exchange)._pass_handed_on()  # raise (the default): the verdict is read
