"""Tests for gradcomp.wire.container (message layout, validation, fuzzing); the checksum: test_wire_checksum.py."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from gradcomp.errors import ConfigError, WireError
from gradcomp.wire import (
    FORMAT_VERSION,
    HEADER_BYTES,
    SECTION_HEADER_BYTES,
    Codec,
    FieldSpec,
    bits_needed,
    checksum64,
    decode,
    encode,
    optimal_rice_parameter,
)
from gradcomp.wire.bits import decoded_dtype
from gradcomp.wire.device import check_pending
from gradcomp.wire.format import encoded_size
from wire_paths import device_path

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
M64 = (1 << 64) - 1


# ----------------------------------------------------------------------------------------------- helpers


def u8(data: bytes | bytearray | list[int]) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def frame(body: bytes, n_sections: int, **over) -> torch.Tensor:
    """A header with a correct length and checksum (unless overridden) around ``body``."""
    fields = dict(magic=b"GC", version=FORMAT_VERSION, flags=0, n=n_sections, reserved=0, length=len(body))
    fields["checksum"] = None
    fields.update(over)
    cs = checksum64(u8(body)) if fields["checksum"] is None else fields["checksum"]
    head = struct.pack(
        "<2sBBHHIQ",
        fields["magic"],
        fields["version"],
        fields["flags"],
        fields["n"],
        fields["reserved"],
        fields["length"],
        cs,
    )
    return u8(head + body)


def section(codec: int, param: int, count: int, data: bytes, nbytes: int | None = None) -> bytes:
    return struct.pack("<BBII", codec, param, count, len(data) if nbytes is None else nbytes) + data


def body_of(buf: torch.Tensor) -> bytes:
    return bytes(buf[HEADER_BYTES:].tolist())


def assert_fields_equal(out, fields, specs):
    assert len(out) == len(fields)
    for o, f, s in zip(out, fields, specs):
        f = f.reshape(-1)
        if s.codec in (Codec.F32, Codec.F16, Codec.BF16):
            dt = {Codec.F32: torch.float32, Codec.F16: torch.float16, Codec.BF16: torch.bfloat16}[s.codec]
            assert o.dtype == dt
            ref = f.to(dt)
            # bit-exact, including the sign of zero
            assert torch.equal(
                o.view(torch.int16 if dt != torch.float32 else torch.int32),
                ref.view(torch.int16 if dt != torch.float32 else torch.int32),
            )
        else:
            # BITS: the narrowest signed dtype that holds the width; POSITIONS and GOLOMB: int64 (indices)
            assert o.dtype == (decoded_dtype(s.width) if s.codec == Codec.BITS else torch.int64)
            assert torch.equal(o.to(torch.int64), f.to(torch.int64))


def round_trip(fields, specs):
    buf = encode(fields, specs)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    out = decode(buf, specs)
    assert_fields_equal(out, fields, specs)
    for o in out:
        assert o.device == buf.device
    return buf, out


def rand_positions(d: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(d, generator=g)[:k].sort().values


MIXED_SPECS = [
    FieldSpec(Codec.POSITIONS, max_count=100, universe=1000),
    FieldSpec(Codec.F32, max_count=100),
    FieldSpec(Codec.BITS, max_count=100, width=3),
]


def mixed_message(k: int = 20, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        rand_positions(1000, k, seed),
        torch.randn(k, generator=g),
        torch.randint(0, 8, (k,), generator=g),
    ]


# ------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", [Codec.F32, Codec.F16, Codec.BF16])
def test_float_round_trip(codec, device):
    special = torch.tensor(
        [0.0, -0.0, 1.0, -1.5, 3.0e38, -3.0e38, 1.0e-40, -1.0e-45, 65504.0, 6.0e-8, 1.0e-3], dtype=torch.float32
    )
    g = torch.Generator().manual_seed(int(codec))
    for values in (special, torch.randn(1001, generator=g) * 10, torch.zeros(0), torch.tensor([-0.0])):
        v = values.to(device)
        if codec != Codec.F32:
            v = v.to({Codec.F16: torch.float16, Codec.BF16: torch.bfloat16}[codec]).float()
        round_trip([v], [FieldSpec(codec, count=v.numel())])
        round_trip([v], [FieldSpec(codec, max_count=5000)])


def test_float_conversion_on_encode():
    x = torch.tensor([1.0 / 3.0, 2.0, -0.0], dtype=torch.float64)
    for codec, dt in [(Codec.F32, torch.float32), (Codec.F16, torch.float16), (Codec.BF16, torch.bfloat16)]:
        (out,) = decode(encode([x], [FieldSpec(codec, count=3)]), [FieldSpec(codec, count=3)])
        assert out.dtype == dt and torch.equal(out, x.to(dt))
        assert torch.signbit(out[2])


def test_negative_zero_is_preserved():
    (out,) = decode(
        encode([torch.tensor([-0.0, 0.0])], [FieldSpec(Codec.F32, count=2)]), [FieldSpec(Codec.F32, count=2)]
    )
    assert torch.signbit(out).tolist() == [True, False]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 13, 16, 31, 32])
def test_bits_round_trip(width, device):
    g = torch.Generator().manual_seed(width)
    for n in (0, 1, 9, 500):
        v = torch.randint(0, 2**width, (n,), generator=g).to(device)
        round_trip([v], [FieldSpec(Codec.BITS, count=n, width=width)])
        round_trip([v], [FieldSpec(Codec.BITS, max_count=1000, width=width)])
    round_trip([torch.zeros(17, dtype=torch.int64, device=device)], [FieldSpec(Codec.BITS, count=17, width=width)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", [Codec.POSITIONS, Codec.GOLOMB])
def test_positions_round_trip(codec, device):
    cases = [
        (1000, torch.empty(0, dtype=torch.int64)),
        (1000, torch.tensor([0])),
        (1000, torch.tensor([999])),
        (1, torch.tensor([0])),
        (64, torch.arange(64)),  # k = d
        (1000, rand_positions(1000, 10, 1)),
        (100_000, rand_positions(100_000, 1000, 2)),
        (2**31, torch.tensor([0, 2**31 - 5])),
        (2**32, torch.tensor([0, 2**32 - 1])),
    ]
    for universe, pos in cases:
        pos = pos.to(device)
        round_trip([pos], [FieldSpec(codec, max_count=universe, universe=universe)])
        round_trip([pos], [FieldSpec(codec, count=pos.numel(), universe=universe)])
        if codec == Codec.GOLOMB and universe <= 100_000:  # b = 3 on a 2**32 gap would be 2**29 bits
            round_trip([pos], [FieldSpec(codec, count=pos.numel(), universe=universe, golomb_b=3)])


def test_golomb_b_choice_and_header():
    pos = rand_positions(10_000, 100, 5)
    buf = encode([pos], [FieldSpec(Codec.GOLOMB, count=100, universe=10_000)])
    assert buf[HEADER_BYTES + 1].item() == optimal_rice_parameter(0.01) == 6
    buf = encode([pos], [FieldSpec(Codec.GOLOMB, count=100, universe=10_000, golomb_b=4)])
    assert buf[HEADER_BYTES + 1].item() == 4
    assert torch.equal(decode(buf, [FieldSpec(Codec.GOLOMB, max_count=200, universe=10_000, golomb_b=4)])[0], pos)
    # the decoder expects the b that encode() would choose for the spec: another one in the param byte (here
    # with a valid checksum) would decode the same stream to other positions
    with pytest.raises(WireError, match="Rice parameter 4 != expected 5"):
        decode(buf, [FieldSpec(Codec.GOLOMB, count=100, universe=10_000, golomb_b=5)])
    with pytest.raises(WireError, match="Rice parameter 4 != expected 6"):
        decode(buf, [FieldSpec(Codec.GOLOMB, max_count=200, universe=10_000)])
    single = encode([torch.tensor([37])], [FieldSpec(Codec.GOLOMB, max_count=200, universe=10_000)])
    for b in range(32):
        raw = bytearray(single.tolist())
        if raw[HEADER_BYTES + 1] == b:
            continue
        raw[HEADER_BYTES + 1] = b
        with pytest.raises(WireError, match="Rice parameter"):
            decode(frame(bytes(raw[HEADER_BYTES:]), 1), [FieldSpec(Codec.GOLOMB, max_count=200, universe=10_000)])


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_messages(device):
    for k in (0, 1, 20, 100):
        fields = [f.to(device) for f in mixed_message(k, seed=k)]
        round_trip(fields, MIXED_SPECS)
    specs = [
        FieldSpec(Codec.GOLOMB, max_count=5000, universe=100_000),
        FieldSpec(Codec.F16, max_count=5000),
        FieldSpec(Codec.BITS, max_count=5000, width=1),
        FieldSpec(Codec.BF16, count=1),
        FieldSpec(Codec.F32, count=3),
        FieldSpec(Codec.BITS, count=2, width=32),
    ]
    g = torch.Generator().manual_seed(9)
    pos = rand_positions(100_000, 777, 9)
    fields = [
        pos,
        torch.randn(777, generator=g).half().float(),
        torch.randint(0, 2, (777,), generator=g),
        torch.tensor([2.5]),
        torch.tensor([[1.0, -0.0, 3.0]]),  # 2-D fields are flattened
        torch.tensor([0, 2**32 - 1]),
    ]
    round_trip([f.to(device) for f in fields], specs)


def test_empty_message():
    buf = encode([], [])
    assert buf.numel() == HEADER_BYTES
    assert decode(buf, []) == []


def test_layout():
    pos = torch.tensor([1, 5, 9])
    vals = torch.tensor([1.0, -2.0, 0.5])
    specs = [FieldSpec(Codec.POSITIONS, count=3, universe=10), FieldSpec(Codec.F32, count=3)]
    buf = encode([pos, vals], specs)
    raw = bytes(buf.tolist())
    magic, ver, flags, n, res, length, cs = struct.unpack("<2sBBHHIQ", raw[:HEADER_BYTES])
    assert (magic, ver, flags, n, res) == (b"GC", FORMAT_VERSION, 0, 2, 0)
    assert length == len(raw) - HEADER_BYTES
    assert cs == checksum64(buf[HEADER_BYTES:])
    s0 = struct.unpack("<BBII", raw[HEADER_BYTES : HEADER_BYTES + SECTION_HEADER_BYTES])
    assert s0 == (Codec.POSITIONS, bits_needed(10), 3, 2)
    assert raw[30:32] == bytes([1 | 5 << 4, 9])
    s1 = struct.unpack("<BBII", raw[32:42])
    assert s1 == (Codec.F32, 0, 3, 12)
    assert raw[42:] == struct.pack("<3f", 1.0, -2.0, 0.5)
    assert len(raw) == encoded_size(specs) == HEADER_BYTES + 2 * SECTION_HEADER_BYTES + 2 + 12


def test_odd_offset_float_section():
    # BITS section of 1 byte puts the following float data at an odd offset
    specs = [FieldSpec(Codec.BITS, count=3, width=1), FieldSpec(Codec.F32, count=4), FieldSpec(Codec.F16, count=3)]
    fields = [torch.tensor([1, 0, 1]), torch.tensor([1.5, -0.0, 7.0, 1e-42]), torch.tensor([0.5, -1.0, 3.0])]
    round_trip(fields, specs)


# ------------------------------------------------------------------------------------------ encode misuse


def test_encode_misuse():
    cases = [
        ([torch.zeros(3)], [FieldSpec(Codec.F32, count=4)]),  # wrong count
        ([torch.zeros(6)], [FieldSpec(Codec.F32, max_count=5)]),  # over max_count
        ([torch.zeros(3, dtype=torch.int64)], [FieldSpec(Codec.F32, count=3)]),  # not floating
        ([torch.zeros(3)], [FieldSpec(Codec.BITS, count=3, width=4)]),  # float for BITS
        ([torch.tensor([16])], [FieldSpec(Codec.BITS, count=1, width=4)]),  # value too large
        ([torch.tensor([-1])], [FieldSpec(Codec.BITS, count=1, width=4)]),  # negative
        # not strictly increasing
        ([torch.tensor([3, 3])], [FieldSpec(Codec.POSITIONS, count=2, universe=10)]),
        ([torch.tensor([5, 2])], [FieldSpec(Codec.GOLOMB, count=2, universe=10)]),
        ([torch.tensor([2, 10])], [FieldSpec(Codec.POSITIONS, count=2, universe=10)]),  # >= universe
        ([torch.tensor([2, 10])], [FieldSpec(Codec.GOLOMB, count=2, universe=10)]),
        ([torch.tensor([-1, 3])], [FieldSpec(Codec.GOLOMB, count=2, universe=10)]),
        ([torch.tensor([1.0, 3.0])], [FieldSpec(Codec.GOLOMB, count=2, universe=10)]),
        ([torch.zeros(3)], []),  # fields vs specs
        ([torch.zeros(3)], [FieldSpec(Codec.F32)]),  # neither count nor max_count
        ([torch.zeros(3, dtype=torch.int64)], [FieldSpec(Codec.BITS, count=3)]),  # no width
        ([torch.zeros(3, dtype=torch.int64)], [FieldSpec(Codec.BITS, count=3, width=33)]),
        ([torch.tensor([1])], [FieldSpec(Codec.POSITIONS, count=1)]),  # no universe
        ([torch.tensor([1])], [FieldSpec(Codec.POSITIONS, count=1, universe=2**32 + 1)]),
        ([torch.tensor([1])], [FieldSpec(Codec.GOLOMB, count=1, universe=10, golomb_b=32)]),
        ([torch.tensor([1, 2, 3])], [FieldSpec(Codec.GOLOMB, count=3, universe=2)]),  # count > universe
        ([torch.tensor([1])], [FieldSpec(99, count=1)]),  # unknown codec
        ([torch.tensor([1])], [FieldSpec(Codec.F32, count=2**32)]),  # count too large for u32
        ([[1.0]], [FieldSpec(Codec.F32, count=1)]),  # not a tensor
        ([torch.tensor([1])], ["F32"]),  # not a spec
    ]
    for fields, specs in cases:
        with pytest.raises(ConfigError):
            encode(fields, specs)
            # the device path (tests/wire_paths.py) checks a field's values on the device and reads the verdict
            # with the next device read of the thread, or here: the misuse is refused either way, and no failed
            # check is left over to surface in an unrelated later decode
            check_pending()


def test_decode_rejects_bad_specs_with_config_error():
    buf = encode([torch.zeros(2)], [FieldSpec(Codec.F32, count=2)])
    with pytest.raises(ConfigError):
        decode(buf, [FieldSpec(Codec.F32)])


# ---------------------------------------------------------------------------------- decode: named errors


def test_decode_error_messages():
    specs = MIXED_SPECS
    buf = encode(mixed_message(20), specs)
    raw = bytes(buf.tolist())
    body = raw[HEADER_BYTES:]

    def fails(b, pattern, sp=specs):
        with pytest.raises(WireError, match=pattern):
            decode(b, sp)

    fails(buf[:10], "shorter than the 20-byte header")
    fails(frame(body, 3, magic=b"XY"), "bad magic")
    fails(frame(body, 3, version=7), "unsupported format version 7")
    fails(frame(body, 3, flags=1), "flags")
    fails(frame(body, 3, reserved=2), "reserved")
    fails(frame(body, 2), "2 sections, expected 3")
    fails(buf[:-5], f"truncated buffer: header says {len(body)} body bytes, got {len(body) - 5}")
    fails(torch.cat([buf, u8(b"\0")]), "oversized")
    # the length field is outside the checksum: a flipped bit in it must not read as a plain cut or padding
    for bit in (0, 9, 30):
        flipped = bytearray(raw)
        flipped[8 + bit // 8] ^= 1 << (bit % 8)
        fails(u8(bytes(flipped)), "length field is corrupted")
    fails(frame(body, 3, checksum=(checksum64(u8(body)) + 1) & M64), "checksum mismatch")
    fails(u8(raw), "section 0: codec 5", sp=[FieldSpec(Codec.GOLOMB, max_count=100, universe=1000)] + specs[1:])
    fails(u8(raw), "section 1: count 20 != expected 32", sp=[specs[0], FieldSpec(Codec.F32, count=32), specs[2]])
    fails(u8(raw), "section 2: count 20 exceeds", sp=specs[:2] + [FieldSpec(Codec.BITS, max_count=10, width=3)])
    fails(
        u8(raw), "section 2: bit width 3 != expected 4", sp=specs[:2] + [FieldSpec(Codec.BITS, max_count=100, width=4)]
    )
    fails(
        u8(raw), "section 0: position width", sp=[FieldSpec(Codec.POSITIONS, max_count=100, universe=5000)] + specs[1:]
    )
    fails(u8(raw), "section 0: .* exceeds", sp=[FieldSpec(Codec.POSITIONS, max_count=100, universe=10)] + specs[1:])
    # sections with a valid header and checksum but inconsistent contents
    f32 = struct.pack("<2f", 1.0, 2.0)
    one = [FieldSpec(Codec.F32, max_count=10)]
    fails(frame(section(1, 0, 2, f32) + b"\0", 1), "trailing bytes", sp=one)
    fails(frame(section(1, 0, 3, f32), 1), "8 data bytes, expected 12", sp=one)
    fails(frame(section(1, 0, 2, f32, nbytes=8)[:-1], 1), "8 data bytes, expected|run past", sp=one)
    fails(frame(section(1, 1, 2, f32), 1), "param 1", sp=one)
    fails(frame(section(1, 0, 2, f32)[:7], 1), "section header runs past", sp=one)
    fails(frame(b"", 1), "section header runs past", sp=one)
    fails(frame(section(7, 0, 2, f32), 1), "codec 7 \\(unknown\\) where F32 expected", sp=one)
    pos_spec = [FieldSpec(Codec.POSITIONS, max_count=10, universe=16)]
    fails(frame(section(5, 4, 3, bytes([0x21, 0x02])), 1), "not strictly increasing", sp=pos_spec)  # 1,2,2
    fails(frame(section(5, 4, 1, bytes([0x11])), 1), "padding", sp=pos_spec)
    uni_spec = [FieldSpec(Codec.POSITIONS, max_count=10, universe=12)]
    fails(frame(section(5, 4, 2, bytes([0xF1])), 1), "positions must lie in", sp=uni_spec)  # 1, 15
    gspec = [FieldSpec(Codec.GOLOMB, max_count=10, universe=100, golomb_b=2)]
    fails(frame(section(6, 2, 3, bytes([0xFF])), 1), "section 0: golomb: truncated", sp=gspec)
    fails(frame(section(6, 32, 1, bytes([0])), 1), "Rice parameter 32 != expected 2", sp=gspec)
    open_b = [FieldSpec(Codec.GOLOMB, max_count=10, universe=100)]  # b = optimal_rice_parameter(3 / 100) = 4
    fails(frame(section(6, 2, 3, bytes([0xFF])), 1), "Rice parameter 2 != expected 4", sp=open_b)
    fails(frame(section(6, 2, 0, bytes([0])), 1), "0 positions", sp=gspec)
    fails(frame(section(6, 2, 1, bytes([0, 0])), 1), "bits left", sp=gspec)
    # absurd counts are rejected by size checks before anything is allocated
    fails(frame(section(1, 0, 2**32 - 1, f32), 1), "exceeds", sp=one)
    big = [FieldSpec(Codec.F32, max_count=2**40)]
    fails(frame(section(1, 0, 2**32 - 1, f32), 1), "data bytes, expected", sp=big)
    fails(frame(section(1, 0, 2, f32, nbytes=2**32 - 1), 1), "data bytes", sp=big)
    gbig = [FieldSpec(Codec.GOLOMB, max_count=2**32, universe=2**40, golomb_b=31)]
    fails(frame(section(6, 31, 2**32 - 1, b"\0" * 16), 1), "truncated", sp=gbig)
    gbig = [FieldSpec(Codec.GOLOMB, max_count=2**32, universe=2**40, golomb_b=0)]
    fails(frame(section(6, 0, 1, b"\0" * 10, nbytes=2**31), 1), "run past", sp=gbig)


def test_older_format_versions_are_refused_naming_both():
    buf = encode(mixed_message(5), MIXED_SPECS)
    assert FORMAT_VERSION == 2 and buf[2].item() == 2
    for old in range(FORMAT_VERSION):
        bad = buf.clone()
        bad[2] = old
        with pytest.raises(WireError, match=f"version {old} .*reads version {FORMAT_VERSION} only"):
            decode(bad, MIXED_SPECS)


LINKED_SPECS = [
    FieldSpec(Codec.GOLOMB, max_count=1000, universe=1000),
    FieldSpec(Codec.F32, max_count=1000, same_count_as=-1),
]


def test_linked_counts_round_trip_and_encode_checks():
    for k in (0, 1, 20, 1000):
        round_trip([rand_positions(1000, k, k), torch.randn(k)], LINKED_SPECS)
    with pytest.raises(ConfigError, match="same_count_as"):
        encode([rand_positions(1000, 5, 0), torch.randn(4)], LINKED_SPECS)
    # several slots' spec lists concatenated: the link stays relative to its own slot
    specs = LINKED_SPECS + [FieldSpec(Codec.F32, count=3)] + LINKED_SPECS
    fields = [rand_positions(1000, 7, 1), torch.randn(7), torch.randn(3), rand_positions(1000, 2, 2), torch.randn(2)]
    round_trip(fields, specs)


def test_linked_count_specs_are_checked():
    for link in (0, 1, -2, 1.0, True):
        specs = [FieldSpec(Codec.F32, max_count=3), FieldSpec(Codec.F32, count=0, same_count_as=link)]
        with pytest.raises(ConfigError, match="same_count_as"):
            decode(encode([], []), specs)
    with pytest.raises(ConfigError, match="contradicts"):
        encode(
            [torch.zeros(2), torch.zeros(3)],
            [FieldSpec(Codec.F32, count=2), FieldSpec(Codec.F32, count=3, same_count_as=-1)],
        )


def test_sections_that_disagree_are_refused_with_a_valid_checksum():
    """The issue's case: threshold/golomb with the position count lowered by one and the checksum redone."""
    count_at = HEADER_BYTES + 2  # section 0's count field
    # Positions that end with a gap of 0 (Rice code "00" for b = 1) and a short padding: the stream without
    # its last code is a valid stream of 299 codes, so only the link between the sections can object.
    for seed in range(100):
        positions = rand_positions(998, 298, seed)
        positions = torch.cat([positions, torch.tensor([998, 999])])
        buf = encode([positions, torch.randn(300)], LINKED_SPECS)
        assert buf[HEADER_BYTES + 1].item() == 1  # b = 1 at density 0.3
        raw = bytearray(buf.tolist())
        struct.pack_into("<I", raw, count_at, 299)
        bad = frame(bytes(raw[HEADER_BYTES:]), 2)  # checksum recomputed
        try:
            decode(bad, LINKED_SPECS[:1] + [FieldSpec(Codec.F32, max_count=1000)])  # without the link
        except WireError:
            continue  # this stream's padding would not take the two zero bits
        with pytest.raises(WireError, match="section 1: count 300 != count 299 of section 0: the sections disagree"):
            decode(bad, LINKED_SPECS)
        break
    else:
        raise AssertionError("no message reproduced the issue's case")
    raw = bytearray(buf.tolist())
    struct.pack_into("<I", raw, count_at, 301)
    with pytest.raises(WireError, match="section 0: golomb"):
        decode(frame(bytes(raw[HEADER_BYTES:]), 2), LINKED_SPECS)
    # the values' count alone lowered (and their bytes cut to match): refused by the link
    body = bytearray(buf[HEADER_BYTES:].tolist())
    second = SECTION_HEADER_BYTES + struct.unpack_from("<I", body, 6)[0]
    struct.pack_into("<II", body, second + 2, 299, 4 * 299)
    del body[second + SECTION_HEADER_BYTES + 4 * 299 :]
    with pytest.raises(WireError, match="section 1: count 299 != count 300 of section 0: the sections disagree"):
        decode(frame(bytes(body), 2), LINKED_SPECS)


