"""The device path's deferred finiteness verdict (``train.agreement.drive_agreeing`` with a device flag): issue 30's
guarantees hold there too. Every fixed-size method's step that a NaN on one worker spoils runs its rounds to the
end, is abandoned at the step's one read on every worker, raises the same NonFiniteGradientError at the same step,
and leaves every worker's state as if the step had never happened (tests/test_faults.py's runs, with the wire's
device path forced on CPU tensors: tests/wire_paths.py)."""

from __future__ import annotations

import pytest
import torch
from test_faults import _undone_run

from gradcomp.train import agreement, aggregator
from wire_paths import device_path as use_device_path

DEFERRED = {
    "topk-ef": ("topk", {"density": 0.25, "error_feedback": True}, "auto"),
    "signum": ("signum", {}, "auto"),
    "powersgd": ("powersgd", {}, "auto"),
    "terngrad_shared": ("terngrad_shared", {}, "auto"),
    "cnat": ("cnat", {}, "auto"),
    "efsignsgd": ("efsignsgd", {}, "auto"),
    "qsgd": ("qsgd", {}, "auto"),
    "none": ("none", {}, "auto"),
    "randomk-ef": ("randomk", {"density": 0.25, "error_feedback": True}, "auto"),
    "local_topk": ("local_topk", {"density": 0.25}, "auto"),
    "true_topk": ("true_topk", {"density": 0.25}, "auto"),
    "sketch": ("sketch", {"density": 0.25}, "auto"),
    # the leader's broadcast of positions first, as it is; the verdict rides on the next message, read at the end
    "lgc-training": ("lgc", {"density": 0.25, "dense_steps": 1, "topk_steps": 3}, "auto"),
    "lgc-compressed": ("lgc", {"density": 0.25, "dense_steps": 1, "topk_steps": 1}, "auto"),
    "lgc-ps": ("lgc", {"density": 0.25, "dense_steps": 1, "topk_steps": 1, "variant": "ps"}, "auto"),
    # fixed sizes both ways: the verdict rides on the all-to-all and is read with the owner's checks of it
    "topk-ef-sharded": ("topk", {"density": 0.25, "error_feedback": True}, "sharded"),
    "cnat-sharded": ("cnat", {}, "sharded"),
    # the verdict rides on the gather; the root reads it with its checks and passes a bad one on in its broadcast
    "topk-ef-ps": ("topk", {"density": 0.25, "error_feedback": True}, "ps"),
    "cnat-ps": ("cnat", {}, "ps"),
    "qsgd-ps": ("qsgd", {}, "ps"),
}


@pytest.fixture
def device_path(monkeypatch):
    use_device_path(monkeypatch)
    monkeypatch.setenv("GRADCOMP_KERNELS", "0")
    seen = []
    deferred, settle = agreement._drive_deferred, aggregator.settle

    def spy(*args):
        agreed, result = deferred(*args)
        seen.append(agreed)
        return agreed, result

    def settled(*args):  # a verdict the driver handed on is read, and the step abandoned, at the step's end
        abandoned = settle(*args)
        if abandoned:
            seen.remove(True)
            seen.append(False)
        return abandoned

    monkeypatch.setattr(agreement, "_drive_deferred", spy)
    monkeypatch.setattr(aggregator, "settle", settled)
    return seen


@pytest.mark.parametrize("label", list(DEFERRED))
def test_a_non_finite_step_is_abandoned_at_the_one_read_and_undone_exactly(label, device_path):
    _abandoned_and_undone(label, *DEFERRED[label], device_path)
    assert device_path.count(True) == 6 * 3 + 5 * 3 - 3  # every other step went through the deferred path too


AT_FIRST_MESSAGE = {  # sizes that vary
    "threshold": ("threshold", {"threshold": 0.01, "error_feedback": True}, "auto"),
    "threshold-ps": ("threshold", {"threshold": 0.01, "error_feedback": True}, "ps"),
    "threshold-sharded": ("threshold", {"threshold": 0.01, "error_feedback": True}, "sharded"),
    "sbc": ("sbc", {"density": 0.25}, "auto"),
    "stc": ("stc", {"density": 0.25}, "auto"),
    "dgc": ("dgc", {"density": 0.25}, "auto"),
}


@pytest.mark.parametrize("label", list(AT_FIRST_MESSAGE))
def test_a_variable_size_step_agrees_on_its_first_message_and_is_undone_exactly(label, device_path):
    """Sizes that vary: a bad worker's tensors are zeroed on the device and the verdict, marked on the device, is
    read with the size exchange: the same step raises on every worker and is undone exactly."""
    _abandoned_and_undone(label, *AT_FIRST_MESSAGE[label], device_path)


def _abandoned_and_undone(label: str, name: str, params: dict, topology: str, seen: list) -> None:
    """A NaN on worker 1 at step 2 raises at step 2 on all 3 workers, abandoned through the device flag's driver,
    and leaves the parameters as a run without that step."""
    with_nan = _undone_run(name, params, topology, "nan on rank 1")
    abandoned = seen.count(False)
    without = _undone_run(name, params, topology, "never happened")
    for (raised, p), (none_raised, q) in zip(with_nan, without):
        assert raised == [2] and none_raised == []
        assert torch.equal(p, q), "the state after the undone step differs from never having had it"
    assert abandoned == 3, f"{label}: the device flag abandoned the step on {abandoned} of 3 workers"


