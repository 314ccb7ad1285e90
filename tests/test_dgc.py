"""Deep Gradient Compression (``dgc``): wire round trip, sampled-threshold selection against exact top-k,
momentum correction + masking by hand, warm-up, clipping, state, refusals, registration, simulated cluster."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from gradients import rank_order_mean, worker_gradients
from roundtrip import round_trip

import gradcomp
from gradcomp import ConfigError, Slot
from gradcomp.compressors.base import bind_worker, shared_seed
from gradcomp.compressors.dgc import DGC, WARMUP_DENSITIES, sample_count
from gradcomp.experiments.run.config import TrainConfig
from gradcomp.feedback import ErrorFeedback
from gradcomp.registry import parse_param_strings
from gradcomp.train.exchange import GradientExchange
from gradcomp.wire import encode
from wire_paths import device_path


def randn(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def sent_by(c, x, slot, step):
    return c.decompress(c.compress(x, slot, step), slot, step)


def expected_threshold(magnitude, density, sample, seed, step, index, worker):
    """The documented first tau, written out independently: of n_s uniform draws, the r-th largest, r = the
    expected number of top-k entries among them (n_s·k/d) plus 4 standard deviations plus 4; the k-th largest
    of all of |v| when n_s >= d."""
    d = magnitude.numel()
    k = math.ceil(Fraction(repr(density)) * d)
    n = max(math.ceil(Fraction(repr(sample)) * d), math.ceil(2 / Fraction(repr(density))))
    if n >= d:
        return torch.sort(magnitude, descending=True).values[k - 1]
    gen = torch.Generator().manual_seed(shared_seed(seed, step, index, f"dgc:{worker}"))
    samples = magnitude[torch.randint(d, (n,), generator=gen)]
    mean = n * k / d
    rank = min(n, math.ceil(mean + 4 * math.sqrt(mean) + 4))
    return torch.sort(samples, descending=True).values[rank - 1]


# ------------------------------------------------------------------------------------------ registration, wire


def test_registered_owns_momentum_and_defaults():
    c = gradcomp.make("dgc")
    assert type(c) is DGC and c.name == "dgc" and "dgc" in gradcomp.available()
    assert c.owns_momentum and DGC.owns_momentum and not c.summable and not c.unbiased
    assert c.params() == {
        "density": 0.001,
        "momentum": 0.9,
        "sample": 0.01,
        "clip": None,
        "warmup_steps": 0,
        "positions": "golomb",
        "seed": 0,
    }
    cfg = TrainConfig(compressor="dgc", params=parse_param_strings(["momentum=0.8", "clip=none"]))
    note = cfg.hand_momentum_to_method()
    assert note and "momentum" in note and cfg.momentum == 0.0
    compressor, _ = cfg.build_compressors()
    assert isinstance(compressor, DGC) and compressor.momentum == 0.8 and compressor.clip is None


@pytest.mark.parametrize("positions", ["golomb", "fixed"])
@pytest.mark.parametrize("params", [{}, {"density": 0.05, "warmup_steps": 2}, {"density": 1.0, "clip": 0.5}])
def test_wire_round_trip(positions, params):
    c = gradcomp.make("dgc", positions=positions, **params)
    gen = torch.Generator().manual_seed(1)
    for d in (1, 10, 257, 5000):
        slot = Slot(f"w{d}", d % 7, d)
        cases = [
            torch.randn(d, generator=gen),
            torch.randn(d, generator=gen) * 1e-30,
            torch.randn(d, generator=gen) * 1e30,
            torch.randn(d, generator=gen) * torch.logspace(-20, 20, d),
            torch.zeros(d),
            torch.where(torch.rand(d, generator=gen) < 0.5, torch.tensor(0.0), torch.tensor(-0.0)),
            torch.linspace(-3, 3, d, dtype=torch.float64),
        ]
        for step, x in enumerate(cases):
            before = x.clone()
            out = round_trip(c, x, slot, step)
            assert torch.equal(x, before)  # the input is never modified
            assert not (out[out.nonzero()] == 0).any()
    # a zero tensor sends nothing at all (a zero never travels)
    fresh = gradcomp.make("dgc", positions=positions, **params)
    positions_field, values = fresh.compress(torch.zeros(300), Slot("z", 0, 300), 0)
    assert positions_field.numel() == 0 and values.numel() == 0


def test_golomb_positions_are_the_smaller_default():
    slot = Slot("fc", 0, 200_704)  # SmallCNN's largest layer on MNIST
    x = randn(slot.numel, 3)
    sizes = {}
    for positions in ("golomb", "fixed"):
        c = gradcomp.make("dgc", positions=positions)
        fields, specs = c.compress(x, slot, 0), c.specs(slot)
        sizes[positions] = (encode(fields[:1], specs[:1]).numel(), encode(fields, specs).numel())
    assert sizes["golomb"][0] < 0.7 * sizes["fixed"][0]  # positions: ~12 bits against ceil(log2 d) = 18
    assert sizes["golomb"][1] < sizes["fixed"][1]


# ------------------------------------------------------------------------------------------------ selection


def exact_top_k(x, k):
    return torch.sort(torch.topk(x.abs(), k, sorted=False).indices).values


def counting_passes(monkeypatch):
    """Count the passes over |v| (calls of ``magnitude_candidates`` made by dgc's selection)."""
    import gradcomp.compressors.dgc as dgc_module

    calls = []
    original = dgc_module.magnitude_candidates
    monkeypatch.setattr(dgc_module, "magnitude_candidates", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    return calls


@pytest.mark.parametrize(("d", "density"), [(20_000, 0.001), (200_000, 0.001), (200_000, 0.01), (12_800, 0.001)])
def test_sends_exactly_the_top_k_on_gaussian_input_in_one_pass(d, density, monkeypatch):
    # before, the paper's threshold (the ceil(p·n_s)-th of ~2000 draws) let fewer than k through on about half
    # of these steps (mean sent/k 0.74 at d = 20k, as little as 0.05k on one step); now every step sends the
    # exact top-k, and the first tau (4 sigmas below) nearly always suffices: one pass over |v| per step
    passes = counting_passes(monkeypatch)
    k = math.ceil(density * d)
    slot = Slot("w", 3, d)
    for step in range(20):
        x = randn(d, 1000 + step)
        c = gradcomp.make("dgc", density=density, momentum=0.0)  # first step: v = g
        positions, values = c.compress(x, slot, step)
        assert torch.equal(positions, exact_top_k(x, k))  # sorted, exactly k, the top-k of |v|
        assert torch.equal(values, x[positions])
    assert len(passes) == 20


def test_too_few_candidates_lower_the_threshold_until_k_pass(monkeypatch):
    # the sampled entries are made the largest of the tensor, so the sample overestimates tau: the first tau
    # lets fewer than k through, and each lowered one too, down to the sample's smallest value (the distinct
    # sampled entries, fewer than k of them); then every nonzero entry is a candidate. Exactly k are sent.
    d, density = 1000, 0.1
    k = math.ceil(density * d)  # 100; n_s = max(10, 20) = 20 draws, first rank 12 (2 + 4·sqrt(2) + 4)
    slot = Slot("w", 2, d)
    passes = counting_passes(monkeypatch)
    for step in range(3):
        gen = torch.Generator().manual_seed(shared_seed(0, step, 2, "dgc:0"))
        picks = torch.randint(d, (20,), generator=gen)
        x = randn(d, 50 + step)
        x[picks] = 100.0 + torch.arange(20, dtype=torch.float32)
        tau = expected_threshold(x.abs(), density, 0.01, 0, step, 2, 0)
        assert int((x.abs() >= tau).sum()) < k  # the first tau is too high
        c = gradcomp.make("dgc", density=density, momentum=0.0)
        passes.clear()
        positions, values = c.compress(x, slot, step)
        assert torch.equal(positions, exact_top_k(x, k))
        assert torch.equal(values, x[positions])
        assert set(picks.tolist()) <= set(positions.tolist())
        assert len(passes) >= 3  # lowered step by step, then all nonzero entries


def test_one_lowering_suffices_when_the_first_tau_is_a_little_high(monkeypatch):
    # only the largest sampled entries are made large: the first tau falls among them and lets about r of
    # them through (r < k); the next tau (4r-th largest sample) is an ordinary value and lets enough through
    d, density = 200_000, 0.001
    k = math.ceil(density * d)  # 200; n_s = 2000 draws, first rank 12 (2 + 4·sqrt(2) + 4), then 48
    slot = Slot("w", 0, d)
    passes = counting_passes(monkeypatch)
    gen = torch.Generator().manual_seed(shared_seed(0, 5, 0, "dgc:0"))
    picks = torch.randint(d, (2000,), generator=gen)
    x = randn(d, 77)
    x[picks[:20]] = 50.0 + torch.arange(20, dtype=torch.float32)  # 20 huge entries, all in the sample
    tau = expected_threshold(x.abs(), density, 0.01, 0, 5, 0, 0)
    assert int((x.abs() >= tau).sum()) < k
    positions, values = gradcomp.make("dgc", momentum=0.0).compress(x, slot, 5)
    assert torch.equal(positions, exact_top_k(x, k)) and torch.equal(values, x[positions])
    assert len(passes) == 2


def test_fewer_nonzero_entries_than_k_sends_them_all():
    x = torch.zeros(50_000)
    x[torch.tensor([3, 999, 20_000, 49_999])] = torch.tensor([1e-30, -2.0, 3.0, -1e-3])
    positions, values = gradcomp.make("dgc", density=0.001, momentum=0.0).compress(x, Slot("w", 0, 50_000), 0)
    assert positions.tolist() == [3, 999, 20_000, 49_999] and torch.equal(values, x[positions])


def test_sample_is_seeded_by_seed_step_slot_and_worker():
    d = 20_000
    x = randn(d, 5) * torch.exp(randn(d, 6))

    def chosen(seed=0, step=0, index=0, worker=0):  # the sampled threshold (the selection may be exact top-k)
        c = gradcomp.make("dgc", density=0.01, sample=0.01, seed=seed)
        bind_worker(c, worker)
        tau = c.selector.threshold(x.abs(), Slot("w", index, d), step)
        assert tau == expected_threshold(x.abs(), 0.01, 0.01, seed, step, index, worker)
        return tau

    base = chosen()
    assert torch.equal(base, chosen())  # reproducible
    for other in (chosen(seed=1), chosen(step=1), chosen(index=1), chosen(worker=1)):
        assert not torch.equal(base, other)


def test_sample_size_has_a_floor_of_two_kept_values():
    # n_s = max(ceil(sample·d), ceil(2 / p)): at p = 0.001 and d = 100k, 2000 draws (not 1000) keep 2 values
    d = 100_000
    x = randn(d, 8) * torch.exp(randn(d, 9))
    assert sample_count(0.001, 0.01, d) == 2000 and sample_count(0.001, 0.05, d) == 5000
    assert sample_count(1.0, 0.01, d) == d
    c = gradcomp.make("dgc")
    for step in range(3):
        tau = c.selector.threshold(x.abs(), Slot("w", 0, d), step)
        assert tau == expected_threshold(x.abs(), 0.001, 0.01, 0, step, 0, 0)


def test_full_sample_is_exact_top_k():
    # n_s >= d: the "sample" is all of |v|, so exactly k values are sent whatever the step
    x = randn(1000, 2)
    c = gradcomp.make("dgc", density=0.01, sample=1.0, momentum=0.0)
    positions, _ = c.compress(x, Slot("w", 0, 1000), 7)
    assert torch.equal(positions, torch.sort(torch.topk(x.abs(), 10).indices).values)


# ------------------------------------------------------------------------------ momentum correction + masking


def test_momentum_correction_and_masking_by_hand():
    d, k, m = 400, 20, 0.5
    slot = Slot("w", 0, d)
    c = gradcomp.make("dgc", density=k / d, sample=1.0, momentum=m)  # sample = 1: exact top-k
    u, v = torch.zeros(d), torch.zeros(d)
    for step in range(6):
        g = randn(d, 100 + step)
        u = m * u + g
        v = v + u
        top = torch.sort(v.abs(), descending=True, stable=True).indices[:k]
        sent = sent_by(c, g, slot, step)
        assert set(sent.nonzero().reshape(-1).tolist()) == set(top.tolist())
        torch.testing.assert_close(sent[top], v[top], rtol=0, atol=0)
        v[top] = 0
        u[top] = 0  # momentum factor masking
        torch.testing.assert_close(c.accumulated["w#400"], v, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(c.velocity["w#400"], u, rtol=1e-6, atol=1e-6)


def test_with_everything_sent_masking_leaves_no_momentum():
    # density 1 sends all of v every step, so masking resets every coordinate's momentum: what is sent is g
    c = gradcomp.make("dgc", density=1.0, momentum=0.9)
    slot = Slot("p", 0, 300)
    for step in range(4):
        g = randn(300, step)
        assert torch.equal(sent_by(c, g, slot, step), g)
        assert not c.velocity["p#300"].any() and not c.accumulated["p#300"].any()


# ------------------------------------------------------------------------------------------ warm-up, clipping


def test_warmup_densities_per_stage():
    d, w = 10_000, 3
    c = gradcomp.make("dgc", warmup_steps=w, sample=1.0)  # exact top-k: the count is k = ceil(p·d)
    expected = [p for p in WARMUP_DENSITIES for _ in range(w)] + [0.001] * 4
    assert expected[:12:3] == [0.25, 0.0625, 0.015625, 0.004]
    slot = Slot("w", 0, d)
    for step, p in enumerate(expected):
        assert c.density_at(step) == p
        positions, _ = c.compress(randn(d, step), slot, step)
        assert positions.numel() == math.ceil(Fraction(repr(p)) * d)
    assert [gradcomp.make("dgc").density_at(s) for s in (0, 100)] == [0.001, 0.001]
    # a warm-up stage never goes below the target density
    big = gradcomp.make("dgc", density=0.1, warmup_steps=2)
    assert [big.density_at(s) for s in range(6)] == [0.25, 0.25, 0.1, 0.1, 0.1, 0.1]


def test_clipping_bounds_each_tensor_before_accumulation():
    a, b = Slot("a", 0, 500), Slot("b", 1, 50)
    ga, gb = randn(500, 1) * 10, randn(50, 2) * 1e-3  # norms ~220 and ~0.007
    c = gradcomp.make("dgc", density=1.0, clip=2.0, momentum=0.5)
    sa = sent_by(c, ga, a, 0)
    assert float(sa.norm()) == pytest.approx(2.0, rel=1e-5)
    torch.testing.assert_close(sa, ga * (2.0 / float(ga.double().norm())))  # scaled, direction kept
    assert torch.equal(sent_by(c, gb, b, 0), gb)  # within the bound: untouched, per tensor
    # the clipped gradient is what enters the momentum and the accumulation (by hand, exact top-1)
    c = gradcomp.make("dgc", density=1 / 500, sample=1.0, clip=2.0, momentum=0.5)
    u, v = torch.zeros(500), torch.zeros(500)
    for step in range(3):
        g = randn(500, 3 + step) * 10
        u = 0.5 * u + g * (2.0 / float(g.double().norm()))
        v = v + u
        top = torch.argmax(v.abs())
        sent = sent_by(c, g, a, step)
        assert sent.nonzero().reshape(-1).tolist() == [int(top)]
        torch.testing.assert_close(sent[top], v[top], rtol=1e-6, atol=0)
        u[top], v[top] = 0, 0
        torch.testing.assert_close(c.velocity["a#500"], u, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c.accumulated["a#500"], v, rtol=1e-5, atol=1e-6)
    unclipped = gradcomp.make("dgc", density=1.0, momentum=0.5)
    assert torch.equal(sent_by(unclipped, ga, a, 0), ga)
    # huge entries do not overflow the norm (computed in float64)
    huge = torch.full((10,), 1e30)
    assert float(sent_by(gradcomp.make("dgc", density=1.0, clip=1.0), huge, Slot("h", 2, 10), 0).norm()) == (
        pytest.approx(1.0, rel=1e-5)
    )


# ------------------------------------------------------------------------------------------ state, refusals


def test_state_round_trip_continues_identically():
    slots = [Slot("w", 0, 3000), Slot("b", 1, 40)]
    stream = [[randn(s.numel, 10 * t + s.index) for s in slots] for t in range(6)]
    params = {"density": 0.01, "clip": 5.0, "warmup_steps": 2}
    c = gradcomp.make("dgc", **params)
    for t in range(3):
        for s, g in zip(slots, stream[t]):
            c.compress(g, s, t)
    other = gradcomp.make("dgc", **params)
    other.load_state_dict(c.state_dict())
    for t in range(3, 6):
        for s, g in zip(slots, stream[t]):
            for x, y in zip(c.compress(g, s, t), other.compress(g, s, t)):
                assert torch.equal(x, y)
    assert set(c.state_dict()["velocity"]) == {"w#3000", "b#40"}
    c.retain(slots[:1])
    assert set(c.state_dict()["velocity"]) == set(c.state_dict()["accumulated"]) == {"w#3000"}
    with pytest.raises(ConfigError, match="keys"):
        other.load_state_dict({"residuals": {}})


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"density": 0.0}, "density"),
        ({"density": 1.5}, "density"),
        ({"density": "0.1"}, "density"),
        ({"sample": 0.0}, "sample"),
        ({"sample": 2.0}, "sample"),
        ({"sample": True}, "sample"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 1.5}, "warmup_steps"),
        ({"clip": 0.0}, "clip"),
        ({"clip": -1.0}, "clip"),
        ({"clip": float("inf")}, "clip"),
        ({"clip": True}, "clip"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"positions": "int64"}, "positions"),
        ({"seed": -1}, "seed"),
        ({"nesterov": True}, "no parameter"),
    ],
)
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(ConfigError, match=match):
        gradcomp.make("dgc", **params)


