"""A saved aggregator state records what it belongs to (method, parameters); loading it elsewhere is refused.

Without the check, a top-k residual saved for a 16-wide layer was kept beside a new 32-wide one and never used,
and PowerSGD's state loaded into top-k emptied the residuals: silently different training.
"""

import pytest
import torch
from torch import nn

import gradcomp
from gradcomp.errors import ConfigError
from gradcomp.transport.sim import SimulatedCluster


def _aggregator(model, method="topk", cluster=None, **kw):
    cluster = cluster or SimulatedCluster(1)
    compressor = gradcomp.make(method, **({"density": 0.5, "error_feedback": True} if method == "topk" else {}))
    return gradcomp.GradientAggregator(model, compressor, cluster.transports[0], **kw)


def _trained(model, method="topk", steps=2, **kw):
    cluster = SimulatedCluster(1)
    agg = _aggregator(model, method, cluster, **kw)

    def train(transport):
        for _ in range(steps):
            model.zero_grad()
            model(torch.randn(4, model[0].in_features)).sum().backward()
            agg.step()

    cluster.run(train)
    return agg


def test_a_state_loads_into_the_same_method_and_parameters():
    torch.manual_seed(0)
    saved = _trained(nn.Sequential(nn.Linear(8, 16))).state_dict()
    assert saved["method"].startswith("SingleRound(compressor=ErrorFeedback(TopK(density=0.5")
    assert saved["slots"] == [["0.weight", 128], ["0.bias", 16]]
    agg = _aggregator(nn.Sequential(nn.Linear(8, 16)))
    agg.load_state_dict(saved)
    assert agg.steps == 2
    residuals = agg.state_dict()["exchange"]["compressor"]["residuals"]
    assert residuals.keys() == saved["exchange"]["compressor"]["residuals"].keys() and len(residuals) == 2


def test_a_state_saved_for_other_parameters_is_refused_and_nothing_loaded():
    saved = _trained(nn.Sequential(nn.Linear(8, 16))).state_dict()
    agg = _aggregator(nn.Sequential(nn.Linear(8, 32)))
    with pytest.raises(ConfigError, match=r"saved for other parameters: 0.weight \(128 entries\) there, "
                                          r"0.weight \(256\) here; 0.bias \(16 entries\) there, 0.bias \(32\) here"):
        agg.load_state_dict(saved)
    assert agg.steps == 0 and agg.state_dict()["exchange"]["compressor"]["residuals"] == {}
    model_granularity = _aggregator(nn.Sequential(nn.Linear(8, 16)), granularity="model")
    with pytest.raises(ConfigError, match="2 slots there, 1 here"):
        model_granularity.load_state_dict(saved)


def test_a_state_saved_by_another_method_is_refused():
    saved = _trained(nn.Sequential(nn.Linear(8, 16)), method="powersgd").state_dict()
    with pytest.raises(ConfigError, match=r"saved by PowerSGD\(rank=.*this GradientAggregator runs SingleRound"):
        _aggregator(nn.Sequential(nn.Linear(8, 16))).load_state_dict(saved)


@pytest.mark.parametrize("state", [{}, None, "state", {"steps": 1}])
def test_what_is_not_an_aggregator_state_is_refused_by_name(state):
    with pytest.raises(ConfigError, match=r"GradientAggregator.load_state_dict expects what its state_dict\(\) "
                                          r"returns \(keys steps, exchange\)"):
        _aggregator(nn.Sequential(nn.Linear(8, 16))).load_state_dict(state)


def test_a_model_state_dict_is_refused_too():
    model = nn.Sequential(nn.Linear(8, 16))
    with pytest.raises(ConfigError, match=r"got keys \['0.bias', '0.weight'\]"):
        _aggregator(model).load_state_dict(model.state_dict())


def test_a_state_saved_before_identities_were_recorded_still_loads():
    saved = _trained(nn.Sequential(nn.Linear(8, 16))).state_dict()
    old = {"steps": saved["steps"], "exchange": saved["exchange"]}
    agg = _aggregator(nn.Sequential(nn.Linear(8, 16)))
    agg.load_state_dict(old)
    assert agg.steps == 2


def test_a_single_round_exchange_refuses_another_methods_keys():
    agg = _aggregator(nn.Sequential(nn.Linear(8, 16)))
    with pytest.raises(ConfigError, match=r"keys compressor and server, got \['error', 'q'\]"):
        agg.exchange.load_state_dict({"q": {}, "error": {}})


@pytest.mark.parametrize("value", ["no", "yes", 1, 0])
def test_error_feedback_must_be_a_bool(value):
    # "no" is a truthy string: it used to turn error feedback on
    with pytest.raises(ConfigError, match=f"error_feedback must be true or false, got {value!r}"):
        gradcomp.make("topk", error_feedback=value)


def test_a_state_saved_for_parameters_of_other_shapes_is_refused():
    """The same names and sizes, other shapes: (16, 8) saved, (8, 16) here. PowerSGD's factors (and a top-k residual's
    meaning) belong to the shape; the state loaded silently before 2026-12-06."""
    torch.manual_seed(0)
    saved = _trained(nn.Sequential(nn.Linear(8, 16, bias=False)), "powersgd").state_dict()
    assert saved["shapes"] == [[16, 8]]
    agg = _aggregator(nn.Sequential(nn.Linear(16, 8, bias=False)), "powersgd")
    with pytest.raises(ConfigError, match=r"other shapes: 0.weight \(16, 8\) there, \(8, 16\) here"):
        agg.load_state_dict(saved)
    older = {k: v for k, v in saved.items() if k != "shapes"}  # a state saved before shapes were recorded
    _aggregator(nn.Sequential(nn.Linear(8, 16, bias=False)), "powersgd").load_state_dict(older)
