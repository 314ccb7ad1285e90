"""GradientAggregator's defects a review found: frozen parameters moved, states loaded on another rank or world
size, different parameter lists crashing inside gloo, float64 set after construction unannounced, and a DDP
model accepted (its gradients would be exchanged twice)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.errors import ConfigError, WireError
from gradcomp.train import exchange as exchange_module
from gradcomp.transport.sim import SimulatedCluster


def _topk():
    return gradcomp.make("topk", density=0.05, error_feedback=True)


def _batch(step: int, rank: int = 0):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10))


def test_a_parameter_frozen_after_construction_gets_no_gradient_and_does_not_move():
    model, cluster = _net(), SimulatedCluster(1)
    agg = gradcomp.GradientAggregator(model, _topk(), cluster.transports[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def train(transport):
        for step in range(8):
            if step == 3:  # error feedback has built a residual for it by now
                model[0].weight.requires_grad_(False)
                frozen = model[0].weight.detach().clone()
                trained = model[2].weight.detach().clone()
            opt.zero_grad()
            F.cross_entropy(model(_batch(step)[0]), _batch(step)[1]).backward()
            agg.step()
            assert step < 3 or model[0].weight.grad is None
            opt.step()
        return frozen, trained

    [(frozen, trained)] = cluster.run(train)
    assert torch.equal(model[0].weight.detach(), frozen)
    assert not torch.equal(model[2].weight.detach(), trained)  # the others still train
    assert len(agg.slots) == 4  # it keeps its slot: every worker sends the same slots


def test_an_unused_parameter_receives_the_aggregate_as_documented():
    model, cluster = _net(), SimulatedCluster(1)
    extra = nn.Linear(4, 4)
    agg = gradcomp.GradientAggregator(
        [*model.named_parameters(), ("extra", extra.weight)], _topk(), cluster.transports[0]
    )

    def train(transport):
        model.zero_grad()
        F.cross_entropy(model(_batch(0)[0]), _batch(0)[1]).backward()
        agg.step()

    cluster.run(train)
    assert extra.weight.grad is not None and not extra.weight.grad.any()  # zeros: nothing used, no residual yet
    assert "receives the aggregate" in gradcomp.GradientAggregator.step.__doc__


def _trained_states(world: int) -> list[dict]:
    cluster = SimulatedCluster(world)
    models = [_net() for _ in range(world)]
    aggs = [gradcomp.GradientAggregator(m, _topk(), t) for m, t in zip(models, cluster.transports)]

    def train(transport):
        m, agg = models[transport.rank], aggs[transport.rank]
        for step in range(2):
            m.zero_grad()
            F.cross_entropy(m(_batch(step, transport.rank)[0]), _batch(step, transport.rank)[1]).backward()
            agg.step()
        return agg.state_dict()

    return cluster.run(train)


def test_a_state_saved_by_another_rank_or_world_size_is_refused():
    states = _trained_states(2)
    assert (states[1]["rank"], states[1]["world_size"]) == (1, 2)
    cluster = SimulatedCluster(2)
    rank1 = gradcomp.GradientAggregator(_net(), _topk(), cluster.transports[1])
    with pytest.raises(ConfigError, match=r"this state was saved by rank 0 of 2; this is rank 1 of 2"):
        rank1.load_state_dict(states[0])
    assert rank1.steps == 0  # nothing loaded
    rank1.load_state_dict(states[1])
    assert rank1.steps == 2
    alone = gradcomp.GradientAggregator(_net(), _topk(), SimulatedCluster(1).transports[0])
    with pytest.raises(ConfigError, match=r"saved by rank 0 of 2; this is rank 0 of 1"):
        alone.load_state_dict(states[0])


def test_a_state_saved_before_ranks_were_recorded_still_loads():
    old = {k: v for k, v in _trained_states(2)[0].items() if k not in ("rank", "world_size")}
    agg = gradcomp.GradientAggregator(_net(), _topk(), SimulatedCluster(2).transports[1])
    agg.load_state_dict(old)
    assert agg.steps == 2


def _step_with_a_parameter_missing_on_rank_1() -> list[tuple[Exception | None, int]]:
    """One step of two simulated workers whose slot lists differ (rank 1 lacks the last bias): per rank, what
    step() raised (None if nothing) and the collectives booked."""
    cluster = SimulatedCluster(2)
    models = [_net() for _ in range(2)]
    named = [list(models[0].named_parameters()), list(models[1].named_parameters())[:-1]]
    aggs = [gradcomp.GradientAggregator(n, _topk(), t) for n, t in zip(named, cluster.transports)]

    def train(transport):
        m = models[transport.rank]
        F.cross_entropy(m(_batch(0)[0]), _batch(0)[1]).backward()
        try:
            aggs[transport.rank].step()
        except (ConfigError, WireError) as exc:
            return exc, transport.counter.collectives
        return None, transport.counter.collectives

    return cluster.run(train)


def test_different_parameters_on_the_simulated_workers_are_refused_before_anything_is_sent():
    for error, collectives in _step_with_a_parameter_missing_on_rank_1():
        assert isinstance(error, ConfigError) and (
            "the workers' parameters differ (slot 3 is 2.bias (10 entries) on rank 0 "
            "but nothing on rank 1; rank 0 has 4 slots, rank 1 3)"
            in str(error)
        )
        assert collectives == 0  # the check is not booked, and no exchange ran


def test_a_slot_list_corrupted_on_its_way_raises_wire_error_not_a_parse_error(monkeypatch):
    """The lists exchanged when the digests differ are container messages: one bit flipped in the copy of rank 0's
    list that rank 1 receives is a WireError there (a bare JSON list raised the parser's error, or named a wrong
    difference); rank 0 still names the difference. Nothing of a step is sent on either."""
    real = exchange_module._setup_all_gather

    def corrupting(transport, t):
        gathered = real(transport, t)
        if t.dtype == torch.uint8 and transport.rank == 1:
            gathered = [g.clone() for g in gathered]
            gathered[0][-1] ^= 4
        return gathered

    monkeypatch.setattr(exchange_module, "_setup_all_gather", corrupting)
    (error0, collectives0), (error1, collectives1) = _step_with_a_parameter_missing_on_rank_1()
    assert isinstance(error0, ConfigError) and "the workers' parameters differ (slot 3 is 2.bias" in str(error0)
    assert isinstance(error1, WireError) and "checksum" in str(error1)
    assert collectives0 == collectives1 == 0


def test_the_same_parameters_pass_the_check_once_and_it_is_counted_as_set_up_only():
    world = 3
    cluster = SimulatedCluster(world)
    models = [_net() for _ in range(world)]
    aggs = [gradcomp.GradientAggregator(m, gradcomp.make("none"), t) for m, t in zip(models, cluster.transports)]

    def train(transport):
        for step in range(2):
            models[transport.rank].zero_grad()
            F.cross_entropy(models[transport.rank](_batch(step)[0]), _batch(step)[1]).backward()
            aggs[transport.rank].step()
        c = transport.counter
        return c.up_control, c.collectives, c.up_setup, c.down_setup, c.bytes_up, list(c.ops), c.report()

    numel = sum(p.numel() for p in models[0].parameters())
    for control, collectives, up_setup, down_setup, bytes_up, ops, report in cluster.run(train):
        assert (control, collectives, ops) == (0, 2, ["all_reduce"])  # one all-reduce per step, no control bytes
        assert (up_setup, down_setup) == (16, 16 * (world - 1))  # the digest and its length, two int64, once
        assert bytes_up == 2 * 4 * numel  # the steps' own bytes, without the set-up
        assert "set-up    sent 16 B, received 32 B (once per run" in report


def test_float64_after_construction_is_announced_once_by_step():
    model, cluster = _net(), SimulatedCluster(1)
    agg = gradcomp.GradientAggregator(model, gradcomp.make("none"), cluster.transports[0])
    model.double()

    def train(transport):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                model.zero_grad()
                F.cross_entropy(model(_batch(step)[0].double()), _batch(step)[1]).backward()
                agg.step()
        return caught

    [caught] = cluster.run(train)
    messages = [(str(w.message), w.filename) for w in caught if "float64" in str(w.message)]
    assert len(messages) == 1, messages
    assert messages[0][0].startswith("GradientAggregator: 4 float64 parameter(s) (0.weight, 0.bias, 2.weight")
    assert messages[0][1] == __file__  # points at the caller of step()


def _on_gloo(rank: int, world: int) -> dict:
    out = {}
    # a DDP model: its backward already all-reduces the gradients
    try:
        gradcomp.GradientAggregator(DDP(_net()), _topk())
    except ConfigError as exc:
        out["ddp"] = str(exc)

    # the DDP hook's state records the rank too (the same identity)
    ddp = DDP(_net())
    state = gradcomp.register_ddp_hook(ddp, _topk())
    F.cross_entropy(ddp(_batch(0, rank)[0]), _batch(0, rank)[1]).backward()
    saved = [None] * world
    dist.all_gather_object(saved, state.state_dict())
    try:
        state.load_state_dict(saved[0])
        out["hook_loaded_rank0"] = True
    except ConfigError as exc:
        out["hook_loaded_rank0"] = str(exc)
    state.close()
    return out


def _different_parameters(rank: int, world: int) -> dict:
    out = {}
    # different parameters: rank 1 lacks the last one; every rank raises before any gradient is sent
    for method in ("topk", "powersgd"):
        model = _net()
        named = list(model.named_parameters())
        named = named if rank == 0 else named[:-1]
        agg = gradcomp.GradientAggregator(named, _topk() if method == "topk" else gradcomp.make("powersgd"))
        F.cross_entropy(model(_batch(0, rank)[0]), _batch(0, rank)[1]).backward()
        try:
            agg.step()
            out[method] = None
        except ConfigError as exc:
            out[method] = str(exc)
    return out


@pytest.fixture(scope="module")
def gloo_results():
    return run_workers(_on_gloo, 2, timeout=180)


def test_a_ddp_model_is_refused_pointing_to_the_hook(gloo_results):
    for r in gloo_results:
        assert r["ddp"].startswith("GradientAggregator got a DistributedDataParallel model")
        assert "gradients: they would be exchanged twice. Use gradcomp.register_ddp_hook(" in r["ddp"]


def test_the_ddp_hooks_state_is_refused_on_another_rank(gloo_results):
    rank0, rank1 = gloo_results
    assert rank0["hook_loaded_rank0"] is True
    assert rank1["hook_loaded_rank0"].startswith(
        "CompressionHookState.load_state_dict: this state was saved by rank 0 of 2; this is rank 1 of 2"
    )


@pytest.mark.parametrize("method", ["topk", "powersgd"])
def test_different_parameters_on_gloo_workers_raise_config_error_on_every_rank(method):
    # before the check, gloo aborted rank 1 ("size doesn't match", SIGABRT) and rank 0 reported a lost worker
    for r in run_workers(_different_parameters, 2, timeout=180):
        assert r[method] is not None, "step() returned"
        assert r[method].startswith(
            "GradientAggregator: the workers' parameters differ (slot 3 is 2.bias (10 entries) on rank 0 but "
            "nothing on rank 1; rank 0 has 4 slots, rank 1 3)"
        )
        assert r[method].endswith("Nothing was sent")
