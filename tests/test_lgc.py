"""Learned Gradient Compression: stages, common positions, both variants' rounds and bytes, identical
autoencoder copies, state, bad parameters."""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers

import gradcomp
from gradcomp.compressors.base import Slot
from gradcomp.errors import ConfigError
from gradcomp.schemes.lgc import LGC
from gradcomp.train.exchange import GradientExchange
from gradcomp.wire.golomb import golomb_encode

SLOTS = [
    Slot("conv.weight", 0, 200, (8, 25)),
    Slot("conv.bias", 1, 8),
    Slot("fc1.weight", 2, 20000, (50, 400)),
    Slot("fc1.bias", 3, 50),
    Slot("fc2.weight", 4, 500, (10, 50)),
    Slot("fc2.bias", 5, 10),
]
DENSE = 200 + 8 + 500 + 10  # first and last layer, skipped
D = 20000 + 50
WORLD = 4


def grads(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    base = torch.Generator().manual_seed(7 + step)  # a component shared by the workers, as real gradients have
    return [torch.randn(s.numel, generator=base) + 0.5 * torch.randn(s.numel, generator=gen) for s in SLOTS]


def make(**kw):
    params = {"density": 0.01, "dense_steps": 2, "topk_steps": 3}
    params.update(kw)
    return lambda: LGC(**params)


def _residual(scheme):
    layout = scheme.layout(SLOTS)
    return None if layout.residual is None else layout.residual.clone()


def run_cluster(world, make_scheme, steps, grads_for=grads):
    def worker(t):
        scheme = make_scheme()
        ex = GradientExchange(scheme, t)
        history = []
        for step in range(steps):
            before = t.counter.snapshot()
            out = ex.exchange(SLOTS, grads_for(t.rank, step), step)
            c = t.counter
            history.append({
                "out": [o.clone() for o in out],
                "up": c.up_payload - before.up_payload,
                "down": c.down_payload - before.down_payload,
                "control": (c.up_control + c.down_control) - (before.up_control + before.down_control),
                "digests": scheme.autoencoder_digests(),
                "residual": _residual(scheme),
            })  # fmt: skip
        return history, scheme

    with gradcomp.SimulatedCluster(world, timeout=120) as cluster:
        return cluster.run(worker)


def test_stage_boundaries_and_dense_first_stage():
    scheme = LGC(dense_steps=2, topk_steps=3)
    assert [scheme.stage(s) for s in range(7)] == [1, 1, 2, 2, 2, 3, 3]
    runs = run_cluster(2, make(), 1)
    mean = [(a + b) / 2 for a, b in zip(grads(0, 0), grads(1, 0))]
    for o, m in zip(runs[0][0][0]["out"], mean):
        torch.testing.assert_close(o, m, rtol=0, atol=1e-6)
    assert runs[0][0][0]["up"] == runs[0][0][0]["down"] == 4 * (D + DENSE)


def test_first_and_last_layer_are_skipped_and_the_rest_concatenated():
    lay = LGC(density=0.01).layout(SLOTS)
    assert [SLOTS[i].name for i in lay.skipped] == ["conv.weight", "conv.bias", "fc2.weight", "fc2.bias"]
    assert lay.d == D and lay.k == 201 and lay.length == 208 and lay.latent == 52
    assert LGC(density=0.01, skip=False).layout(SLOTS).d == D + DENSE


@pytest.mark.parametrize("variant", ["ring", "ps"])
def test_top_k_stage_sends_the_leaders_positions_and_every_workers_values(variant):
    runs = run_cluster(WORLD, make(variant=variant, dense_steps=0, topk_steps=2), 2)
    k = 201
    acc = [torch.cat([grads(r, 0)[i] for i in (2, 3)]) for r in range(WORLD)]
    leader = 0  # step 0, rotating leader
    positions = torch.sort(acc[leader].abs(), descending=True, stable=True).indices[:k].sort().values
    mean = sum(a[positions] for a in acc) / WORLD
    for rank, (history, _) in enumerate(runs):
        out = torch.cat([history[0]["out"][2], history[0]["out"][3]])
        assert set(out.nonzero().reshape(-1).tolist()) == set(positions.tolist())
        torch.testing.assert_close(out[positions], mean, rtol=0, atol=1e-6)
        residual = history[0]["residual"]
        assert torch.all(residual[positions] == 0)
        keep = torch.ones(D, dtype=torch.bool)
        keep[positions] = False
        assert torch.equal(residual[keep], acc[rank][keep])
        # bytes: the positions' Golomb stream down, the values allgathered, the dense layers allreduced
        coded = golomb_encode(positions, runs[0][1].layout(SLOTS).rice)[0].numel()
        assert history[0]["up"] == 4 * k + 4 * DENSE
        assert history[0]["down"] == coded + 4 * k * (WORLD - 1) + 4 * DENSE
        assert history[0]["control"] == 8  # the stream's length
    # step 1: the leader rotates to worker 1
    acc1 = [runs[r][0][0]["residual"] + torch.cat([grads(r, 1)[i] for i in (2, 3)]) for r in range(WORLD)]
    positions1 = torch.sort(acc1[1].abs(), descending=True, stable=True).indices[:k]
    out1 = torch.cat([runs[0][0][1]["out"][2], runs[0][0][1]["out"][3]])
    assert set(out1.nonzero().reshape(-1).tolist()) == set(positions1.tolist())


@pytest.mark.parametrize("variant", ["ring", "ps"])
def test_autoencoder_copies_stay_identical_and_replicas_agree(variant):
    runs = run_cluster(WORLD, make(variant=variant), 7)
    for step in range(7):
        ref = runs[0][0][step]
        for history, _ in runs[1:]:
            assert history[step]["digests"] == ref["digests"]
            for o, r in zip(history[step]["out"], ref["out"]):
                assert torch.equal(o, r)
    trainer = next(iter(runs[0][1]._layouts.values())).trainer
    assert trainer.steps == 3 and len(trainer.model.decoders) == (WORLD if variant == "ps" else 1)
    # frozen in stage 3: the digest after the last top-k step is the final one
    assert runs[0][0][4]["digests"] == runs[0][0][6]["digests"] != runs[0][0][2]["digests"]


def test_ring_stage_three_bytes_and_update():
    runs = run_cluster(WORLD, make(variant="ring"), 6)
    lay = runs[0][1].layout(SLOTS)
    step = runs[0][0][5]
    for history, _ in runs:
        h = history[5]
        # up: the scale (max-allreduce) and the codes with the dense layers; down: the same plus positions
        assert h["up"] == 4 + 4 * (lay.latent + DENSE)
        assert h["down"] - h["up"] > 0 and h["control"] == 8
    out = torch.cat([step["out"][2], step["out"][3]])
    assert 0 < int((out != 0).sum()) <= lay.k  # the decoded mean at the k common positions only


def test_ps_stage_three_bytes():
    runs = run_cluster(WORLD, make(variant="ps", innovation=0.1), 6)
    lay = runs[0][1].layout(SLOTS)
    n = lay.innovation
    assert n == 21
    for history, _ in runs:
        h = history[5]
        assert h["up"] == 8 * n + 4 * DENSE  # innovation (fp32 value, int32 index) and the dense layers
        # down: the leader's message (scale, code, positions) and the server's k means with the dense means
        assert h["down"] > 4 * (1 + lay.latent) + 4 * (lay.k + DENSE)


def test_state_round_trip_continues_exactly():
    runs = run_cluster(1, make(variant="ring"), 4)
    state = runs[0][1].state_dict()

    def continued(load):
        def worker(t):
            scheme = LGC(density=0.01, dense_steps=2, topk_steps=3)
            if load:
                scheme.load_state_dict(state)
            ex = GradientExchange(scheme, t)
            return [ex.exchange(SLOTS, grads(0, s), s) for s in (4, 5)]

        with gradcomp.SimulatedCluster(1) as cluster:
            return cluster.run(worker)[0]

    full = run_cluster(1, make(variant="ring"), 6)[0][0]  # the uninterrupted run
    resumed = continued(True)
    for step, out in zip((4, 5), resumed):
        for a, b in zip(out, full[step]["out"]):
            assert torch.equal(a, b)
    fresh = continued(False)
    assert any(not torch.equal(a, b) for a, b in zip(fresh[1], full[5]["out"]))


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"variant": "tree"}, "variant"),
        ({"dense_steps": -1}, "dense_steps"),
        ({"topk_steps": 0}, "topk_steps"),
        ({"density": 0.0}, "density"),
        ({"density": 1.5}, "density"),
        ({"innovation": 0.0}, "innovation"),
        ({"latent_channels": 0}, "latent_channels"),
        ({"lr": 0.0}, "lr"),
        ({"skip": "yes"}, "skip"),
    ],
)
def test_bad_parameters(params, match):
    with pytest.raises(ConfigError, match=match):
        gradcomp.make("lgc", **params)


