"""wire.container.encode writes every message into ONE freshly allocated buffer (the single-copy layout).

test_wire_stability.py pins the bytes of hundreds of messages; these tests pin what the single-copy encoder
adds: the same bytes as an independent reference built with struct for every float input dtype, shape, stride
and section offset (aligned or not, small sections copied by numpy and large ones by torch); one allocation
of exactly the message size and no other temporary as large as the data; a fresh buffer per call that
aliases neither the fields nor an earlier message; and decoded values that do not alias the buffer.
"""

from __future__ import annotations

import struct

import pytest
import torch

from gradcomp.wire import (
    FORMAT_VERSION,
    HEADER_BYTES,
    SECTION_HEADER_BYTES,
    Codec,
    FieldSpec,
    checksum64,
    container,
    decode,
)
from gradcomp.wire.bits import bits_needed, pack_bits
from gradcomp.wire.container import encode

FLOAT = {Codec.F32: torch.float32, Codec.F16: torch.float16, Codec.BF16: torch.bfloat16}
SMALL = container._SMALL_COPY


def reference(fields, specs) -> bytes:
    """The message built independently: struct headers, raw float bytes, pack_bits streams."""
    body = b""
    for f, s in zip(fields, specs):
        f = f.detach().reshape(-1)
        if s.codec in FLOAT:
            # Tensor.to is the reference conversion; rebuilt from its (exact) values: fresh, stride 1
            dense = torch.tensor(f.to(FLOAT[s.codec]).tolist(), dtype=FLOAT[s.codec])
            data = bytes(dense.view(torch.uint8).tolist())
            param = 0
        elif s.codec == Codec.BITS:
            data, param = bytes(pack_bits(f, s.width).tolist()), s.width
        else:  # POSITIONS
            param = bits_needed(s.universe)
            data = bytes(pack_bits(f, param).tolist())
        body += struct.pack("<BBII", int(s.codec), param, f.numel(), len(data)) + data
    cs = checksum64(torch.tensor(list(body), dtype=torch.uint8))
    return struct.pack("<2sBBHHIQ", b"GC", FORMAT_VERSION, 0, len(specs), 0, len(body), cs) + body


def as_bytes(buf: torch.Tensor) -> bytes:
    return buf.numpy().tobytes()