def test_decode_requires_uint8_tensor():
    with pytest.raises(WireError):
        decode(torch.zeros(30, dtype=torch.int32), [])
    with pytest.raises(WireError):
        decode(b"GC" + bytes(18), [])


# ------------------------------------------------------------------------------------------ corruption


def test_every_single_bit_flip_is_rejected():
    buf = encode(mixed_message(6), MIXED_SPECS)
    n = buf.numel()
    assert n < 120
    for bit in range(8 * n):
        bad = buf.clone()
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(WireError):
            decode(bad, MIXED_SPECS)


def test_random_bit_flips_in_a_larger_message():
    specs = [FieldSpec(Codec.GOLOMB, max_count=2000, universe=100_000), FieldSpec(Codec.F32, max_count=2000)]
    buf = encode([rand_positions(100_000, 1000, 3), torch.randn(1000)], specs)
    rng = random.Random(4)
    for _ in range(300):
        bit = rng.randrange(8 * buf.numel())
        bad = buf.clone()
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(WireError):
            decode(bad, specs)


def test_every_truncation_and_extension_is_rejected():
    buf = encode(mixed_message(10), MIXED_SPECS)
    for cut in range(buf.numel()):
        with pytest.raises(WireError):
            decode(buf[:cut], MIXED_SPECS)
    for extra in (b"\0", b"\x01", bytes(7), bytes(range(40))):
        with pytest.raises(WireError):
            decode(torch.cat([buf, u8(extra)]), MIXED_SPECS)


