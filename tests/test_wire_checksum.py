"""The container's body checksum (gradcomp.wire.checksum): CRC-32C and CRC-32, and what they detect.

The detection tests run on the checksum alone and on real messages through ``decode``. The two-bit tests
(``test_the_same_bit_in_two_words_*``, ``test_random_two_bit_flips_*``) fail with the version-1 weighted-sum
checksum, which missed exactly those; single-bit flips and bursts were already caught by it (every weight was
odd, and a burst of at most 64 bits changes at most two adjacent words by amounts it could not cancel), so
those tests guard the CRC against a weaker replacement rather than reproduce the old failure.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from gradcomp import Slot, make
from gradcomp.errors import WireError
from gradcomp.wire import HEADER_BYTES, decode, encode
from gradcomp.wire.checksum import checksum64, crc32, crc32c, to_host
from wire_paths import device_path

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


# ------------------------------------------------- the device formulation (torch operations), tested on the CPU

from gradcomp.errors import ConfigError  # noqa: E402
from gradcomp.wire import Codec, FieldSpec  # noqa: E402
from gradcomp.wire.checksum import BLOCK_BYTES, checksum64_tensor  # noqa: E402
from gradcomp.wire.device import check_pending  # noqa: E402


def _unsigned(t: torch.Tensor) -> int:
    return int(t) & (2**64 - 1)


def test_the_torch_formulation_gives_the_host_checksum_for_every_size():
    gen = torch.Generator().manual_seed(29)
    sizes = [0, 1, 2, 3, 7, 8, 9, 31, 33, 1000, 4095, 4096, 4097, 65_537, 100_003, 3 * 2**20 + 5]
    sizes += [k * BLOCK_BYTES + d for k in (1, 2, 3, 5, 64, 127) for d in (-1, 0, 1)]  # block boundaries
    for n in sizes:
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        got = checksum64_tensor(data)
        assert got.dtype == torch.int64 and got.shape == () and got.device == data.device
        assert _unsigned(got) == checksum64(data), n
    for fill in (0, 255):  # all zeros, all ones: the init / final-xor conventions
        for n in (1, BLOCK_BYTES, 5 * BLOCK_BYTES + 3):
            data = torch.full((n,), fill, dtype=torch.uint8)
            assert _unsigned(checksum64_tensor(data)) == checksum64(data), (fill, n)
    check = torch.tensor(list(b"123456789"), dtype=torch.uint8)
    assert _unsigned(checksum64_tensor(check)) == 0xCBF43926 << 32 | 0xE3069283
    view = torch.randint(0, 256, (2000,), dtype=torch.uint8, generator=gen)[3:1500:2]  # a strided view
    assert _unsigned(checksum64_tensor(view)) == checksum64(view.contiguous())
    with pytest.raises(WireError):
        checksum64_tensor(view.to(torch.int32))


# around the Triton kernels' tile sizes: 64-byte blocks, 4 KB per program, 4096 entries per later program
_KERNEL_SIZES = [0, 1, 63, 64, 65, 4095, 4096, 4097, 64**3 - 1, 64**3 + 1, 64**3 * 3 + 17, 1_000_003]


_INTERPRETED = """
import sys, torch
from gradcomp.wire.checksum import checksum64, checksum64_tensor
gen = torch.Generator().manual_seed(5)
for n in [int(a) for a in sys.argv[1:]]:
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    got = int(checksum64_tensor(data, kernel="triton")) & (2**64 - 1)
    assert got == checksum64(data), n
for fill in (0, 255):
    data = torch.full((5000,), fill, dtype=torch.uint8)
    assert int(checksum64_tensor(data, kernel="triton")) & (2**64 - 1) == checksum64(data), fill
print("ok")
"""


_INTERPRETED_FAST = """
import torch
from gradcomp.wire import checksum as C
from gradcomp.wire.checksum import checksum64, checksum64_tensor
gen = torch.Generator().manual_seed(5)
data = torch.randint(0, 256, (3000,), dtype=torch.uint8, generator=gen)
def check(n, offset, **config):
    C.FAST_CONFIG.clear()
    C.FAST_CONFIG.update(config)
    view = data[offset:offset + n]  # views that start off a 16-byte boundary, as a body after its header does
    got = int(checksum64_tensor(view, kernel="triton-fast")) & (2**64 - 1)
    assert got == checksum64(view), (n, offset, config)
