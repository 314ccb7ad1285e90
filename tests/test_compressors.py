"""Tests for the built-in compressors (none, fp16, bf16, topk, randomk, threshold).

Every compressor must survive the wire bit-exactly: compress → encode → decode → decompress gives exactly the
tensor that compress → decompress gives. Then each compressor's own contract: top-k keeps the k = ceil(p·d)
largest magnitudes, random-k draws shared, non-repeating positions (unbiased when scaled), threshold keeps
|x| > tau, fp16 saturates, and bad parameters raise ConfigError at construction.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from roundtrip import f32_bits as bits
from roundtrip import round_trip

import gradcomp
from gradcomp import ConfigError, Slot
from gradcomp.compressors import BFloat16, Float16, NoCompression, RandomK, Threshold, TopK
from gradcomp.compressors.base import accumulate, kept_count
from gradcomp.wire import HEADER_BYTES, SECTION_HEADER_BYTES, bits_needed, encode

NAMES = ["none", "fp16", "bf16", "topk", "randomk", "threshold"]

# Parameter sets per compressor used for the round-trip tests (both position codecs for the sparse ones).
CONFIGS = [
    ("none", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("topk", {"density": 0.1}),
    ("topk", {"density": 0.1, "positions": "golomb"}),
    ("topk", {"density": 0.01}),
    ("topk", {"density": 1.0}),
    ("topk", {"density": 1.0, "positions": "golomb"}),
    ("randomk", {"density": 0.1}),
    ("randomk", {"density": 0.1, "scale": True, "seed": 7}),
    ("randomk", {"density": 1.0}),
    ("threshold", {"threshold": 0.5}),
    ("threshold", {"threshold": 0.5, "positions": "golomb"}),
    ("threshold", {"threshold": 1e-3}),
]
CONFIG_IDS = [name + "".join(f"-{k}={v}" for k, v in params.items()) for name, params in CONFIGS]


def inputs(d: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "normal": torch.randn(d, generator=g),
        "tiny": torch.randn(d, generator=g) * 1e-30,
        "huge": torch.randn(d, generator=g) * 1e30,
        "mixed": torch.randn(d, generator=g) * torch.logspace(-20, 20, d),
        "signed-zeros": torch.where(torch.rand(d, generator=g) < 0.5, torch.tensor(0.0), torch.tensor(-0.0)),
    }


# ----------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_random_tensors(name, params, seed):
    c = gradcomp.make(name, **params)
    for d in (1000, 257):
        for kind, x in inputs(d, seed * 100 + d).items():
            for step in (0, 3):
                round_trip(c, x, Slot(f"{kind}", 5, d), step)


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=CONFIG_IDS)
def test_round_trip_edge_cases(name, params):
    c = gradcomp.make(name, **params)
    cases = {
        "one": torch.tensor([-2.5]),
        "one-zero": torch.zeros(1),
        "zeros": torch.zeros(100),
        "ones": torch.ones(64),
        "two-d": torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5.5,  # compressors flatten
        "float64": torch.linspace(-3, 3, 50, dtype=torch.float64),
        "float16": torch.linspace(-3, 3, 50).to(torch.float16),
        "empty": torch.zeros(0),
    }
    for label, x in cases.items():
        out = round_trip(c, x, Slot(label, 0, x.numel()))
        assert out.numel() == x.numel(), label


@pytest.mark.parametrize(("name", "params"), CONFIGS, ids=CONFIG_IDS)
def test_accumulate_adds_the_decompressed_message(name, params):
    c = gradcomp.make(name, **params)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, generator=g)
    slot = Slot("w", 2, 300)
    fields = c.compress(x, slot, 4)
    out = torch.randn(300, generator=g)
    expected = out + c.decompress(fields, slot, 4)
    accumulate(c, fields, slot, 4, out)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_compress_does_not_modify_its_input(name):
    c = gradcomp.make(name)
    x = torch.randn(500, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    fields = c.compress(x, Slot("w", 0, 500), 0)
    c.decompress(fields, Slot("w", 0, 500), 0)
    assert torch.equal(x, before)


# ----------------------------------------------------------------------------------------------- dense


def test_none_is_exact():
    x = inputs(300, 1)["mixed"]
    out = round_trip(NoCompression(), x, Slot("w", 0, 300))
    assert torch.equal(bits(out), bits(x))
    x64 = torch.randn(10, dtype=torch.float64)
    assert torch.equal(round_trip(NoCompression(), x64, Slot("w", 0, 10)), x64.to(torch.float32))


def test_fp16_is_a_cast_within_range():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 100
    out = round_trip(Float16(), x, Slot("w", 0, 1000))
    assert torch.equal(out, x.to(torch.float16).to(torch.float32))
    assert not torch.equal(out, x)  # it does lose precision


def test_fp16_saturates_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 65504.0, -65504.0, 65519.0, 65520.0, -70000.0, 3.4e38, -3.4e38, 1.0])
    out = round_trip(Float16(), x, Slot("w", 0, x.numel()))
    assert torch.isfinite(out).all()
    expected = torch.tensor([65504.0, -65504.0, 65504.0, -65504.0, 65504.0, 65504.0, -65504.0, 65504.0, -65504.0, 1.0])
    assert torch.equal(out, expected)
    # float64 input beyond even float32's range saturates as well
    x64 = torch.tensor([1e300, -1e300], dtype=torch.float64)
    assert torch.equal(round_trip(Float16(), x64, Slot("w", 0, 2)), torch.tensor([65504.0, -65504.0]))


def test_fp16_saturates_bfloat16_input():
    x = torch.tensor([1e6, -1e6, 7e4], dtype=torch.bfloat16)
    out = Float16().decompress(Float16().compress(x, Slot("w", 0, 3), 0), Slot("w", 0, 3), 0)
    assert torch.equal(out, torch.tensor([65504.0, -65504.0, 65504.0]))


def test_bf16_is_a_cast_that_keeps_fp32_range():
    x = inputs(1000, 4)["mixed"]
    out = round_trip(BFloat16(), x, Slot("w", 0, 1000))
    assert torch.equal(out, x.to(torch.bfloat16).to(torch.float32))
    big = torch.tensor([1e30, -1e-30, 1e38])
    out = round_trip(BFloat16(), big, Slot("w", 0, 3))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, big, rtol=2**-8, atol=0)


@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_dense_wire_size(name):
    per_value = {"none": 4, "fp16": 2, "bf16": 2}[name]
    d = 1001
    c = gradcomp.make(name)
    buf = encode(c.compress(torch.randn(d), Slot("w", 0, d), 0), c.specs(Slot("w", 0, d)))
    assert buf.numel() == HEADER_BYTES + SECTION_HEADER_BYTES + per_value * d


# ----------------------------------------------------------------------------------------------- top-k


@pytest.mark.parametrize(
    ("density", "d", "k"),
    [
        (0.01, 1000, 10),
        (0.01, 1001, 11),
        (0.1, 7, 1),
        (0.5, 7, 4),
        (1.0, 13, 13),
        (1e-9, 10, 1),
        (0.25, 1, 1),
        (0.001, 100_000, 100),
        (0.3, 10, 3),
    ],
)
def test_topk_count_is_ceil_p_d(density, d, k):
    assert k == max(1, math.ceil(Fraction(str(density)) * d))  # the reference is decimal arithmetic
    assert kept_count(density, d) == k
    c = TopK(density)
    slot = Slot("w", 0, d)
    positions, values = c.compress(torch.randn(d), slot, 0)
    assert positions.numel() == k and values.numel() == k


@pytest.mark.parametrize(("density", "d", "k"), [(0.07, 100, 7), (0.55, 100, 55), (0.0079, 1_000_000, 7900)])
def test_topk_count_exact_decimal_products(density, d, k):
    assert kept_count(density, d) == k


@pytest.mark.parametrize("positions", ["fixed", "golomb"])
@pytest.mark.parametrize(("d", "density"), [(1000, 0.01), (1000, 0.1), (4097, 0.05), (50, 1.0), (1, 0.5)])
def test_topk_keeps_exactly_the_k_largest_magnitudes(positions, d, density):
    c = TopK(density, positions=positions)
    k = kept_count(density, d)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        # distinct magnitudes with random signs, so "the k largest" is unique
        mags = torch.randperm(d, generator=g).to(torch.float32) + 1.0
        x = mags * torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0) * 0.001
        slot = Slot("w", 0, d)
        pos, vals = c.compress(x, slot, seed)
        assert pos.numel() == k
        assert bool((pos[1:] > pos[:-1]).all()), "positions must be strictly increasing"
        expected = torch.sort(torch.argsort(x.abs(), descending=True)[:k]).values
        assert torch.equal(pos.to(torch.int64), expected)
        assert torch.equal(vals, x[expected])
        out = round_trip(c, x, slot, seed)
        dense = torch.zeros(d)
        dense[expected] = x[expected]
        assert torch.equal(out, dense)


def test_topk_density_one_is_lossless():
    x = torch.randn(333)
    for positions in ("fixed", "golomb"):
        assert torch.equal(round_trip(TopK(1.0, positions), x, Slot("w", 0, 333)), x)


def test_topk_all_zeros_and_ties():
    c = TopK(0.1)
    out = round_trip(c, torch.zeros(100), Slot("w", 0, 100))
    assert torch.equal(out, torch.zeros(100))
    # ties: any k of the equal magnitudes, but exactly k, values kept with their sign
    x = torch.tensor([1.0, -1.0] * 50)
    pos, vals = c.compress(x, Slot("w", 0, 100), 0)
    assert pos.numel() == 10 and pos.unique().numel() == 10
    assert torch.equal(vals, x[pos])


@pytest.mark.parametrize("d", [1_000_000])
def test_topk_positions_are_bit_packed(d):
    density = 0.01
    k = kept_count(density, d)
    x = torch.randn(d, generator=torch.Generator().manual_seed(0))
    slot = Slot("w", 0, d)
    fixed = TopK(density)
    buf = encode(fixed.compress(x, slot, 0), fixed.specs(slot))
    width = bits_needed(d)
    assert width == 20
    expected = HEADER_BYTES + 2 * SECTION_HEADER_BYTES + (k * width + 7) // 8 + 4 * k
    assert buf.numel() == expected
    assert buf.numel() < k * (8 + 4)  # never int64 positions
    assert buf.numel() < k * (4 + 4)  # not even int32

    golomb = TopK(density, positions="golomb")
    gbuf = encode(golomb.compress(x, slot, 0), golomb.specs(slot))
    assert gbuf.numel() < buf.numel()  # Rice-coded gaps at 1% density beat 20-bit positions
    torch.testing.assert_close(round_trip(golomb, x, slot), round_trip(fixed, x, slot), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------- random-k


def test_randomk_positions_shared_between_instances():
    d = 1000
    slot = Slot("w", 3, d)
    a, b = RandomK(0.05, seed=11), RandomK(0.05, seed=11)
    for step in range(5):
        pa, pb = a.positions(slot, step, torch.device("cpu")), b.positions(slot, step, torch.device("cpu"))
        assert torch.equal(pa, pb)
        # the positions do not depend on the data, and compress picks exactly them
        x = torch.arange(1, d + 1, dtype=torch.float32)
        assert torch.equal(a.compress(x, slot, step)[0], x[pa])
        assert torch.equal(b.compress(-x, slot, step)[0], -x[pb])
        # the slot name does not matter, only (seed, step, index)
        assert torch.equal(pa, b.positions(Slot("other-name", 3, d), step, torch.device("cpu")))


def test_randomk_positions_change_with_step_seed_and_index():
    d, density = 1000, 0.05
    cpu = torch.device("cpu")
    base = RandomK(density, seed=1).positions(Slot("w", 0, d), 0, cpu)
    others = [
        RandomK(density, seed=1).positions(Slot("w", 0, d), 1, cpu),  # next step
        RandomK(density, seed=2).positions(Slot("w", 0, d), 0, cpu),  # other run seed
        RandomK(density, seed=1).positions(Slot("w", 1, d), 0, cpu),  # other tensor
    ]
    for p in others:
        assert not torch.equal(p, base)
    steps = [RandomK(density, seed=1).positions(Slot("w", 0, d), s, cpu) for s in range(20)]
    assert len({tuple(p.tolist()) for p in steps}) == 20


@pytest.mark.parametrize(("d", "density"), [(1000, 0.05), (10, 0.5), (7, 1.0), (1, 0.01), (100, 0.999)])
def test_randomk_positions_never_repeat(d, density):
    c = RandomK(density)
    k = kept_count(density, d)
    for step in range(30):
        p = c.positions(Slot("w", 0, d), step, torch.device("cpu"))
        assert p.numel() == k
        assert p.dtype == torch.int64
        assert bool((p[1:] > p[:-1]).all())  # sorted and unique
        assert int(p.min()) >= 0 and int(p.max()) < d


def test_randomk_unscaled_keeps_values_as_they_are():
    d = 200
    x = torch.randn(d, generator=torch.Generator().manual_seed(5))
    c = RandomK(0.1, scale=False)
    assert c.unbiased is False and c.omega is None
    slot = Slot("w", 0, d)
    for step in range(5):
        out = round_trip(c, x, slot, step)
        p = c.positions(slot, step, torch.device("cpu"))
        expected = torch.zeros(d)
        expected[p] = x[p]
        assert torch.equal(out, expected)


def test_randomk_scaled_multiplies_by_d_over_k():
    d = 200
    x = torch.randn(d, generator=torch.Generator().manual_seed(5))
    c = RandomK(0.1, scale=True)
    assert c.unbiased is True
    assert c.omega == pytest.approx(1 / 0.1 - 1)
    k = kept_count(0.1, d)
    slot = Slot("w", 0, d)
    out = round_trip(c, x, slot, 2)
    p = c.positions(slot, 2, torch.device("cpu"))
    expected = torch.zeros(d)
    expected[p] = x[p] * (d / k)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)


def _mean_and_stderr(c: RandomK, x: torch.Tensor, draws: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    slot = Slot("w", 0, x.numel())
    samples = torch.stack([c.decompress(c.compress(x, slot, step), slot, step) for step in range(draws)])
    mean = samples.mean(0)
    stderr = samples.std(0) / math.sqrt(draws)  # empirical standard error of each entry's mean
    return mean, stderr, kept_count(c.density, x.numel())


def test_randomk_scaled_is_unbiased():
    d, draws = 24, 3000
    x = torch.linspace(-2.0, 3.0, d)
    mean, stderr, k = _mean_and_stderr(RandomK(0.25, scale=True, seed=3), x, draws)
    # analytic standard error of the mean: |x_i| * sqrt((d/k - 1) / draws); the empirical one must agree
    analytic = x.abs() * math.sqrt((d / k - 1) / draws)
    nonzero = x != 0
    torch.testing.assert_close(stderr[nonzero], analytic[nonzero], rtol=0.15, atol=0)
    z = (mean - x).abs() / analytic.clamp_min(1e-12)
    assert float(z[nonzero].max()) < 4.5, f"max z-score {float(z.max()):.2f}"
    # the whole-vector relative error is consistent with unbiasedness too
    assert float((mean - x).norm() / x.norm()) < 4 * math.sqrt((d / k - 1) / draws)


def test_randomk_unscaled_is_biased_towards_zero():
    d, draws = 24, 3000
    x = torch.linspace(-2.0, 3.0, d)
    c = RandomK(0.25, scale=False, seed=3)
    mean, _, k = _mean_and_stderr(c, x, draws)
    p = k / d
    analytic = x.abs() * math.sqrt(p * (1 - p) / draws)
    nonzero = x != 0
    # E[C(x)] = (k/d) x for the unscaled variant
    z = (mean - p * x).abs() / analytic.clamp_min(1e-12)
    assert float(z[nonzero].max()) < 4.5
    # and that is far from x: the bias is many standard errors wide for every entry with |x_i| >= 0.5
    big = x.abs() >= 0.5
    assert bool(((mean - x).abs()[big] > 10 * analytic[big]).all())


def test_randomk_summable_messages_add():
    d = 300
    c = RandomK(0.1, scale=True, seed=4)
    slot = Slot("w", 0, d)
    xs = [torch.randn(d, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    msgs = [c.compress(x, slot, 9) for x in xs]
    summed = [sum(m[0] for m in msgs)]
    torch.testing.assert_close(
        c.decompress(summed, slot, 9), sum(c.decompress(m, slot, 9) for m in msgs), rtol=1e-6, atol=1e-6
    )


# ----------------------------------------------------------------------------------------------- threshold


@pytest.mark.parametrize("positions", ["fixed", "golomb"])
def test_threshold_keeps_exactly_above_tau(positions):
    tau = 0.5
    above = float(torch.nextafter(torch.tensor(tau), torch.tensor(1.0)))  # next float32 above tau
    x = torch.tensor([tau, -tau, above, -above, 0.0, 0.49, -0.51, 7.0, -0.0, 0.5000001])
    c = Threshold(tau, positions=positions)
    slot = Slot("w", 0, x.numel())
    pos, vals = c.compress(x, slot, 0)
    assert pos.tolist() == [2, 3, 6, 7, 9]
    assert torch.equal(vals, x[pos])
    out = round_trip(c, x, slot)
    assert torch.equal(out, torch.where(x.abs() > tau, x, torch.zeros(())))


@pytest.mark.parametrize("positions", ["fixed", "golomb"])
def test_threshold_random(positions):
    c = Threshold(1.0, positions=positions)
    for seed in range(3):
        x = torch.randn(2000, generator=torch.Generator().manual_seed(seed))
        out = round_trip(c, x, Slot("w", 0, 2000), seed)
        assert torch.equal(out, torch.where(x.abs() > 1.0, x, torch.zeros(())))
    # nothing above the threshold: an empty message; everything above: lossless
    assert torch.equal(round_trip(c, torch.full((10,), 0.5), Slot("w", 0, 10)), torch.zeros(10))
    x = torch.full((10,), -3.0)
    assert torch.equal(round_trip(c, x, Slot("w", 0, 10)), x)


def test_threshold_compresses_a_bucket_with_one_read(monkeypatch):
    """compress_slots on the torch path (a GPU's): the messages of compress, slot by slot, with the slots' counts
    read back together once (sync_counting), not once per slot; empty and all-kept slots included."""
    from sync_counting import counting

    from gradcomp.compressors import sparse

    monkeypatch.setattr(sparse, "_numpy_path", lambda t: False)
    c = Threshold(1.0)
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(500, generator=g), torch.full((7,), 0.5), torch.full((3,), -2.0), torch.randn(64, generator=g)]
    slots = [Slot(f"s{i}", i, x.numel()) for i, x in enumerate(xs)]
    with counting() as counter:
        got = c.compress_slots(xs, slots, 0)
    assert counter.total == 1, counter
    for fields, x, slot in zip(got, xs, slots):
        expected = c.compress(x, slot, 0)
        assert all(torch.equal(a, b) for a, b in zip(fields, expected))


# ----------------------------------------------------------------------------------------------- bad parameters


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, gradcomp.GradcompError)


@pytest.mark.parametrize("name", ["topk", "randomk"])
@pytest.mark.parametrize("density", [0, 0.0, -0.1, 1.5, 1.0000001, float("nan"), float("inf"), -float("inf")])
def test_bad_density_raises(name, density):
    with pytest.raises(ConfigError):
        gradcomp.make(name, density=density)
    cls = {"topk": TopK, "randomk": RandomK}[name]
    with pytest.raises(ConfigError):
        cls(density=density)


@pytest.mark.parametrize("threshold", [0, 0.0, -1e-9, -1.0, float("nan"), float("inf")])
def test_bad_threshold_raises(threshold):
    with pytest.raises(ConfigError):
        gradcomp.make("threshold", threshold=threshold)
    with pytest.raises(ConfigError):
        Threshold(threshold)


@pytest.mark.parametrize("name", ["topk", "threshold"])
@pytest.mark.parametrize("positions", ["zip", "", "FIXED", "int64"])
def test_bad_positions_codec_raises(name, positions):
    with pytest.raises(ConfigError):
        gradcomp.make(name, positions=positions)


def test_unknown_compressor_and_parameter_raise():
    with pytest.raises(ConfigError, match="unknown compressor"):
        gradcomp.make("top-k")
    with pytest.raises(ConfigError):
        gradcomp.make("")
    with pytest.raises(ConfigError, match="densty"):
        gradcomp.make("topk", densty=0.1)
    with pytest.raises(ConfigError):
        gradcomp.make("threshold", density=0.1)
    for name in ("none", "fp16", "bf16"):
        with pytest.raises(ConfigError):
            gradcomp.make(name, density=0.1)
    with pytest.raises(ConfigError):
        gradcomp.make("topk", density="lots")


@pytest.mark.parametrize("density", [1e-6, 0.01, 0.5, 1.0])
def test_good_densities_are_accepted(density):
    assert gradcomp.make("topk", density=density).density == density
    assert gradcomp.make("randomk", density=density).density == density


@pytest.mark.parametrize("name", ["topk", "randomk"])
def test_fixed_k_larger_than_the_tensor_is_refused_before_sending(name):
    c = gradcomp.make(name, k=11)
    slot = Slot("net.3.bias", 3, 10)
    with pytest.raises(gradcomp.ConfigError, match="k=11 exceeds the 10 elements of net.3.bias"):
        c.compress(torch.randn(10), slot, 0)
    with pytest.raises(gradcomp.ConfigError):
        c.specs(slot)
    ok = gradcomp.make(name, k=10)
    fields = ok.compress(torch.randn(10), slot, 0)
    assert fields[-1].numel() == 10


def test_bf16_saturates_instead_of_overflowing():
    x = torch.tensor([3.4e38, -3.4e38, 1.0])
    fields = BFloat16().compress(x, Slot("w", 0, 3), 0)
    assert torch.isfinite(fields[0]).all()
    assert fields[0][0] == torch.finfo(torch.bfloat16).max and fields[0][2] == 1.0


def test_sample_without_replacement_is_uniform_and_distinct():
    from gradcomp.compressors.sparse import sample_without_replacement

    n, k, draws = 50, 5, 4000
    counts = torch.zeros(n)
    gen = torch.Generator().manual_seed(3)
    for _ in range(draws):
        chosen = sample_without_replacement(n, k, gen, torch.device("cpu"))
        assert chosen.numel() == k and chosen.unique().numel() == k
        counts[chosen] += 1
    expected = draws * k / n  # 400 per position; binomial sd ~ 19
    assert (counts - expected).abs().max() < 5 * (expected * (1 - k / n)) ** 0.5
    # chi-square with 49 degrees of freedom stays well below its 0.1 % tail (~86)
    assert float(((counts - expected) ** 2 / expected).sum()) < 86


def test_randomblock_is_one_shared_contiguous_block_that_wraps():
    c, twin = gradcomp.make("randomblock", density=0.1, seed=4), gradcomp.make("randomblock", density=0.1, seed=4)
    slot = Slot("w", 5, 100)
    x = torch.arange(1.0, 101.0)
    starts = set()
    for step in range(200):
        out = c.decompress(c.compress(x, slot, step), slot, step)
        kept = out.nonzero().reshape(-1)
        assert kept.numel() == 10
        assert torch.equal(out[kept], x[kept])
        # contiguous modulo d
        assert torch.equal(torch.sort((kept - c.start(slot, step)) % 100).values, torch.arange(10))
        assert c.start(slot, step) == twin.start(slot, step)
        starts.add(c.start(slot, step))
    assert len(starts) > 80  # fresh placement every step


def test_randomblock_scaled_is_unbiased():
    c = gradcomp.make("randomblock", density=0.05, scale=True)
    slot = Slot("w", 0, 200)
    x = torch.randn(200)
    draws = 4000
    mean = sum(c.decompress(c.compress(x, slot, s), slot, s) for s in range(draws)) / draws
    stderr = x.abs() * ((1 / 0.05 - 1) / draws) ** 0.5
    assert ((mean - x).abs() <= 5 * stderr + 1e-6).all()


def test_randomk_draws_each_slots_positions_once_per_step(monkeypatch):
    import gradcomp.compressors.sparse as sparse

    calls = []
    real = sparse.sample_without_replacement

    def counting(n, k, gen, device):
        calls.append((n, k))
        return real(n, k, gen, device)

    monkeypatch.setattr(sparse, "sample_without_replacement", counting)
    c = gradcomp.make("randomk", density=0.01)
    slots = [Slot(f"p{i}", i, 1000 + 100 * i) for i in range(3)]
    xs = [torch.randn(s.numel) for s in slots]
    fields = [c.compress(x, s, 7) for x, s in zip(xs, slots)]  # every slot compressed, then every slot decoded
    outs = [c.decompress(f, s, 7) for f, s in zip(fields, slots)]
    assert len(calls) == 3
    for x, f, out in zip(xs, fields, outs):  # the decode put the values back where the compress took them
        kept = out != 0
        assert int(kept.sum()) == f[0].numel() and torch.equal(out[kept], x[kept])
    c.compress(xs[0], slots[0], 8)  # a new step draws again
    assert len(calls) == 4