# ------------------------------------------------------------------------------------------ simulated cluster


def test_simulated_cluster_keeps_replicas_identical():
    world, sizes = 3, [5000, 300, 7]
    slots = [Slot(f"p{i}", i, n) for i, n in enumerate(sizes)]
    params = {"density": 0.01, "warmup_steps": 1}

    def worker(t):
        ex = GradientExchange(gradcomp.make("dgc", **params), t)
        return [[o.clone() for o in ex.exchange(slots, worker_gradients(t.rank, s, sizes, 10), s)] for s in range(3)]

    with gradcomp.SimulatedCluster(world, timeout=60) as cluster:
        runs = cluster.run(worker)
    references = []
    for r in range(world):
        ref = gradcomp.make("dgc", **params)
        bind_worker(ref, r)
        references.append(ref)
    for s in range(3):
        for i, slot in enumerate(slots):
            per_worker = [sent_by(references[r], worker_gradients(r, s, sizes, 10)[i], slot, s) for r in range(world)]
            for r in range(world):
                assert torch.equal(runs[r][s][i], runs[0][s][i])  # identical replicas
            torch.testing.assert_close(runs[0][s][i], rank_order_mean(per_worker), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "extra", [{"error_feedback": True}, {"feedback": "residual"}, {"feedback": "momentum_masking"}]
)
def test_a_second_residual_on_top_of_dgcs_own_is_refused(extra):
    with pytest.raises(ConfigError, match="keeps its own residual"):
        gradcomp.make("dgc", **extra)
    with pytest.raises(ConfigError, match="keeps its own residual"):
        gradcomp.make("dgc+cnat", **extra)
    assert not isinstance(gradcomp.make("dgc", feedback="none"), ErrorFeedback)