# --------------------------------------------------------------------------------------------------- fuzz

FUZZ_SPEC_LISTS = [
    MIXED_SPECS,
    [FieldSpec(Codec.GOLOMB, max_count=200, universe=5000), FieldSpec(Codec.F16, count=7)],
    [
        FieldSpec(Codec.GOLOMB, count=10, universe=100, golomb_b=2),
        FieldSpec(Codec.BF16, max_count=50),
        FieldSpec(Codec.BITS, count=5, width=32),
    ],
    [FieldSpec(Codec.BITS, max_count=300, width=1), FieldSpec(Codec.POSITIONS, max_count=2**32, universe=2**32)],
    [],
]


def fuzz_valid_messages(rng: random.Random):
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    k = rng.randrange(0, 11)
    yield 0, encode(mixed_message(rng.randrange(0, 60), seed=rng.randrange(100)), MIXED_SPECS)
    pos = rand_positions(5000, rng.randrange(0, 200), rng.randrange(100))
    yield 1, encode([pos, torch.randn(7, generator=g)], FUZZ_SPEC_LISTS[1])
    yield (
        2,
        encode(
            [
                rand_positions(100, 10, k),
                torch.randn(rng.randrange(0, 50), generator=g),
                torch.randint(0, 2**32, (5,), generator=g),
            ],
            FUZZ_SPEC_LISTS[2],
        ),
    )
    yield (
        3,
        encode(
            [torch.randint(0, 2, (rng.randrange(0, 300),), generator=g), torch.tensor([0, 2**31, 2**32 - 1])],
            FUZZ_SPEC_LISTS[3],
        ),
    )
    yield 4, encode([], [])


