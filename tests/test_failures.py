"""Failures across real workers: a worker that vanishes, a NaN on one worker, bad parameters."""

from __future__ import annotations

import os
import time

import pytest
import torch
from distributed import run_workers

import gradcomp
from gradcomp.compressors.base import Slot
from gradcomp.experiments.launch import launch
from gradcomp.experiments.runner import TrainConfig
from gradcomp.transport.dist import DistTransport


def _one_worker_vanishes(rank: int, world: int):
    transport = DistTransport()
    exchange = gradcomp.GradientExchange(gradcomp.make("topk", density=0.1), transport)
    slot = Slot("w", 0, 1000)
    if rank == 1:
        exchange.exchange([slot], [torch.randn(1000)], 0)  # one good round
        os._exit(0)  # vanish without a word
    started = time.monotonic()
    try:
        # rank 0 may still be finishing the first round when rank 1 is gone; either round must fail cleanly
        exchange.exchange([slot], [torch.randn(1000)], 0)
        exchange.exchange([slot], [torch.randn(1000)], 1)
    except gradcomp.WorkerLostError as exc:
        return ("WorkerLostError", str(exc), time.monotonic() - started)
    except Exception as exc:
        return (type(exc).__name__, str(exc), time.monotonic() - started)
    return ("no error", "", time.monotonic() - started)


@pytest.mark.slow
def test_a_vanished_worker_gives_a_clear_error_not_a_hang():
    results = run_workers(_one_worker_vanishes, 2, timeout=120, teardown=False)
    kind, message, waited = results[0]
    assert kind == "WorkerLostError", (kind, message)
    assert "disappeared" in message
    assert waited < 60  # the group's time-out in tests/distributed.py; a closed connection is noticed sooner


@pytest.mark.slow
def test_nan_on_one_worker_stops_the_launch_with_its_name(monkeypatch):
    # a learning rate this large makes the loss overflow within a few steps on every worker
    cfg = TrainConfig(dataset="synthetic", model="mlp", workers=2, steps=40, lr=1e6, momentum=0.0, progress=False,
                      timeout_s=60)
    started = time.monotonic()
    with pytest.raises(gradcomp.GradcompError) as info:
        launch(cfg)
    assert "non-finite" in str(info.value) and "net." in str(info.value)
    assert time.monotonic() - started < 100


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"compressor": "topk", "params": {"density": 1.5}}, "density"),
        ({"compressor": "topk", "params": {"density": 0.0}}, "density"),
        ({"compressor": "zip"}, "unknown compressor"),
        ({"compressor": "topk", "params": {"k": 100_000}}, "exceeds"),
        ({"workers": 0}, "workers"),
        ({"granularity": "neuron"}, "granularity"),
        ({"compressor": "topk", "topology": "allreduce"}, "not summable"),
        ({"server_compressor": "topk"}, "topology ps"),
        # fits every layer of the MLP but not a sixteenth of its output bias
        ({"compressor": "topk", "params": {"k": 2}, "topology": "sharded", "workers": 16}, "shard"),
        ({"compressor": "powersgd", "params": {"rank": 0}}, "rank"),
        ({"compressor": "powersgd", "topology": "allgather"}, "owns its rounds"),
        ({"compressor": "signsgd", "topology": "allreduce"}, "not summable"),
    ],
)
def test_bad_configuration_fails_before_any_worker_starts(overrides, match):
    settings = {"dataset": "synthetic", "model": "mlp", "workers": 2, "steps": 2, "progress": False, **overrides}
    cfg = TrainConfig(**settings)
    started = time.monotonic()
    with pytest.raises(gradcomp.ConfigError, match=match):
        launch(cfg)
    assert time.monotonic() - started < 5  # no processes were spawned