def float_input(n: int, dtype: torch.dtype, layout: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n + 1, generator=g, dtype=torch.float64) * 300
    x[: min(n, 4)] = torch.tensor([0.0, -0.0, 7e4, -1e-45][: min(n, 4)], dtype=torch.float64)
    x = x.to(dtype)
    if layout == "strided":
        return x[: 2 * n : 2]
    if layout == "2d-transposed" and n % 2 == 0:
        return x[:n].reshape(2, n // 2).t()
    return x[:n].clone()


@pytest.mark.parametrize("codec", [Codec.F32, Codec.F16, Codec.BF16])
@pytest.mark.parametrize("src_dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "2d-transposed"])
@pytest.mark.parametrize("n", [0, 1, 3, 100, SMALL // 2 + 3, SMALL + 7])
def test_float_sections_match_the_reference_at_every_offset(codec, src_dtype, layout, n):
    x = float_input(n, src_dtype, layout, seed=n)
    # the float section after a BITS section of 0..4 bytes: data offsets 30 + 10 + 0..4, aligned or not
    for lead in range(5):
        bits = torch.ones(8 * lead, dtype=torch.int64)
        specs = [FieldSpec(Codec.BITS, max_count=64, width=1), FieldSpec(codec, count=n)]
        buf = encode([bits, x], specs)
        assert as_bytes(buf) == reference([bits, x], specs), (lead, n)
    one = encode([x], [FieldSpec(codec, count=n)])  # first section: F32 misaligned at byte 30
    assert as_bytes(one) == reference([x], [FieldSpec(codec, count=n)])


def test_zero_dim_and_mixed_messages_match_the_reference():
    g = torch.Generator().manual_seed(1)
    fields = [
        torch.tensor(2.5),
        torch.tensor([1, 4, 9]),
        torch.randn(SMALL + 1, generator=g),
        torch.randint(0, 8, (1001,), generator=g),
        torch.randn(7, generator=g).half(),
        torch.randn(3, 5, generator=g).t(),
    ]
    specs = [
        FieldSpec(Codec.F32, count=1),
        FieldSpec(Codec.POSITIONS, count=3, universe=10),
        FieldSpec(Codec.BF16, count=SMALL + 1),
        FieldSpec(Codec.BITS, count=1001, width=3),
        FieldSpec(Codec.F16, count=7),
        FieldSpec(Codec.F32, count=15),
    ]
    buf = encode(fields, specs)
    assert as_bytes(buf) == reference(fields, specs)
    assert len(decode(buf, specs)) == len(specs)


def test_big_bits_section_takes_the_torch_copy():
    v = torch.randint(0, 2, (8 * SMALL + 24,), generator=torch.Generator().manual_seed(2))
    specs = [FieldSpec(Codec.BITS, count=v.numel(), width=1), FieldSpec(Codec.F16, count=2)]
    fields = [v, torch.tensor([1.0, -2.0])]
    assert as_bytes(encode(fields, specs)) == reference(fields, specs)


def _allocated(fn) -> int:
    """Bytes allocated on the CPU by the top-level torch ops that ``fn`` runs (freed or not)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None and e.cpu_memory_usage > 0)


@pytest.mark.parametrize(
    "codec,src_dtype",
    [(Codec.F16, torch.float16), (Codec.F16, torch.float32), (Codec.BF16, torch.bfloat16), (Codec.F32, torch.float32)],
)
def test_one_allocation_of_exactly_the_message(codec, src_dtype):
    n = 1 << 20
    x = torch.randn(n).to(src_dtype)
    specs = [FieldSpec(codec, count=n)]
    size = HEADER_BYTES + SECTION_HEADER_BYTES + n * FLOAT[codec].itemsize
    encode([x], specs)  # warm-up
    allocated = _allocated(lambda: encode([x], specs))
    assert allocated == size  # the output itself: no body, no concatenation, no cast temporary


def test_output_is_fresh_exact_and_aliases_nothing():
    x = torch.randn(1000).half()
    specs = [FieldSpec(Codec.F16, count=1000)]
    a = encode([x], specs)
    b = encode([x], specs)
    assert torch.equal(a, b)
    assert a.storage_offset() == 0 and a.untyped_storage().nbytes() == a.numel()
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert a.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    before = as_bytes(a)
    x.fill_(1.0)  # the caller reuses its tensor: the message keeps its bytes
    b.fill_(0)  # another message is overwritten: this one keeps its bytes
    assert as_bytes(a) == before


def test_inputs_are_untouched_and_grad_is_ignored():
    x = torch.randn(300, requires_grad=True)
    y = torch.randn(300, dtype=torch.float64)
    y_before = y.clone()
    specs = [FieldSpec(Codec.F16, count=300), FieldSpec(Codec.BF16, count=300)]
    buf = encode([x * 2, y], specs)
    assert not buf.requires_grad and buf.grad_fn is None
    assert torch.equal(y, y_before)
    assert as_bytes(buf) == reference([(x * 2).detach(), y], specs)


def test_decoded_floats_do_not_alias_the_buffer():
    x = torch.randn(64)
    specs = [FieldSpec(Codec.F16, count=64), FieldSpec(Codec.F32, count=64)]
    buf = encode([x, x], specs)
    half, full = decode(buf, specs)
    saved = (half.clone(), full.clone())
    buf[HEADER_BYTES:].fill_(0xFF)  # a receive buffer reused for the next message
    assert torch.equal(half, saved[0]) and torch.equal(full, saved[1])


def test_device_section_header_writer():
    """The non-CPU path writes all section headers with one indexed write; it is plain torch, so check it here."""
    out = torch.zeros(60, dtype=torch.uint8)
    heads = [(20, struct.pack("<BBII", 1, 0, 3, 12)), (42, struct.pack("<BBII", 4, 7, 9, 8))]
    container._put_heads(out, heads)
    raw = as_bytes(out)
    assert raw[20:30] == heads[0][1] and raw[42:52] == heads[1][1]
    assert raw[:20] == bytes(20) and raw[30:42] == bytes(12) and raw[52:] == bytes(8)
    container._put_heads(out, [])  # no sections: nothing to write
