"""Learned Gradient Compression: stages, common positions, both variants' rounds and bytes, identical
autoencoder copies, state, bad parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_workers

import gradcomp
from gradcomp.compressors.base import Slot
from gradcomp.errors import ConfigError
from gradcomp.schemes import lgc
from gradcomp.schemes.lgc import LGC
from gradcomp.train.exchange import GradientExchange
from gradcomp.wire import HEADER_BYTES, SECTION_HEADER_BYTES
from gradcomp.wire.golomb import golomb_encode


def framed(sections: int) -> int:
    """Bytes a container message adds to its sections' data (every message LGC gathers or broadcasts)."""
    return HEADER_BYTES + sections * SECTION_HEADER_BYTES

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


def _layout(scheme, slots=SLOTS):
    return scheme._layouts[tuple(s.name for s in slots)]


def _trainer(scheme, slots=SLOTS):
    """The slot list's autoencoder (None before its first top-k step)."""
    return scheme.state.get("autoencoder", lgc.list_slot(_layout(scheme, slots)))


def _residual(scheme):
    layout = scheme._layouts.get(tuple(s.name for s in SLOTS))
    residual = None if layout is None else scheme.state.get("residual", lgc.list_slot(layout))
    return None if residual is None else residual.clone()


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
    lay = LGC(density=0.01).layout(SLOTS, step=0)
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
        # the leader (a worker) uploads its positions once: booked as its upload, the others' download; the
        # positions and the values are container messages of one section each
        coded = golomb_encode(positions, _layout(runs[0][1]).rice)[0].numel() + framed(1)
        sent = coded if rank == leader else 0
        values = 4 * k + framed(1)
        assert history[0]["up"] == values + 4 * DENSE + sent
        assert history[0]["down"] == coded - sent + values * (WORLD - 1) + 4 * DENSE
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
    trainer = _trainer(runs[0][1])
    assert trainer.steps == 3 and len(trainer.model.decoders) == (WORLD if variant == "ps" else 1)
    # frozen in stage 3: the digest after the last top-k step is the final one
    assert runs[0][0][4]["digests"] == runs[0][0][6]["digests"] != runs[0][0][2]["digests"]


DECODER_BYTES = 4 * (4 * 64 + 64 + 64 * 256 * 3 + 256 + 256 * 128 * 3 + 128 + 128 * 64 * 3 + 64 + 64 * 3 + 1)
SYNC_BYTES = DECODER_BYTES + framed(1)  # a container message of one fp32 section


def test_ring_stage_three_bytes_and_update():
    runs = run_cluster(WORLD, make(variant="ring"), 7)
    lay = _layout(runs[0][1])
    common = 4 + 4 * (lay.latent + DENSE)  # the scale (max-allreduce), the codes with the dense layers
    for step, leader in ((5, 1), (6, 2)):
        coded = runs[3][0][step]["down"] - common - (SYNC_BYTES if step == 5 else 0)  # the leader's positions
        assert coded > 0
        for rank, (history, _) in enumerate(runs):
            h = history[step]
            # step 5, the first compressed step: rank 0's decoder to every worker, once (a peer broadcast)
            sync = SYNC_BYTES if step == 5 else 0
            assert h["up"] == common + (coded if rank == leader else 0) + (sync if rank == 0 else 0)
            assert h["down"] == common + (0 if rank == leader else coded) + (0 if rank == 0 else sync)
            assert h["control"] == 8  # the positions' length
    out = torch.cat([runs[0][0][5]["out"][2], runs[0][0][5]["out"][3]])
    assert 0 < int((out != 0).sum()) <= lay.k  # the decoded mean at the k common positions only