def test_the_device_selection_helpers_match_boolean_indexing(monkeypatch):
    """``sparse.compact`` gives torch.nonzero's indices with a size known beforehand, and keep_largest's torch path
    (the one a GPU runs: one read, no boolean indexing) keeps what boolean indexing kept, refusing ties and NaN."""
    from gradcomp.compressors import sparse

    g = torch.Generator().manual_seed(3)
    for n, p in [(1, 0.5), (17, 0.0), (17, 1.0), (1000, 0.1), (4096, 0.7)]:
        mask = torch.rand(n, generator=g) < p
        assert torch.equal(sparse.compact(mask, int(mask.sum())), torch.nonzero(mask).reshape(-1))
    monkeypatch.setattr(sparse, "_numpy_path", lambda t: False)
    positions = torch.randperm(10000, generator=g)[:500].sort().values
    scores = torch.rand(500, generator=g)
    got = sparse.keep_largest(positions, scores, 40)
    keep = scores >= scores.topk(40).values[-1]
    assert torch.equal(got[0], positions[keep]) and torch.equal(got[1], scores[keep])
    tied = scores.clone()
    tied[scores.topk(41).indices[-2:]] = 1.5  # the 40th and 41st largest now tie
    tied[scores.topk(39).indices] = 2.0
    assert sparse.keep_largest(positions, tied, 40) is None
    nan = scores.clone()
    nan[7] = float("nan")
    assert sparse.keep_largest(positions, nan, 40) is None


