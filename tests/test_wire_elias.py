"""Tests for gradcomp.wire.elias: vectorized Elias-gamma coding of positive integers."""

from __future__ import annotations

import random

import pytest
import torch

from gradcomp.errors import ConfigError, WireError
from gradcomp.wire.elias import MAX_VALUE, elias_gamma_decode, elias_gamma_encode, elias_gamma_lengths

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference_encode(values: list[int]) -> tuple[bytes, int]:
    """Bit by bit: N = floor(log2 v) zeros, then v's N + 1 bits MSB first; stream LSB-first in bytes."""
    bits: list[int] = []
    for v in values:
        n = v.bit_length() - 1
        bits += [0] * n + [(v >> (n - j)) & 1 for j in range(n + 1)]
    out = bytearray((len(bits) + 7) // 8)
    for k, bit in enumerate(bits):
        out[k // 8] |= bit << (k % 8)
    return bytes(out), len(bits)


def random_values(k: int, seed: int) -> list[int]:
    """Mixed magnitudes: small (geometric-like), up to 2^40, up to 2^62, and the edges 1, 2^40, 2^63 - 1."""
    rng = random.Random(seed)
    pick = [
        lambda: 1,
        lambda: rng.randint(1, 8),
        lambda: rng.randint(1, 1000),
        lambda: rng.randint(1, 2**40),
        lambda: 2**40,
        lambda: rng.randint(2**61, 2**62),
        lambda: MAX_VALUE,
    ]
    return [rng.choice(pick)() for _ in range(k)]


def round_trip(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    buf, nbits = elias_gamma_encode(values)
    assert buf.dtype == torch.uint8 and buf.numel() == (nbits + 7) // 8 and buf.device == values.device
    out = elias_gamma_decode(buf, values.numel())
    assert out.dtype == torch.int64 and out.device == values.device
    assert torch.equal(out, values.reshape(-1).to(torch.int64))
    return buf, nbits


def test_known_bytes():
    # 1 -> "1", 2 -> "010", 3 -> "011", 4 -> "00100": bits 1 010 011 00100, LSB first
    buf, nbits = elias_gamma_encode(torch.tensor([1, 2, 3, 4]))
    assert nbits == 12
    assert buf.tolist() == [0b01100101, 0b0010]
    # eight ones fill exactly one byte: no padding
    buf, nbits = elias_gamma_encode(torch.ones(8, dtype=torch.int64))
    assert nbits == 8 and buf.tolist() == [0xFF]


def test_matches_reference():
    for seed, k in enumerate([1, 2, 7, 8, 9, 100, 1000]):
        values = random_values(k, seed)
        buf, nbits = elias_gamma_encode(torch.tensor(values))
        ref, ref_bits = reference_encode(values)
        assert nbits == ref_bits
        assert bytes(buf.tolist()) == ref
        assert elias_gamma_lengths(torch.tensor(values)).tolist() == [2 * (v.bit_length() - 1) + 1 for v in values]


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_random(device):
    for seed, k in enumerate([1, 2, 3, 8, 17, 1000, 20_000]):
        round_trip(torch.tensor(random_values(k, seed), device=device))
    # geometric-like small values (the gaps and levels of a sparse QSGD message), many of them
    g = torch.Generator().manual_seed(5)
    small = (torch.rand(200_000, generator=g).log() / torch.log(torch.tensor(0.9))).floor().to(torch.int64) + 1
    round_trip(small.to(device))


@pytest.mark.parametrize("device", DEVICES)
def test_edges(device):
    dev = torch.device(device)
    buf, nbits = elias_gamma_encode(torch.empty(0, dtype=torch.int64, device=dev))
    assert nbits == 0 and buf.numel() == 0
    assert elias_gamma_decode(buf, 0).numel() == 0
    for v in (1, 2, 3, 255, 256, 2**31 - 1, 2**31, 2**32, 2**40, 2**40 + 1, 2**53 + 1, 2**62, MAX_VALUE):
        _, nbits = round_trip(torch.tensor([v], device=dev))
        assert nbits == 2 * (v.bit_length() - 1) + 1
    _, nbits = round_trip(torch.tensor([2**40] * 3 + [1] * 5, device=dev))
    assert nbits == 3 * 81 + 5
    # floor(log2) must be exact just below and at powers of two (a float log2 rounds 2^53 - 1 up)
    vals = torch.tensor([2**k - 1 for k in range(2, 64)] + [2**k for k in range(0, 63)], device=dev)
    assert torch.equal(
        elias_gamma_lengths(vals).cpu(), torch.tensor([2 * (v.bit_length() - 1) + 1 for v in vals.tolist()])
    )
    round_trip(vals)


def test_integer_dtypes():
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        values = torch.tensor([1, 2, 5, 100, 127], dtype=dtype)
        buf, _ = elias_gamma_encode(values)
        assert elias_gamma_decode(buf, 5).tolist() == [1, 2, 5, 100, 127]
    buf, _ = elias_gamma_encode(torch.tensor([[3, 1], [4, 1]]))  # any shape, flattened
    assert elias_gamma_decode(buf, 4).tolist() == [3, 1, 4, 1]


@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([1, 0, 2]),
        torch.tensor([-1]),
        torch.tensor([5, -(2**62)]),
        torch.tensor([1.0, 2.0]),
        torch.tensor([True]),
        torch.tensor([1 + 0j]),
        [1, 2, 3],
    ],
)
def test_encoder_refuses_bad_input(bad):
    with pytest.raises(ConfigError):
        elias_gamma_encode(bad)


def test_decoder_refuses_truncated_and_oversized_streams():
    values = torch.tensor(random_values(300, 11))
    buf, nbits = elias_gamma_encode(values)
    assert nbits % 8 != 0  # there is padding to corrupt
    for cut in range(1, 12):  # every truncation by whole bytes
        with pytest.raises(WireError, match="truncated"):
            elias_gamma_decode(buf[:-cut], 300)
    with pytest.raises(WireError, match="truncated"):
        elias_gamma_decode(buf, 301)  # one code more than the stream holds
    with pytest.raises(WireError):
        elias_gamma_decode(buf, 299)  # a whole code left over
    zero, one = torch.zeros(1, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)
    for extra in (zero, one, torch.full((5,), 0xFF, dtype=torch.uint8)):
        with pytest.raises(WireError, match="left after"):
            elias_gamma_decode(torch.cat([buf, extra]), 300)  # trailing garbage
    padded = buf.clone()
    padded[-1] |= 1 << 7  # the last byte's top bit is padding
    with pytest.raises(WireError, match="padding"):
        elias_gamma_decode(padded, 300)


def test_decoder_refuses_malformed_input():
    with pytest.raises(WireError, match="truncated"):
        elias_gamma_decode(torch.zeros(4, dtype=torch.uint8), 1)  # no leading one at all
    with pytest.raises(WireError, match="truncated"):
        elias_gamma_decode(torch.zeros(0, dtype=torch.uint8), 1)
    with pytest.raises(WireError, match="0 codes"):
        elias_gamma_decode(torch.ones(1, dtype=torch.uint8), 0)
    # 63 zeros and a one: a value of at least 2^63, beyond int64
    huge = torch.tensor([0] * 7 + [0x80] + [0xFF] * 7 + [0x7F], dtype=torch.uint8)  # 127 bits, 1 padding bit
    with pytest.raises(WireError, match="beyond int64"):
        elias_gamma_decode(huge, 1)
    # far more bytes than count codes can use
    with pytest.raises(WireError, match="too long"):
        elias_gamma_decode(torch.full((100,), 0xFF, dtype=torch.uint8), 2)
    for bad_count in (-1, True, 2.0, None):
        with pytest.raises(WireError, match="invalid code count"):
            elias_gamma_decode(torch.ones(1, dtype=torch.uint8), bad_count)
    for bad_buf in (torch.ones(2, dtype=torch.int64), b"\x01", [1]):
        with pytest.raises(WireError):
            elias_gamma_decode(bad_buf, 1)


def test_corrupted_streams_fail_cleanly():
    """Every single-bit flip either raises WireError or decodes exactly `count` values >= 1.

    A flip inside a code's value bits gives another valid stream — no prefix code can notice that; the
    container's 64-bit checksum does. A flip of a zero run or leading one shifts every later code boundary,
    which the exact-length check catches. It never hangs and never raises anything else.
    """
    rng = random.Random(3)
    values = torch.tensor([rng.choice([1, 1, 2, rng.randint(1, 300), 2**40 + rng.randint(0, 99)]) for _ in range(40)])
    buf, _ = elias_gamma_encode(values)
    errors = 0
    for bit in range(8 * buf.numel()):
        bad = buf.clone()
        bad[bit // 8] ^= 1 << (bit % 8)
        try:
            out = elias_gamma_decode(bad, 40)
        except WireError:
            errors += 1
            continue
        assert out.numel() == 40 and bool((out >= 1).all())
        assert not torch.equal(out, values)  # a different stream never decodes to the original values
    assert errors > 0.2 * 8 * buf.numel()
