"""Tests for qsgd (QSGD, Alistarh et al. 2017): both codings, unbiasedness, the variance bound, measured bits.

Statistical tests draw N independent messages (different steps) of a fixed vector. Their tolerances come from
the variance of the rounding, bounded as in the paper: one entry rounded between the levels ||g||·l/s and
||g||·(l + 1)/s has variance ||g||²·(sy − l)(l + 1 − sy)/s² <= ||g||²·min(1/(4s²), y/s), y = |g_i|/||g||, and
summed over the entries E||Q(g) − g||² <= ω||g||² with ω = min(d/s², √d/s).
"""

from __future__ import annotations

import math

import pytest
import torch
from roundtrip import f32_bits, round_trip

import gradcomp
from gradcomp import ConfigError, NonFiniteGradientError, Slot, WireError
from gradcomp.compressors.base import bind_worker
from gradcomp.compressors.natural import RandomDithering
from gradcomp.compressors.qsgd import QSGD, elias_max_bytes
from gradcomp.registry import parse_param_strings
from gradcomp.wire import HEADER_BYTES, SECTION_HEADER_BYTES, decode, encode
from gradcomp.wire.elias import elias_gamma_lengths

Z = 5.0  # standard errors allowed
CODINGS = ["packed", "elias"]


def heavy(d: int, seed: int) -> torch.Tensor:
    """Student-t with 2 degrees of freedom (infinite variance), from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(3, d, generator=g)
    return z[0] / ((z[1] ** 2 + z[2] ** 2) / 2).sqrt()


def vectors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "normal": torch.randn(1000, generator=g),
        "odd-length": torch.randn(1001, generator=g),  # d not a multiple of 8
        "thirteen": torch.randn(13, generator=g),
        "zeros": torch.zeros(50),
        "neg-zeros": -torch.zeros(5),
        "single": torch.tensor([-3.7]),
        "single-zero": torch.zeros(1),
        "empty": torch.zeros(0),
        "heavy": heavy(300, 12),
        "huge": torch.tensor([1e38, -1e38, 3e37, -2.5e36, 1.0, -1e-30, 0.0, 1e-45, 7e37]),
        "tiny": torch.randn(77, generator=g) * 1e-38,
        "one-big": torch.cat([torch.tensor([-1e6]), torch.randn(500, generator=g) * 1e-3]),
    }


def levels_of(compressor: QSGD, x: torch.Tensor, slot: Slot, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(level index ξ, negative mask, norm) of one draw, read from the packed coding's codes."""
    packed = QSGD(levels=compressor.levels, seed=compressor.seed)
    bind_worker(packed, compressor.worker)
    norm, codes = packed.compress(x, slot, step)
    return codes & ((1 << packed.level_bits) - 1), (codes >> packed.level_bits) & 1 == 1, float(norm)


# ------------------------------------------------------------------------------------------------- wire


@pytest.mark.parametrize("levels", [1, 2, 7, 255])
def test_round_trip_both_codings_identical(levels):
    packed, elias = QSGD(levels=levels), QSGD(levels=levels, coding="elias")
    for i, (label, x) in enumerate(vectors().items()):
        for step in (0, 9):
            slot = Slot(label, i, x.numel())
            a = round_trip(packed, x, slot, step)
            b = round_trip(elias, x, slot, step)
            assert torch.equal(f32_bits(a), f32_bits(b)), f"{label}: the codings carry different tensors"
            if label in ("zeros", "neg-zeros", "single-zero"):
                assert torch.equal(f32_bits(b), torch.zeros(x.numel(), dtype=torch.int32))
            assert torch.isfinite(b).all()


def test_round_trip_large_tensor_and_levels():
    for levels, d in ((1, 100_003), (3, 100_003), (1000, 5003), ((1 << 24) - 1, 5003)):
        x = heavy(d, 1)
        slot = Slot("big", 2, d)
        a = round_trip(QSGD(levels=levels), x, slot, 4)
        b = round_trip(QSGD(levels=levels, coding="elias"), x, slot, 4)
        assert torch.equal(f32_bits(a), f32_bits(b))