def mutate(raw: bytearray, rng: random.Random) -> bytearray:
    kind = rng.randrange(6)
    if kind == 0 and raw:  # flip some bits
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(raw))
            raw[i] ^= 1 << rng.randrange(8)
    elif kind == 1 and raw:  # overwrite a run with random bytes
        i = rng.randrange(len(raw))
        for j in range(i, min(len(raw), i + rng.randint(1, 12))):
            raw[j] = rng.randrange(256)
    elif kind == 2 and raw:  # delete a run
        i = rng.randrange(len(raw))
        del raw[i : i + rng.randint(1, 8)]
    elif kind == 3:  # insert random bytes
        i = rng.randrange(len(raw) + 1)
        raw[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif kind == 4 and len(raw) >= 4:  # write an extreme u32 somewhere (counts, sizes)
        i = rng.randrange(len(raw) - 3)
        raw[i : i + 4] = struct.pack("<I", rng.choice([0, 1, 2**31, 2**32 - 1, rng.randrange(2**32)]))
    else:  # replace everything after some point with garbage
        i = rng.randrange(len(raw) + 1)
        raw[i:] = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
    return raw


def refit_header(raw: bytearray, rng: random.Random) -> bytearray:
    """Make the header consistent again (length and checksum), so only section parsing can object."""
    body = bytes(raw[HEADER_BYTES:])
    n = struct.unpack_from("<H", raw, 4)[0] if len(raw) >= 6 else 0
    return bytearray(bytes(frame(body, n).tolist()))


def check_only_wire_errors(buf: torch.Tensor, specs) -> bool:
    try:
        out = decode(buf, specs)
    except Exception as e:
        assert type(e) is WireError, f"{type(e).__name__}: {e}"
        return False
    assert len(out) == len(specs)
    return True


def test_fuzz_only_wire_errors():
    rng = random.Random(1234)
    n_decoded = n_rejected = 0
    # 1. random byte strings of random length
    for _ in range(600):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 80)))
        for specs in (FUZZ_SPEC_LISTS[rng.randrange(len(FUZZ_SPEC_LISTS))],):
            ok = check_only_wire_errors(u8(raw), specs)
            n_decoded += ok
            n_rejected += not ok
    # 2. a valid header (right magic, section count, length, checksum) around a random body
    for _ in range(800):
        idx = rng.randrange(len(FUZZ_SPEC_LISTS))
        specs = FUZZ_SPEC_LISTS[idx]
        body = bytearray()
        for s in specs:  # plausible section headers with random fields, then random data
            if rng.random() < 0.7:
                count = rng.choice([0, 1, 5, 7, 10, 50, rng.randrange(1000), rng.randrange(2**32)])
                nbytes = rng.choice([0, 1, 2, 8, 20, rng.randrange(64), rng.randrange(2**32)])
                param = rng.choice([0, 1, 2, 3, 32, rng.randrange(256)])
                codec = int(s.codec) if rng.random() < 0.9 else rng.randrange(256)
                body += struct.pack("<BBII", codec, param, count, nbytes)
            body += bytes(rng.randrange(256) for _ in range(rng.randrange(0, 30)))
        buf = frame(bytes(body), len(specs))
        ok = check_only_wire_errors(buf, specs)
        n_decoded += ok
        n_rejected += not ok
    # 3. mutations of valid messages, with and without a recomputed (valid) header
    for _ in range(250):
        for idx, buf in fuzz_valid_messages(rng):
            raw = mutate(bytearray(buf.tolist()), rng)
            for candidate in (raw, refit_header(raw, rng)):
                ok = check_only_wire_errors(u8(candidate), FUZZ_SPEC_LISTS[idx])
                n_decoded += ok
                n_rejected += not ok
                # decode against a mismatched spec list too
                check_only_wire_errors(u8(candidate), FUZZ_SPEC_LISTS[(idx + 1) % len(FUZZ_SPEC_LISTS)])
    assert n_rejected > 2000