@pytest.mark.slow
def test_the_fault_tests_pass_on_the_device_path(device_path):
    """tests/test_faults.py's two-process runs (GradientAggregator and the DDP hook over gloo), on the device path:
    the same error on every rank at the same step, no state changed, the replicas together."""
    import test_faults

    test_faults.test_aggregator_nan_on_one_rank_raises_the_same_error_on_every_rank()
    test_faults.test_hook_nan_on_one_rank_raises_the_same_error_on_every_rank()


@pytest.mark.slow
def test_gradscaler_skips_on_every_rank_on_the_device_path(device_path):
    """tests/test_gradscaler.py's runs on the device path: an overflow on one rank skips the step on every rank."""
    import test_gradscaler
    from distributed import run_workers

    runs = run_workers(test_gradscaler._worker, 2, timeout=180)
    for driver in ("aggregator", "hook"):
        for label in test_gradscaler.METHODS:
            test_gradscaler.test_an_overflow_on_one_rank_skips_the_step_on_every_rank(runs, driver, label)
            test_gradscaler.test_a_scaler_leaves_parameters_and_residuals_as_without_one(runs, driver, label)


@pytest.mark.parametrize("name", ["qsgd", "efsignsgd"])
def test_a_message_that_overflows_inside_a_compressor_abandons_the_step_on_every_worker(name, device_path):
    """Finite gradients whose compression is not finite (QSGD: a 2-norm above float32's range; EF-signSGD: gradient
    plus residual overflowing): the device path sends the NaN / Inf, and the aggregation, which sees it in the sums,
    abandons the step on every worker (the same error at the same step, the state as before it), never applying a
    non-finite aggregate. (The host path: tests/test_faults.py.)"""
    from test_faults import overflow_run

    assert [[event[:3] for event in events] for events in overflow_run(name)] == [[(2, 2, True)], [(2, 2, True)]]
    assert device_path.count(False) == 2


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("topology", ["sharded", "ps"])
def test_a_servers_aggregate_that_a_message_makes_non_finite_abandons_the_step_on_every_worker(
    topology, world, device_path
):
    """A shard owner or a parameter server is the only worker that sees its aggregate; when a message makes it
    non-finite under a deferred verdict (QSGD: fixed sizes), it cannot stop alone (the others wait in its collective,
    which hung until the time-out): it sends an abandoned message in its aggregate's place, and every worker
    abandons the step at its next read, the state as before it."""
    from test_faults import server_overflow_run

    assert server_overflow_run("qsgd", topology, world) == [[(0, True), (1, True), (2, 2, True), (3, True)]] * world
    assert device_path.count(False) == world  # abandoned through the deferred verdict, on every worker


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["sharded", "ps"])
def test_the_hook_abandons_a_pass_whose_server_aggregate_is_not_finite_on_every_rank(topology, device_path):
    """The same under the DDP hook, two gloo processes: both ranks raise NonFiniteGradientError in backward at the
    same step, the state unchanged, and the group is free at once (no rank left waiting in a collective)."""
    from test_faults import check_hook_server_overflow

    check_hook_server_overflow("qsgd", topology)


@pytest.mark.parametrize("flag", ["bool", "device"])
def test_a_step_of_broadcasts_only_agrees_in_one_flag_round_after_them(flag):
    """A scheme whose every message is a broadcast (its root's data only) cannot carry the verdict: every worker
    sends them as they are, then agrees in one all-reduce of a float32 flag, with a bool verdict and with a
    device flag alike: a worker that was not finite stops every worker there, and the result is kept otherwise."""
    from gradcomp.transport.requests import Broadcast
    from gradcomp.transport.sim import SimulatedCluster

    def rounds(rank):
        got = yield Broadcast(torch.tensor([10.0 + rank]), root=0)
        return float(got[0])

    def fn(t, bad_rank):
        finite = t.rank != bad_rank
        verdict = finite if flag == "bool" else torch.tensor([finite])
        return agreement.drive_agreeing(t, rounds(t.rank), verdict, after_rounds=False)

    with SimulatedCluster(3) as cluster:
        assert cluster.run(lambda t: fn(t, None)) == [(True, 10.0)] * 3
        assert cluster.run(lambda t: fn(t, 2)) == [(False, None)] * 3


def test_sharded_with_a_worker_that_owns_nothing_agrees_at_the_first_message(device_path):
    """Slots smaller than W leave some worker without a shard to serve, so it makes no owner's read that could
    take the deferred verdict: the sharded topology then agrees at its first message, and a NaN on one worker
    stops every worker at the same step (deferred, the others abandoned before the all-gather that this one
    entered: a collective of unequal sizes)."""
    import gradcomp
    from gradcomp.transport.sim import SimulatedCluster

    def work(transport):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)  # slots of 2 and 1 entries: worker 2 of 3 owns no entry
        aggregator = gradcomp.GradientAggregator(model, gradcomp.make("cnat"), transport, topology="sharded")
        raised = []
        for step in range(4):
            x = torch.randn(4, 2)
            if step == 2 and transport.rank == 1:
                x[0, 0] = float("nan")
            model.zero_grad()
            model(x).sum().backward()
            try:
                aggregator.step()
            except gradcomp.NonFiniteGradientError:
                raised.append(step)
        return raised

    with SimulatedCluster(3, timeout=30) as cluster:
        assert cluster.run(work) == [[2], [2], [2]]