def test_quantisation_matches_random_dithering():
    """qsgd is random dithering with the ℓ2 norm: same levels, same message layout (draws salted differently)."""
    x = torch.randn(300, generator=torch.Generator().manual_seed(2))
    slot = Slot("w", 1, 300)
    assert QSGD(levels=5).specs(slot) == RandomDithering(levels=5).specs(slot)
    q = QSGD(levels=4)
    y = x.double().abs() / torch.linalg.vector_norm(x.double())
    for step in range(30):
        level, negative, norm = levels_of(q, x, slot, step)
        scaled = 4 * y
        assert bool(((level >= torch.floor(scaled - 1e-5)) & (level <= torch.ceil(scaled + 1e-5))).all())
        assert torch.equal(negative, (x < 0) & (level > 0))
        out = q.decompress(q.compress(x, slot, step), slot, step)
        assert torch.equal(out, torch.where(negative, -1.0, 1.0) * (norm * (level.float() / 4)))
    assert norm == pytest.approx(float(torch.linalg.vector_norm(x.double())), rel=1e-6)


@pytest.mark.parametrize("levels,width", [(1, 2), (2, 3), (3, 3), (4, 4), (7, 4), (8, 5), (255, 9)])
@pytest.mark.parametrize("d", [1, 13, 1000, 1001])
def test_packed_size(levels, width, d):
    c = QSGD(levels=levels)
    slot = Slot("t", 0, d)
    assert [(s.codec.name, s.width) for s in c.specs(slot)] == [("F32", None), ("BITS", width)]
    buf = encode(c.compress(torch.randn(d), slot, 0), c.specs(slot))
    assert buf.numel() == HEADER_BYTES + 2 * SECTION_HEADER_BYTES + 4 + math.ceil(width * d / 8)


def elias_expected_bytes(level: torch.Tensor) -> int:
    """The documented elias size, computed from the level indices alone (not from the encoder)."""
    positions = torch.nonzero(level).reshape(-1).tolist()
    gaps = [p - q for p, q in zip(positions, [-1] + positions[:-1])]
    stream = sum(2 * (v.bit_length() - 1) + 1 for v in gaps + level[level > 0].tolist())
    nnz = len(positions)
    return HEADER_BYTES + 3 * SECTION_HEADER_BYTES + 4 + math.ceil(nnz / 8) + math.ceil(stream / 8)


@pytest.mark.parametrize("levels", [1, 2, 7, 100])
def test_elias_size_is_the_documented_one(levels):
    c = QSGD(levels=levels, coding="elias")
    for i, (label, x) in enumerate(vectors().items()):
        slot = Slot(label, i, x.numel())
        for step in (0, 3):
            fields = c.compress(x, slot, step)
            level, negative, _ = levels_of(c, x, slot, step)
            assert fields[1].tolist() == negative[level > 0].long().tolist()  # signs of the nonzeros only
            buf = encode(fields, c.specs(slot))
            assert buf.numel() == elias_expected_bytes(level), label
            assert fields[2].numel() <= elias_max_bytes(x.numel(), levels)


def test_elias_max_bytes_bounds_the_densest_message():
    # every entry at the top level: d gaps of 1 and d levels s; the bound must hold
    for d in (1, 8, 1000):
        for s in (1, 2, 7, 255):
            x = torch.ones(d)
            c = QSGD(levels=s, coding="elias")
            stream = c.compress(x, Slot("x", 0, d), 0)[2]
            assert stream.numel() <= elias_max_bytes(d, s)
            gaps = torch.ones(d, dtype=torch.int64)
            worst = int(elias_gamma_lengths(gaps).sum() + elias_gamma_lengths(torch.full((d,), s)).sum())
            assert math.ceil(worst / 8) <= elias_max_bytes(d, s)


