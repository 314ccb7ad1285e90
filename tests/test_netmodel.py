"""The latency-bandwidth model applied to measured collectives."""

from __future__ import annotations

import math

import pytest

import gradcomp
from gradcomp.experiments.run.config import TrainConfig
from gradcomp.experiments.run.runner import run_simulated
from gradcomp.netmodel import NetworkModel, parse_bandwidth, parse_latency


@pytest.mark.parametrize(
    ("text", "bps"), [("1Gbit", 1e9), ("10 Gbit/s", 1e10), ("100Mbps", 1e8), ("2.5e9", 2.5e9), (1e6, 1e6)]
)
def test_bandwidth_parsing(text, bps):
    assert parse_bandwidth(text) == bps


@pytest.mark.parametrize(("text", "s"), [("50us", 50e-6), ("1ms", 1e-3), ("0", 0.0), (0.002, 0.002)])
def test_latency_parsing(text, s):
    assert parse_latency(text) == pytest.approx(s)


@pytest.mark.parametrize("bad", ["fast", "-1Gbit", "0", "1 parsec", "1.2.3Gbit", "+-1G"])
def test_bad_bandwidth_is_refused(bad):
    with pytest.raises(gradcomp.ConfigError, match="bandwidth must"):
        parse_bandwidth(bad)


@pytest.mark.parametrize("bad", ["soon", "-1ms", "5-us", "1.2.3ms", "3 days"])
def test_bad_latency_is_refused(bad):
    with pytest.raises(gradcomp.ConfigError, match="latency must"):
        parse_latency(bad)


def test_textbook_costs():
    net = NetworkModel(bandwidth_bps=8e9, latency_s=1e-5)  # 1 GB/s
    n = 1_000_000  # bytes: 1 ms on the link
    assert net.call_seconds("all_reduce", n, 4) == pytest.approx(6e-5 + 1.5e-3)
    assert net.call_seconds("all_gather", n, 4) == pytest.approx(3e-5 + 3e-3)
    assert net.call_seconds("gather", n, 4) == pytest.approx(1e-5 + 3e-3)
    assert net.call_seconds("broadcast", n, 4) == pytest.approx(2 * (1e-5 + 1e-3))
    # all-to-all of n bytes: each worker sends 3 chunks of n/4 bytes, one message each
    assert net.call_seconds("all_to_all", n, 4) == pytest.approx(3e-5 + 0.75e-3)
    assert net.call_seconds("all_reduce", n, 1) == 0
    # linear in bytes: pricing the mean size of several calls is exact
    assert net.seconds({"all_gather": [2, 3 * n]}, 4) == pytest.approx(
        net.call_seconds("all_gather", n, 4) + net.call_seconds("all_gather", 2 * n, 4)
    )


def test_a_run_reports_the_modelled_time_of_what_it_sent():
    cfg = TrainConfig(dataset="synthetic", model="mlp", workers=4, steps=5, progress=False,
                      bandwidth="1Gbit", latency="50us")
    result = run_simulated(cfg)
    d = result["num_parameters"]
    per_step = 2 * 3 * 50e-6 + 2 * 3 / 4 * 32 * d / 1e9  # one fp32 ring allreduce
    assert result["modelled_communicate_s"] == pytest.approx(5 * per_step)
    assert result["network"] == {"bandwidth_bps": 1e9, "latency_s": pytest.approx(50e-6)}
    assert math.isfinite(result["communicate_s"])
