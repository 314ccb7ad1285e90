"""A non-finite gradient on one rank only: every rank raises the same NonFiniteGradientError at the same step, no
rank's residual or momentum changes, and no rank waits for a time-out (gloo, GradientAggregator and the DDP hook,
top-k with error feedback and Signum)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers, same
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from wire_paths import device_path

pytestmark = pytest.mark.timeout(200)

BAD_STEP, BAD_RANK, STEPS = 3, 1, 5
METHODS = {
    "topk-ef": lambda: gradcomp.make("topk", density=0.25, error_feedback=True),
    "signum": lambda: gradcomp.make("signum"),
    "topk-ef-ps": lambda: gradcomp.make("topk", density=0.25, error_feedback=True),
    # two rounds; on the device path the verdict rides on the all-to-all and is read by every shard owner
    "cnat-sharded": lambda: gradcomp.make("cnat"),
    "none": lambda: gradcomp.make("none"),
    # all-reduce only: on the device path the DDP hook reads their verdict once per backward pass, at the last bucket
    "powersgd": lambda: gradcomp.make("powersgd"),
    "fp16": lambda: gradcomp.make("fp16"),
}
TOPOLOGY = {"topk-ef-ps": "ps", "cnat-sharded": "sharded"}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)
    if step == BAD_STEP and rank == BAD_RANK:
        x[0, 0] = float("nan")
    return x, y


def _aggregator(rank: int, world: int) -> dict:
    out = {}
    for label, make in METHODS.items():
        model = _net()
        agg = gradcomp.GradientAggregator(model, make(), topology=TOPOLOGY.get(label, "auto"))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        events = []
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _batch(step, rank)
            F.cross_entropy(model(x), y).backward()
            before = agg.state_dict()["exchange"]
            started = time.monotonic()
            try:
                agg.step()
            except gradcomp.NonFiniteGradientError as exc:
                events.append({"step": step, "error_step": exc.step, "message": str(exc).split(";")[0],
                               "unchanged": same(before, agg.state_dict()["exchange"]),
                               "seconds": time.monotonic() - started})
                continue
            opt.step()
        out[label] = {"events": events, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
    return out


def _check(per_rank: list[dict], labels) -> None:
    for label in labels:
        runs = [r[label] for r in per_rank]
        for rank, run in enumerate(runs):
            assert len(run["events"]) == 1, (label, rank, run["events"])
            event = run["events"][0]
            assert event["step"] == BAD_STEP and event["error_step"] == BAD_STEP, (label, rank, event)
            assert event["unchanged"], (label, rank, "the method's state changed at the bad step")
            assert event["seconds"] < 20, (label, rank, event)
        assert len({run["events"][0]["message"] for run in runs}) == 1, label  # the same error on every rank
        for run in runs[1:]:
            assert torch.equal(run["params"], runs[0]["params"]), label  # the replicas went on together


@pytest.mark.slow
def test_aggregator_nan_on_one_rank_raises_the_same_error_on_every_rank():
    _check(run_workers(_aggregator, 3, timeout=180), METHODS)


def _hook(rank: int, world: int) -> dict:
    # a 10 s time-out: a rank that waited for one would take that long, and fail with WorkerLostError
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=10))
    out = {}
    for label, make in METHODS.items():
        model = _net()
        ddp = DDP(model, bucket_cap_mb=0.001, process_group=group)  # several buckets
        state = gradcomp.register_ddp_hook(ddp, make(), topology=TOPOLOGY.get(label, "auto"), nonfinite="raise")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        events = []
        for step in range(BAD_STEP + 1):
            opt.zero_grad()
            x, y = _batch(step, rank)
            before = state.state_dict()["exchange"]
            started = time.monotonic()
            try:
                F.cross_entropy(ddp(x), y).backward()
            except gradcomp.NonFiniteGradientError as exc:  # the typed error, from backward itself
                failure = exc
                events.append({
                    "step": step, "error_step": getattr(failure, "step", None), "type": type(failure).__name__,
                    "message": str(failure).split(";")[0], "in_backward": state.failure is None,
                    "unchanged": same(before, state.state_dict()["exchange"]),
                    "seconds": time.monotonic() - started,
                })
                break
            opt.step()
        state.close(timeout=20)
        t = torch.ones(1)
        dist.all_reduce(t, group=group)  # the group is usable at once: no collective of the hook in flight
        out[label] = {"events": events, "sum": float(t),
                      "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
    return out


@pytest.mark.slow
def test_hook_nan_on_one_rank_raises_the_same_error_on_every_rank():
    per_rank = run_workers(_hook, 2, timeout=180)
    for label in METHODS:
        for rank, r in enumerate(per_rank):
            run = r[label]
            assert r[label]["sum"] == 2.0
            (event,) = run["events"]
            assert event["type"] == "NonFiniteGradientError" and event["in_backward"], (label, rank, event)
            assert event["step"] == BAD_STEP and event["error_step"] == BAD_STEP, (label, rank, event)
            assert event["unchanged"], (label, rank, "the method's state changed at the bad step")
            assert event["seconds"] < 8, (label, rank, event)  # under the group's 10 s time-out
        assert per_rank[0][label]["events"][0]["message"] == per_rank[1][label]["events"][0]["message"], label
        assert torch.equal(per_rank[0][label]["params"], per_rank[1][label]["params"]), label


# -- a step undone exactly: a run with a non-finite step ignored == a run that never had that step ------------------

UNDONE = {
    "topk-ef": ("topk", {"density": 0.25, "error_feedback": True}, "auto"),
    "topk-ef-sharded": ("topk", {"density": 0.25, "error_feedback": True}, "sharded"),
    "threshold-ps": ("threshold", {"threshold": 0.01, "error_feedback": True}, "ps"),
    "signum": ("signum", {}, "auto"),
    "powersgd": ("powersgd", {}, "auto"),
    "dgc": ("dgc", {"density": 0.25}, "auto"),
    "terngrad_shared": ("terngrad_shared", {}, "auto"),
    "lgc-training": ("lgc", {"density": 0.25, "dense_steps": 1, "topk_steps": 3}, "auto"),  # its first message
    "lgc-compressed": ("lgc", {"density": 0.25, "dense_steps": 1, "topk_steps": 1}, "auto"),  # is a broadcast
}


def _undone_run(name: str, params: dict, topology: str, bad: str):
    def fn(t):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        agg = gradcomp.GradientAggregator(model, gradcomp.make(name, **params), t, topology=topology)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        raised = []
        for step in range(6):
            g = torch.Generator().manual_seed(10 * step + t.rank)
            x, y = torch.randn(5, 16, generator=g), torch.randint(0, 8, (5,), generator=g)
            if step == 2 and bad == "never happened":
                continue
            if step == 2 and t.rank == 1:
                x[0, 0] = float("nan")
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            try:
                agg.step()
            except gradcomp.NonFiniteGradientError as exc:
                raised.append(exc.step)
                continue
            opt.step()
        return raised, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    from gradcomp.transport.sim import SimulatedCluster

    with SimulatedCluster(3) as cluster:
        return cluster.run(fn)


@pytest.mark.parametrize("label", list(UNDONE))
def test_a_non_finite_step_is_undone_exactly(label):
    name, params, topology = UNDONE[label]
    if name not in gradcomp.available():
        pytest.skip(f"{name} is not registered")
    with_nan = _undone_run(name, params, topology, "nan on rank 1")
    without = _undone_run(name, params, topology, "never happened")
    for (raised, p), (none_raised, q) in zip(with_nan, without):
        assert raised == [2] and none_raised == []
        assert torch.equal(p, q), "the state after the undone step differs from never having had it"


# -- finite gradients whose compression is not finite, on one worker ---------------------------------------------


def overflow_run(name: str) -> list[list[tuple]]:
    """Two simulated workers; at step 2 worker 1's gradients are finite (3e38) but their compression is not (QSGD:
    the 2-norm above float32's range; EF-signSGD: gradient plus a residual of about 1e38, left by step 1).
    Per worker: (step, the error's step, state unchanged, the error's message) of every error raised."""
    from distributed import same

    from gradcomp.transport.sim import SimulatedCluster

    def fn(t):
        model = nn.Linear(4, 3)
        agg = gradcomp.GradientAggregator(model, gradcomp.make(name), t)
        events = []
        for step in range(4):
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.5 + t.rank)
                if step == 1 and t.rank == 1 and name == "efsignsgd":  # leaves residuals of about ±1e38
                    p.grad.view(-1)[::2] = 3e38
                if step == 2 and t.rank == 1:
                    p.grad.fill_(3e38)  # finite, but its 2-norm (EF-signSGD: its sum with the residual) is not
            before = agg.state_dict()["exchange"]
            try:
                agg.step()
            except gradcomp.NonFiniteGradientError as exc:
                events.append((step, exc.step, same(before, agg.state_dict()["exchange"]), str(exc)))
        return events

    with SimulatedCluster(2) as cluster:
        return cluster.run(fn)


@pytest.mark.parametrize("name", ["qsgd", "efsignsgd"])
def test_a_compression_that_overflows_on_one_worker_stops_every_worker(name):
    """The host path's compressor refuses such gradients on worker 1 only, before its first message; worker 1 then
    sends a "not finite" verdict instead, so both workers abandon step 2 with the same error and no state changed
    (the code before this waited forever in the simulated cluster, until the time-out over gloo), and only worker 1
    says why."""
    per_worker = overflow_run(name)
    assert [[event[:3] for event in events] for events in per_worker] == [[(2, 2, True)], [(2, 2, True)]]
    assert [("compression of its finite gradients" in events[0][3]) for events in per_worker] == [False, True]


def _step_event(agg, model: nn.Module, step: int) -> tuple:
    """``agg.step()``: (step, every gradient finite) if it was applied, (step, the error's step, the method's state
    unchanged) if it raised NonFiniteGradientError."""
    from distributed import same

    before = agg.state_dict()["exchange"]
    try:
        agg.step()
    except gradcomp.NonFiniteGradientError as exc:
        return step, exc.step, same(before, agg.state_dict()["exchange"])
    return step, all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())


# -- a server's (or a shard owner's) aggregate that a message makes non-finite: only that worker sees it ------------


def _spoil(name: str, step: int, grad: torch.Tensor) -> None:
    """Rank 1's weight gradient at ``step``: its last row 3e38, finite, in the last shard (sharded) only. QSGD's
    2-norm of it overflows at step 2; SBC sends part of it at step 1 (half the row) and keeps the rest as residuals
    of 3e38, so its step 2 message, gradient plus residual, is Inf."""
    if step == 2 or (step == 1 and name == "sbc"):
        grad[-1].fill_(3e38)
        if step == 1:
            grad[-1, ::2] = 0.5


def _server_overflow(transport, name: str, topology: str, server: str | None = None) -> list[tuple]:
    torch.manual_seed(0)
    model = nn.Linear(40, 30)
    params = {"density": 0.1} if name == "sbc" else {}
    extra = {} if server is None else {"server_compressor": gradcomp.make(server)}
    agg = gradcomp.GradientAggregator(model, gradcomp.make(name, **params), transport, topology=topology, **extra)
    events = []
    for step in range(4):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5 + transport.rank)
        if transport.rank == 1:
            _spoil(name, step, model.weight.grad)
        events.append(_step_event(agg, model, step))
    return events


def server_overflow_run(name: str, topology: str, world: int, server: str | None = None) -> list[list[tuple]]:
    """Per worker of a simulated cluster: (step, all gradients finite) of each step applied, (step, the error's
    step, state unchanged) of each step that raised NonFiniteGradientError."""
    from gradcomp.transport.sim import SimulatedCluster

    with SimulatedCluster(world, timeout=30) as cluster:
        return cluster.run(lambda t: _server_overflow(t, name, topology, server))


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("topology", ["sharded", "ps"])
def test_a_server_compressor_that_cannot_compress_a_finite_aggregate_stops_every_worker(topology, path, monkeypatch):
    """`none` up, QSGD down: the root's (or the last owner's) aggregate of rank 1's 3e38 row is finite, but QSGD's
    2-norm of it is not. On the host path the server compressor refused it on that worker alone, after the step's
    first message, and the others waited in the broadcast (all-gather) until the time-out; it now notes it for the
    step's end agreement and sends a stand-in. On the device path, where QSGD sends its Inf norm, every worker
    applied Inf gradients without an error; the decoded result's finiteness is now read with its checks. Either way
    every worker raises at step 2, its state as before it."""
    if path == "device":
        device_path(monkeypatch)
        monkeypatch.setenv("GRADCOMP_KERNELS", "0")
    want = [(0, True), (1, True), (2, 2, True), (3, True)]
    assert server_overflow_run("none", topology, 3, server="qsgd") == [want] * 3


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("topology", ["sharded", "ps"])
def test_a_servers_aggregate_that_a_message_makes_non_finite_stops_every_worker(topology, world):
    """SBC over a parameter server or sharded: the root or the last shard's owner alone sees that a message made its
    aggregate non-finite. That aggregate used to go on as it was: every worker applied Inf gradients without an
    error, and the residuals stayed Inf for the steps after. The server now notes it for the step's end agreement
    (settle), and every worker raises at that step, its state as before it. (The device path, where QSGD's fixed
    sizes defer the verdict: tests/test_deferred_verdict.py.)"""
    assert server_overflow_run("sbc", topology, world) == [[(0, True), (1, True), (2, 2, True), (3, True)]] * world


def _hook_server_overflow(rank: int, world: int, name: str, topology: str) -> dict:
    from distributed import same

    torch.manual_seed(0)
    model = nn.Linear(40, 30)
    ddp = DDP(model, bucket_cap_mb=0.001)
    params = {"density": 0.1} if name == "sbc" else {}
    state = gradcomp.register_ddp_hook(ddp, gradcomp.make(name, **params), topology=topology, nonfinite="raise")
    events = []
    for step in range(4):
        x = torch.full((1, 40), 0.5 + rank)
        if rank == 1:
            _spoil(name, step, x)  # the last row of the weight's gradient is x
        before = state.state_dict()["exchange"]
        try:
            ddp(x)[:, -1].sum().backward()
            events.append((step, "applied"))
        except gradcomp.NonFiniteGradientError as failure:
            events.append((step, type(failure).__name__, getattr(failure, "step", None),
                           same(before, state.state_dict()["exchange"])))
            break
    state.close(timeout=20)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group is usable at once
    return {"events": events, "sum": float(t)}


def check_hook_server_overflow(name: str, topology: str) -> None:
    runs = run_workers(_hook_server_overflow, 2, name, topology, timeout=120)
    want = [(0, "applied"), (1, "applied"), (2, "NonFiniteGradientError", 2, True)]
    assert [r["events"] for r in runs] == [want, want]
    assert [r["sum"] for r in runs] == [2.0, 2.0]


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["sharded", "ps"])
def test_the_hook_stops_every_rank_when_a_servers_aggregate_is_not_finite(topology):
    """The same under the DDP hook, two gloo processes, on the host path."""
    check_hook_server_overflow("sbc", topology)


def _hook_refusal_behind_a_dense_slot(rank: int, world: int) -> list[tuple]:
    from distributed import same

    torch.manual_seed(0)
    model = nn.Linear(40, 2)  # its 2-entry bias is not worth compressing: it goes first, in a dense all-reduce
    ddp = DDP(model)
    state = gradcomp.register_ddp_hook(ddp, gradcomp.make("qsgd"), nonfinite="raise")  # (default min_compression_rate)
    events = []
    for step in range(4):
        x = torch.full((1, 40), 0.5 + rank)
        if rank == 1 and step == 2:
            x.fill_(3e38)  # the weight's gradient is x: finite, its 2-norm is not
        before = state.state_dict()["exchange"]
        try:
            ddp(x).sum().backward()
            events.append((step, "applied"))
        except gradcomp.NonFiniteGradientError as failure:
            events.append((step, type(failure).__name__, failure.step, same(before, state.state_dict()["exchange"]),
                           "compression of its finite gradients" in str(failure)))
            break
    state.close(timeout=20)
    return events


@pytest.mark.slow
def test_a_refusal_behind_a_dense_slot_stops_every_rank():
    """The DDP hook sends a bucket's slots that are not worth compressing first, in a dense all-reduce, and used to
    compress the others after it: QSGD's refusal of rank 1's finite gradients (their 2-norm above float32's range)
    then raised on rank 1 alone, and rank 0 waited in the all-gather until the time-out. The compression now runs
    before anything is sent, so the refusal is rank 1's verdict and both ranks raise at step 2."""
    runs = run_workers(_hook_refusal_behind_a_dense_slot, 2, timeout=120)
    head = [(0, "applied"), (1, "applied")]
    assert runs == [head + [(2, "NonFiniteGradientError", 2, True, False)],
                    head + [(2, "NonFiniteGradientError", 2, True, True)]]


def _lgc_huge(transport, variant: str, spoiled: tuple[int, ...], step_bad: int, value: float) -> list[tuple]:
    """LGC (1 dense step, 2 top-k steps, then compressed), 6 steps; at ``step_bad`` the first layer's gradient of the
    ``spoiled`` workers is ``value``, finite. Per step: applied and all finite, or (the error's step, state
    unchanged)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    method = gradcomp.make("lgc", density=0.1, dense_steps=1, topk_steps=2, variant=variant)
    agg = gradcomp.GradientAggregator(model, method, transport)
    events = []
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + transport.rank)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        if step == step_bad and transport.rank in spoiled:
            model[0].weight.grad.fill_(value)
        events.append(_step_event(agg, model, step))
    return events


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("variant", ["ps", "ring"])
def test_lgc_compresses_a_finite_gradient_of_any_size(variant, path, monkeypatch):
    """A finite gradient of 1e20 on one worker, kept in its residual: the leader's (ps) or the workers' (ring) scale,
    a root mean square, overflowed float32, so every value became NaN: applied on every worker for every later step
    (ps), or read as a "not finite" mark in the scales' max all-reduce, which abandoned every later step (ring). The
    scale is now overflow-safe: every step applies finite gradients, the same on both workers."""
    from gradcomp.transport.sim import SimulatedCluster

    if path == "device":
        device_path(monkeypatch)
        monkeypatch.setenv("GRADCOMP_KERNELS", "0")
    with SimulatedCluster(2, timeout=30) as cluster:
        runs = cluster.run(lambda t: _lgc_huge(t, variant, (1,), 2, 1e20))
    assert runs == [[(step, True) for step in range(6)]] * 2


@pytest.mark.parametrize("path", ["host", "device"])
def test_lgc_abandons_a_step_whose_result_overflows_on_every_worker(path, monkeypatch):
    """Both workers' gradients 3e38 at a top-k step: their mean overflows float32. It was applied as Inf, and the
    residuals and the autoencoder stayed non-finite for good; the step is now abandoned on both workers alike, its
    state as before it, and the later steps are finite."""
    from gradcomp.transport.sim import SimulatedCluster

    if path == "device":
        device_path(monkeypatch)
        monkeypatch.setenv("GRADCOMP_KERNELS", "0")
    with SimulatedCluster(2, timeout=30) as cluster:
        runs = cluster.run(lambda t: _lgc_huge(t, "ps", (0, 1), 1, 3e38))
    assert runs == [[(0, True), (1, 1, True), *[(step, True) for step in range(2, 6)]]] * 2


@pytest.mark.parametrize("path", ["host", "device"])
def test_an_aggregate_that_a_message_makes_non_finite_abandons_the_step_on_every_worker(path, monkeypatch):
    """SBC keeps residuals, and no check of its own sees g + residual overflow float32: at step 2 worker 1's finite
    gradients (3e38) on top of the residuals of 3e38 that step 1 left send an Inf message. The gathered aggregate is
    then Inf on every worker, which abandons the step on every worker, the state as before it, instead of applying
    it (on either path)."""
    from gradcomp.transport.sim import SimulatedCluster

    if path == "device":
        device_path(monkeypatch)
        monkeypatch.setenv("GRADCOMP_KERNELS", "0")

    def fn(t):
        torch.manual_seed(0)
        model = nn.Linear(40, 30)
        agg = gradcomp.GradientAggregator(model, gradcomp.make("sbc", density=0.1), t)
        events = []
        for step in range(4):
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.5 + t.rank)
                if step == 1 and t.rank == 1:
                    p.grad.view(-1)[::2] = 3e38  # sent in part: residuals of 3e38 stay
                if step == 2 and t.rank == 1:
                    p.grad.fill_(3e38)
            events.append(_step_event(agg, model, step))
        return events

    with SimulatedCluster(2) as cluster:
        per_worker = cluster.run(fn)
    assert per_worker[0] == per_worker[1] == [(0, True), (1, True), (2, 2, True), (3, True)], per_worker