def gradient_like(d: int) -> torch.Tensor:
    from gradcomp.experiments.bench.cases import synthetic_gradient

    return synthetic_gradient(d)


@pytest.mark.parametrize("levels", [1, 2])
def test_elias_is_shorter_than_packed_at_low_levels(levels, capsys):
    """On a heavy-tailed gradient-like tensor most levels are 0: the Elias message is far shorter."""
    d = 1 << 18
    x = gradient_like(d)
    slot = Slot("g", 0, d)
    sizes = {}
    nnz = []
    for coding in CODINGS:
        c = QSGD(levels=levels, coding=coding)
        sizes[coding] = [encode(c.compress(x, slot, s), c.specs(slot)).numel() * 8 / d for s in range(5)]
        if coding == "elias":
            nnz = [c.compress(x, slot, s)[1].numel() for s in range(5)]
    packed, elias = sum(sizes["packed"]) / 5, sum(sizes["elias"]) / 5
    with capsys.disabled():
        print(
            f"\n  qsgd s={levels}, d={d}: packed {packed:.4f} bits/entry, elias {elias:.4f} bits/entry "
            f"(x{packed / elias:.1f} shorter), mean nnz {sum(nnz) / 5:.0f}"
        )
    assert max(sizes["elias"]) < min(sizes["packed"]) / 10
    # E[nnz] = Σ min(1, s·y_i) <= s·√d
    y = x.double().abs() / torch.linalg.vector_norm(x.double())
    expected = float(torch.clamp(levels * y, max=1.0).sum())
    assert expected <= levels * math.sqrt(d)
    assert abs(sum(nnz) / 5 - expected) <= Z * math.sqrt(expected / 5)


def test_packed_is_shorter_when_levels_are_large_and_dense():
    # 64 equal entries, s = 255: every s·y = 31.875, levels 31 or 32 (Elias 1 + 1 + 9 or 11 bits vs packed 9)
    x = torch.ones(64)
    slot = Slot("x", 0, 64)
    packed, elias = (encode(c.compress(x, slot, 0), c.specs(slot)).numel() for c in (QSGD(255), QSGD(255, 0, "elias")))
    assert packed < elias
    # but a dense message of small levels is shorter in Elias: d = 4096 equal entries, s = 255, levels 3 or 4
    x = torch.ones(4096)
    slot = Slot("x", 0, 4096)
    packed, elias = (encode(c.compress(x, slot, 0), c.specs(slot)).numel() for c in (QSGD(255), QSGD(255, 0, "elias")))
    assert elias < packed


# ------------------------------------------------------------------------------------------------- corrupted


def tampered(c: QSGD, slot: Slot, fields: list[torch.Tensor]) -> None:
    """A message whose fields the container accepts but whose content is impossible must raise WireError; inside a
    step that keeps its refusals for its end, that error is noted instead and the message adds nothing."""
    from gradcomp.wire.refusals import Refusals, refusing_later

    specs = c.specs(slot)
    with pytest.raises(WireError) as raised:
        c.decompress(decode(encode(fields, specs), specs), slot, 0)
    refusals = Refusals()
    with refusing_later(refusals):
        out = c.decompress(decode(encode(fields, specs), specs), slot, 0)
    assert refusals.messages == [str(raised.value)] and not out.any()