def test_valid_header_with_garbage_sections_is_rejected_by_section_checks():
    """The checksum is not the only line of defence: with a correct checksum, garbage still fails."""
    rng = random.Random(99)
    rejected = 0
    for _ in range(200):
        specs = MIXED_SPECS
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 100)))
        try:
            decode(frame(body, len(specs)), specs)
        except WireError as e:
            assert "checksum" not in str(e)
            rejected += 1
    assert rejected == 200


# ------------------------------------------------------------------------------------------------ CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    big = torch.randint(0, 256, (100_001,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert checksum64(big.cuda()) == checksum64(big)
    fields = mixed_message(50)
    cpu = encode(fields, MIXED_SPECS)
    gpu = encode([f.cuda() for f in fields], MIXED_SPECS)
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
    out = decode(cpu.cuda(), MIXED_SPECS)
    assert all(o.is_cuda for o in out)
    assert_fields_equal([o.cpu() for o in out], fields, MIXED_SPECS)


# ------------------------------------------------------------------------------ sized before encoding


def sized_specs(fixed_golomb: int) -> list[FieldSpec]:
    """A message sized on the device: Golomb positions and their values (free count), the mixed sections (three
    free counts), a Golomb field of ``fixed_golomb`` positions (a fixed count) and three fp16 values."""
    return [
        FieldSpec(Codec.GOLOMB, max_count=500, universe=5000),
        FieldSpec(Codec.F32, max_count=500, same_count_as=-1),
        *MIXED_SPECS,
        FieldSpec(Codec.GOLOMB, count=fixed_golomb, universe=70),
        FieldSpec(Codec.F16, count=3),
    ]


