"""Would-be GPU synchronisations in a training step, counted on the CPU, against each method's budget.

For every registered method, one steady-state training step (after two warm-up steps) of the GradientAggregator
and of the DDP hook (world size 1 over gloo, in this process) runs under :mod:`sync_counting`, which counts every
operation that would make the host wait for a GPU (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``,
``nonzero``, boolean indexing, ...) on every thread the step uses (the DDP hook's communication thread too). The
test fails when a method's count exceeds its budget, the numbers of ``tests/sync_budget.py`` (the table of
docs/gpu.md, checked against it below). ``python tests/test_sync_count.py`` prints the counts and where they come
from.
"""

from __future__ import annotations

import copy
import gc
import re
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sync_counting import count_on_this_thread, counting
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.registry import BUILTIN
from sync_budget import (
    BUDGETS, FIXED_SIZE, NOTES, READS_NOTHING_HANDED_ON, TOPOLOGIES, VERDICT_IN_RESULT, topology_table,
)
from gradcomp.train import comm_thread, ddp_hook
from wire_paths import device_path
from gradcomp.wire.bits import set_device_path_on_cpu

ROOT = Path(__file__).resolve().parents[1]
PARAMS = {"lgc": {"density": 0.05, "dense_steps": 1, "topk_steps": 1}}
WARMUP = 2


def _method(name: str):
    return gradcomp.make(name, **PARAMS.get(name, {}))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 10))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 40, generator=g), torch.randint(0, 10, (32,), generator=g)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    if dist.is_initialized():  # pragma: no cover - another test left one
        dist.destroy_process_group()
    store = tmp_path_factory.mktemp("sync") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    gc.collect()  # the tests' DDP models freed while the group exists (tests/test_race_worker_clock.py says why)
    dist.destroy_process_group()


@pytest.fixture
def device_paths(monkeypatch):
    device_path(monkeypatch)  # the wire's device path on CPU tensors
    monkeypatch.setenv("GRADCOMP_KERNELS", "0")  # the torch code that runs on a GPU, not the numba kernels


def count_aggregator_step(name: str, nonfinite: str = "raise"):
    model = _model()
    aggregator = gradcomp.GradientAggregator(model, _method(name), nonfinite=nonfinite)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(WARMUP + 1):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if step == WARMUP:
            with counting() as counter:
                aggregator.step()
        else:
            aggregator.step()
        opt.step()
    return counter


def count_ddp_step(name: str, monkeypatch, *, scaler=None, hook_threads: set | None = None,
                   buckets: list | None = None, bucket_cap_mb: float = 0.005, nonfinite: str = "raise"):
    """The counts of one steady-state DDP step; ``hook_threads`` collects the threads the hook was called on,
    ``buckets`` the index of every bucket of the counted step."""
    monkeypatch.setattr(comm_thread._CommThread, "_run", count_on_this_thread(comm_thread._CommThread._run))
    submit = ddp_hook.CompressionHookState.submit

    def recorded(self, bucket):
        if hook_threads is not None:
            hook_threads.add(threading.get_ident())
        if buckets is not None:
            buckets.append(bucket.index())
        return submit(self, bucket)

    monkeypatch.setattr(ddp_hook.CompressionHookState, "submit", recorded)
    model = DDP(_model(), bucket_cap_mb=bucket_cap_mb)
    state = gradcomp.register_ddp_hook(model, _method(name), scaler=scaler, nonfinite=nonfinite)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        for step in range(WARMUP + 1):
            x, y = _batch(step)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if scaler is not None:
                loss = scaler.scale(loss)
            if step == WARMUP:
                if buckets is not None:
                    buckets.clear()
                with counting() as counter:
                    loss.backward()
                    state.wait()
            else:
                loss.backward()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
    finally:
        state.close()
    return counter


def _check(kind: str, name: str, counter) -> None:
    budget = BUDGETS[name][kind]
    total = counter.total
    assert total <= budget, f"{name} ({kind}): {total} would-be synchronisations > budget {budget}: {counter}"
    assert total == budget, f"{name} ({kind}): {total} would-be synchronisations, lower the budget {budget} to it"


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_aggregator_step_stays_within_the_budget(name, group, device_paths):
    _check("aggregator", name, count_aggregator_step(name))


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_ddp_hook_step_stays_within_the_budget(name, group, device_paths, monkeypatch):
    _check("ddp", name, count_ddp_step(name, monkeypatch))


