"""Tests for gradcomp.wire.bits: fixed-width LSB-first bit packing."""

from __future__ import annotations

import pytest
import torch

from gradcomp.errors import ConfigError, WireError
from gradcomp.wire import bits_needed, pack_bits, pack_bool, unpack_bits, unpack_bool
from wire_paths import device_path

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ALL_WIDTHS = list(range(1, 33))


def reference_pack(values: list[int], width: int) -> bytes:
    """Bit-by-bit reference of the documented layout (global bit k -> bit k % 8 of byte k // 8)."""
    out = bytearray((len(values) * width + 7) // 8)
    for i, v in enumerate(values):
        for j in range(width):
            if (v >> j) & 1:
                k = i * width + j
                out[k // 8] |= 1 << (k % 8)
    return bytes(out)


@pytest.mark.parametrize("width", ALL_WIDTHS)
def test_matches_reference_layout(width):
    g = torch.Generator().manual_seed(width)
    for n in (1, 5, 8, 13, 64):
        # include the extremes 0 and 2**width - 1
        v = torch.randint(0, 2**width, (n,), generator=g, dtype=torch.int64)
        v[0] = 2**width - 1
        if n > 1:
            v[1] = 0
        packed = pack_bits(v, width)
        assert packed.dtype == torch.uint8
        assert packed.numel() == (n * width + 7) // 8
        assert bytes(packed.tolist()) == reference_pack(v.tolist(), width)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", ALL_WIDTHS)
def test_round_trip_random(width, device):
    g = torch.Generator().manual_seed(1000 + width)
    for n in (0, 1, 2, 7, 8, 9, 100, 1001):
        v = torch.randint(0, 2**width, (n,), generator=g, dtype=torch.int64).to(device)
        packed = pack_bits(v, width)
        assert packed.device == v.device
        out = unpack_bits(packed, width, n)
        assert out.dtype == torch.int64
        assert torch.equal(out, v)


@pytest.mark.parametrize("width", [1, 3, 8, 16, 32])
def test_all_zeros_and_all_max(width):
    for fill in (0, 2**width - 1):
        v = torch.full((37,), fill, dtype=torch.int64)
        assert torch.equal(unpack_bits(pack_bits(v, width), width, 37), v)


def test_little_endian_for_byte_multiples():
    v = torch.tensor([0x01020304, 0xFFFFFFFF, 0], dtype=torch.int64)
    assert pack_bits(v, 32).tolist() == [4, 3, 2, 1, 255, 255, 255, 255, 0, 0, 0, 0]
    assert pack_bits(torch.tensor([0x0102, 0xABCD]), 16).tolist() == [2, 1, 0xCD, 0xAB]
    assert pack_bits(torch.tensor([7, 200]), 8).tolist() == [7, 200]


def test_lsb_first_bitmap():
    assert pack_bits(torch.tensor([1, 0, 1, 1]), 1).tolist() == [0b1101]
    assert pack_bits(torch.tensor([1, 2, 3]), 2).tolist() == [0b111001]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool])
def test_input_dtypes(dtype):
    width = 1 if dtype == torch.bool else 7
    v = torch.tensor([0, 1, 1, 0, 1] if dtype == torch.bool else [0, 5, 127, 64, 3]).to(dtype)
    out = unpack_bits(pack_bits(v, width), width, 5)
    assert torch.equal(out, v.to(torch.int64))


def test_multidimensional_input_is_flattened():
    v = torch.arange(12).reshape(3, 4)
    assert torch.equal(unpack_bits(pack_bits(v, 4), 4, 12), v.reshape(-1))


def test_large_width1_and_odd_width():
    g = torch.Generator().manual_seed(0)
    v = torch.randint(0, 2, (1_000_003,), generator=g)
    assert torch.equal(unpack_bits(pack_bits(v, 1), 1, v.numel()), v)
    v = torch.randint(0, 2**27, (200_001,), generator=g)
    assert torch.equal(unpack_bits(pack_bits(v, 27), 27, v.numel()), v)


@pytest.mark.parametrize("width", [0, 33, -1, 1.0, True, None])
def test_bad_width(width):
    with pytest.raises(ConfigError):
        pack_bits(torch.tensor([0]), width)
    with pytest.raises(ConfigError):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), width, 1)


@pytest.mark.parametrize("width", [1, 5, 8, 16, 31, 32])
def test_out_of_range_values(width):
    with pytest.raises(ConfigError):
        pack_bits(torch.tensor([0, 2**width]), width)
    with pytest.raises(ConfigError):
        pack_bits(torch.tensor([-1, 0]), width)


def test_non_integer_input():
    with pytest.raises(ConfigError):
        pack_bits(torch.tensor([1.0, 2.0]), 4)
    with pytest.raises(ConfigError):
        pack_bits([1, 2], 4)


@pytest.mark.parametrize("width", [1, 3, 8, 12, 32])
def test_unpack_wrong_length(width):
    v = torch.arange(10) % (2**width)
    packed = pack_bits(v, width)
    with pytest.raises(WireError):
        unpack_bits(packed[:-1], width, 10)
    with pytest.raises(WireError):
        unpack_bits(torch.cat([packed, torch.zeros(1, dtype=torch.uint8)]), width, 10)
    with pytest.raises(WireError):
        unpack_bits(packed, width, -1)
    with pytest.raises(WireError):
        unpack_bits(packed.to(torch.int32), width, 10)