def test_elias_refuses_impossible_messages():
    from gradcomp.wire.elias import elias_gamma_encode

    d = 100
    c = QSGD(levels=3, coding="elias")
    slot = Slot("x", 0, d)
    norm = torch.ones(1)

    def stream(values):
        return elias_gamma_encode(torch.tensor(values, dtype=torch.int64))[0].to(torch.int64)

    signs2 = torch.tensor([0, 1])
    tampered(c, slot, [norm, signs2, stream([5, 1, 96, 2])])  # second position 4 + 96 = 100 >= d
    tampered(c, slot, [norm, signs2, stream([101, 1, 1, 2])])  # first position 100 >= d
    tampered(c, slot, [norm, signs2, stream([5, 1, 2**40, 2])])  # a gap beyond d (no overflow)
    tampered(c, slot, [norm, signs2, stream([5, 1, 2**62, 2])])
    tampered(c, slot, [norm, signs2, stream([5, 4, 3, 2])])  # level 4 > s = 3
    tampered(c, slot, [norm, signs2, stream([5, 1, 3])])  # truncated: 3 codes for 2 nonzeros
    tampered(c, slot, [norm, signs2, stream([5, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1])])  # trailing codes
    tampered(c, slot, [norm, torch.tensor([1]), stream([])])  # one sign, no codes
    tampered(c, slot, [norm, torch.zeros(0, dtype=torch.int64), stream([1, 1])])  # codes but no signs
    # a well-formed message decodes: positions 4 and 6 (gaps 5, 2), levels 1 and 3
    specs = c.specs(slot)
    ok = c.decompress(decode(encode([norm, signs2, stream([5, 1, 2, 3])], specs), specs), slot, 0)
    expected = torch.zeros(d)
    expected[4], expected[6] = 1 / 3, -1.0
    assert torch.equal(ok, expected)
    edge = c.decompress(decode(encode([norm, signs2, stream([5, 1, 95, 2])], specs), specs), slot, 0)
    assert torch.equal(edge[99], -(torch.tensor(2.0) / 3))  # the last entry, d − 1 = 4 + 95


def test_container_refuses_flipped_bytes_of_an_elias_message():
    x = heavy(500, 3)
    c = QSGD(levels=2, coding="elias")
    slot = Slot("x", 0, 500)
    specs = c.specs(slot)
    buf = encode(c.compress(x, slot, 0), specs)
    for i in range(HEADER_BYTES, buf.numel()):
        bad = buf.clone()
        bad[i] ^= 0x10
        with pytest.raises(WireError):
            c.decompress(decode(bad, specs), slot, 0)
    with pytest.raises(WireError):
        decode(buf[:-1], specs)


# ------------------------------------------------------------------------------------------------ statistics


def exact_variance(x: torch.Tensor, s: int) -> torch.Tensor:
    """Per-entry Var[Q(g)_i] from the definition, in float64: ||g||²·(sy − l)(l + 1 − sy)/s²."""
    xd = x.double()
    n = torch.linalg.vector_norm(xd)
    sy = xd.abs() / n * s
    lo = torch.floor(sy)
    return n * n * (sy - lo) * (lo + 1 - sy) / (s * s)


def draws(c: QSGD, x: torch.Tensor, n: int, start: int = 0) -> torch.Tensor:
    """n decompressed messages (steps start..start+n−1), through the wire."""
    slot = Slot("w", 5, x.numel())
    specs = c.specs(slot)
    out = []
    for step in range(start, start + n):
        out.append(c.decompress(decode(encode(c.compress(x, slot, step), specs), specs), slot, step).double())
    return torch.stack(out)