def test_ps_stage_three_bytes():
    runs = run_cluster(WORLD, make(variant="ps", innovation=0.1), 7)
    lay = _layout(runs[0][1])
    n = lay.innovation
    assert n == 21
    means = 4 * (lay.k + DENSE) + framed(1)  # the server's k means with the dense means: the server's downlink
    for step, leader in ((5, 1), (6, 2)):
        message = runs[3][0][step]["down"] - means  # the leader's scale, code and positions
        assert message > 4 * (1 + lay.latent)
        for rank, (history, _) in enumerate(runs):
            h = history[step]
            # up: the innovation (fp32 value, 32-bit index) with the dense layers, a container of 3 sections; no
            # decoder is sent (only the ring syncs one)
            assert h["up"] == 8 * n + 4 * DENSE + framed(3) + (message if rank == leader else 0)
            assert h["down"] == means + (0 if rank == leader else message)


def _by_names(state):
    """The state dict as LGC wrote it before its autoencoders moved into its SlotState: the residuals in it, each
    slot list's autoencoder and flag under its names joined by ``|`` (a compressed one not synced yet: False)."""
    names = {key: key.rpartition("#")[0] for key in state["residual"]}
    return {"residual": state["residual"], "layouts": {
        names[key]: {"autoencoder": part, "synced": state["synced"].get(key, False)}
        for key, part in state["autoencoder"].items()}}  # fmt: skip


def _per_slot_list(state):
    """The state dict as LGC wrote it before its residuals moved into a SlotState: one entry per slot list."""
    earlier = _by_names(state)
    residuals = {key.rpartition("#")[0]: t for key, t in earlier["residual"].items()}
    return {k: {**part, "residual": residuals[k]} for k, part in earlier["layouts"].items()}


@pytest.mark.parametrize("written", ["now", "by names", "per slot list"])
def test_state_round_trip_continues_exactly(written):
    runs = run_cluster(1, make(variant="ring"), 4)
    state = runs[0][1].state_dict()
    assert set(state) == {"residual", "autoencoder", "synced"}
    assert len(state["residual"]) == 1 and state["autoencoder"].keys() == state["residual"].keys()
    state = {"now": dict, "by names": _by_names, "per slot list": _per_slot_list}[written](state)

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
    c = ex.transport.counter
    return outs, scheme.autoencoder_digests(), (c.up_payload, c.down_payload, c.up_control + c.down_control)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ring", "ps"])
def test_gloo_workers_match_each_other_and_the_simulated_cluster(single_thread, variant):
    real = run_workers(_gloo_worker, WORLD, variant, timeout=300)
    for outs, digests, _ in real[1:]:
        assert digests == real[0][1]
        for a, b in zip(outs, real[0][0]):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
    sim = run_cluster(WORLD, lambda: LGC(variant=variant, density=0.01, dense_steps=1, topk_steps=2), 5)
    assert sim[0][0][-1]["digests"] == real[0][1]  # the same autoencoder, bit for bit
    for step in range(5):
        for x, y in zip(sim[0][0][step]["out"], real[0][0][step]):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    for (history, _), (_, _, booked) in zip(sim, real):  # gloo books what the simulated cluster books
        assert booked == tuple(sum(h[key] for h in history) for key in ("up", "down", "control"))


@pytest.mark.parametrize("variant", ["ring", "ps"])
def test_report_counts_training_and_held_out_errors(variant):
    runs = run_cluster(2, make(variant=variant), 7)
    report = runs[0][1].report()
    assert report["autoencoder_seconds"] > 0
    (lay,) = report["layouts"]
    assert lay["autoencoder_steps"] == 3 and lay["held_out_steps"] == 2  # steps 5 and 6
    assert lay["held_out_error"] >= 0 and 0 < lay["topk_same_bits_error"] < 1
    assert lay["train_loss_first"] is not None and lay["k"] == 201


# -- found by a review: skip per model, per-bucket state, decoder sync, peer broadcasts, trainer state ----------

TWO_LAYERS = [  # a two-layer MLP (nn.Sequential(Flatten, Linear, ReLU, Linear)): its first and last layer are all
    Slot("net.1.weight", 0, 8000, (100, 80)),
    Slot("net.1.bias", 1, 100),
    Slot("net.3.weight", 2, 1000, (10, 100)),
    Slot("net.3.bias", 3, 10),
]
TAIL, HEAD = SLOTS[2:], SLOTS[:2]  # DDP's buckets after its rebuild: the last parameters first