@pytest.mark.parametrize("width,count", [(1, 3), (3, 5), (5, 9), (7, 1), (12, 3), (31, 1)])
def test_unpack_nonzero_padding(width, count):
    packed = pack_bits(torch.zeros(count, dtype=torch.int64), width)
    pad_bits = 8 * packed.numel() - count * width
    assert pad_bits > 0
    for bit in range(count * width, 8 * packed.numel()):
        bad = packed.clone()
        bad[bit // 8] |= 1 << (bit % 8)
        with pytest.raises(WireError, match="padding"):
            unpack_bits(bad, width, count)


def test_empty():
    assert pack_bits(torch.empty(0, dtype=torch.int64), 13).numel() == 0
    assert unpack_bits(torch.empty(0, dtype=torch.uint8), 13, 0).numel() == 0
    with pytest.raises(WireError):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), 13, 0)


def test_bits_needed():
    assert [bits_needed(n) for n in (0, 1, 2, 3, 4, 5, 256, 257, 2**32)] == [1, 1, 1, 2, 2, 3, 8, 9, 32]
    assert bits_needed(2**32 + 1) == 33
    with pytest.raises(ConfigError):
        bits_needed(-1)


@pytest.mark.parametrize("device", DEVICES)
def test_bool_helpers(device):
    g = torch.Generator().manual_seed(3)
    m = (torch.rand(1003, generator=g) < 0.3).to(device)
    packed = pack_bool(m)
    assert packed.numel() == 126
    out = unpack_bool(packed, 1003)
    assert out.dtype == torch.bool and torch.equal(out, m)
    with pytest.raises(WireError):
        unpack_bool(packed[:-1], 1003)


@pytest.mark.parametrize("width", [1, 3, 7, 10, 13, 16, 17, 24, 31, 32])
def test_small_cpu_path_writes_the_same_bytes_as_the_vectorised_one(width, monkeypatch):
    import gradcomp.wire.bits as bits

    gen = torch.Generator().manual_seed(width)
    for n in (1, 7, 8, 9, 63, 200):
        values = torch.randint(0, min(1 << width, 1 << 62), (n,), generator=gen, dtype=torch.int64)
        small = pack_bits(values, width)
        monkeypatch.setattr(bits, "_SMALL", -1)  # force the torch path
        large = pack_bits(values, width)
        assert torch.equal(unpack_bits(small, width, n), values)
        monkeypatch.undo()
        assert torch.equal(small, large)
        assert torch.equal(unpack_bits(large, width, n), values)


def test_small_cpu_path_rejects_padding_bits():
    buf = pack_bits(torch.tensor([5, 1, 2]), 3)  # 9 bits: 7 padding bits in the second byte
    buf[1] |= 0x80
    with pytest.raises(WireError, match="padding"):
        unpack_bits(buf, 3, 3)


@pytest.mark.parametrize("width", [9, 10, 11, 12, 13, 14, 15, 16])
def test_window_unpack_matches_the_reference_layout(width, monkeypatch):
    """The CPU's window unpacking (widths 9-16, more than _SMALL values) reads every value the documented layout
    put there: across chunk boundaries, in a last partial group, with extreme values."""
    import gradcomp.wire.bits as bits

    monkeypatch.setattr(bits, "_CHUNK", 64)  # several chunks even for these small arrays
    monkeypatch.setattr(bits, "_SMALL", 16)
    gen = torch.Generator().manual_seed(width)
    for n in (17, 64, 65, 130, 1001):
        values = torch.randint(0, 1 << width, (n,), generator=gen, dtype=torch.int64)
        values[0], values[-1] = (1 << width) - 1, (1 << width) - 1
        packed = torch.tensor(list(reference_pack(values.tolist(), width)), dtype=torch.uint8)
        out = unpack_bits(packed, width, n)
        assert out.dtype == torch.int64 and torch.equal(out, values)


@pytest.mark.parametrize("width,count", [(9, 5001), (13, 5003), (15, 4099)])
def test_window_unpack_rejects_padding_bits(width, count):
    packed = pack_bits(torch.zeros(count, dtype=torch.int64), width)
    for bit in (count * width, 8 * packed.numel() - 1):
        bad = packed.clone()
        bad[bit // 8] |= 1 << (bit % 8)
        with pytest.raises(WireError, match="padding"):
            unpack_bits(bad, width, count)


@pytest.mark.parametrize("width", [1, 3, 8, 9, 12, 16, 17, 23, 28, 31, 32])
def test_the_device_path_writes_and_reads_the_reference_layout(width, monkeypatch):
    """The torch formulation a GPU runs (tests/wire_paths.py sends CPU tensors down it): for widths above 8 a
    fixed number of operations (gathered windows) instead of one per byte column; the same bytes as the
    documented layout, the values back, extremes included, and padding bits refused."""
    device_path(monkeypatch)
    gen = torch.Generator().manual_seed(77 + width)
    for n in (1, 7, 8, 9, 63, 300):
        values = torch.randint(0, 1 << width, (n,), generator=gen, dtype=torch.int64)
        values[0], values[-1] = (1 << width) - 1, (1 << width) - 1
        packed = pack_bits(values, width)
        assert bytes(packed.tolist()) == reference_pack(values.tolist(), width)
        assert torch.equal(unpack_bits(packed, width, n), values)
        if n * width % 8:
            bad = packed.clone()
            bad[-1] |= 0x80  # the last bit of the last byte: padding
            with pytest.raises(WireError, match="padding"):
                unpack_bits(bad, width, n)