def _complete_at_issue(monkeypatch):
    """Make every async collective's future complete before it is returned, as NCCL's does (it is marked
    completed once the collective is enqueued on the device): a callback chained to it then runs at once, on the
    issuing thread."""
    real = dist.all_reduce

    def all_reduce(tensor, *args, async_op=False, **kwargs):
        work = real(tensor, *args, async_op=async_op, **kwargs)
        if async_op:
            work.wait()
            assert work.get_future().done()
        return work

    monkeypatch.setattr(dist, "all_reduce", all_reduce)


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_the_ddp_hook_reads_nothing_on_the_autograd_thread(name, group, device_paths, monkeypatch):
    """The hook's reads happen on its communication thread, never on the thread that runs backward, even when a
    collective's future is complete before the hook chains to it (NCCL), and the budget holds there too."""
    _complete_at_issue(monkeypatch)
    hook_threads: set = set()
    counter = count_ddp_step(name, monkeypatch, hook_threads=hook_threads)
    assert hook_threads and not hook_threads & set(counter.threads), f"{name}: read on the autograd thread: {counter}"
    _check("ddp", name, counter)


# the fixed-size methods whose one read is the verdict after the last round (no message of theirs is decoded by the
# wire)
READ_AFTER_ROUNDS = list(READS_NOTHING_HANDED_ON)


@pytest.mark.parametrize("name", FIXED_SIZE)
def test_the_hook_reads_once_per_pass_whatever_the_buckets(name, group, device_paths, monkeypatch):
    """Every fixed-size method: the pass's verdicts (and the checks of the messages the wire decoded, held on the
    device: wire.device.hold_for_the_pass) are read once, at the pass's last bucket, however many buckets."""
    buckets: list = []
    counter = count_ddp_step(name, monkeypatch, buckets=buckets, bucket_cap_mb=0.001)
    assert len(buckets) >= 2, buckets  # several buckets in the counted step
    assert counter.total == 1, f"{name}: {counter.total} reads for {len(buckets)} buckets: {counter}"


@pytest.mark.parametrize("name", ["threshold", "sbc", "stc", "dgc"])
def test_the_hook_reads_the_variable_methods_data_checks_once_per_pass(name, group, device_paths, monkeypatch):
    """Sizes that vary: the size exchange (which brings every message's layout values, and the selections' counts
    where they vary: no transfer of the messages to the host) stays per bucket, the checks wait for the pass's one read
    (wire.device.hold_for_the_pass): with two buckets, one read fewer than two steps of one."""
    buckets: list = []
    counter = count_ddp_step(name, monkeypatch, buckets=buckets, bucket_cap_mb=0.001)
    assert len(buckets) == 2, buckets
    assert counter.total == 2 * (BUDGETS[name]["ddp"] - 1) + 1, f"{name}: {counter}"


def test_the_methods_that_read_after_the_rounds_are_the_budget_tables():
    assert sorted(n for n in FIXED_SIZE if "after the last round" in NOTES[n]) == READ_AFTER_ROUNDS



@pytest.mark.parametrize("at_once", [False, True], ids=["gloo", "completed-at-issue"])
@pytest.mark.parametrize("name", READ_AFTER_ROUNDS)
def test_the_hook_reads_nothing_with_a_scaler_where_the_verdict_comes_after_the_rounds(name, at_once, group,
                                                                                       device_paths, monkeypatch):
    """Under a GradScaler, a bad step's NaN lands in every rank's gradients without a read (a stateless
    all-reduce's sum carries it; the others' agreed flag fills them on the device and puts the state back), and
    scaler.step's own read is the verdict: the hook reads nothing. (That the step is then skipped on every rank:
    tests/test_gradscaler.py, on the device path in tests/test_deferred_verdict.py.)"""
    if at_once:
        _complete_at_issue(monkeypatch)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    assert count_ddp_step(name, monkeypatch, scaler=scaler).total == 0