def test_skip_sends_the_models_first_and_last_layer_dense_not_a_buckets():
    scheme = LGC(density=0.01)
    # before the DDP hook named the model (its first backward pass), a bucket that is not the whole model
    # cannot know the model's last layer: it travels dense
    assert scheme.layout(TAIL, step=0).d == 0 and not scheme._layouts
    scheme.retain(SLOTS)
    tail, head = scheme.layout(TAIL, step=1), scheme.layout(HEAD, step=1)
    assert [TAIL[i].name for i in tail.skipped] == ["fc2.weight", "fc2.bias"] and tail.d == D
    assert head.d == 0 and head.skipped == [0, 1]  # only the model's first layer: dense


def test_a_model_whose_first_and_last_layer_are_all_its_layers_skips_nothing():
    assert LGC(density=0.01).layout(TWO_LAYERS, step=0).skipped == []
    scheme = LGC(density=0.01)
    scheme.retain(TWO_LAYERS)
    assert scheme.layout(TWO_LAYERS).d == 9110


@pytest.mark.parametrize("skip", [True, False])
def test_skip_with_a_flattened_model_slot_is_refused_before_sending(skip):
    model = [Slot("model", 0, D + DENSE)]

    def worker(t):
        ex = GradientExchange(LGC(density=0.01, skip=skip, dense_steps=0), t)
        if skip:
            with pytest.raises(ConfigError, match="flattened vector"):
                ex.exchange(model, [torch.cat(grads(0, 0))], 0)
        else:
            ex.exchange(model, [torch.cat(grads(0, 0))], 0)
        return t.counter.collectives

    with gradcomp.SimulatedCluster(1) as cluster:
        assert (cluster.run(worker) == [0]) == skip


def _passes(t, scheme, steps):
    """DDP's way: the whole model in one bucket in the first pass, then two buckets; retain after each pass."""
    ex = GradientExchange(scheme, t)
    history = []
    for step in range(steps):
        g = grads(t.rank, step)
        out = [torch.empty(0)] * len(SLOTS)
        for bucket in [range(6)] if step == 0 else [range(2, 6), range(2)]:
            for i, o in zip(bucket, ex.exchange([SLOTS[i] for i in bucket], [g[i] for i in bucket], step)):
                out[i] = o.clone()
        scheme.retain(SLOTS)
        history.append(out)
    return history


def test_a_restore_undoes_an_autoencoder_made_in_the_undone_step_and_loads_into_a_live_one():
    """Restoring the state taken before the first top-k step leaves no autoencoder (the step done again makes a
    fresh one); restoring one taken later puts it into the autoencoder that is there. Either way the state dict is
    the one restored, and the run goes on as the uninterrupted one; a state loaded into a fresh LGC and not used
    yet is its state dict too."""
    from distributed import same

    def worker(t):
        scheme = LGC(density=0.01, dense_steps=1, topk_steps=3)
        ex = GradientExchange(scheme, t)
        outs = [ex.exchange(SLOTS, grads(t.rank, 0), 0)]
        before = scheme.state_dict()
        ex.exchange(SLOTS, grads(t.rank, 1), 1)  # undone: its autoencoder was made and trained
        made = _trainer(scheme) is not None
        scheme.load_state_dict(before)
        checks = [made, _trainer(scheme) is None, same(scheme.state_dict(), before)]
        outs.append(ex.exchange(SLOTS, grads(t.rank, 1), 1))
        trainer, taken = _trainer(scheme), scheme.state_dict()
        ex.exchange(SLOTS, grads(t.rank, 2), 2)  # undone
        scheme.load_state_dict(taken)
        checks += [_trainer(scheme) is trainer, same(scheme.state_dict(), taken)]
        outs += [ex.exchange(SLOTS, grads(t.rank, s), s) for s in (2, 3)]
        fresh = LGC(density=0.01, dense_steps=1, topk_steps=3)
        fresh.load_state_dict(taken)
        checks.append(same(fresh.state_dict(), taken))
        return outs, checks

    with gradcomp.SimulatedCluster(2) as cluster:
        runs = cluster.run(worker)
    full = run_cluster(2, make(dense_steps=1), 4)
    for rank, (outs, checks) in enumerate(runs):
        assert all(checks), checks
        for step, out in enumerate(outs):
            assert all(torch.equal(a, b) for a, b in zip(out, full[rank][0][step]["out"])), (rank, step)


