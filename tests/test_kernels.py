"""The compiled kernels (gradcomp.kernels) against the numpy/torch paths they replace: the same bytes, the same
codes, the same errors; and the generated bit-packing module against its generator."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import gradcomp
from gradcomp import kernels, wire
from gradcomp.compressors.base import Slot
from gradcomp.compressors.natural import cnat_decode, cnat_encode, uniform23
from gradcomp.compressors.sign import _below
from gradcomp.errors import ConfigError, NonFiniteGradientError, WireError
from gradcomp.wire import Codec, FieldSpec
from gradcomp.wire.bits import pack_bits, pack_bits_into, packed_nbytes, packs_into, unpack_bits
from wire_paths import device_path

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba is not importable")

ROOT = Path(__file__).resolve().parent.parent
WIDTHS = sorted(kernels.BITPACK_WIDTHS)
SIZES = (4097, 64 * 100, 64 * 100 + 63, 100_003)  # above the small-array path; whole blocks and tails


@pytest.fixture
def without_kernels(monkeypatch):
    """A context in which every caller takes its numpy/torch path."""

    class Switch:
        def __enter__(self):
            monkeypatch.setenv("GRADCOMP_KERNELS", "0")

        def __exit__(self, *exc):
            monkeypatch.delenv("GRADCOMP_KERNELS")

    return Switch()


def test_generated_module_is_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "scripts" / "generate_bitpack_kernels.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.TARGET.read_text() == generator.source()
    assert set(generator.KERNEL_WIDTHS) == kernels.BITPACK_WIDTHS


def test_environment_switch_disables_kernels(without_kernels):
    big = 1 << 22
    assert kernels.bitpack(9, big) is not None and kernels.cnat() is not None and kernels.sign(big) is not None
    with without_kernels:
        assert not kernels.enabled()
        assert kernels.bitpack(9, big) is None and kernels.cnat() is None and kernels.sign(big) is None
    assert kernels.bitpack(8, big) is None and kernels.bitpack(1, big) is None and kernels.bitpack(17, big) is None


_POLICY = """
import sys, torch
from gradcomp.wire import pack_bits
from gradcomp.compressors.sign import pack_signs
pack_bits(torch.ones(4096, dtype=torch.int64), 9)
pack_signs(torch.randn(1 << 21))
print("numba" in sys.modules)
{big}
print("numba" in sys.modules)
"""


@pytest.mark.parametrize(
    "big",
    [
        "pack_bits(torch.ones(4097, dtype=torch.int64), 9)",
        "pack_signs(torch.randn(1 << 22))",
        "import gradcomp; gradcomp.make('cnat').compress(torch.ones(10), gradcomp.Slot('w', 0, 10), 0)",
    ],
)
def test_small_tensors_do_not_load_numba(big):
    """numba costs ~110 MB per process: small fields and sign bitmaps take the numpy paths until it is loaded."""
    import subprocess
    import sys

    code = _POLICY.format(big=big)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("n", SIZES)
def test_pack_and_unpack_match_the_numpy_path(width, n, without_kernels):
    g = torch.Generator().manual_seed(width * 1000 + n)
    values = torch.randint(0, 1 << width, (n,), generator=g)
    values[:64] = (1 << width) - 1  # every bit of a whole block set
    for dtype in (torch.int64, torch.int32, torch.int16) + ((torch.uint8, torch.int8) if width < 8 else ()):
        v = values.to(dtype)
        assert packs_into(v, width)
        packed = pack_bits(v, width)
        with without_kernels:
            assert not packs_into(v, width)
            expected = pack_bits(v, width)
            assert torch.equal(unpack_bits(expected, width, n), values)
        assert torch.equal(packed, expected), dtype
        assert torch.equal(unpack_bits(packed, width, n), values)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("offset", (0, 3, 30))
def test_pack_into_an_unaligned_destination(width, offset):
    n = 64 * 70 + 5
    values = torch.randint(0, 1 << width, (n,), generator=torch.Generator().manual_seed(width))
    nbytes = packed_nbytes(n, width)
    memory = np.full(offset + nbytes + 7, 0xAB, dtype=np.uint8)
    pack_bits_into(values, width, memory[offset : offset + nbytes])
    assert bytes(memory[offset : offset + nbytes]) == bytes(pack_bits(values, width).numpy())
    assert (memory[:offset] == 0xAB).all() and (memory[offset + nbytes :] == 0xAB).all()  # nothing else written
    with pytest.raises(ConfigError, match="destination size"):
        pack_bits_into(values, width, memory[: nbytes - 1])


@pytest.mark.parametrize("width", (2, 9, 15))
@pytest.mark.parametrize("where", (0, 6399, 6400 + 62))  # in a whole block, its last value, in the tail
def test_out_of_range_values_are_refused(width, where):
    values = torch.zeros(6400 + 63, dtype=torch.int32)
    for bad in (1 << width, -1):
        values[where] = bad
        with pytest.raises(ConfigError, match=rf"2\*\*{width}.*\[{min(bad, 0)}, {max(bad, 0)}\]"):
            pack_bits(values, width)
        with pytest.raises(ConfigError, match="2\\*\\*"):
            wire.encode([values], [FieldSpec(Codec.BITS, count=values.numel(), width=width)])


@pytest.mark.parametrize("width", (3, 9, 15))
def test_nonzero_padding_bits_are_refused(width):
    n = 64 * 80 + 7  # the last byte has unused high bits for these widths
    assert (n * width) % 8
    buf = pack_bits(torch.ones(n, dtype=torch.int64), width).clone()
    buf[-1] |= 0x80
    with pytest.raises(WireError, match="padding"):
        unpack_bits(buf, width, n)


@pytest.mark.parametrize(
    "name",
    ["cnat", "terngrad", "natural_dithering", "random_dithering", "qsgd", "signsgd", "signum", "efsignsgd", "onebit"],
)
def test_messages_are_identical_with_and_without_kernels(name, without_kernels):
    assert kernels.sign(1 << 22) is not None  # loads numba: from here on every kernel takes any size
    compressor = gradcomp.make(name, error_feedback=False)
    x = torch.randn(50_001, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 50_001)
    slot = Slot("w", 0, x.numel())
    fields = compressor.compress(x, slot, 4)
    message = wire.encode(fields, compressor.specs(slot))
    compressor = gradcomp.make(name, error_feedback=False)  # a fresh one: signum's momentum starts again
    with without_kernels:
        fields_torch = compressor.compress(x, slot, 4)
        message_torch = wire.encode(fields_torch, compressor.specs(slot))
        decoded_torch = compressor.decompress(wire.decode(message_torch, compressor.specs(slot)), slot, 4)
    assert torch.equal(message, message_torch)
    decoded = compressor.decompress(wire.decode(message, compressor.specs(slot)), slot, 4)
    assert torch.equal(decoded, decoded_torch)


# ------------------------------------------------------------------------------------------------------ cnat


def _awkward_floats(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-40, 37, n)
    specials = [0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, 1.17549435e-38, 2.0**127, -(2.0**127), 3.4e38, -3.4e38, 1.0]
    x[: len(specials)] = torch.tensor(specials)
    return x


@pytest.mark.parametrize("n", [0, 1, 8, 131_073])
def test_cnat_codes_of_small_and_empty_tensors_agree(n, without_kernels):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    codes = cnat_encode(x, 9)
    with without_kernels:
        expected = cnat_encode(x, 9)
    assert codes.dtype == expected.dtype == torch.int16 and codes.shape == expected.shape == (n,)
    assert torch.equal(codes, expected)


@pytest.mark.parametrize("key", [0, 1, 12345, (1 << 63) - 1])
def test_cnat_kernel_codes_equal_the_torch_definition(key, without_kernels):
    x = _awkward_floats(300_017, key % 97)
    codes = cnat_encode(x, key)
    with without_kernels:
        expected = cnat_encode(x, key)
    assert codes.dtype == expected.dtype == torch.int16
    assert torch.equal(codes, expected)
    assert int(codes[1]) == 0 and codes[7:11].tolist() == [254, 510, 254, 510]  # -0.0; |x| >= 2^127 never rounds up
    # entries of x coded one piece at a time with the kernel's offset give the codes of the whole
    kernel = kernels.cnat()
    bits = x.view(torch.int32).numpy()  # (the kernel module; numba is loaded by now)
    pieces = np.empty(x.numel(), dtype=np.int16)
    for start in range(0, x.numel(), 70_000):
        kernel.cnat_codes(bits[start : start + 70_000], key, start, pieces[start : start + 70_000])
    assert np.array_equal(pieces, codes.numpy())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 99_999])
def test_cnat_kernel_refuses_non_finite_values(bad, where, without_kernels):
    x = torch.randn(100_000)
    x[where] = bad
    with pytest.raises(NonFiniteGradientError, match="w.*cnat"):
        cnat_encode(x, 3, "w")
    with without_kernels, pytest.raises(NonFiniteGradientError):
        cnat_encode(x, 3, "w")


def test_cnat_decode_and_accumulate_kernels_equal_the_torch_path(without_kernels):
    codes = torch.arange(512, dtype=torch.int64).repeat(300)
    codes[codes == 256] = 0  # the encoder never makes a sign on exponent 0
    values = cnat_decode(codes)
    with without_kernels:
        expected = cnat_decode(codes)
    assert torch.equal(values.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(cnat_decode(codes.to(torch.int16)).view(torch.int32), expected.view(torch.int32))
    compressor = gradcomp.make("cnat")
    slot = Slot("w", 0, codes.numel())
    total = torch.randn(codes.numel(), generator=torch.Generator().manual_seed(2)) * 1e30
    reference = total.clone() + expected
    compressor.accumulate([codes], slot, 0, total)
    assert torch.equal(total.view(torch.int32), reference.view(torch.int32))


def test_uniform23_is_uniform_and_fresh_per_key():
    n = 1 << 20
    u = uniform23(7, 0, n)
    assert int(u.min()) >= 0 and int(u.max()) < 1 << 23
    # mean and variance of a uniform on [0, 2^23): 2^22 and 2^46/12, each within 5 standard errors
    mean, var = u.double().mean().item(), u.double().var().item()
    assert abs(mean - 2**22) < 5 * math.sqrt(2**46 / 12 / n)
    assert abs(var / (2**46 / 12) - 1) < 5 * math.sqrt(0.8 / n)
    # the 256 buckets of the top 8 bits: chi-square with 255 degrees of freedom stays below its 0.9999 quantile
    counts = torch.bincount(u >> 15, minlength=256).double()
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    assert chi2 < 255 + 4.0 * math.sqrt(2 * 255) + 30
    # another key, and the next entries of the same key, are uncorrelated with these draws
    for other in (uniform23(8, 0, n), uniform23(7, n, n)):
        r = torch.corrcoef(torch.stack([u.double(), other.double()]))[0, 1].item()
        assert abs(r) < 5 / math.sqrt(n)
    # a piece starting at an offset is the same numbers as the whole
    assert torch.equal(uniform23(7, 1000, 5000), u[1000:6000])


# ------------------------------------------------------------------------------------------------------ signs


@pytest.mark.parametrize("n", [1, 7, 8, 9, 4099, 262_144 + 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sign_bits_are_packbits_of_the_negative_mask(n, dtype):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=dtype)
    x[::5] = -0.0  # not negative
    x[4::7] = 0.0
    x[6::19] = torch.finfo(dtype).smallest_normal * 2.0**-20  # a subnormal: positive in both comparisons
    x[1::11] = float("nan")
    x[2::13] = -float("nan")  # nor is a NaN with the sign bit set
    x[3::17] = -float("inf")
    a = x.numpy()
    for compare, zero_negative in ((np.less, False), (np.less_equal, True)):  # x < 0, and x <= 0 for zeros as −
        out = np.full((n + 7) // 8, 0xFF, dtype=np.uint8)
        below = _below(a.dtype, zero_negative)
        negatives = kernels.sign(1 << 22).sign_bits(a, out, below)
        assert np.array_equal(out, np.packbits(compare(a, 0), bitorder="little"))  # padding bits 0 as well
        assert negatives == int(compare(a, 0).sum())
        longer = np.full((n + 7) // 8 + 3, 0xFF, dtype=np.uint8)  # bytes past the bitmap are not counted
        assert kernels.sign(1 << 22).sign_bits(a, longer, below) == negatives


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "onebit"])
def test_sign_decoding_kernels_give_the_same_sums(name, without_kernels):
    assert kernels.sign(1 << 22) is not None  # loads numba: from here on every kernel takes any size
    compressor = gradcomp.make(name, error_feedback=False)
    n = 100_003
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    slot = Slot("w", 0, n)
    local = compressor.compress(x, slot, 0)
    wired = wire.decode(wire.encode(local, compressor.specs(slot)), compressor.specs(slot))
    start = torch.randn(n, generator=torch.Generator().manual_seed(4))
    results = []
    for fields in (local, wired):  # uint8 bytes from the compressor, int64 from the wire
        for kernels_on in (True, False):
            added, subtracted = start.clone(), start.clone()
            if kernels_on:
                compressor.accumulate(fields, slot, 0, added)
                compressor.subtract_sent(fields, slot, 0, subtracted)
            else:
                with without_kernels:
                    compressor.accumulate(fields, slot, 0, added)
                    compressor.subtract_sent(fields, slot, 0, subtracted)
            results.append((added.view(torch.int32), subtracted.view(torch.int32)))
    decoded = compressor.decompress(local, slot, 0)
    assert torch.equal(results[0][0], (start + decoded).view(torch.int32))
    assert torch.equal(results[0][1], (start - decoded).view(torch.int32))
    for added, subtracted in results[1:]:
        assert torch.equal(added, results[0][0]) and torch.equal(subtracted, results[0][1])


# ---------------------------------------------------------------------------------- the lookup decoder


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("natural_dithering", {"levels": 8}),
        ("natural_dithering", {"levels": 3, "norm": "inf", "norm_codec": "cnat"}),
        ("random_dithering", {"levels": 7}),
        ("random_dithering", {"levels": 127}),
        ("qsgd", {}),
        ("terngrad", {}),
    ],
)
@pytest.mark.parametrize("scale", [0.75, 0.0, 3.0e38])
def test_lookup_decode_and_accumulate_equal_the_torch_path(name, params, scale, without_kernels):
    """Every code the wire can carry (levels above s too, and TernGrad's unused 3), repeated past the kernel's
    size limit, decoded and added with and without the compiled decoder: the same float32 bits."""
    compressor = gradcomp.make(name, **params)
    # every code the width holds, the ones no sender makes too (a receiver refuses those: check_message,
    # tests/test_received_values.py): the two decoders must agree on them all the same
    compressor.check_message = lambda *args: None
    width = 2 if name == "terngrad" else compressor.width
    codes = torch.arange(1 << width, dtype=torch.int64).repeat(9000 >> width << 1)
    assert codes.numel() >= kernels.BITPACK_MIN_COUNT
    if name != "terngrad" and params.get("norm_codec") == "cnat":
        head = cnat_encode(torch.tensor([scale]), 5)
    else:
        head = torch.tensor([scale], dtype=torch.float32)
    fields, slot = [head, codes], Slot("w", 0, codes.numel())
    total = torch.randn(codes.numel(), generator=torch.Generator().manual_seed(3))
    added = total.clone()
    values = compressor.decompress(fields, slot, 0)
    compressor.accumulate(fields, slot, 0, added)
    with without_kernels:
        expected = compressor.decompress(fields, slot, 0)
        expected_added = total.clone()
        compressor.accumulate(fields, slot, 0, expected_added)
    assert kernels.lookup(codes.numel()) is not None  # the first pair did take the kernel
    assert torch.equal(values.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(added.view(torch.int32), expected_added.view(torch.int32))


def test_the_lookup_table_is_built_once_per_instance():
    compressor = gradcomp.make("natural_dithering", levels=5)
    slot = Slot("w", 0, 10_000)
    fields = [torch.tensor([2.0]), torch.zeros(10_000, dtype=torch.int64)]
    compressor.decompress(fields, slot, 0)
    table = compressor._table
    compressor.decompress(fields, slot, 1)
    assert compressor._table is table and table.numel() == 1 << compressor.level_bits


def test_the_lookup_decoder_refuses_a_sum_of_another_size():
    assert kernels.lookup(1 << 22) is not None
    compressor = gradcomp.make("terngrad")
    fields = [torch.tensor([1.0]), torch.ones(10_000, dtype=torch.int64)]
    with pytest.raises(ConfigError, match="10000 codes cannot be added into a tensor of 9999"):
        compressor.accumulate(fields, Slot("w", 0, 10_000), 0, torch.zeros(9_999))


def test_cnat_accumulate_refuses_a_sum_of_another_size():
    compressor = gradcomp.make("cnat")
    with pytest.raises(RuntimeError, match="size"):  # torch's own message: the kernel would write past the end
        compressor.accumulate([torch.zeros(10_000, dtype=torch.int16)], Slot("w", 0, 10_000), 0, torch.zeros(9_999))


@pytest.mark.parametrize("width", [1, 2, 8, 9, 15, 16, 31, 32])
@pytest.mark.parametrize("kernels_on", [True, False])
def test_bits_fields_decode_to_the_narrowest_dtype_on_every_path(width, kernels_on, without_kernels):
    """The compiled unpacker, the windowed numpy path (widths 9-16), the small-array and the torch paths: the
    same values, in int16 up to 15 bits, int32 up to 31, int64 for 32."""
    gen = torch.Generator().manual_seed(width)
    for n in (100, 100_003):  # the small-array path, then the large ones
        values = torch.randint(0, 1 << min(width, 62), (n,), generator=gen, dtype=torch.int64) & ((1 << width) - 1)
        spec = [FieldSpec(Codec.BITS, count=n, width=width)]
        if kernels_on:
            (out,) = wire.decode(wire.encode([values], spec), spec)
        else:
            with without_kernels:
                (out,) = wire.decode(wire.encode([values], spec), spec)
        assert out.dtype == wire.bits.decoded_dtype(width)
        assert torch.equal(out.to(torch.int64), values)


# ---------------------------------------------------------------------------------- dithering codes


def _dithering_inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y in [0, 1] with the awkward values (0, subnormals, powers of two, 1 and just above), u with 0 and the
    values the comparisons meet, x with signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.rand(n, generator=gen) ** 6  # many small values
    special = [0.0, 1e-45, 1e-40, 2.0**-126, 2.0**-127, 2.0**-8, 2.0**-7, 0.5, 0.75, 1.0, 1.0000001, 0.1]
    y[: len(special)] = torch.tensor(special)
    y[len(special) : len(special) + 200] = 2.0 ** -torch.arange(200).clamp(max=149).float()
    u = torch.rand(n, generator=gen)
    u[:5] = torch.tensor([0.0, 0.5, 0.25, 0.9999999, 0.0])
    x = torch.randn(n, generator=gen)
    x[:4] = torch.tensor([-0.0, 0.0, -1.0, 1.0])
    return y, u, x


@pytest.mark.parametrize(("name", "levels"), [("random_dithering", 1), ("random_dithering", 7),
                                              ("random_dithering", 127), ("random_dithering", 70_000),
                                              ("natural_dithering", 1), ("natural_dithering", 8),
                                              ("natural_dithering", 126), ("qsgd", 127)])  # fmt: skip
def test_dithering_code_kernels_equal_the_torch_operations(name, levels):
    compressor = gradcomp.make(name, levels=levels)
    kernel = compressor._codes_kernel(1 << 22)
    assert kernel is not None
    y, u, x = _dithering_inputs(200_003, levels)
    dtype = wire.bits.decoded_dtype(compressor.width)  # what compress allocates
    codes = torch.empty(y.numel(), dtype=dtype)
    kernel(y.numpy(), u.numpy(), x.numpy(), compressor.levels, compressor.level_bits, codes.numpy())
    expected = torch.empty(y.numel(), dtype=torch.int64)
    compressor._codes(y.clone(), u.clone(), x, expected, cpu=True)
    assert np.array_equal(codes.numpy().astype(np.int64), expected.numpy())
    assert codes.min() >= 0 and (codes & ((1 << compressor.level_bits) - 1)).max() <= levels


def test_a_subclass_with_its_own_levels_gets_the_torch_path():
    from gradcomp.compressors.natural import RandomDithering

    class Coarser(RandomDithering):
        def _level_index(self, y, u):
            return super()._level_index(y, u) // 2

    assert Coarser(levels=7)._codes_kernel(1 << 22) is None
    assert RandomDithering(levels=7)._codes_kernel(1 << 22) is not None


def test_compiled_shortcuts_stand_aside_for_a_subclass_s_own_decoding():
    from gradcomp.compressors.natural import RandomDithering, TernGrad

    class Doubled(RandomDithering):
        def decompress(self, fields, slot, step):
            return 2 * super().decompress(fields, slot, step)

    class OwnCodes(RandomDithering):
        def _codes(self, y, u, x, out, cpu):
            super()._codes(y, u, x, out, cpu)

    assert OwnCodes(levels=7)._codes_kernel(1 << 22) is None
    assert kernels.lookup(1 << 22) is not None
    compressor, slot = Doubled(levels=7), Slot("w", 0, 10_000)
    fields = compressor.compress(torch.randn(10_000), slot, 0)
    total = torch.zeros(10_000)
    compressor.accumulate(fields, slot, 0, total)
    assert torch.equal(total, compressor.decompress(fields, slot, 0))
    with pytest.raises(ConfigError, match="5000 probabilities for 10000 entries"):
        TernGrad().ternary_codes(torch.randn(10_000), torch.rand(5_000), slot, 0)


# ---------------------------------------------------------------------------------- random-k's positions


@pytest.mark.parametrize(
    "n, k", [(10_000_000, 100_000), (1 << 20, 4097), (100_000, 24_999), (64 * 1000 + 5, 5000), (4097 * 1024, 4097)]
)
def test_random_k_positions_are_those_of_the_sort(n, k, without_kernels):
    from gradcomp.compressors.sparse import sample_without_replacement

    cpu = torch.device("cpu")
    assert kernels.sample(n, k) is not None
    for seed in range(3):
        compiled = sample_without_replacement(n, k, torch.Generator().manual_seed(seed), cpu)
        with without_kernels:
            assert kernels.sample(n, k) is None
            sorted_path = sample_without_replacement(n, k, torch.Generator().manual_seed(seed), cpu)
        assert compiled.dtype == torch.int64 and torch.equal(compiled, sorted_path)
        assert bool((compiled[1:] > compiled[:-1]).all()) and 0 <= int(compiled[0]) and int(compiled[-1]) < n


def test_random_k_positions_over_several_rounds_of_draws(monkeypatch, without_kernels):
    """Rounds far shorter than k, so both paths must draw again and again: the same draws, the same answer."""
    from gradcomp.compressors import sparse

    def short_rounds(n, k):
        while True:
            yield 97

    monkeypatch.setattr(sparse, "_draw_sizes", short_rounds)
    n, k, cpu = 50_000, 10_000, torch.device("cpu")
    compiled = sparse.sample_without_replacement(n, k, torch.Generator().manual_seed(5), cpu)
    with without_kernels:
        sorted_path = sparse.sample_without_replacement(n, k, torch.Generator().manual_seed(5), cpu)
    assert torch.equal(compiled, sorted_path) and compiled.numel() == k


def test_radix_sort_sorts_keys_of_any_width():
    sample_kernel = kernels.sample(1 << 20, 1 << 14)
    rng = np.random.default_rng(0)
    for bits in (1, 11, 12, 13, 24, 31, 40):
        keys = rng.integers(0, 1 << bits, size=5000, dtype=np.int64)
        result = sample_kernel.radix_sort(keys.copy(), np.empty_like(keys), bits)
        assert np.array_equal(result, np.sort(keys)), bits


def test_random_k_kernel_is_kept_for_dense_enough_samples():
    assert kernels.sample(1024 * 5000, 5000) is not None
    assert kernels.sample(1024 * 5000 + 1, 5000) is None  # a bitmap of over 1024 bits per position kept


@pytest.mark.parametrize("n, k", [(1 << 20, 4097), (100_000, 24_999), (64 * 1000 + 5, 5000), (1000, 3), (41, 10)])
def test_random_k_positions_on_the_device_path_are_the_host_paths_without_a_host_read(n, k, monkeypatch):
    """The device path draws two rounds at once and finds their first k distinct values with sizes known in
    advance (no .item(), no boolean index): the same positions as the host path."""
    from sync_counting import counting

    from gradcomp.compressors.sparse import sample_without_replacement

    cpu = torch.device("cpu")
    for seed in range(3):
        host = sample_without_replacement(n, k, torch.Generator().manual_seed(seed), cpu)
        device_path(monkeypatch)
        with counting() as counter:
            device = sample_without_replacement(n, k, torch.Generator().manual_seed(seed), cpu)
        device_path(monkeypatch, False)
        assert counter.total == 0, counter
        assert device.dtype == torch.int64 and torch.equal(device, host)


def test_random_k_positions_on_the_device_path_stay_distinct_when_the_draws_repeat(monkeypatch):
    """Fewer than k distinct values among the draws (forced here; vanishingly rare for real): still k distinct
    sorted positions in range, the drawn ones and then the smallest undrawn ones, with no host read."""
    from sync_counting import counting

    from gradcomp.compressors.sparse import sample_without_replacement

    real = torch.randint
    monkeypatch.setattr(torch, "randint", lambda n, size, **kw: real(3, size, **kw) * 7)  # only 0, 7, 14
    device_path(monkeypatch)
    with counting() as counter:
        got = sample_without_replacement(1000, 10, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert counter.total == 0, counter
    assert got.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 14]