@pytest.mark.parametrize("at_once", [False, True], ids=["gloo", "completed-at-issue"])
@pytest.mark.parametrize("name", READ_AFTER_ROUNDS)
def test_the_hook_reads_nothing_when_told_to_propagate_where_the_verdict_comes_after_the_rounds(
        name, at_once, group, device_paths, monkeypatch):
    """``nonfinite="propagate"`` without a scaler: the same zero reads (the NaN in every rank's gradients goes to
    the user's own check; that it does, on every rank: tests/test_propagate.py), where the default reads once."""
    if at_once:
        _complete_at_issue(monkeypatch)
    assert count_ddp_step(name, monkeypatch, nonfinite="propagate").total == 0
    assert count_ddp_step(name, monkeypatch).total == BUDGETS[name]["ddp"] == 1


@pytest.mark.parametrize("name", READ_AFTER_ROUNDS)
def test_the_aggregator_reads_nothing_when_told_to_propagate_where_the_verdict_comes_after_the_rounds(
        name, group, device_paths):
    """``GradientAggregator(..., nonfinite="propagate")``: the same zero reads as the hook's (its step() returns None
    instead of saying whether the step stood; tests/test_propagate.py checks the NaN on every rank)."""
    assert count_aggregator_step(name, nonfinite="propagate").total == 0
    assert count_aggregator_step(name).total == BUDGETS[name]["aggregator"] == 1


def test_the_methods_whose_sum_carries_the_verdict():
    from gradcomp.schemes.base import Scheme
    from gradcomp.schemes.single_round import SingleRound

    slots = [gradcomp.Slot("w", 0, 100)]
    carried = []
    for name in sorted(BUDGETS):
        scheme = _method(name)
        if not isinstance(scheme, Scheme):
            scheme = SingleRound(scheme)
        carried += [name] if scheme.verdict_in_result(slots) else []
    assert carried == list(VERDICT_IN_RESULT)
    stateful = SingleRound(gradcomp.make("randomk", density=0.25, error_feedback=True))
    assert not stateful.verdict_in_result(slots)  # a residual would keep the NaN: the verdict is read, and undone


def test_fixed_size_methods_read_once_per_step():
    """One read per step at most: the finiteness verdict, with the wire's checks (docs/gpu.md says why not zero)."""
    assert {name: BUDGETS[name] for name in FIXED_SIZE if max(BUDGETS[name].values()) > 1} == {}


def test_every_method_has_a_budget():
    assert sorted(BUDGETS) == sorted(BUILTIN)  # gradcomp's own methods (plugins bring their own budgets, if any)
    assert set(FIXED_SIZE) <= set(BUDGETS)


def test_the_counter_sees_every_kind_of_synchronisation(device_paths):
    t = torch.arange(10.0)
    with counting() as counter:
        t.sum().item()
        int(t[3])
        bool((t > 3).any())
        t.tolist()
        t.numpy()
        t.cpu()
        t.to("cpu")
        torch.nonzero(t > 4)
        t[t > 5]
        t.masked_select(t > 6)
        torch.unique(t)
        t[torch.tensor([1, 2])] = 0.0  # a Python number put at positions: copied to the device
        t[3:5].clone()  # not a synchronisation
        t.to(torch.float16)  # nor is a cast
        t.index_fill_(0, torch.tensor([1, 2]), 0.0)  # nor a fill with the number itself
        t[torch.tensor([1, 2])] = t[4:6].clone()  # nor a put of device data
        t[6:] = 0.0  # nor a slice's fill (the number is read on the host)
    assert counter.counts == {
        "item": 3, "tolist": 1, "numpy": 1, "cpu": 2, "nonzero": 1, "bool-index": 1, "masked_select": 1, "unique": 1,
        "host-scalar-put": 1,
    }, counter


# The compressors whose host path refuses a NaN / Inf input with a host read: on the device path they read nothing
# and the non-finite value must travel in the message (never a finite stand-in), so the receivers' sums show it.
NON_FINITE_CARRIERS = {
    "cnat": {}, "qsgd": {}, "natural_dithering": {}, "random_dithering": {"norm": "inf"},
    "natural_dithering-cnat-norm": {"norm_codec": "cnat"}, "terngrad": {}, "terngrad-no-clip": {"clip": 0},
    "efsignsgd": {"error_feedback": False}, "onebit": {"error_feedback": False},
}  # fmt: skip