def sized_message(k: int, seed: int, fixed: torch.Tensor) -> list[torch.Tensor]:
    """Fields for ``sized_specs(fixed.numel())``: k positions and values, 20 mixed entries, the ``fixed`` positions."""
    g = torch.Generator().manual_seed(seed)
    return [rand_positions(5000, k, seed), torch.randn(k, generator=g), *mixed_message(20, seed), fixed,
            torch.randn(3, generator=g)]


def test_length_on_device_is_encodes_length_and_its_streams_give_the_same_bytes(monkeypatch):
    """The device path sizes a variable message before encoding it (``length_on_device``: nothing read), reads the
    length with its Golomb streams' lengths and hands those to ``encode(stream_bits=...)``: the length is the
    message's and the bytes are those the host path writes, for Golomb, positions, bits and floats, empty or not."""
    from sync_counting import counting

    from gradcomp.wire.format import length_on_device

    specs = sized_specs(0)
    for k, seed in ((1, 0), (37, 1), (500, 2), (0, 3)):
        fields = sized_message(k, seed, torch.zeros(0, dtype=torch.int64))
        on_host = encode(fields, specs)
        device_path(monkeypatch)
        with counting() as counter:
            length, which, bits = length_on_device(fields, specs)
        assert counter.total == 0, counter
        assert which == [0, 5]
        assert int(length) == on_host.numel()
        streams = dict(zip(which, bits.tolist()))
        with counting() as counter:
            got = encode(fields, specs, stream_bits=streams)
        assert counter.total == 0, counter  # (the sender checks wait for the next read)
        check_pending()
        assert torch.equal(got, on_host)
        device_path(monkeypatch, False)


def test_a_variable_message_decodes_on_the_device_from_its_layout_values(monkeypatch):
    """A size exchange brings a variable message's layout values (``layout_values``: its free counts and Golomb
    streams' lengths, computed on the device and not read: those its headers hold). With them the device path
    decodes the message where it is, nothing read until the checks, which it reads with the caller's others: the
    fields are the host path's. Values that disagree with the message's own headers but imply its length are refused
    at that read (its fields were decoded from them), as is a corrupted body; values that imply another length, or
    that no message can have, send it to the host path, which reads its own."""
    from sync_counting import counting

    from gradcomp.wire.device import DeviceChecks

    from gradcomp.wire.format import free_sections, layout_values, length_on_device

    specs = sized_specs(2)
    for k, seed in ((1, 0), (37, 1), (500, 2), (0, 3)):
        fields = sized_message(k, seed, torch.tensor([3, 60]))
        buf = encode(fields, specs)
        device_path(monkeypatch)
        with counting() as counter:
            _, _, bits = length_on_device(fields, specs)
            values = layout_values(specs, [f.numel() for f in fields], bits, torch.device("cpu"))
        assert counter.total == 0, counter
        heads, off = [], 20  # (codec, param, count, data bytes) of every section, from the message's headers
        for _ in specs:
            heads.append(struct.unpack_from("<BBII", buf.numpy(), off))
            off += 10 + heads[-1][3]
        # the free counts (the Golomb positions', the mixed sections' three), then both Golomb streams' bytes
        assert values.tolist() == [heads[i][2] for i in (0, 2, 3, 4)] + [heads[i][3] for i in (0, 5)]
        given = values.tolist()
        later = DeviceChecks()
        with counting() as counter:
            got = decode(buf, specs, later, layout=given)
        assert counter.total == 0, str(counter)
        later.read()
        assert_fields_equal(got, fields, specs)
        assert len(free_sections(specs)[0]) == 4  # the Golomb positions' count and the mixed sections' three
        wrong = values.tolist()
        wrong[1:4] = [16, 21, 23]  # other counts of the mixed sections, -5, +4 and +1 bytes: the same length
        later = DeviceChecks()
        decode(buf, specs, later, layout=wrong)
        with pytest.raises(WireError, match="size exchange announced"):
            later.read()
        longer = values.tolist()
        longer[0] = k + 1 if k < 500 else k - 1  # another length than the message's: its own headers are read
        assert_fields_equal(decode(buf, specs, layout=longer), fields, specs)
        bad = buf.clone()
        bad[-1] ^= 1
        later = DeviceChecks()
        decode(bad, specs, later, layout=values.tolist())
        with pytest.raises(WireError, match="checksum mismatch"):
            later.read()
        impossible = values.tolist()
        impossible[0] = -5
        assert_fields_equal(decode(buf, specs, layout=impossible), fields, specs)  # (the host path's headers)
        device_path(monkeypatch, False)