# iterations of 4 x 2 x 16 = 128 bytes in 3 programs: 1-15 bytes, one vector, the ends of an iteration, first
# programs whose run starts before the stream (iteration counts not divisible by 3), every offset modulo 16
for i, n in enumerate([1, 2, 3, 7, 8, 15, 16, 17, 127, 128, 129, 300, 700, 1001]):
    for offset in (i % 16, (5 * i + 3) % 16):
        check(n, offset, rows=4, k=2, programs=3)
for fill in (0, 255):
    view = torch.full((400,), fill, dtype=torch.uint8)[1:]
    assert int(checksum64_tensor(view, kernel="triton-fast")) & (2**64 - 1) == checksum64(view), fill
check(66 * 32 + 3, 5, rows=2, k=1, programs=70)  # 67 programs of one iteration: two base-64 digits
print("ok")
"""


def test_the_triton_kernels_give_the_host_checksum_in_the_interpreter():
    """gradcomp.wire.crc_triton run by Triton's interpreter on CPU tensors (subprocesses, side by side:
    TRITON_INTERPRET is read when the kernels are defined). Triton ships with CUDA builds of torch only, so this
    runs where it is installed (``pip install triton`` beside a CPU torch); scripts/gpu_check.sh runs the same
    kernels compiled, on a GPU. The "triton-fast" kernel runs with tiles of a few rows (its tables are made for
    any tile), so that the cases cover every offset modulo 16 and several programs with few iterations."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    sizes = [n for n in _KERNEL_SIZES if n <= 64**3 + 1]  # one and two launches; the interpreter is slow
    runs = [subprocess.Popen([sys.executable, "-c", script, *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for script, args in ((_INTERPRETED, map(str, sizes)), (_INTERPRETED_FAST, ()))]
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0 and out.strip() == "ok", err[-3000:]


def test_the_fast_kernels_tables():
    """The tables of the "triton-fast" kernel, without Triton: A^-t undoes A^t, the nibble images of a 16-byte
    piece xor to its raw CRC pair, and the step table advances a pair over one iteration."""
    from gradcomp.wire.checksum import _BASIS, _advance, _affine_constant, _apply, _fast_host_tables, _zero_byte

    rng = np.random.default_rng(3)
    state = rng.integers(0, 2**63, 50, dtype=np.int64).astype(np.uint64) * np.uint64(3)
    for t in (1, 5, 15, 4096, 2**33 + 7):
        assert np.array_equal(_apply(_advance(-t), _apply(_advance(t), state)), state), t
    assert np.array_equal(_advance(3), _zero_byte(_zero_byte(_zero_byte(_BASIS))))
    rows, k = 4, 2
    table = _fast_host_tables(rows, k)
    pieces, step = table[: k * 512].reshape(k, 32, 16), table[k * 512: k * 512 + 256].reshape(16, 16)
    row = table[k * 512 + 256:][: rows * 2048].reshape(rows, 8, 256)
    for _ in range(20):
        piece = rng.integers(0, 256, 16, dtype=np.uint8)
        value = int.from_bytes(piece.tobytes(), "little")
        got = np.uint64(0)
        for c in range(32):
            got ^= pieces[k - 1, c, value >> (4 * c) & 15]  # the last tile: no zero bytes after it
        raw = checksum64(torch.from_numpy(piece)) ^ _affine_constant(16)
        assert int(got) == raw
        pair = int(rng.integers(0, 2**63)) * 2 + 1
        advanced = np.uint64(0)
        for c in range(16):
            advanced ^= step[c, pair >> (4 * c) & 15]
        assert advanced == _apply(_advance(k * rows * 16), np.array([pair], dtype=np.uint64))[0]
    assert np.array_equal(row[-1], _BASIS) and np.array_equal(row[-2], _advance(16))
    assert (table.size - k * 512 - 256 - rows * 2048 - 16 * 256) % (64 * 256) == 0  # whole digit tables


def test_the_cuda_default_kernel_and_its_environment_switch(monkeypatch):
    """A CUDA buffer's checksum takes the fast Triton kernel unless GRADCOMP_CHECKSUM_KERNEL names another (the same
    bytes whichever: the CUDA test checks all three); a name that is not a kernel is refused."""
    from gradcomp.wire.checksum import KERNEL_ENV, cuda_kernel

    monkeypatch.delenv(KERNEL_ENV, raising=False)
    assert cuda_kernel() == "triton-fast"
    for name in ("triton", "torch", "triton-fast"):
        monkeypatch.setenv(KERNEL_ENV, name)
        assert cuda_kernel() == name
    monkeypatch.setenv(KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match=KERNEL_ENV):
        cuda_kernel()


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel"):
        checksum64_tensor(torch.zeros(3, dtype=torch.uint8), kernel="cuda")


def test_a_single_flipped_bit_changes_the_torch_checksum():
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (5 * BLOCK_BYTES + 7,), dtype=torch.uint8, generator=gen)
    base = _unsigned(checksum64_tensor(data))
    for bit in range(0, 8 * data.numel(), 13):
        bad = data.clone()
        bad[bit // 8] ^= 1 << (bit % 8)
        assert _unsigned(checksum64_tensor(bad)) == checksum64(bad) != base


def _mixed_message(seed: int):
    """Fields of every codec, fixed counts (the device decode's one-transfer path) and variable ones."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randperm(5000, generator=g)[:300].sort().values
    fields = [
        torch.randn(1001, generator=g),
        torch.randn(77, generator=g).half(),
        torch.randn(64, generator=g).bfloat16(),
        torch.randint(0, 8, (333,), generator=g),
        pos,
        torch.randint(0, 2**13, (10,), generator=g),
    ]
    fixed = [
        FieldSpec(Codec.F32, count=1001),
        FieldSpec(Codec.F16, count=77),
        FieldSpec(Codec.BF16, count=64),
        FieldSpec(Codec.BITS, count=333, width=3),
        FieldSpec(Codec.POSITIONS, count=300, universe=5000),
        FieldSpec(Codec.BITS, count=10, width=13),
    ]
    variable = fixed[:4] + [FieldSpec(Codec.GOLOMB, max_count=5000, universe=5000), fixed[5]]
    return fields, fixed, variable


def _decode_with(path: str, monkeypatch, buf, specs):
    device_path(monkeypatch, "1" if path == "device" else "0" == "1")
    return decode(buf, specs)


@pytest.mark.parametrize("encoder,decoder", [("device", "host"), ("host", "device"), ("device", "device")])
def test_a_message_encoded_on_one_path_decodes_on_the_other(monkeypatch, encoder, decoder):
    for seed in range(3):
        fields, fixed, variable = _mixed_message(seed)
        for specs in (fixed, variable):
            device_path(monkeypatch, False)
            reference = encode(fields, specs)
            device_path(monkeypatch, "1" if encoder == "device" else "0" == "1")
            buf = encode(fields, specs)
            assert torch.equal(buf, reference)  # the same bytes, header and checksum included
            out = _decode_with(decoder, monkeypatch, buf, specs)
            for got, sent in zip(out, fields):
                assert torch.equal(got.to(sent.dtype), sent)
    check_pending()


@pytest.mark.parametrize("specs_kind", ["fixed", "variable"])
def test_the_device_decode_rejects_what_the_host_decode_rejects(monkeypatch, specs_kind):
    fields, fixed, variable = _mixed_message(4)
    specs = fixed if specs_kind == "fixed" else variable
    buf = encode(fields, specs)
    rng = random.Random(4)
    cases = [(bit,) for bit in rng.sample(range(8 * buf.numel()), 60)]  # anywhere: header, section heads, data
    cases += [tuple(rng.sample(range(8 * HEADER_BYTES, 8 * buf.numel()), 2)) for _ in range(40)]
    for bits in cases:
        bad = buf.clone()
        for bit in bits:
            bad[bit // 8] ^= 1 << (bit % 8)
        messages = []
        for path in ("host", "device"):
            with pytest.raises(WireError) as err:
                _decode_with(path, monkeypatch, bad, specs)
            messages.append(str(err.value))
        assert messages[0] == messages[1]  # the device path falls back to the host path's diagnosis


def test_set_padding_bits_and_bad_positions_under_a_valid_checksum_are_rejected_on_the_device_path(monkeypatch):
    from gradcomp.wire.checksum import checksum64 as host_checksum

    fields, fixed, _ = _mixed_message(5)
    buf = encode(fields, fixed)

    def reframed(mutate):
        bad = buf.clone()
        mutate(bad)
        body = bad[HEADER_BYTES:]
        bad[12:20] = torch.tensor(list(host_checksum(body).to_bytes(8, "little")), dtype=torch.uint8)
        return bad

    bits_end = HEADER_BYTES + 4 * 10 + 4 * 1001 + 2 * 77 + 2 * 64 + (333 * 3 + 7) // 8  # the 3-bit section's end
    padding = reframed(lambda b: b.__setitem__(bits_end - 1, int(b[bits_end - 1]) | 0x80))
    with pytest.raises(WireError, match="padding"):
        _decode_with("device", monkeypatch, padding, fixed)
    pos_start = bits_end + 10
    swapped = reframed(lambda b: b.__setitem__(pos_start, 0xFF))  # the first position jumps past the second
    with pytest.raises(WireError, match="increasing|range"):
        _decode_with("device", monkeypatch, swapped, fixed)


def test_sender_checks_of_the_device_path_are_raised_at_the_next_read(monkeypatch):
    device_path(monkeypatch)
    check_pending()  # nothing left over from other tests
    spec = [FieldSpec(Codec.BITS, count=3, width=3)]
    encode([torch.tensor([1, 9, 2])], spec)  # 9 does not fit 3 bits: not read back here
    with pytest.raises(ConfigError, match=r"2\*\*3"):
        check_pending()
    encode([torch.tensor([5, 3, 4])], [FieldSpec(Codec.POSITIONS, count=3, universe=10)])  # not increasing
    good = encode([torch.tensor([1, 2, 3])], spec)
    with pytest.raises(ConfigError, match="increasing"):
        decode(good, spec)  # raised with the next device-path decode's one transfer
    assert decode(good, spec)[0].tolist() == [1, 2, 3]  # and only once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_checksum_on_the_device_and_messages_across_devices():
    gen = torch.Generator().manual_seed(11)
    for n in (0, 1, 63, 64, 65, 100_003, 3 * 2**20 + 5):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        got = checksum64_tensor(data.cuda())
        assert got.is_cuda and _unsigned(got) == checksum64(data), n
    for n in _KERNEL_SIZES + [4096**2 + 4097]:  # both device kernels; the last takes three Triton launches
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        for kernel in ("torch", "triton", "triton-fast"):
            assert _unsigned(checksum64_tensor(data.cuda(), kernel=kernel)) == checksum64(data), (kernel, n)
    big = torch.randint(0, 256, (100_000,), dtype=torch.uint8, generator=gen).cuda()
    for offset in range(16):  # "triton-fast" reads 16-byte vectors from the aligned address before a view
        for n in (1, 15, 16, 17, 4095, 65_537 + offset):
            view = big[offset:offset + n]
            assert _unsigned(checksum64_tensor(view, kernel="triton-fast")) == checksum64(view), (offset, n)
    for seed in range(2):
        fields, fixed, variable = _mixed_message(seed)
        for specs in (fixed, variable):
            on_cpu = encode(fields, specs)
            on_gpu = encode([f.cuda() for f in fields], specs)
            assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), on_cpu)  # the same bytes, checksum included
            for buf in (on_gpu.cpu(), on_cpu.cuda()):  # encoded on one side, decoded on the other
                for got, sent in zip(decode(buf, specs), fields):
                    assert torch.equal(got.cpu().to(sent.dtype), sent)
    check_pending()


def test_decodes_checked_together_raise_what_decode_raises(monkeypatch):
    from gradcomp.schemes.single_round import aggregate_buffers
    from gradcomp.wire.device import DeviceChecks

    device_path(monkeypatch)
    fields, fixed, _ = _mixed_message(6)
    good = encode(fields, fixed)
    bad = good.clone()
    bad[HEADER_BYTES + 40] ^= 4  # a data bit: the checksum no longer matches
    later = DeviceChecks()
    for buf in (good, good):
        decode(buf, fixed, later)
    assert later.read([torch.tensor(True), torch.tensor(False)]) == [True, False]
    decode(good, fixed, later)
    decode(bad, fixed, later)  # nothing read yet: no error here
    with pytest.raises(WireError, match="checksum mismatch"):
        later.read()
    # in an aggregation: the corrupted second message is refused before any result is returned
    compressor = make("topk", density=0.1)
    slots = [Slot("w", 0, 500), Slot("b", 1, 8)]
    g = torch.Generator().manual_seed(6)
    message = encode(
        [f for s in slots for f in compressor.compress(torch.randn(s.numel, generator=g), s, 0)],
        [spec for s in slots for spec in compressor.specs(s)],
    )
    assert len(aggregate_buffers(compressor, slots, [message, message], 0, torch.device("cpu"))) == 2
    broken = message.clone()
    broken[-1] ^= 1
    with pytest.raises(WireError, match="checksum mismatch"):
        aggregate_buffers(compressor, slots, [message, broken], 0, torch.device("cpu"))


def test_a_variable_message_leaves_its_data_checks_for_the_read(monkeypatch):
    """A Golomb message (its layout depends on the data) decoded with ``later``: its headers and checksum are read
    at once, its data checks (the Golomb code structure here) wait for ``later.read()``, which raises the error the
    host decoder names."""
    from gradcomp.wire.device import DeviceChecks

    device_path(monkeypatch)
    pos = torch.tensor([3, 40, 41, 900, 4000])
    specs = [FieldSpec(Codec.GOLOMB, max_count=10, universe=5000)]
    good = encode([pos], specs)
    bad = good.clone()
    bad[-1] = 0xFF  # the last stream byte: padding bits set (or codes past the count), checksum made to match
    bad[12:20] = torch.tensor(list(checksum64(bad[HEADER_BYTES:]).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(WireError, match="golomb"):
        decode(bad, specs)  # without later: raised at once
    later = DeviceChecks()
    assert decode(good, specs, later)[0].tolist() == pos.tolist()
    assert len(later._items) == 1  # its check waits for the read
    decode(bad, specs, later)  # nothing raised yet
    with pytest.raises(WireError, match="golomb"):
        later.read()


def test_one_golomb_field_of_known_count_decodes_with_one_read(monkeypatch):
    """A message whose counts are exact and whose one Golomb stream's length is what the message's length leaves
    (LGC's positions) takes the fixed-layout device path: one small read, not the whole message to the host; a
    stream with a fault the checksum does not see is still refused with the host path's error."""
    from sync_counting import counting

    device_path(monkeypatch)
    check_pending()
    g = torch.Generator().manual_seed(5)
    pos = torch.randperm(20000, generator=g)[:200].sort().values
    specs = [FieldSpec(Codec.F32, count=3), FieldSpec(Codec.GOLOMB, count=200, universe=20000)]
    values = torch.randn(3, generator=g)
    good = encode([values, pos], specs)
    with counting() as counter:
        got = decode(good, specs)
    assert torch.equal(got[1], pos) and torch.equal(got[0], values)
    assert counter.total == 1, counter
    bad = good.clone()
    bad[-1] = 0xFF  # padding bits / codes past the count; the checksum made to match
    bad[12:20] = torch.tensor(list(checksum64(bad[HEADER_BYTES:]).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(WireError, match="golomb"):
        decode(bad, specs)
    with pytest.raises(WireError):
        decode(good[:-1], specs)  # cut: the header's length disagrees
