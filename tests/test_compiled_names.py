"""A compiled model's parameters have the slots of the model itself: torch.compile's wrapper names them
"_orig_mod.<name>", and a state saved with the one was refused by the other (an integrations audit). Slot names
drop that prefix now, and a state saved under the prefixed names (before) loads too, its residuals kept."""

from __future__ import annotations

import torch
from torch import nn

import gradcomp
from gradcomp.compressors.state import plain_name


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _steps(model, aggregator, rank: int, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(10 * step + rank)
        model.zero_grad()
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        aggregator.step()


def _run(compile_second: bool, rename_saved: bool) -> dict:
    """2 steps on the plain model, its state saved; 2 more on a copy (compiled or not) loaded with it."""
    out = {}

    def worker(transport):
        method = gradcomp.make("topk", density=0.3, error_feedback=True)
        first = _model()
        aggregator = gradcomp.GradientAggregator(first, method, transport)
        _steps(first, aggregator, transport.rank, range(2))
        state = aggregator.state_dict()
        if rename_saved:  # what a compiled model saved before: every name and key under "_orig_mod."
            state = _prefixed(state)
        second = _model()
        second.load_state_dict(first.state_dict())
        model = torch.compile(second, backend="eager") if compile_second else second
        again = gradcomp.GradientAggregator(model, gradcomp.make("topk", density=0.3, error_feedback=True), transport)
        again.load_state_dict(state)
        again.steps = aggregator.steps
        _steps(model, again, transport.rank, range(2, 4))
        out[transport.rank] = [p.detach().clone() for p in second.parameters()]

    with gradcomp.SimulatedCluster(2) as cluster:
        cluster.run(worker)
    return out


def _prefixed(obj):
    if isinstance(obj, dict):
        return {(f"_orig_mod.{k}" if isinstance(k, str) and "#" in k else k): _prefixed(v) for k, v in obj.items()}
    if isinstance(obj, list) and obj and isinstance(obj[0], (list, tuple)) and isinstance(obj[0][0], str):
        return [[f"_orig_mod.{s[0]}", *s[1:]] for s in obj]
    return obj


def test_plain_name():
    assert plain_name("_orig_mod.0.weight") == "0.weight" and plain_name("0.weight") == "0.weight"
    assert plain_name("blocks.0._orig_mod.w/shard1") == "blocks.0.w/shard1"  # a compiled block inside a model
    assert plain_name("enc_orig_mod.weight") == "enc_orig_mod.weight"  # whole components only


def test_named_tuples_of_a_compiled_model_save_and_load():
    """Parameters handed as (name, parameter) pairs of a compiled model: their slots are plain too, so the
    aggregator loads its own state (the review of the first version found one side stripped, the other not)."""
    def worker(transport):
        model = torch.compile(_model(), backend="eager")
        make = lambda: gradcomp.make("topk", density=0.3, error_feedback=True)  # noqa: E731
        first = gradcomp.GradientAggregator(list(model.named_parameters()), make(), transport)
        _steps(model, first, 0, range(1))
        again = gradcomp.GradientAggregator(list(model.named_parameters()), make(), transport)
        again.load_state_dict(first.state_dict())
        return [s.name for s in again.slots]

    with gradcomp.SimulatedCluster(1) as cluster:
        [names] = cluster.run(worker)
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_a_compiled_model_has_the_plain_models_slots():
    """The slot names themselves (a state's identity and its keys), not only the loading, are the plain model's."""
    def worker(transport):
        method = gradcomp.make("topk", density=0.3, error_feedback=True)
        plain = gradcomp.GradientAggregator(_model(), method, transport)
        compiled = gradcomp.GradientAggregator(torch.compile(_model(), backend="eager"), method, transport)
        return [s.name for s in plain.slots], [s.name for s in compiled.slots]

    with gradcomp.SimulatedCluster(1) as cluster:
        [(plain, compiled)] = cluster.run(worker)
    assert plain == compiled == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_a_state_loads_across_compiled_and_plain_and_from_prefixed_names():
    reference = _run(compile_second=False, rename_saved=False)
    for compiled, renamed in ((True, False), (True, True), (False, True)):
        got = _run(compiled, renamed)
        for rank in (0, 1):
            for a, b in zip(reference[rank], got[rank]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