@pytest.mark.parametrize("label", sorted(NON_FINITE_CARRIERS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_input_reaches_the_message_without_a_host_read(label, bad, device_paths):
    compressor = gradcomp.make(label.split("-")[0], **NON_FINITE_CARRIERS[label])
    x = torch.linspace(-1.0, 1.0, 37)
    x[5] = bad
    slot = gradcomp.Slot("w", 0, x.numel())
    with counting() as counter:
        fields = compressor.compress(x, slot, 3)
    assert counter.total == 0, counter
    out = compressor.decompress(fields, slot, 3)
    assert not torch.isfinite(out).all(), f"{label}: a {bad} input decoded to a finite message"
    assert torch.isfinite(compressor.decompress(compressor.compress(x.nan_to_num(0.0), slot, 3), slot, 3)).all()


def test_terngrad_shared_makes_every_result_non_finite_on_the_device_path(device_paths):
    scheme = gradcomp.make("terngrad_shared")
    scheme.bind(0, 1)
    x = torch.linspace(-1.0, 1.0, 37)
    x[2] = float("nan")
    rounds = scheme.run([gradcomp.Slot("w", 0, 37)], [x], 0)
    with counting() as counter:
        shared = next(rounds)  # the max-allreduce of the scalers, which a world of one answers with its own
    assert counter.total == 0, counter
    assert shared.tensor.tolist() == [float("inf")]  # a NaN scaler goes out as +Inf (a max keeps it everywhere)
    gathered = rounds.send(shared.tensor)
    with pytest.raises(StopIteration) as done:
        rounds.send([gathered.tensor])
    assert not torch.isfinite(done.value.value[0]).any()


def test_sign_padding_is_checked_with_the_steps_one_read(device_paths):
    from gradcomp.errors import WireError
    from gradcomp.schemes.single_round import aggregate_buffers, encode_slots

    compressor = gradcomp.make("signsgd")
    slots = [gradcomp.Slot("b", 0, 10)]
    good = encode_slots(compressor, slots, [compressor.compress(torch.linspace(-1, 1, 10), slots[0], 0)])
    with counting() as counter:
        aggregate_buffers(compressor, slots, [good], 0, torch.device("cpu"))
    assert counter.total == 1, counter  # the one read of the checks and the sums
    fields = compressor.compress(torch.linspace(-1, 1, 10), slots[0], 0)
    fields[0][-1] |= 0x80  # a padding bit after the 10th sign (the checksum is computed over it: it passes)
    bad = encode_slots(compressor, slots, [fields])
    with counting() as counter, pytest.raises(WireError, match="nonzero padding bits after 10 signs"):
        aggregate_buffers(compressor, slots, [bad], 0, torch.device("cpu"))
    assert counter.counts.get("item", 0) == 0, counter


@pytest.mark.parametrize("name", ["threshold", "sbc"])
def test_variable_messages_come_to_the_host_in_one_transfer_whatever_the_world_size(name, monkeypatch):
    """Aggregating W messages whose layout depends on the data reads twice on the device path, for any W: their
    headers in one transfer (device.fetch_together) and the checks with the sums' finiteness; the result is
    the host path's, and a corrupted message among them still raises the host path's WireError."""
    from gradcomp.errors import WireError
    from gradcomp.schemes.single_round import aggregate_buffers, encode_slots

    compressor = gradcomp.make(name, **({"threshold": 0.5} if name == "threshold" else {"density": 0.1}))
    slots = [gradcomp.Slot("w", 0, 3000), gradcomp.Slot("b", 3000, 40)]
    g = torch.Generator().manual_seed(0)
    buffers = [
        encode_slots(compressor, slots, [compressor.compress(torch.randn(s.numel, generator=g), s, 0) for s in slots])
        for _ in range(4)
    ]
    assert len({b.numel() for b in buffers}) > 1, [b.numel() for b in buffers]  # sizes that vary
    on_host = aggregate_buffers(compressor, slots, buffers, 0, torch.device("cpu"))
    device_path(monkeypatch)
    monkeypatch.setenv("GRADCOMP_KERNELS", "0")
    for world in (1, 2, 4):
        with counting() as counter:
            got = aggregate_buffers(compressor, slots, buffers[:world], 0, torch.device("cpu"))
        assert counter.total == 2, f"W={world}: {counter}"
        if world == 4:
            assert all(torch.equal(a, b) for a, b in zip(got, on_host))
    bad = buffers[2].clone()
    bad[-1] ^= 1  # a flipped bit in the last section's data: the checksum no longer matches
    with pytest.raises(WireError, match="checksum"):
        aggregate_buffers(compressor, slots, [buffers[0], buffers[1], bad], 0, torch.device("cpu"))


def _count_simulated(name: str, topology: str, world: int, steps: int):
    """Every worker's reads over ``steps`` steps of GradientAggregator on a simulated cluster of ``world``."""
    from gradcomp.transport.sim import SimulatedCluster

    base = _model()

    def work(transport):
        model = copy.deepcopy(base)
        aggregator = gradcomp.GradientAggregator(model, _method(name), transport, topology=topology)
        for step in range(steps):
            x, y = _batch(10 * step + transport.rank)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            aggregator.step()

    with SimulatedCluster(world) as cluster, counting() as counter:
        cluster.run(work)
    return counter


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("name", ["cnat", "topk", "none"])
def test_a_topologys_reads_per_step_are_its_budget(name, topology, device_paths):
    """A steady-state step's reads (those of 3 steps less those of 2, the same set-up in both) at W = 2 and 3:
    the root's (or an owner's) and each other worker's budget, whatever W."""
    root, other = TOPOLOGIES[topology][0]
    for world in (2, 3):
        three, two = (_count_simulated(name, topology, world, steps) for steps in (3, 2))
        assert three.total - two.total == root + (world - 1) * other, f"{name} over {topology}, W = {world}: {three}"


def test_the_docs_topology_table_is_the_budget():
    assert topology_table() in (ROOT / "docs" / "gpu.md").read_text()


def test_the_docs_table_is_the_budget():
    text = (ROOT / "docs" / "gpu.md").read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `([a-z_0-9]+)` \| [^|]* \| (\d+) \| (\d+) \|", line)
        if m:
            rows[m.group(1)] = {"aggregator": int(m.group(2)), "ddp": int(m.group(3))}
    assert rows == {name: {"aggregator": b["aggregator"], "ddp": b["ddp"]} for name, b in BUDGETS.items()}


if __name__ == "__main__":  # python tests/test_sync_count.py [NAME ...]: the counts and their call sites
    import os
    import tempfile

    import _pytest.monkeypatch

    set_device_path_on_cpu(True)
    os.environ["GRADCOMP_KERNELS"] = "0"
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    for name in sys.argv[1:] or sorted(gradcomp.available()):
        mp = _pytest.monkeypatch.MonkeyPatch()
        try:
            agg = count_aggregator_step(name)
            ddp = count_ddp_step(name, mp)
            print(f"{name:18s} aggregator {agg.total:3d}  ddp {ddp.total:3d}", flush=True)
            print(f"    agg: {agg}\n    ddp: {ddp}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"{name:18s} error {type(exc).__name__}: {exc}", flush=True)
        finally:
            mp.undo()
    dist.destroy_process_group()


@pytest.mark.parametrize("name,params", [
    ("qsgd", {"error_feedback": True}), ("terngrad", {"error_feedback": True}),
    ("random_dithering", {"error_feedback": True, "levels": 5}), ("natural_dithering", {"feedback": "momentum_masking"}),
    ("topk+qsgd", {"error_feedback": True}),
])  # fmt: skip
def test_a_workers_own_message_is_not_checked_with_a_read(name, params, group, device_paths, monkeypatch):
    """The receivers' range checks (wire.refusals.check_received_range) join the decoding step's one read. Error
    feedback decodes the worker's own message too (these classes have no subtract_sent), outside any collecting
    DeviceChecks: a check there was read at once, 4 more reads a step (9 for TernGrad). It is left out now."""
    monkeypatch.setitem(PARAMS, name, params)
    assert count_aggregator_step(name).total == 1
