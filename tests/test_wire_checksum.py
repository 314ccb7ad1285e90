"""The container's body checksum (gradcomp.wire.checksum): CRC-32C and CRC-32, and what they detect.

The detection tests run on the checksum alone and on real messages through ``decode``. The two-bit tests
(``test_the_same_bit_in_two_words_*``, ``test_random_two_bit_flips_*``) fail with the version-1 weighted-sum
checksum, which missed exactly those; single-bit flips and bursts were already caught by it (every weight was
odd, and a burst of at most 64 bits changes at most two adjacent words by amounts it could not cancel), so
those tests guard the CRC against a weaker replacement rather than reproduce the old failure.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from gradcomp import Slot, make
from gradcomp.errors import WireError
from gradcomp.wire import HEADER_BYTES, decode, encode
from gradcomp.wire.checksum import checksum64, crc32, crc32c, to_host

# ----------------------------------------------------------------------------------------- definitions

POLY_C = 0x1EDC6F41  # CRC-32C (Castagnoli), x^32 term implied
POLY_I = 0x04C11DB7  # CRC-32 (IEEE 802.3, zlib)


def reference_crc(data: bytes, poly: int) -> int:
    """Bit-by-bit reflected CRC-32 with init and final xor 0xFFFFFFFF: the textbook definition."""
    reflected = int(f"{poly:032b}"[::-1], 2)
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (reflected if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_check_values():
    data = torch.tensor(list(b"123456789"), dtype=torch.uint8)
    assert crc32c(data) == 0xE3069283
    assert crc32(data) == 0xCBF43926
    assert checksum64(data) == 0xCBF43926 << 32 | 0xE3069283


def test_matches_the_reference_definition_on_any_view():
    rng = random.Random(5)
    data = bytes(rng.randrange(256) for _ in range(1100))
    t = torch.tensor(list(data), dtype=torch.uint8)
    for start, stop in ((0, 0), (0, 1), (0, 7), (0, 8), (0, 9), (0, 64), (0, 65), (3, 1003), (5, 13), (1, 1100)):
        view = t[start:stop]  # odd lengths, views that start off an 8-byte boundary
        c, i = reference_crc(data[start:stop], POLY_C), reference_crc(data[start:stop], POLY_I)
        assert crc32c(view) == c and crc32(view) == i
        assert checksum64(view) == i << 32 | c
    assert checksum64(t[:1000].reshape(10, 100)) == checksum64(t[:1000])  # any shape, flattened
    assert checksum64(t[::2]) == checksum64(t[::2].contiguous())  # a strided view
    with pytest.raises(WireError):
        checksum64(t.to(torch.int32))


# ----------------------------------------------------------------------- the polynomials' properties


def _mulmod(a: int, b: int, m: int) -> int:
    """a·b mod m in GF(2)[x] (polynomials as ints, bit k = coefficient of x^k)."""
    deg = m.bit_length() - 1
    out = 0
    while b:
        if b & 1:
            out ^= a
        b >>= 1
        a <<= 1
        if a >> deg & 1:
            a ^= m
    return out


def _x_power(e: int, m: int) -> int:
    """x^e mod m in GF(2)[x]."""
    out, base = 1, 2
    while e:
        if e & 1:
            out = _mulmod(out, base, m)
        base = _mulmod(base, base, m)
        e >>= 1
    return out


def _divmod(a: int, m: int) -> tuple[int, int]:
    q, deg = 0, m.bit_length() - 1
    while a and a.bit_length() - 1 >= deg:
        shift = a.bit_length() - 1 - deg
        q |= 1 << shift
        a ^= m << shift
    return q, a


def _clmul(a: int, b: int) -> int:
    out = 0
    while b:
        if b & 1:
            out ^= a
        a <<= 1
        b >>= 1
    return out


G_C = 1 << 32 | POLY_C
G_I = 1 << 32 | POLY_I
G = _clmul(G_C, G_I)  # the 64-bit generator the pair amounts to


def test_generator_polynomials_have_the_claimed_orders():
    # G_C = (x + 1)·P31; x has order 2^31 − 1 (a prime) modulo P31, so P31 is primitive
    p31, rest = _divmod(G_C, 0b11)
    assert rest == 0 and p31.bit_length() - 1 == 31
    assert _x_power(2**31 - 1, p31) == 1 and _x_power(2**31 - 1, G_C) == 1
    # G_I is primitive of degree 32: x^(2^32 − 1) = 1 and no x^((2^32 − 1)/q) = 1 for q | 2^32 − 1
    assert _x_power(2**32 - 1, G_I) == 1
    for q in (3, 5, 17, 257, 65537):
        assert _x_power((2**32 - 1) // q, G_I) != 1
    assert _divmod(G_I, 0b11)[1] != 0  # not divisible by x + 1, hence coprime to G_C (G_I is irreducible)
    order = math.lcm(2**31 - 1, 2**32 - 1)  # order of x modulo G: a 2-bit error must be that far apart
    assert order > 8 * (2**32 - 1) * 10**8  # far more than the bits of the largest body (u32 length)
    assert G.bit_length() - 1 == 64 and G & 1  # bursts of up to 64 bits


def _flip_polynomial(buf: np.ndarray, poly: int, shift: int) -> None:
    """XOR the error polynomial poly·x^shift into buf: bit k of the LSB-first stream is degree 8n − 1 − k."""
    top = 8 * buf.size - 1
    degree = 0
    while poly:
        if poly & 1:
            k = top - (degree + shift)
            buf[k // 8] ^= 1 << (k % 8)
        poly >>= 1
        degree += 1


def test_the_pair_is_one_64_bit_crc():
    """Errors that are multiples of G go unseen; multiples of one half's generator only are seen by the other."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 512, dtype=np.uint8)
    base = checksum64(torch.from_numpy(data))
    for shift in (0, 1, 7, 100, 3000):
        for poly, same_c, same_i in ((G, True, True), (G_C, True, False), (G_I, False, True)):
            bad = data.copy()
            _flip_polynomial(bad, poly, shift)
            new = checksum64(torch.from_numpy(bad))
            assert (new & 0xFFFFFFFF == base & 0xFFFFFFFF) == same_c
            assert (new >> 32 == base >> 32) == same_i