def test_a_latent_code_not_smaller_than_the_values_is_refused_before_sending():
    def worker(t):
        ex = GradientExchange(LGC(density=0.001, latent_channels=16), t)
        with pytest.raises(ConfigError, match="not smaller than the k"):
            ex.exchange(SLOTS, grads(0, 0), 0)
        return t.counter.collectives

    with gradcomp.SimulatedCluster(1) as cluster:
        assert cluster.run(worker) == [0]


# -- real gloo workers -------------------------------------------------------------------------------------------


def _gloo_worker(rank, world_size, variant):
    from gradcomp.transport.dist import DistTransport

    scheme = LGC(variant=variant, density=0.01, dense_steps=1, topk_steps=2)
    ex = GradientExchange(scheme, DistTransport())
    outs = [ex.exchange(SLOTS, grads(rank, s), s) for s in range(5)]
    return outs, scheme.autoencoder_digests()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ring", "ps"])
def test_gloo_workers_match_each_other_and_the_simulated_cluster(single_thread, variant):
    real = run_workers(_gloo_worker, WORLD, variant, timeout=300)
    for outs, digests in real[1:]:
        assert digests == real[0][1]
        for a, b in zip(outs, real[0][0]):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
    sim = run_cluster(WORLD, lambda: LGC(variant=variant, density=0.01, dense_steps=1, topk_steps=2), 5)
    assert sim[0][0][-1]["digests"] == real[0][1]  # the same autoencoder, bit for bit
    for step in range(5):
        for x, y in zip(sim[0][0][step]["out"], real[0][0][step]):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["ring", "ps"])
def test_report_counts_training_and_held_out_errors(variant):
    runs = run_cluster(2, make(variant=variant), 7)
    report = runs[0][1].report()
    assert report["autoencoder_seconds"] > 0
    (lay,) = report["layouts"]
    assert lay["autoencoder_steps"] == 3 and lay["held_out_steps"] == 2  # steps 5 and 6
    assert lay["held_out_error"] >= 0 and 0 < lay["topk_same_bits_error"] < 1
    assert lay["train_loss_first"] is not None and lay["k"] == 201
