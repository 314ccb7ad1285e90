"""fp16-style loss scaling with torch.amp.GradScaler through GradientAggregator and the DDP hook (gloo, CPU).

An overflow forced on one rank at a chosen step: every rank skips that step (its parameters and the method's state
do not move), every rank's scale halves, training goes on, and the replicas stay identical. Without an overflow, a
run with a scaler gives the parameters and residuals of a run without one, bit for bit: error feedback works in
unscaled units (the scale is a power of 2, so unscaling and scaling back are exact).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import run_workers, same
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp

pytestmark = pytest.mark.timeout(200)

BAD_STEP, BAD_RANK, STEPS, INIT_SCALE = 2, 1, 5, 2.0**12
METHODS = {
    "topk-ef": lambda: gradcomp.make("topk", density=0.25, error_feedback=True),
    "signum": lambda: gradcomp.make("signum"),
    "none": lambda: gradcomp.make("none"),
    # on the device path, under a scaler, these two read no verdict: the NaN in the sum is it (verdict_in_result)
    "fp16": lambda: gradcomp.make("fp16"),
    "randomk": lambda: gradcomp.make("randomk", density=0.25),
    # stateful, all-reduce only: on the device path, under a scaler, the hook applies its verdict with torch.where at
    # the pass's last bucket (NaN there, the state put back), reading nothing
    "powersgd": lambda: gradcomp.make("powersgd"),
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step`` (every rank its own): 8 inputs of _net's width and their labels."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _run(rank: int, label: str, driver: str, scaled: bool, overflow: bool) -> dict:
    model = _net()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=1000) if scaled else None
    if driver.startswith("hook"):
        ddp = DDP(model, bucket_cap_mb=0.001)
        # "hook": scaler= given; "hook-unchanged": a loop written for torch's hooks, the hook's defaults;
        # "hook-raise": nonfinite="raise", no scaler, the typed error caught around backward
        options = {"hook": {"scaler": scaler}, "hook-unchanged": {}, "hook-raise": {"nonfinite": "raise"}}[driver]
        state = gradcomp.register_ddp_hook(ddp, METHODS[label](), **options)
        forward, exchange = ddp, None
    else:
        state = gradcomp.GradientAggregator(model, METHODS[label](), scaler=scaler)
        forward, exchange = model, state
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank)
        loss = F.cross_entropy(forward(x), y)
        if overflow and step == BAD_STEP and rank == BAD_RANK:
            loss = loss * float("inf")  # this rank's gradients overflow
        before_params, before_state = _flat(model), state.state_dict()["exchange"]
        raised = None
        try:
            (scaler.scale(loss) if scaler else loss).backward()
        except gradcomp.NonFiniteGradientError as exc:
            if driver != "hook-raise":  # the other loops catch nothing: an error ends them
                raise
            raised = exc.step
        if exchange is not None:
            exchange.step()
        scale = scaler.get_scale() if scaler else None
        if scaler:
            scaler.step(opt)
            scaler.update()
        elif raised is None:
            opt.step()
        steps.append({
            "raised": raised, "moved": not torch.equal(before_params, _flat(model)),
            "state_unchanged": same(before_state, state.state_dict()["exchange"]),
            "scale_before": scale, "scale_after": scaler.get_scale() if scaler else None,
        })
    out = {"steps": steps, "params": _flat(model), "state": state.state_dict()["exchange"]}
    if driver.startswith("hook"):
        out["failure"] = repr(state.failure)
        state.close(timeout=20)
    return out


def _worker(rank: int, world: int) -> dict:
    out = {}
    for driver in ("aggregator", "hook"):
        for label in METHODS:
            out[driver, label, "overflow"] = _run(rank, label, driver, scaled=True, overflow=True)
            out[driver, label, "scaled"] = _run(rank, label, driver, scaled=True, overflow=False)
            out[driver, label, "plain"] = _run(rank, label, driver, scaled=False, overflow=False)
    for label in METHODS:
        out["hook-unchanged", label, "overflow"] = _run(rank, label, "hook-unchanged", scaled=True, overflow=True)
        out["hook-raise", label, "overflow"] = _run(rank, label, "hook-raise", scaled=False, overflow=True)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_workers(_worker, 2, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["aggregator", "hook", "hook-unchanged"])
@pytest.mark.parametrize("label", list(METHODS))
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(runs, driver, label):
    """"hook-unchanged" is a GradScaler loop written for torch's hooks, the hook registered with its defaults
    (no scaler=): the NaN reaches every rank's gradients, and the scaler skips as it does with torch's hooks."""
    per_rank = [r[driver, label, "overflow"] for r in runs]
    for rank, run in enumerate(per_rank):
        assert run.get("failure", "None") == "None", (rank, run["failure"])
        for step, s in enumerate(run["steps"]):
            if step == BAD_STEP:
                assert not s["moved"] and s["state_unchanged"], (rank, step, s)  # skipped, state untouched
                assert s["scale_after"] == s["scale_before"] / 2, (rank, step, s)  # the scale halved
            else:
                assert s["moved"] and s["scale_after"] == s["scale_before"], (rank, step, s)  # training goes on
    assert torch.equal(per_rank[0]["params"], per_rank[1]["params"])  # replicas identical
    assert per_rank[0]["steps"][-1]["scale_after"] == INIT_SCALE / 2


@pytest.mark.slow
@pytest.mark.parametrize("label", list(METHODS))
def test_nonfinite_raise_is_the_typed_error_from_backward_on_every_rank_and_training_goes_on(runs, label):
    per_rank = [r["hook-raise", label, "overflow"] for r in runs]
    for rank, run in enumerate(per_rank):
        assert run["failure"] == "None", (rank, run["failure"])  # not a failure of the hook: it goes on
        for step, s in enumerate(run["steps"]):
            if step == BAD_STEP:  # caught as gradcomp.NonFiniteGradientError, on both ranks, this step
                assert s["raised"] == BAD_STEP and not s["moved"] and s["state_unchanged"], (rank, step, s)
            else:
                assert s["raised"] is None and s["moved"], (rank, step, s)
    assert torch.equal(per_rank[0]["params"], per_rank[1]["params"])  # replicas identical


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["aggregator", "hook"])
@pytest.mark.parametrize("label", list(METHODS))
def test_a_scaler_leaves_parameters_and_residuals_as_without_one(runs, driver, label):
    for r in runs:
        scaled, plain = r[driver, label, "scaled"], r[driver, label, "plain"]
        assert torch.equal(scaled["params"], plain["params"])
        assert same(scaled["state"], plain["state"])  # residuals and momentum in unscaled units


def test_local_steps_refuse_an_aggregator_with_a_scaler():
    from gradcomp.transport.sim import SimulatedCluster

    cluster = SimulatedCluster(1)
    agg = gradcomp.GradientAggregator(_net(), gradcomp.make("none"), cluster.transports[0],
                                      scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(gradcomp.ConfigError, match="without a scaler"):
        gradcomp.LocalUpdateExchange(agg, 2)
    handing_on = gradcomp.GradientAggregator(_net(), gradcomp.make("none"), cluster.transports[0], nonfinite="propagate")
    with pytest.raises(gradcomp.ConfigError, match="not 'propagate'"):
        gradcomp.LocalUpdateExchange(handing_on, 2)


def test_a_scaler_that_is_not_one_is_refused_before_anything_is_sent():
    from gradcomp.transport.sim import SimulatedCluster

    with pytest.raises(gradcomp.ConfigError, match="GradScaler"):
        gradcomp.GradientAggregator(_net(), gradcomp.make("none"), SimulatedCluster(1).transports[0], scaler=2.0)
