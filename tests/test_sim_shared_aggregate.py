"""The simulated cluster adds up an all-gather's messages once for all workers: same results, honest timings."""

from __future__ import annotations

import pytest

from gradcomp.experiments.run.config import TrainConfig
from gradcomp.experiments.run.runner import run_simulated
from gradcomp.schemes import single_round
from gradcomp.transport.sim import SimulatedCluster, computed_once


def _run(compressor, params, topology="auto", workers=4):
    cfg = TrainConfig(compressor=compressor, params=params, topology=topology, workers=workers, steps=3,
                      dataset="synthetic", model="cnn", batch_size=16, simulate=True, progress=False)
    return run_simulated(cfg)


@pytest.mark.parametrize(("compressor", "params", "topology"), [
    ("topk", {"density": 0.02}, "auto"), ("qsgd", {}, "auto"), ("signum", {}, "auto"),
    ("threshold", {"threshold": 0.001}, "auto"), ("randomk", {"density": 0.05}, "allgather"),
])
def test_parameters_and_bytes_equal_those_of_every_worker_aggregating_itself(compressor, params, topology,
                                                                             monkeypatch):
    shared = _run(compressor, params, topology)
    calls = []

    def every_worker(label, compute):
        calls.append(label)
        return compute()

    monkeypatch.setattr(single_round, "computed_once", every_worker)
    alone = _run(compressor, params, topology)
    assert len(calls) == 4 * 3  # the unshared path really ran: every worker, every step
    for key in ("parameter_digest", "bits_up_by_worker", "bits_down_by_worker", "final_loss", "replicas_identical"):
        assert shared[key] == alone[key], key
    assert shared["replicas_identical"]


def test_the_aggregate_is_computed_once_per_all_gather_and_charged_to_every_worker(monkeypatch):
    computed = []
    real = single_round.aggregate_buffers

    def counting(*args, **kwargs):
        computed.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(single_round, "aggregate_buffers", counting)
    _run("topk", {"density": 0.02}, workers=4)
    assert len(computed) == 3  # three steps, one all-gather each: once each, not 4 times


def test_computed_once_copies_and_charges():
    import torch

    with SimulatedCluster(3) as cluster:

        def worker(transport):
            gathered = transport.all_gather(torch.tensor([float(transport.rank)]))
            result = computed_once("sum", lambda: [sum(gathered)])
            result[0] += 100 * transport.rank  # a worker's own copy: changing it changes nobody else's
            return result[0].item(), transport.charged_s

        results = cluster.run(worker)
    assert [r for r, _ in results] == [3.0, 103.0, 203.0]
    assert sorted(c > 0 for _, c in results) == [False, True, True]  # two workers were charged, one computed
    assert computed_once("x", lambda: 7) == 7  # outside a simulated worker: a plain call
