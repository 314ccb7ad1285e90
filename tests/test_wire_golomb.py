"""Tests for gradcomp.wire.golomb: Golomb–Rice coding of sorted positions."""

from __future__ import annotations

import math

import pytest
import torch

from gradcomp.errors import ConfigError, WireError
from gradcomp.wire import golomb_decode, golomb_encode, optimal_rice_parameter

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference_encode(positions: list[int], b: int) -> tuple[bytes, int]:
    """Straightforward bit-by-bit encoder of the documented layout (remainder MSB first)."""
    bits: list[int] = []
    prev = -1
    for p in positions:
        g = p - prev - 1
        prev = p
        q, r = g >> b, g & ((1 << b) - 1)
        bits += [1] * q + [0] + [(r >> (b - 1 - i)) & 1 for i in range(b)]
    out = bytearray((len(bits) + 7) // 8)
    for k, bit in enumerate(bits):
        out[k // 8] |= bit << (k % 8)
    return bytes(out), len(bits)


def random_positions(d: int, k: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(d, generator=g)[:k].sort().values.to(device)


def round_trip(pos: torch.Tensor, b: int, universe: int) -> tuple[torch.Tensor, int]:
    buf, nbits = golomb_encode(pos, b)
    assert buf.dtype == torch.uint8 and buf.numel() == (nbits + 7) // 8
    out = golomb_decode(buf, b, pos.numel(), universe)
    assert out.dtype == torch.int64 and out.device == pos.device
    assert torch.equal(out, pos.to(torch.int64))
    return buf, nbits


@pytest.mark.parametrize("b", [0, 1, 2, 3, 5, 8, 13, 31])
def test_matches_reference(b):
    for seed, (d, k) in enumerate([(1, 1), (10, 3), (100, 17), (1000, 40), (64, 64)]):
        pos = random_positions(d, k, seed)
        buf, nbits = golomb_encode(pos, b)
        ref, ref_bits = reference_encode(pos.tolist(), b)
        assert nbits == ref_bits
        assert bytes(buf.tolist()) == ref


def test_known_bytes():
    # gaps 0, 5, 2 with b = 2: "0 00", "1 0 01", "0 10" -> bits 000 1001 010 (LSB first)
    buf, nbits = golomb_encode(torch.tensor([0, 6, 9]), 2)
    assert nbits == 10
    assert buf.tolist() == [0b01001000, 0b01]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b", [0, 1, 4, 7, 12])
def test_round_trip_random(b, device):
    for seed, (d, k) in enumerate([(10, 1), (1000, 10), (5000, 2500), (100_000, 1000), (100_000, 37)]):
        round_trip(random_positions(d, k, seed, device), b, d)


@pytest.mark.parametrize("device", DEVICES)
def test_edge_cases(device):
    dev = torch.device(device)
    # no positions
    buf, nbits = golomb_encode(torch.empty(0, dtype=torch.int64, device=dev), 5)
    assert nbits == 0 and buf.numel() == 0
    out = golomb_decode(buf, 5, 0, 100)
    assert out.numel() == 0 and out.dtype == torch.int64
    # a single element, at both ends of the universe
    for p in (0, 99):
        round_trip(torch.tensor([p], device=dev), 3, 100)
    # all positions 0..d-1 (every gap 0), including exactly byte-aligned streams
    for d in (1, 7, 8, 9, 1000):
        for b in (0, 1, 3):
            round_trip(torch.arange(d, device=dev), b, d)
    # universe == last position + 1
    round_trip(torch.tensor([3, 4, 10], device=dev), 1, 11)


@pytest.mark.parametrize("device", DEVICES)
def test_huge_gaps(device):
    dev = torch.device(device)
    pos = torch.tensor([0, 2**31 - 5], device=dev)
    b = optimal_rice_parameter(2 / 2**31)
    _, nbits = round_trip(pos, b, 2**31)
    assert nbits < 2 * (b + 1) + 16
    # gaps beyond 32 bits, large b
    round_trip(torch.tensor([2**40, 2**41 - 1], device=dev), 31, 2**41)
    round_trip(torch.tensor([5, 2**31 + 7, 2**32 - 1], device=dev), 30, 2**32)
    # a small b with a unary part of a few million ones: memory and time must stay modest
    pos = torch.tensor([1, 3_000_000, 3_000_001, 12_000_000], device=dev)
    _, nbits = round_trip(pos, 2, 12_000_001)
    assert nbits == (1 >> 2) + (2_999_998 >> 2) + (0 >> 2) + (8_999_998 >> 2) + 4 * 3


@pytest.mark.parametrize("d,p", [(10**6, 0.01), (10**6, 0.001)])
def test_near_entropy(d, p):
    """Golomb bits per position are within 3% of log2(C(d, k)) / k (the SBC paper's claim)."""
    k = int(d * p)
    pos = random_positions(d, k, seed=7)
    b = optimal_rice_parameter(k / d)
    _, nbits = round_trip(pos, b, d)
    entropy = (math.lgamma(d + 1) - math.lgamma(k + 1) - math.lgamma(d - k + 1)) / math.log(2) / k
    ratio = (nbits / k) / entropy
    assert 1.0 <= ratio < 1.03, f"{nbits / k:.4f} bits/position vs entropy {entropy:.4f} (b={b})"


def test_optimal_rice_parameter():
    phi = (math.sqrt(5) + 1) / 2
    for p in (0.5, 0.3, 0.1, 0.05, 0.01, 0.003, 0.001, 1e-4, 1e-6):
        expected = 1 + math.floor(math.log2(math.log(phi - 1) / math.log(1 - p)))
        assert optimal_rice_parameter(p) == min(31, max(0, expected))
    assert optimal_rice_parameter(0.01) == 6
    assert optimal_rice_parameter(0.001) == 9
    assert optimal_rice_parameter(1.0) == 0
    assert optimal_rice_parameter(0.9) == 0
    assert optimal_rice_parameter(0.0) == 31
    assert optimal_rice_parameter(1e-30) == 31
    for bad in (-0.1, 1.5, float("nan"), "x"):
        with pytest.raises(ConfigError):
            optimal_rice_parameter(bad)


def test_encode_misuse():
    for bad in ([3, 3], [5, 2], [-1, 4], [-3]):
        with pytest.raises(ConfigError):
            golomb_encode(torch.tensor(bad), 2)
    with pytest.raises(ConfigError):
        golomb_encode(torch.tensor([1.0, 2.0]), 2)
    for b in (-1, 32, 2.0, None):
        with pytest.raises(ConfigError):
            golomb_encode(torch.tensor([1, 2]), b)
    with pytest.raises(ConfigError):
        golomb_decode(torch.zeros(1, dtype=torch.uint8), 2, 1, -1)


def test_decode_errors():
    b = optimal_rice_parameter(0.01)
    for seed in range(20):
        pos = random_positions(10_000, 100, seed=seed)
        buf, nbits = golomb_encode(pos, b)
        if nbits % 8:
            break
    k = pos.numel()
    assert nbits % 8 != 0  # so that padding bits exist
    with pytest.raises(WireError, match="truncated"):
        golomb_decode(buf[:-1], b, k, 10_000)
    with pytest.raises(WireError, match="truncated"):
        golomb_decode(buf, b, k + 1, 10_000)  # fewer codes than count fit
    with pytest.raises(WireError, match="bits left|padding"):
        golomb_decode(buf, b, k - 1, 10_000)  # more codes than count
    with pytest.raises(WireError, match="bits left"):
        golomb_decode(torch.cat([buf, torch.zeros(1, dtype=torch.uint8)]), b, k, 10_000)
    bad = buf.clone()
    bad[-1] |= 0x80
    with pytest.raises(WireError, match="padding"):
        golomb_decode(bad, b, k, 10_000)
    with pytest.raises(WireError, match="universe"):
        golomb_decode(buf, b, k, int(pos[-1]))
    with pytest.raises(WireError):
        golomb_decode(buf, b, -1, 10_000)
    with pytest.raises(WireError):
        golomb_decode(buf, 32, k, 10_000)
    with pytest.raises(WireError):
        golomb_decode(buf, b, 0, 10_000)  # count 0 accepts only an empty buffer
    with pytest.raises(WireError):
        golomb_decode(torch.empty(0, dtype=torch.uint8), b, 1, 10_000)
    with pytest.raises(WireError):
        golomb_decode(buf, b, 20_000, 10_000)  # more positions than the universe holds
    # a stream of all ones never terminates a code
    with pytest.raises(WireError, match="truncated"):
        golomb_decode(torch.full((4,), 255, dtype=torch.uint8), 0, 1, 10_000)
    # an absurdly long stream for the universe
    with pytest.raises(WireError):
        golomb_decode(torch.zeros(1000, dtype=torch.uint8), 0, 1, 10)


def test_decode_random_garbage_only_wire_errors():
    g = torch.Generator().manual_seed(11)
    for _ in range(300):
        n = int(torch.randint(0, 40, (1,), generator=g))
        buf = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
        b = int(torch.randint(0, 8, (1,), generator=g))
        count = int(torch.randint(0, 60, (1,), generator=g))
        try:
            out = golomb_decode(buf, b, count, 1000)
        except Exception as e:
            assert type(e) is WireError, repr(e)
        else:
            assert out.numel() == count
            assert bool((out[1:] > out[:-1]).all()) and (count == 0 or 0 <= int(out[0]) <= int(out[-1]) < 1000)
            re, _ = golomb_encode(out, b)
            assert torch.equal(re, buf)  # a stream that decodes is the canonical encoding


def test_decode_mutated_streams_only_wire_errors():
    """Bit flips, truncations, extensions and wrong counts of valid streams: WireError or a valid decode."""
    import random

    rng = random.Random(21)
    decoded = 0
    for trial in range(400):
        d = rng.choice([50, 1000, 100_000])
        k = rng.randrange(0, min(d, 60) + 1)
        pos = random_positions(d, k, trial)
        b = rng.choice([0, 1, 3, optimal_rice_parameter(max(k, 1) / d)])
        buf, _ = golomb_encode(pos, b)
        raw = bytearray(buf.tolist())
        kind = rng.randrange(4)
        count = k
        if kind == 0 and raw:
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(raw))
                raw[i] ^= 1 << rng.randrange(8)
        elif kind == 1 and raw:
            del raw[rng.randrange(len(raw)) :]
        elif kind == 2:
            raw += bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        else:
            count = max(0, k + rng.choice([-2, -1, 1, 2]))
        t = torch.tensor(list(raw), dtype=torch.uint8)
        try:
            out = golomb_decode(t, b, count, d)
        except Exception as e:
            assert type(e) is WireError, repr(e)
            continue
        decoded += 1
        assert out.numel() == count
        if count:
            assert bool((out[1:] > out[:-1]).all()) and 0 <= int(out[0]) and int(out[-1]) < d
        assert torch.equal(golomb_encode(out, b)[0], t)
    assert decoded > 0


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_decode_agrees_with_the_checked_one(device):
    """The device path's decoder (``flags``: nothing read back) accepts exactly the streams the checked decoder
    accepts, sound and corrupted (bit flips, a wrong count, a byte cut or added), and gives the same positions; those
    of a refused stream still lie in [0, universe)."""
    import random

    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    rejected = 0
    for _ in range(600):
        universe = rng.choice([1, 5, 64, 1000, 5000])
        k = rng.randint(1, min(universe, 60))
        pos = torch.randperm(universe, generator=g)[:k].sort().values
        b = rng.choice([optimal_rice_parameter(k / universe), 0, 1, 3, 7])
        data = golomb_encode(pos, b)[0].clone()
        count, r = k, rng.random()
        if r < 0.4 and data.numel():
            data[rng.randrange(data.numel())] ^= 1 << rng.randrange(8)
        elif r < 0.5:
            count = max(1, k + rng.choice([-1, 1]))
        elif r < 0.6 and data.numel() > 1:
            data = data[:-1]
        elif r < 0.7:
            data = torch.cat([data, torch.tensor([rng.randrange(256)], dtype=torch.uint8)])
        data = data.to(device)
        try:
            expected, error = golomb_decode(data, b, count, universe), None
        except WireError as e:
            expected, error = None, e
        flags: list = []
        try:
            got = golomb_decode(data, b, count, universe, flags)
        except WireError as e:  # the checks on sizes alone raise in both
            assert error is not None and str(e) == str(error)
            continue
        assert len(flags) == 1 and bool(flags[0]) == (error is None), (universe, k, b, count, error)
        # refused or not, they can index a slot of ``universe`` entries before the flag is read
        assert got.numel() == count and (count == 0 or (int(got.min()) >= 0 and int(got.max()) < universe))
        if error is None:
            assert torch.equal(got, expected)
        else:
            rejected += 1
    assert rejected > 100  # the corruptions above do reach the deferred checks


@pytest.mark.parametrize("b", [0, 2, 5])
def test_encode_with_a_known_length_and_deferred_checks(b):
    """The device path's encode: the length read beforehand (golomb_stream_bits) and the order check deferred to
    ``flags`` give the bytes of the plain encode; positions out of order give a false flag, not an error."""
    from gradcomp.wire.golomb import golomb_stream_bits

    for seed, (d, k) in enumerate([(1000, 1), (1000, 37), (50, 50), (100000, 300)]):
        pos = random_positions(d, k, seed)
        plain = golomb_encode(pos, b)
        total = golomb_stream_bits(pos, b)
        assert total.dim() == 0 and int(total) == plain[1]
        flags: list = []
        got = golomb_encode(pos, b, flags, int(total))
        assert torch.equal(got[0], plain[0]) and got[1] == plain[1]
        assert len(flags) == 1 and bool(flags[0][0])
    bad = torch.tensor([3, 9, 9, 12])
    flags = []
    golomb_encode(bad, b, flags, int(golomb_stream_bits(bad, b)))
    assert not bool(flags[0][0])
    with pytest.raises(ConfigError, match="strictly increasing"):
        golomb_encode(bad, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("universe", [1, 2, 7, 100, 1000, 65_537, 2_000_003])
def test_the_rice_parameter_on_the_device_is_the_hosts_for_every_count(universe, device):
    """``rice_parameter_on_device`` compares a count with the counts where the host's parameter steps down: it
    gives ``optimal_rice_parameter(count / universe)`` exactly, for every count of the smaller universes and
    around every step of the larger (where an off-by-one would show), and a stream length with it is encode's."""
    from gradcomp.wire.golomb import _rice_steps, golomb_stream_bits, rice_parameter_on_device

    steps = _rice_steps(universe)
    counts = set(range(universe + 1)) if universe <= 1000 else {0, universe, universe // 2}
    counts |= {c + e for c in steps for e in (-1, 0, 1) if 0 <= c + e <= universe}
    counts = sorted(counts)
    got = torch.stack([rice_parameter_on_device(torch.tensor(c, device=device), universe) for c in counts])
    assert got.tolist() == [optimal_rice_parameter(c / universe) for c in counts]
    pos = random_positions(universe, min(universe, 40), 3, device)
    b = rice_parameter_on_device(torch.tensor(pos.numel(), device=device), universe)
    assert int(golomb_stream_bits(pos, b)) == golomb_encode(pos, optimal_rice_parameter(pos.numel() / universe))[1]