VARIABLE_METHODS = {
    "threshold": ("threshold", {"threshold": 0.5}),  # selected on the device, compacted after the size exchange
    "threshold-ef": ("threshold", {"threshold": 0.5, "error_feedback": True}),  # the same under error feedback
    "threshold-golomb": ("threshold", {"threshold": 0.5, "positions": "golomb"}),  # declines: compress_slots
    # declines under error feedback: the messages compress_slots made, their Golomb lengths computed on the device
    "threshold-golomb-ef": ("threshold", {"threshold": 0.5, "positions": "golomb", "error_feedback": True}),
    "sbc": ("sbc", {"density": 0.05}),
    "stc": ("stc", {"density": 0.05}),  # selected on the device, its Golomb lengths from the top-k and a mask
    "stc-sparse": ("stc", {"density": 0.05}),  # with fewer nonzero entries than k: fewer positions sent
    "stc-fixed-sparse": ("stc", {"density": 0.05, "positions": "fixed"}),
    "dgc": ("dgc", {"density": 0.05}),  # torch.topk on the device path: the sampled threshold's positions
    "dgc-sparse": ("dgc", {"density": 0.05}),  # fewer nonzero entries than k, then none
    "dgc-fixed-sparse": ("dgc", {"density": 0.05, "positions": "fixed"}),
    "dgc-warmup": ("dgc", {"density": 0.01, "warmup_steps": 1}),  # k, hence the Rice parameter, changes each step
    "dgc-clip": ("dgc", {"density": 0.05, "clip": 0.5}),  # declines: compress_slots
}