@pytest.mark.parametrize("levels", [1, 4])
@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_unbiased(levels, kind):
    d, n = 200, 2000
    x = torch.randn(d, generator=torch.Generator().manual_seed(7)) if kind == "normal" else heavy(d, 8)
    c = QSGD(levels=levels, coding="elias")
    assert c.unbiased and not c.summable and c.omega is None
    samples = draws(c, x, n)
    mean = samples.mean(0)
    xd = x.double()
    norm2 = float(xd.square().sum())
    omega = c.omega_bound(d)
    assert omega == min(d / levels**2, math.sqrt(d) / levels)
    # per entry: within Z standard errors, the standard error from the per-entry variance bound
    # ||g||²·min(1/(4s²), y/s) (never smaller than the exact variance, so no entry can hide a bias)
    y = xd.abs() / math.sqrt(norm2)
    bound_var = norm2 * torch.minimum(torch.full_like(y, 1 / (4 * levels**2)), y / levels)
    assert bool((exact_variance(x, levels) <= bound_var * (1 + 1e-9)).all())
    deterministic = bound_var == 0
    assert torch.equal(mean[deterministic], xd[deterministic])
    z = (mean - xd)[~deterministic].abs() / (bound_var[~deterministic] / n).sqrt()
    assert float(z.max()) < Z, f"per-entry bias: max |z| = {float(z.max()):.2f}"
    # directions: Var<v, Q(g) − g> = Σ v_i² Var Q_i <= ω||g||² for |v_i| <= 1, so the mean over n draws
    # lies within Z·sqrt(ω||g||²/n) of 0
    rnd = torch.where(torch.rand(d, generator=torch.Generator().manual_seed(1)) < 0.5, -1.0, 1.0).double()
    for v in (torch.sign(xd), rnd):
        assert abs(float(v @ (mean - xd))) <= Z * math.sqrt(omega * norm2 / n)
    # the whole vector: E||mean − g||² = Σ Var_i / n <= ω||g||²/n; by Chebyshev with 10 standard deviations
    # (false alarm <= 1 %): Var(Σ D_i²) <= h²(3/4 + 1/n)·ω||g||²/n² for D_i = mean_i − g_i, h = ||g||/s the
    # width of a rounding step (E D⁴ <= (h²σ² + 3nσ⁴)/n³ and σ² <= h²/4)
    h2 = norm2 / levels**2
    tolerance = omega * norm2 / n + 10 * math.sqrt(h2 * (0.75 + 1 / n) * omega * norm2) / n
    assert float((mean - xd).square().sum()) <= tolerance


@pytest.mark.parametrize(
    "d,levels,kind",
    [
        (1000, 1, "normal"),  # √d/s = 31.6 is the smaller term
        (1000, 1, "heavy"),
        (16, 8, "normal"),  # d/s² = 0.25 is the smaller term
        (400, 20, "normal"),  # both terms equal 1
        (900, 3, "flat"),  # all |g_i| equal: E = (1 − s/√d)·√d/s, near the bound √d/s
        (64, 4, "flat"),  # sy = 1/2 everywhere: E = d/(4s²)
    ],
)
def test_variance_bound(d, levels, kind):
    g = torch.Generator().manual_seed(d + levels)
    if kind == "normal":
        x = torch.randn(d, generator=g)
    elif kind == "heavy":
        x = heavy(d, 5)
    else:
        x = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0) * 0.37
    c = QSGD(levels=levels, seed=3)
    n = 600
    samples = draws(c, x, n)
    xd = x.double()
    norm2 = float(xd.square().sum())
    errors = (samples - xd).square().sum(1) / norm2  # ||Q(g) − g||² / ||g||² of every draw
    mse, se = float(errors.mean()), float(errors.std()) / math.sqrt(n)
    exact = float(exact_variance(x, levels).sum()) / norm2
    bound = min(d / levels**2, math.sqrt(d) / levels)
    assert exact <= bound
    assert abs(mse - exact) <= Z * se + 1e-9, f"E||Q(g) − g||²/||g||² = {mse:.4g}, exact {exact:.4g}"
    assert mse <= bound + Z * se
    if kind == "flat" and levels == 3:
        assert exact == pytest.approx(bound * (1 - levels / math.sqrt(d)))  # (1 − s/√d) of the bound


# ------------------------------------------------------------------------------------------- config and misc


@pytest.mark.parametrize(
    "params",
    [
        {"levels": 0},
        {"levels": -1},
        {"levels": 2.5},
        {"levels": True},
        {"levels": "4"},
        {"levels": 1 << 24},
        {"coding": "huffman"},
        {"coding": "Elias"},
        {"coding": None},
        {"coding": 1},
        {"seed": -1},
        {"norm": "inf"},  # qsgd is the ℓ2 quantiser; no norm parameter
        {"norm_codec": "cnat"},
    ],
)
def test_bad_parameters(params):
    with pytest.raises(ConfigError):
        gradcomp.make("qsgd", **params)
    if set(params) <= {"levels", "coding", "seed"}:
        with pytest.raises(ConfigError):
            QSGD(**params)


