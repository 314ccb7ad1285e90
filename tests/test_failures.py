"""Failures across real workers: a worker that vanishes, a NaN on one worker, bad parameters."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
from distributed import run_workers

import gradcomp
from gradcomp.compressors.base import Slot
from gradcomp.experiments.run.config import TrainConfig
from gradcomp.experiments.run.launch import launch
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


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the launcher reads process states in /proc")
def test_a_stopped_worker_is_named_by_the_launcher(tmp_path):
    # SIGSTOP: the worker is not dead, its connections stay open; the other one waits the --timeout, then
    # fails. The error must name the stopped worker, not the one that noticed, and come right at the time-out.
    from test_orphans import Launcher, gone_within

    launcher = Launcher(tmp_path, "--timeout", "10")
    try:
        stuck = launcher.wait_until_training()[-1]
        os.kill(stuck, signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert launcher.finish(within=120) == 2, launcher.err[-3000:]
        waited = time.monotonic() - stopped_at
        err = launcher.err
        last = err.rstrip().splitlines()[-1]
        assert last.startswith("gradcomp: error: worker ") and f"(pid {stuck}) was stopped" in last, err[-3000:]
        assert "gave up after the --timeout of 10 s" in last
        assert f"(pid {stuck}) is stopped" in err  # warned while the others still waited
        assert waited >= 10  # the others gave up at their time-out ...
        assert "Unable to shutdown" not in err and waited < 60  # ... not after torch's 30 s grace for SIGTERM
        assert gone_within([stuck], 5) == []
    finally:
        launcher.cleanup()
