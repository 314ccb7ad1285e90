"""Composition: a second compressor applied to the fp32 values of a first one's message."""

from __future__ import annotations

import pytest
import torch

import gradcomp
from gradcomp.wire import decode, encode

SLOT = gradcomp.Slot("w", 2, 5000)


def test_topk_values_through_fp16_round_trip_and_cost_half():
    plain = gradcomp.make("topk", density=0.02)
    composed = gradcomp.make("topk+fp16", density=0.02)
    x = torch.randn(SLOT.numel)
    fields = composed.compress(x, SLOT, 0)
    buf = encode(fields, composed.specs(SLOT))
    out = composed.decompress(decode(buf, composed.specs(SLOT)), SLOT, 0)
    assert torch.equal(out, composed.decompress(fields, SLOT, 0))
    expected = plain.decompress(plain.compress(x, SLOT, 0), SLOT, 0)
    assert torch.equal(out.nonzero(), expected.nonzero())  # same positions
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=0)  # values rounded to fp16
    k = 100
    assert len(encode(plain.compress(x, SLOT, 0), plain.specs(SLOT))) - buf.numel() == 2 * k


def test_composition_accumulates_like_decompress():
    c = gradcomp.make("topk+fp16", density=0.05)
    x = torch.randn(SLOT.numel)
    fields = c.compress(x, SLOT, 3)
    out = torch.ones(SLOT.numel)
    c.accumulate(fields, SLOT, 3, out)
    assert torch.equal(out, 1 + c.decompress(fields, SLOT, 3))


def test_error_feedback_wraps_the_composition_and_params_go_to_the_first():
    c = gradcomp.make("topk+fp16", density=0.05, error_feedback=True)
    assert isinstance(c, gradcomp.ErrorFeedback) and c.inner.name == "topk+fp16"
    assert c.params()["density"] == 0.05
    assert not c.summable


@pytest.mark.parametrize(
    ("name", "match"),
    [("threshold+fp16", "variable length"), ("topk+", "first\\+second"), ("topk+zip", "unknown compressor"),
     ("a+b+c", "first\\+second")],
)
def test_bad_compositions_are_refused(name, match):
    with pytest.raises(gradcomp.ConfigError, match=match):
        gradcomp.make(name).specs(SLOT)


def test_composed_exchange_over_the_simulated_cluster_is_identical_everywhere():
    with gradcomp.SimulatedCluster(3) as cluster:
        def work(t):
            ex = gradcomp.GradientExchange(gradcomp.make("topk+fp16", density=0.1), t)
            torch.manual_seed(t.rank)
            return ex.exchange([SLOT], [torch.randn(SLOT.numel)], 0)[0]

        results = cluster.run(work)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