def test_dgc_compresses_a_bucket_with_two_reads(monkeypatch):
    """compress_slots on the device path: the messages and momentum state of compress slot by slot, step after
    step, with the candidates' counts of all slots read at once and keep_largest's conditions of all slots at
    once (2 reads for 4 slots), also where a slot's k-th largest is tied (torch.topk's pick, as select)."""
    from sync_counting import counting

    device_path(monkeypatch)
    batched, single = DGC(density=0.01), DGC(density=0.01)
    slots = [Slot("a", 0, 20_000), Slot("b", 1, 5000), Slot("c", 2, 300), Slot("d", 3, 8000)]
    g = torch.Generator().manual_seed(9)
    for step in range(4):
        xs = [torch.randn(s.numel, generator=g) for s in slots]
        xs[3][:200] = 5.0  # 200 tied largest entries where k = 80: the tie goes to torch.topk
        with counting() as counter:
            got = batched.compress_slots(xs, slots, step)
        expected = [single.compress(x, s, step) for x, s in zip(xs, slots)]
        for a, b in zip(got, expected):
            assert all(torch.equal(u, v) for u, v in zip(a, b))
        for s in slots:
            assert torch.equal(batched.velocity[f"{s.name}#{s.numel}"], single.velocity[f"{s.name}#{s.numel}"])
            assert torch.equal(batched.accumulated[f"{s.name}#{s.numel}"], single.accumulated[f"{s.name}#{s.numel}"])
        assert counter.total <= 2, counter