# ------------------------------------------------------------------------------- detection: checksum


def _random_buffer(n: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    arr = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return arr, torch.from_numpy(arr)  # the tensor shares the array's memory


def _flip_bits(arr: np.ndarray, bits) -> None:
    for bit in bits:
        arr[bit // 8] ^= np.uint8(1 << (bit % 8))


def test_every_single_bit_flip_changes_the_checksum():
    arr, t = _random_buffer(1024, 1)
    base = checksum64(t)
    for bit in range(8 * arr.size):
        _flip_bits(arr, [bit])
        assert checksum64(t) != base, bit
        _flip_bits(arr, [bit])


def test_the_same_bit_in_two_words_changes_the_checksum():
    """Every bit b, every pair of 8-byte words: the pattern that cancelled in the weighted sum."""
    arr, t = _random_buffer(256, 2)
    base = checksum64(t)
    words = arr.size // 8
    missed = []
    for i in range(words):
        for j in range(i + 1, words):
            for b in range(64):
                bits = (64 * i + b, 64 * j + b)
                _flip_bits(arr, bits)
                if checksum64(t) == base:
                    missed.append((i, j, b))
                _flip_bits(arr, bits)
    assert not missed, f"{len(missed)} of {words * (words - 1) // 2 * 64} missed, e.g. {missed[:3]}"


def test_random_two_bit_flips_change_the_checksum():
    arr, t = _random_buffer(4096, 3)
    base = checksum64(t)
    rng = random.Random(3)
    missed = 0
    for _ in range(20_000):
        bits = rng.sample(range(8 * arr.size), 2)
        _flip_bits(arr, bits)
        missed += checksum64(t) == base
        _flip_bits(arr, bits)
    assert missed == 0


def _burst(rng: random.Random, length: int, nbits: int) -> list[int]:
    start = rng.randrange(nbits - length + 1)
    inner = [start + k for k in range(1, length - 1) if rng.random() < 0.5]
    return sorted({start, start + length - 1, *inner})


def test_bursts_up_to_64_bits_change_the_checksum():
    arr, t = _random_buffer(4096, 4)
    base = checksum64(t)
    rng = random.Random(4)
    for length in range(1, 65):
        for _ in range(150):
            bits = _burst(rng, length, 8 * arr.size)
            _flip_bits(arr, bits)
            assert checksum64(t) != base, (length, bits)
            _flip_bits(arr, bits)


# ------------------------------------------------------------------------ detection: real messages


def threshold_message(numel: int, seed: int, threshold: float = 1.0):
    """A real two-slot threshold message with Golomb-coded positions: (buffer, specs)."""
    compressor = make("threshold", threshold=threshold, positions="golomb")
    slots = [Slot("w", 0, numel), Slot("b", 1, 8)]
    g = torch.Generator().manual_seed(seed)
    fields, specs = [], []
    for slot in slots:
        fields += compressor.compress(torch.randn(slot.numel, generator=g), slot, 0)
        specs += compressor.specs(slot)
    return encode(fields, specs), specs


def _rejected(buf: torch.Tensor, specs) -> bool:
    try:
        decode(buf, specs)
    except WireError:
        return True
    return False


def test_every_single_bit_flip_of_a_message_is_rejected():
    buf, specs = threshold_message(200, 5)
    assert 300 < buf.numel() < 700
    for bit in range(8 * buf.numel()):
        bad = buf.clone()
        bad[bit // 8] ^= 1 << (bit % 8)
        assert _rejected(bad, specs), bit


def test_the_same_bit_in_two_words_of_a_message_is_rejected():
    """Exhaustive over the body's 8-byte word pairs (word-aligned as the old checksum read them)."""
    buf, specs = threshold_message(40, 6, threshold=1.3)
    words = (buf.numel() - HEADER_BYTES) // 8
    assert 8 <= words <= 16
    missed = []
    for i in range(words):
        for j in range(i + 1, words):
            for b in range(64):
                bad = buf.clone()
                for w in (i, j):
                    byte = HEADER_BYTES + 8 * w + b // 8
                    bad[byte] ^= 1 << (b % 8)
                if not _rejected(bad, specs):
                    missed.append((i, j, b))
    assert not missed, f"{len(missed)} accepted, e.g. {missed[:3]}"


def test_random_two_bit_flips_of_a_message_are_rejected():
    buf, specs = threshold_message(3000, 7)
    rng = random.Random(7)
    for _ in range(1500):
        bad = buf.clone()
        for bit in rng.sample(range(8 * buf.numel()), 2):
            bad[bit // 8] ^= 1 << (bit % 8)
        assert _rejected(bad, specs)
    # the same bit of two words, the pairs drawn at random in a larger message
    words = (buf.numel() - HEADER_BYTES) // 8
    for _ in range(1500):
        bad = buf.clone()
        b = rng.randrange(64)
        for w in rng.sample(range(words), 2):
            bad[HEADER_BYTES + 8 * w + b // 8] ^= 1 << (b % 8)
        assert _rejected(bad, specs)


def test_bursts_up_to_32_bits_in_a_message_are_rejected():
    buf, specs = threshold_message(1000, 8)
    rng = random.Random(8)
    for length in range(1, 33):
        for _ in range(40):
            bad = buf.clone()
            for bit in _burst(rng, length, 8 * buf.numel()):
                bad[bit // 8] ^= 1 << (bit % 8)
            assert _rejected(bad, specs), length


def test_crc32_is_zlibs_whichever_implementation_computes_it():
    import zlib

    from gradcomp.wire import checksum

    gen = torch.Generator().manual_seed(5)
    for n in (0, 1, 3, 15, 16, 17, 63, 64, 65, 1000, 4096, 100_003):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        assert checksum.crc32(data) == zlib.crc32(data.numpy().tobytes())
    assert checksum.CRC32_IMPLEMENTATION in ("isal", "zlib")


def test_a_cpu_buffer_is_checksummed_where_it_is():
    buf = torch.arange(100, dtype=torch.uint8)
    assert to_host(buf).data_ptr() == buf.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_buffers_reach_the_host_through_one_reused_pinned_buffer():
    big = torch.randint(0, 256, (3_000_001,), dtype=torch.uint8)
    first = to_host(big.cuda())
    assert first.is_pinned() and torch.equal(first, big)
    where = first.data_ptr()
    small = to_host(big[:1000].cuda())
    assert small.data_ptr() == where and torch.equal(small, big[:1000])  # reused, not reallocated
    assert checksum64(big.cuda()) == checksum64(big)
    larger = torch.randint(0, 256, (5_000_000,), dtype=torch.uint8)
    assert torch.equal(to_host(larger.cuda()), larger)  # grown
