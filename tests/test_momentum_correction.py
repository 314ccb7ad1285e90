"""DGC's momentum correction and momentum factor masking as feedback policies around any contractive
compressor: the update rule, its equivalence to momentum SGD without compression, state, refusals, CLI."""

from __future__ import annotations

import pytest
import torch

import gradcomp
from gradcomp import ConfigError, Slot
from gradcomp.experiments.run.config import TrainConfig
from gradcomp.feedback import MomentumCorrection

SLOT = Slot("w", 0, 400)


def grads(steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(400, generator=gen) for _ in range(steps)]


def sent_by(compressor, x, step):
    return compressor.decompress(compressor.compress(x, SLOT, step), SLOT, step)


@pytest.mark.parametrize("masking", [False, True])
def test_velocity_is_accumulated_and_only_what_was_sent_leaves(masking):
    policy = "momentum_masking" if masking else "momentum_correction"
    mc = gradcomp.make("topk", k=20, feedback=policy, feedback_momentum=0.5)
    assert isinstance(mc, MomentumCorrection) and mc.owns_momentum and mc.masking is masking
    u = torch.zeros(400)
    v = torch.zeros(400)
    for step, g in enumerate(grads(6)):
        u = 0.5 * u + g
        v = v + u
        top = torch.sort(v.abs(), descending=True, stable=True).indices[:20]
        sent = sent_by(mc, g, step)
        assert set(sent.nonzero().reshape(-1).tolist()) == set(top.tolist())
        torch.testing.assert_close(sent[top], v[top])
        v[top] = 0
        if masking:
            u[top] = 0
        torch.testing.assert_close(mc.accumulated["w#400"], v)
        torch.testing.assert_close(mc.velocity["w#400"], u)


def test_with_nothing_dropped_it_is_momentum_sgd():
    # an identity compressor sends all of v every step: the sent sequence is torch SGD's momentum buffer
    mc = gradcomp.make("none", feedback="momentum_correction", feedback_momentum=0.9)
    param = torch.zeros(400, requires_grad=True)
    opt = torch.optim.SGD([param], lr=1.0, momentum=0.9)
    for step, g in enumerate(grads(5, seed=3)):
        sent = sent_by(mc, g, step)
        param.grad = g.clone()
        opt.step()
        torch.testing.assert_close(sent, opt.state[param]["momentum_buffer"], rtol=1e-6, atol=1e-6)


def test_masking_differs_from_correction_alone():
    a = gradcomp.make("topk", k=20, feedback="momentum_correction")
    b = gradcomp.make("topk", k=20, feedback="momentum_masking")
    outs = [(sent_by(a, g, s), sent_by(b, g, s)) for s, g in enumerate(grads(4))]
    assert torch.equal(outs[0][0], outs[0][1]) and not torch.equal(outs[-1][0], outs[-1][1])


def test_state_round_trip():
    mc = gradcomp.make("randomk", density=0.05, feedback="momentum_masking")
    stream = grads(5)
    for s, g in enumerate(stream[:3]):
        sent_by(mc, g, s)
    other = gradcomp.make("randomk", density=0.05, feedback="momentum_masking")
    other.load_state_dict(mc.state_dict())
    for s, g in enumerate(stream[3:], start=3):
        assert torch.equal(sent_by(mc, g, s), sent_by(other, g, s))
    with pytest.raises(ConfigError, match="keys"):
        other.load_state_dict({"residuals": {}})


@pytest.mark.parametrize(
    ("name", "kw", "match"),
    [
        ("randomk", {"density": 0.1, "scale": True, "feedback": "momentum_correction"}, "contractive"),
        ("signum", {"feedback": "momentum_masking"}, "applies momentum itself"),
        ("topk", {"k": 3, "feedback": "momentum_correction", "feedback_momentum": 1.0}, "momentum"),
        ("topk", {"k": 3, "feedback": "sideways"}, "feedback must be"),
        ("topk", {"k": 3, "feedback": "momentum_correction", "error_feedback": True}, "contradicts"),
        ("powersgd", {"feedback": "momentum_correction"}, "owns its rounds"),
    ],
)
def test_refused(name, kw, match):
    with pytest.raises(ConfigError, match=match):
        gradcomp.make(name, **kw)


def test_train_config_moves_the_optimizers_momentum_into_the_policy():
    cfg = TrainConfig(compressor="randomblock", params={"density": 0.01}, feedback="momentum_masking", momentum=0.8)
    note = cfg.hand_momentum_to_method()
    assert "momentum_masking" in note and cfg.momentum == 0.0 and cfg.feedback_momentum == 0.8
    compressor, _ = cfg.build_compressors()
    assert isinstance(compressor, MomentumCorrection) and compressor.momentum == 0.8 and compressor.masking
    assert cfg.label().endswith("+ momentum masking")
    with pytest.raises(ConfigError, match="not both"):
        TrainConfig(compressor="topk", params={"k": 3}, feedback="residual", error_feedback=True).build_compressors()