def test_registry_and_params():
    assert "qsgd" in gradcomp.available()
    c = gradcomp.make("qsgd")
    assert type(c) is QSGD and c.name == "qsgd"
    assert c.params() == {"levels": 127, "seed": 0, "coding": "packed"}
    c = gradcomp.make("qsgd", **parse_param_strings(["coding=elias", "levels=2", "seed=5"]))
    assert c.params() == {"levels": 2, "seed": 5, "coding": "elias"}
    assert gradcomp.make("qsgd", **c.params()).params() == c.params()
    assert c.omega_bound(100) == pytest.approx(min(100 / 4, 10 / 2))
    assert repr(c) == "QSGD(levels=2, seed=5, coding='elias')"


def test_non_finite_raises():
    for coding in CODINGS:
        for bad in (float("nan"), float("inf")):
            x = torch.randn(20)
            x[3] = bad
            with pytest.raises(NonFiniteGradientError):
                QSGD(coding=coding).compress(x, Slot("layer.weight", 0, 20), 0)
        with pytest.raises(NonFiniteGradientError):  # ||x||_2 overflows float32
            QSGD(coding=coding).compress(torch.full((4,), 3.0e38), Slot("x", 0, 4), 0)


def test_deterministic_per_step_slot_and_worker():
    x = torch.randn(500)
    for coding in CODINGS:
        c = QSGD(levels=2, seed=4, coding=coding)
        a = c.compress(x, Slot("a", 1, 500), 3)
        assert all(torch.equal(u, v) for u, v in zip(a, c.compress(x, Slot("a", 1, 500), 3)))
        assert not all(torch.equal(u, v) for u, v in zip(a, c.compress(x, Slot("a", 1, 500), 4)))
        other = QSGD(levels=2, seed=4, coding=coding)
        bind_worker(other, 1)
        assert not all(torch.equal(u, v) for u, v in zip(a, other.compress(x, Slot("a", 1, 500), 3)))
    # qsgd draws its own random numbers: not random_dithering's (salted by the method's name)
    q, r = QSGD(levels=7), RandomDithering(levels=7)
    assert not torch.equal(q.compress(x, Slot("a", 1, 500), 0)[1], r.compress(x, Slot("a", 1, 500), 0)[1])


@pytest.mark.slow
@pytest.mark.parametrize("coding", CODINGS)
def test_simulated_training_runs(tmp_path, coding):
    import json

    from gradcomp.cli import main

    out = tmp_path / "run.json"
    small = "train --dataset synthetic --model mlp --steps 12 --no-progress --simulate --compressor qsgd".split()
    args = [*small, "--param", f"coding={coding}", "--param", "levels=2", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["params"]["coding"] == coding
    assert result["compression_ratio_up"] > (10 if coding == "packed" else 20)
    assert 0.0 <= result["test_accuracy"] <= 1.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("coding", CODINGS)
def test_cuda(coding):
    c = QSGD(levels=2, coding=coding)
    x = heavy(10_001, 2).cuda()
    slot = Slot("x", 0, x.numel())
    fields = c.compress(x, slot, 0)
    assert all(f.device.type == "cuda" for f in fields)
    out = c.decompress(fields, slot, 0)
    assert out.device.type == "cuda"
    specs = c.specs(slot)
    again = c.decompress(decode(encode(fields, specs), specs), slot, 0)
    assert torch.equal(out.view(torch.int32), again.view(torch.int32))
    cpu = c.decompress([f.cpu() for f in fields], slot, 0)
    assert torch.equal(cpu.view(torch.int32), out.cpu().view(torch.int32))