def test_a_loaded_buckets_residual_waits_through_ddps_first_pass():
    """Resumed under DDP, the first pass is one bucket again: the rebuilt buckets' loaded residuals must
    survive its retain until those buckets come back."""
    def worker(t):
        scheme = LGC(density=0.01, dense_steps=1, topk_steps=3)
        _passes(t, scheme, 3)
        state = scheme.state_dict()
        resumed = LGC(density=0.01, dense_steps=1, topk_steps=3)
        resumed.load_state_dict(state)
        ex = GradientExchange(resumed, t)
        g = grads(t.rank, 3)
        ex.exchange(SLOTS, g, 3)  # DDP's first pass after the restart: the whole model in one bucket
        resumed.retain(SLOTS)
        return state, resumed.state.state_dict()

    with gradcomp.SimulatedCluster(2) as cluster:
        runs = cluster.run(worker)
    for state, kept in runs:
        tail = "|".join(s.name for s in TAIL)
        key = next(k for k in state["residual"] if k.rpartition("#")[0] == tail)
        assert key in kept["residual"] and torch.equal(kept["residual"][key], state["residual"][key])
        assert kept["autoencoder"][key]["steps"] == state["autoencoder"][key]["steps"] > 0  # its autoencoder too


def test_every_buckets_residual_and_autoencoder_survive_the_passes():
    def worker(t):
        scheme = LGC(density=0.01, dense_steps=1, topk_steps=3)
        return _passes(t, scheme, 6), scheme

    with gradcomp.SimulatedCluster(2) as cluster:
        runs = cluster.run(worker)
    for history, scheme in runs:
        assert all(torch.equal(a, b) for out, ref in zip(history, runs[0][0]) for a, b in zip(out, ref))
        # the first pass's single bucket never came back: dropped; the two buckets kept across the passes
        assert set(scheme._layouts) == {tuple(s.name for s in TAIL), tuple(s.name for s in HEAD)}
        tail = _layout(scheme, TAIL)
        assert _trainer(scheme, TAIL).steps == 3 and len(tail.held_out) == 2
        state, names = scheme.state_dict(), "|".join(s.name for s in TAIL)
        # the dense bucket has no state; the compressed one's is keyed one way
        assert set(state["residual"]) == set(state["autoencoder"]) == set(state["synced"]) == {f"{names}#{tail.d}"}
    g = [grads(r, 5) for r in range(2)]
    for i in (0, 1, 4, 5):  # the model's first and last layer: the dense mean
        torch.testing.assert_close(runs[0][0][5][i], (g[0][i] + g[1][i]) / 2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", ["ring", "ps"])
def test_replicas_stay_identical_when_the_autoencoder_copies_differ(variant):
    """Copies trained with other rounding (another thread count, CUDA): worker 1's autoencoder is made to
    differ before stage 3 (step 3). Ring: every worker must decode the summed code with the same decoder, so
    rank 0's is sent; ps: the update is the server's broadcast, identical on every replica without any sync,
    and no decoder is sent (each copy keeps its own weights)."""

    def perturb(scheme, step):
        if step == 3 and scheme.rank == 1:
            with torch.no_grad():
                for p in _trainer(scheme).model.parameters():
                    p.mul_(1.01)

    def worker(t):
        scheme = LGC(variant=variant, density=0.01, dense_steps=1, topk_steps=2)
        ex = GradientExchange(scheme, t)
        history = []
        for step in range(5):
            perturb(scheme, step)
            history.append([o.clone() for o in ex.exchange(SLOTS, grads(t.rank, step), step)])
        trainer = _trainer(scheme)
        return history, [trainer.decoder_weights(i) for i in range(len(trainer.model.decoders))]

    with gradcomp.SimulatedCluster(3) as cluster:
        runs = cluster.run(worker)
    for history, _ in runs[1:]:
        for out, ref in zip(history, runs[0][0]):
            assert all(torch.equal(a, b) for a, b in zip(out, ref))
    if variant == "ring":
        assert all(torch.equal(decoders[0], runs[0][1][0]) for _, decoders in runs)
    else:
        assert not torch.equal(runs[1][1][0], runs[0][1][0])  # worker 1's copies were not overwritten


def test_a_peer_broadcast_is_the_roots_upload_and_a_server_broadcast_is_unchanged():
    def worker(t):
        booked = []
        for peer in (True, False):
            before = t.counter.snapshot()
            out = t.broadcast(torch.full((5,), float(t.rank)), 1, peer=peer)
            assert torch.equal(out, torch.ones(5))
            c = t.counter
            booked.append((c.up_payload - before.up_payload, c.down_payload - before.down_payload,
                           c.server_out - before.server_out))  # fmt: skip
        return booked

    with gradcomp.SimulatedCluster(3) as cluster:
        peer, server = zip(*cluster.run(worker))
    assert list(peer) == [(0, 20, 0), (20, 0, 0), (0, 20, 0)]
    assert list(server) == [(0, 20, 0), (0, 20, 60), (0, 20, 0)]


def test_autoencoder_state_is_a_copy_both_ways():
    from gradcomp.schemes.lgc_autoencoder import AutoencoderTrainer

    batch = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    trainer = AutoencoderTrainer()
    trainer.train_step(batch)
    taken = trainer.state_dict()
    kept = copy.deepcopy(taken)
    trainer.train_step(batch)  # training on must not change the state taken before
    assert _same_state(taken, kept)
    assert not _same_state(trainer.state_dict(), kept)
    other = AutoencoderTrainer(seed=1)
    other.load_state_dict(taken)
    other.train_step(batch)  # nor the state given to load_state_dict
    assert _same_state(taken, kept)
    assert other.steps == 2


def _same_state(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _ddp_worker(rank, world_size):
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomp.experiments.run.data import load_dataset, shard_indices
    from gradcomp.experiments.run.models import build_model

    data = load_dataset("synthetic")
    rows = shard_indices(data.num_train, rank, world_size, epoch=0, seed=0)
    out = {}
    for variant in ("ring", "ps"):
        model = build_model("cnn", data, seed=0)
        ddp = DDP(model, bucket_cap_mb=0.01)  # three buckets after DDP's rebuild (as in test_ddp_hook.py)
        scheme = gradcomp.make("lgc", variant=variant, density=0.01, dense_steps=1, topk_steps=2)
        state = gradcomp.register_ddp_hook(ddp, scheme)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(6):
            x, y = data.train_x[rows[16 * step : 16 * step + 16]], data.train_y[rows[16 * step : 16 * step + 16]]
            optimizer.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        state.wait()
        out[variant] = {
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "layouts": {key: (lay.d, getattr(scheme.state.get("autoencoder", lgc.list_slot(lay)), "steps", 0))
                        for key, lay in scheme._layouts.items()},  # fmt: skip
            "state": sorted(state.state_dict()["exchange"]["autoencoder"]),
        }
        state.close()
    return out


@pytest.mark.slow
def test_ddp_hook_with_several_buckets_keeps_every_buckets_autoencoder(single_thread):
    results = run_workers(_ddp_worker, 2, timeout=300)
    for variant in ("ring", "ps"):
        first, second = (r[variant] for r in results)
        assert torch.equal(first["params"], second["params"])
        layouts = first["layouts"]
        assert len(layouts) == 3  # DDP's rebuilt buckets; its first pass's single bucket was dropped
        # fc1 (in a bucket with fc2, the last layer, dense) and conv2's weight compressed, each with its own
        # autoencoder trained in both top-k passes; the bucket of conv2's bias and the first layer (conv1) is dense
        # (32 values left after the skip: too few for a code)
        assert sorted(layouts.values()) == [(0, 0), (12800, 2), (16512, 2)]
        assert first["state"] == sorted(f"{'|'.join(k)}#{d}" for k, (d, _) in layouts.items() if d)