@pytest.mark.parametrize("label", list(VARIABLE_METHODS))
def test_a_variable_exchange_on_the_device_path_equals_the_host_paths(label, monkeypatch):
    """Three simulated workers, three steps: the device path (sized on the device, one read for the lengths and
    layout values, the messages decoded where they are) aggregates exactly what the host path does."""
    import gradcomp
    from gradcomp.transport.sim import SimulatedCluster

    name, params = VARIABLE_METHODS[label]

    def run():
        def fn(t):
            method = gradcomp.make(name, **params)
            model = torch.nn.Linear(60, 30)
            agg = gradcomp.GradientAggregator(model, method, t)
            out = []
            for step in range(3):
                g = torch.Generator().manual_seed(10 * step + t.rank)
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=g)
                    if label.endswith("-sparse"):  # about 2 % nonzero, under STC's 5 %; none at all in a step
                        p.grad *= torch.rand(p.shape, generator=g) < (0.02 if step != 1 else 0.0)
                agg.step()
                out.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
            return out

        with SimulatedCluster(3) as cluster:
            return cluster.run(fn)

    on_host = run()
    device_path(monkeypatch)
    monkeypatch.setenv("GRADCOMP_KERNELS", "0")
    on_device = run()
    for a, b in zip(on_host, on_device):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_length_from_counts_is_encodes_length():
    """A message sized from its fields' counts, some of them on the device (threshold's positions and values, a
    bitmap, floats), has the length encode gives it; a GOLOMB field is refused (its length needs its positions)."""
    from gradcomp.wire.format import length_from_counts

    specs = [*MIXED_SPECS, FieldSpec(Codec.F16, max_count=9), FieldSpec(Codec.BITS, count=5, width=1)]
    for k in (0, 1, 20, 100):
        fields = [*mixed_message(k, k), torch.randn(k % 10), torch.ones(5, dtype=torch.int64)]
        counts = [torch.tensor(k), torch.tensor(k), k, torch.tensor(k % 10), 5]
        assert int(length_from_counts(specs, counts)) == encode(fields, specs).numel()
    with pytest.raises(ConfigError, match="GOLOMB"):
        length_from_counts([FieldSpec(Codec.GOLOMB, max_count=5, universe=50)], [torch.tensor(3)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b", [0, 2, 5])
def test_a_golomb_streams_length_from_its_kept_positions_is_encodes(b, device):
    """STC's device path sizes its message before selecting the kept positions: the stream length of
    ``positions[kept]`` computed from all of them and the mask (a running maximum, no selection) is encode's, for
    masks that keep all, none, the first, the last, runs and scattered entries; with it, length_from_counts takes a
    GOLOMB field."""
    from gradcomp.wire.format import length_from_counts
    from gradcomp.wire.golomb import golomb_encode, golomb_stream_bits

    g = torch.Generator().manual_seed(b)
    positions = torch.sort(torch.randperm(5000, generator=g)[:300]).values.to(device)
    masks = [torch.ones(300, dtype=torch.bool), torch.zeros(300, dtype=torch.bool), torch.arange(300) == 0,
             torch.arange(300) == 299, (torch.arange(300) // 7) % 2 == 0, torch.rand(300, generator=g) < 0.3]
    masks = [m.to(device) for m in masks]
    specs = [FieldSpec(Codec.GOLOMB, max_count=300, universe=5000, golomb_b=b), FieldSpec(Codec.F32, count=1)]
    for kept in masks:
        bits = golomb_stream_bits(positions, b, kept)
        assert int(bits) == golomb_encode(positions[kept], b)[1]
        fields = [positions[kept], torch.ones(1, device=device)]
        length = length_from_counts(specs, [kept.sum(), 1], bits.reshape(1))
        assert int(length) == encode(fields, specs).numel()
    with pytest.raises(ConfigError, match="1 GOLOMB fields"):
        length_from_counts(specs, [torch.tensor(3), 1])


def test_the_device_path_keeps_the_heads_of_fixed_layouts_only(monkeypatch):
    """A fixed layout's header and section heads go to the device once and are kept (the same bytes at every step);
    a variable one's are sent each time and not kept (a kept one costs a wait when it is made, and variable heads
    would make one at every step). The bytes are the host path's either way."""
    from gradcomp.wire import container

    device_path(monkeypatch)
    container._kept_heads.cache_clear()
    fixed = [FieldSpec(Codec.F32, count=5), FieldSpec(Codec.BITS, count=5, width=3)]
    variable = [FieldSpec(Codec.F32, max_count=50), FieldSpec(Codec.POSITIONS, max_count=50, universe=1000)]
    fields = [torch.randn(5), torch.tensor([0, 1, 2, 7, 5])]
    for step in range(3):
        assert torch.equal(decode(encode(fields, fixed), fixed)[1], fields[1])
        n = 3 + step  # a different count, hence different section heads, at every step
        pos = torch.arange(n) * 7
        got = decode(encode([torch.randn(n), pos], variable), variable)
        assert torch.equal(got[1], pos)
    info = container._kept_heads.cache_info()
    assert (info.currsize, info.misses, info.hits) == (1, 1, 2)
    device_path(monkeypatch, False)
    assert torch.equal(encode(fields, fixed), _device_encoded(fields, fixed, monkeypatch))


def _device_encoded(fields, specs, monkeypatch):
    device_path(monkeypatch)
    try:
        return encode(fields, specs)
    finally:
        device_path(monkeypatch, False)


@pytest.mark.parametrize("device", DEVICES)
def test_inside_refusing_later_a_bad_message_is_noted_and_decodes_as_stand_ins(device):
    """What a step that keeps its refusals for its end (``refusing_later``) sees for each mutated message: exactly
    the WireError decode raises outside, noted instead of raised, and zeros in place of the fields (each field's
    decoded dtype; the count its spec fixes, the count of the field it must match, or none); a message that decodes
    outside decodes the same inside, with nothing noted. Every decode counts as a use of the wire."""
    from gradcomp.wire.refusals import Refusals, refusing_later

    rng, noted = random.Random(77), 0
    linked = [FieldSpec(Codec.POSITIONS, count=5, universe=100), FieldSpec(Codec.F32, max_count=5, same_count_as=-1)]
    for _ in range(60):
        own = encode([torch.tensor([1, 4, 9, 16, 25]), torch.randn(5)], linked)
        for specs, buf in [(FUZZ_SPEC_LISTS[i], b) for i, b in fuzz_valid_messages(rng)] + [(linked, own)]:
            bad = u8(bytes(mutate(bytearray(buf.numpy().tobytes()), rng))).to(device)
            try:
                expected, error = decode(bad, specs), None
            except WireError as exc:
                expected, error = None, str(exc)
            refusals = Refusals()
            with refusing_later(refusals):
                got = decode(bad, specs)
            assert refusals.used == 1
            if error is None:
                assert refusals.messages == [] and all(torch.equal(a, b) for a, b in zip(got, expected))
                continue
            noted += 1
            assert refusals.messages == [error]
            counts = []
            for i, spec in enumerate(specs):
                other = counts[i + spec.same_count_as] if spec.same_count_as is not None else 0
                counts.append(spec.count if spec.count is not None else other)
            assert [f.numel() for f in got] == counts and all(not f.any() for f in got)
            dtypes = [torch.int64 if s.codec in (Codec.POSITIONS, Codec.GOLOMB) else
                      decoded_dtype(s.width) if s.codec == Codec.BITS else
                      {Codec.F32: torch.float32, Codec.F16: torch.float16, Codec.BF16: torch.bfloat16}[s.codec]
                      for s in specs]
            assert [f.dtype for f in got] == dtypes and all(f.device.type == bad.device.type for f in got)
    assert noted > 100  # most mutations are refused


@pytest.mark.parametrize("device", DEVICES)
def test_the_fault_flag_says_on_the_device_what_the_read_would_refuse(device, monkeypatch):
    """``DeviceChecks.fault_flag``: the workers' agreement on refused messages needs each worker's verdict on its
    held checks before anything is read. For messages of a fixed layout and of a layout the size exchange announced,
    sound, with a flipped body bit, a flipped section-header bit, or announced values that disagree with their
    headers, the flag is True exactly when ``read`` raises WireError."""
    from gradcomp.wire.device import DeviceChecks
    from gradcomp.wire.format import layout_values

    device_path(monkeypatch)  # (on the CPU: the GPU's code)
    fixed = [FieldSpec(Codec.POSITIONS, count=20, universe=1000), FieldSpec(Codec.F32, count=20),
             FieldSpec(Codec.BITS, count=20, width=3)]
    fields = [f.to(device) for f in mixed_message(20, seed=5)]
    buf = encode(fields, fixed)
    variable = MIXED_SPECS
    vbuf = encode(fields, variable)
    announced = layout_values(variable, [f.numel() for f in fields], None, torch.device(device)).tolist()
    cases = [(buf, fixed, None), (vbuf, variable, announced)]
    seen = []
    for sound, specs, layout in cases:
        for spoil in (None, -1, 3, HEADER_BYTES + 2, "layout"):  # sound, body, header (no CRC), section header
            bad = sound.clone()
            given = layout
            if spoil == "layout":
                if layout is None:
                    continue
                given = list(layout)
                given[1:3] = [given[1] - 1, given[2] + 10]  # other counts, the same length (-4 bytes, +4 bytes)
            elif spoil is not None:
                bad[spoil] ^= 8
            checks = DeviceChecks()
            decode(bad, specs, checks, layout=given)
            flag = bool(checks.fault_flag(torch.device(device)))
            try:
                checks.read()
                refused = False
            except WireError:
                refused = True
            seen.append((spoil, flag, refused))
            assert flag == refused == (spoil is not None), (spoil, flag, refused)
    assert len(seen) == 9
