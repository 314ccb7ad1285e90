"""TernGrad with scaler sharing (``terngrad_shared``): one max-allreduce of scalers, then the ternary round."""

from __future__ import annotations

import math

import pytest
import torch

import gradcomp
from gradcomp.compressors.base import Slot, bind_worker
from gradcomp.errors import ConfigError, NonFiniteGradientError
from gradcomp.schemes.terngrad_shared import TernGradShared
from gradcomp.train.exchange import GradientExchange
from gradcomp.wire import Codec, FieldSpec, encoded_size

SLOTS = [Slot("w", 0, 3000), Slot("m", 1, 500, (20, 25)), Slot("bias", 2, 7)]


def grads(rank, step, slots=SLOTS):
    # workers of different magnitudes, so that the shared scaler differs from most workers' own
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s.numel, generator=gen) * (1 + rank) for s in slots]


def run_cluster(world, make_scheme, steps, grads_for=grads):
    """Per worker: list over steps of (outputs, payload bytes up, payload bytes down)."""

    def worker(t):
        ex = GradientExchange(make_scheme(), t)
        history = []
        for step in steps:
            before = t.counter.snapshot()
            out = ex.exchange(SLOTS, grads_for(t.rank, step), step)
            up = t.counter.up_payload - before.up_payload
            down = t.counter.down_payload - before.down_payload
            history.append(([o.clone() for o in out], up, down))
        return history

    with gradcomp.SimulatedCluster(world, timeout=60) as cluster:
        return cluster.run(worker)


def clipped_max(x, clip):
    """s_i of one worker, computed here without the library: max|x| after clipping at clip·σ."""
    if clip == 0:
        return x.abs().max().item()
    sigma = x.std(correction=0).item()
    return min(x.abs().max().item(), clip * sigma)


@pytest.mark.parametrize("clip", [2.5, 0.0])
@pytest.mark.parametrize("exchange", ["allgather", "allreduce"])
def test_every_entry_is_the_shared_scaler_times_a_count_of_workers(clip, exchange):
    world = 3
    runs = run_cluster(world, lambda: TernGradShared(clip=clip, exchange=exchange), range(2))
    for step in range(2):
        outs = [runs[r][step][0] for r in range(world)]
        for r in range(1, world):  # every replica holds the same aggregate
            assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[r]))
        for i, slot in enumerate(SLOTS):
            s = max(clipped_max(grads(r, step)[i], clip) for r in range(world))
            counts = outs[0][i] * world / s
            assert torch.allclose(counts, counts.round(), atol=1e-4), slot.name
            assert counts.abs().max().item() <= world + 1e-4
            assert counts.abs().max().item() >= 1  # something was sent


def test_allgather_and_allreduce_carry_the_same_ternaries():
    world = 4
    gathered = run_cluster(world, lambda: TernGradShared(exchange="allgather"), range(2))
    reduced = run_cluster(world, lambda: TernGradShared(exchange="allreduce"), range(2))
    for step in range(2):
        for a, b in zip(gathered[0][step][0], reduced[0][step][0]):
            assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_bits_are_one_float_per_slot_then_two_bits_per_coordinate():
    world = 4
    runs = run_cluster(world, lambda: TernGradShared(exchange="allgather"), range(1))
    d = sum(s.numel for s in SLOTS)
    codes = encoded_size([FieldSpec(Codec.BITS, count=s.numel, width=2) for s in SLOTS])
    _, up, down = runs[1][0]
    assert up == 4 * len(SLOTS) + codes  # bytes
    assert down == 4 * len(SLOTS) + (world - 1) * codes
    assert codes < d / 4 + 64  # 2 bits per coordinate plus the wire headers

    runs = run_cluster(world, lambda: TernGradShared(exchange="allreduce"), range(1))
    _, up, down = runs[1][0]
    assert up == down == 4 * len(SLOTS) + d  # int8 sums


def test_unbiased_without_clipping():
    """E[output] = mean of the workers' gradients (clip = 0); checked coordinate-wise over many steps."""
    world, steps = 2, 300
    fixed = [[torch.linspace(-1, 1, s.numel) * (1 + r) for s in SLOTS] for r in range(world)]
    runs = run_cluster(world, lambda: TernGradShared(clip=0.0), range(steps), grads_for=lambda r, step: fixed[r])
    for i, slot in enumerate(SLOTS):
        mean = torch.stack([runs[0][step][0][i] for step in range(steps)]).mean(0)
        want = (fixed[0][i] + fixed[1][i]) / world
        # per coordinate and worker, the output is s/W·(Bernoulli) with s = 2: variance <= (s/W)^2/4 per worker
        s = 2.0
        std_of_mean = math.sqrt(world * (s / world) ** 2 / 4 / steps)
        assert (mean - want).abs().max().item() < 5 * std_of_mean, slot.name


def test_a_worker_with_a_smaller_scaler_keeps_fewer_entries():
    """The probability is |x|/s with the *shared* s: the smallest worker sends fewer nonzeros than alone."""
    world = 2

    def messages(make):
        def worker(t):
            scheme = make()
            scheme.bind(t.rank, t.world_size)
            x = grads(t.rank, 0)[0]
            rounds = scheme.run(SLOTS[:1], [x], 0)
            request = next(rounds)
            if hasattr(request, "op"):  # the shared scaler's max-allreduce
                request = rounds.send(t.all_reduce_max(request.tensor))
            return request

        with gradcomp.SimulatedCluster(world, timeout=30) as cluster:
            return cluster.run(worker)

    shared = messages(lambda: TernGradShared(clip=0.0, exchange="allreduce"))
    small = shared[0].tensor  # worker 0's int8 ternaries (its gradient is half worker 1's)
    alone = gradcomp.make("terngrad", clip=0.0)
    bind_worker(alone, 0)
    _, codes = alone.compress(grads(0, 0)[0], SLOTS[0], 0)
    assert int((small != 0).sum()) < 0.75 * int((codes != 0).sum())


def test_bad_parameters_and_non_finite_gradients_fail_before_anything_is_sent():
    with pytest.raises(ConfigError, match="exchange"):
        gradcomp.make("terngrad_shared", exchange="ring")
    with pytest.raises(ConfigError, match="clip"):
        gradcomp.make("terngrad_shared", clip=-1)
    with pytest.raises(ConfigError, match="at most 127"):
        TernGradShared(exchange="allreduce").bind(0, 128)

    scheme = TernGradShared()
    scheme.bind(0, 2)
    g = grads(0, 0)
    g[1][3] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="m"):
        next(scheme.run(SLOTS, g, 0))  # raises before the first request is yielded


@pytest.mark.slow
def test_gloo_workers_and_the_simulated_cluster_train_the_same_model(tmp_path):
    import json

    from gradcomp.cli import main

    results = []
    for extra in ([], ["--simulate"]):
        out = tmp_path / f"run{len(results)}.json"
        args = ["train", "--dataset", "synthetic", "--model", "mlp", "--steps", "8", "--no-progress",
                "--workers", "3", "--compressor", "terngrad_shared", "--json", str(out), *extra]
        assert main(args) == 0
        results.append(json.loads(out.read_text()))
    real, sim = results
    assert real["backend"] == "gloo" and sim["backend"] == "simulated"
    assert real["replicas_identical"]
    assert sim["parameter_digest"] == real["parameter_digest"]
    assert sim["bits_up_by_worker"] == real["bits_up_by_worker"]
