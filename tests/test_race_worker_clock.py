"""The race worker's training clock: it starts after run_worker's set-up (DDP's constructor included), and
torch's first-call costs are taken by warm-up steps before it, whatever --compute-steps is.

In one process (a gloo group of one), no worker started.
"""

from __future__ import annotations

import functools
import gc
import time

import pytest
import torch
import torch.distributed as dist

from gradcomp.experiments.race import race_worker


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    # The run's DDP model and the hook's group are freed while the groups still exist: left to the collector, a
    # DDP reducer freed after destroy_process_group() sometimes aborted the whole process (about 1 run in 25)
    gc.collect()
    dist.destroy_process_group()


def _cfg(**kw):
    from gradcomp.experiments.run.config import TrainConfig

    return TrainConfig(workers=1, steps=2, batch_size=8, dataset="synthetic", model="mlp", progress=False, **kw)


def test_the_clock_starts_after_ddp_s_set_up(monkeypatch, one_process_group):
    """DDP's constructor (with its parameter broadcast) is set-up, off the clock as for ddp=off methods."""
    from gradcomp.experiments.run.data import load_dataset

    plain = torch.nn.parallel.DistributedDataParallel.__init__

    @functools.wraps(plain)  # its signature, which the runner reads to pick DDP's buffer option
    def slow(self, *args, **kwargs):
        time.sleep(1.0)  # as a broadcast of the parameters over a slow link
        plain(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.parallel.DistributedDataParallel, "__init__", slow)
    cfg = _cfg(ddp=True)
    data = load_dataset("synthetic")
    memory = race_worker.MemoryPeaks(torch.device("cpu"))
    clock = race_worker.RaceClock(data, 0, 1, 2, 0, 8, torch.device("cpu"), memory, verbose=False, label="t")
    started = time.perf_counter()
    stats, wire = race_worker.clocked_run_worker(cfg, torch.device("cpu"), clock)
    assert time.perf_counter() - started >= 1.0 and len(clock.step_end) == 2 and wire is None
    assert clock.step_end[-1] < 0.5, clock.step_end


def test_warm_up_steps_run_even_without_compute_only_steps(monkeypatch, one_process_group):
    from gradcomp.experiments.run.data import load_dataset

    calls = []
    real = race_worker.compute_gradients
    monkeypatch.setattr(race_worker, "compute_gradients", lambda *args: calls.append(1) or real(*args))
    data = load_dataset("synthetic")
    assert race_worker.compute_only(_cfg(), data, 0, torch.device("cpu"), 0) == []
    assert len(calls) == race_worker.WARMUP_STEPS == 2
    assert len(race_worker.compute_only(_cfg(), data, 0, torch.device("cpu"), 3)) == 3 and len(calls) == 7


def test_tiny_allreduce_seconds_times_each_round_after_one_unreported(monkeypatch, one_process_group):
    calls = []
    real = race_worker.dist.all_reduce
    monkeypatch.setattr(race_worker.dist, "all_reduce", lambda t, *a, **k: calls.append(t.numel()) or real(t, *a, **k))
    times = race_worker.tiny_allreduce_seconds(torch.device("cpu"), rounds=4)
    assert len(times) == 4 and all(t > 0 for t in times) and calls == [1] * 5
