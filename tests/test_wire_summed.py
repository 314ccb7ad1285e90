"""The host path of wire.encode checksums large float sections piece by piece as it writes them
(container._put_float_summed), and the dense casts decide their clamp from row sums (dense._all_finite): both must
give exactly the bytes of the plain path."""

from __future__ import annotations

import pytest
import torch

from gradcomp import make, wire
from gradcomp.errors import WireError
from gradcomp.compressors import dense
from gradcomp.compressors.base import Slot
from gradcomp.wire import Codec, FieldSpec, container
from gradcomp.wire.checksum import RunningChecksum64, checksum64

PIECE = container._SUMMED_PIECE


def _spy(monkeypatch) -> list[bool]:
    """Per float section of the next encodes, whether it was written piecewise."""
    calls: list[bool] = []
    real = container._summed_applies

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(container, "_summed_applies", spy)
    return calls


def _plain(fields, specs, monkeypatch):
    """The same message with the piecewise path switched off."""
    with monkeypatch.context() as m:
        m.setattr(container, "_SUMMED_PIECE", 1 << 62)
        return wire.encode(fields, specs)


def test_running_checksum_equals_the_whole_bodys():
    data = torch.randint(0, 256, (3 * 4099 + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    running = RunningChecksum64()
    for start in range(0, data.numel(), 4099):
        running.update(data[start : start + 4099].numpy())
    assert running.value() == checksum64(data)
    assert RunningChecksum64().value() == checksum64(data[:0])


@pytest.mark.parametrize("codec, dtype", [(Codec.F16, torch.float16), (Codec.BF16, torch.bfloat16)])
@pytest.mark.parametrize("source", [torch.float32, "same", "strided"])
def test_large_half_sections_give_the_plain_bytes(codec, dtype, source, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    n = 3 * PIECE // 2 + 777  # three pieces and a bit
    x = torch.randn(2 * n, generator=gen)
    field = {torch.float32: x[:n], "same": x[:n].to(dtype), "strided": x.to(dtype)[::2]}[source]
    small = torch.randint(0, 8, (1008,), generator=gen)  # 378 bytes: the F16 data starts at an even offset
    specs = [FieldSpec(Codec.BITS, count=1008, width=3), FieldSpec(codec, count=n), FieldSpec(Codec.F32, count=5)]
    fields = [small, field, x[:5]]
    calls = _spy(monkeypatch)
    got = wire.encode(fields, specs)
    assert calls == [source != "strided", False]  # a strided source is written whole; F32 x 5 is small
    assert torch.equal(got, _plain(fields, specs, monkeypatch))
    decoded = wire.decode(got, specs)
    assert torch.equal(decoded[1], field.to(dtype))


def test_a_misaligned_large_f32_section_and_two_large_sections(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(PIECE, generator=gen), torch.randn(PIECE + 3, generator=gen)
    specs = [FieldSpec(Codec.F32, count=a.numel()), FieldSpec(Codec.F16, count=b.numel()),
             FieldSpec(Codec.BF16, count=a.numel())]
    fields = [a, b, a]  # the F32 data starts at byte 30: written whole; the halves piecewise
    calls = _spy(monkeypatch)
    got = wire.encode(fields, specs)
    assert calls == [False, True, True]
    assert torch.equal(got, _plain(fields, specs, monkeypatch))
    assert int.from_bytes(got[12:20].numpy().tobytes(), "little") == checksum64(got[wire.HEADER_BYTES :])


def test_a_corrupted_piecewise_message_is_refused():
    x = torch.randn(PIECE * 2)
    specs = [FieldSpec(Codec.F16, count=x.numel())]
    buf = wire.encode([x], specs)
    buf[wire.HEADER_BYTES + 10 + PIECE + 3] ^= 4  # a bit in the second piece
    with pytest.raises(WireError, match="checksum"):
        wire.decode(buf, specs)


@pytest.mark.parametrize("name, dtype, limit", [("fp16", torch.float16, dense.FP16_MAX),
                                                 ("bf16", torch.bfloat16, dense.BF16_MAX)])
def test_the_casts_saturate_exactly_as_clamping_in_float32(name, dtype, limit):
    n = 3 * dense._ROW + 17  # whole rows and a tail
    base = torch.randn(n, generator=torch.Generator().manual_seed(3))
    big = 4.0 * float(torch.finfo(dtype).max) if dtype == torch.float16 else float("inf")
    cases = {
        "none": base,
        "overflow in a row": base.clone().index_fill_(0, torch.tensor([5]), big),
        "negative overflow in the tail": base.clone().index_fill_(0, torch.tensor([n - 1]), -big),
        "inf": base.clone().index_fill_(0, torch.tensor([dense._ROW + 1]), float("inf")),
        "nan": base.clone().index_fill_(0, torch.tensor([2]), float("nan")),
        "finite row whose sum overflows": torch.full((n,), 0.9 * limit),
    }
    compressor = make(name)
    slot = Slot("s", 0, n)
    for what, x in cases.items():
        (out,) = compressor.compress(x, slot, 0)
        expected = x.clamp(-limit, limit).to(dtype)
        assert out.dtype == dtype
        assert torch.equal(out.isnan(), expected.isnan()), what
        assert torch.equal(out.nan_to_num(0.0), expected.nan_to_num(0.0)), what
        assert bool(torch.isfinite(out[~out.isnan()]).all()), what
    assert dense._all_finite(base.to(dtype))
    if dtype == torch.float16:  # a sum over fp16's range, every row's within it: the rows decide, no clamp
        assert float(torch.full((n,), 10.0, dtype=dtype).sum()) == float("inf")
        assert dense._all_finite(torch.full((n,), 10.0, dtype=dtype))
    assert not dense._all_finite(cases["inf"].to(dtype))
    assert not dense._all_finite(cases["nan"].to(dtype))


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_a_cast_written_in_its_message_is_encoded_without_a_copy(name):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(4))
    x[7] = float("inf") if name == "bf16" else 1e6  # saturates, in place in the message
    x[8] = float("nan")
    compressor = make(name)
    slot = Slot("s", 0, x.numel())
    specs = compressor.specs(slot)
    (field,) = compressor.compress(x, slot, 0)
    plain = wire.encode([field.clone()], specs)  # a tensor of its own: copied as always
    message = wire.encode([field], specs)
    assert torch.equal(message, plain)
    assert message.data_ptr() == field.data_ptr() - wire.HEADER_BYTES - 10  # the field is the message's data
    assert torch.equal(wire.decode(message, specs)[0].view(torch.int16), field.view(torch.int16))  # NaN too
    again = wire.encode([field], specs)  # only the first encode is in place: a second message of its own
    assert torch.equal(again, plain) and again.data_ptr() != message.data_ptr()


def test_only_a_reserved_buffer_of_exactly_that_message_is_written_in_place():
    n = 64
    specs = [FieldSpec(Codec.F16, count=n)]
    mine = torch.zeros(wire.HEADER_BYTES + 10 + 2 * n, dtype=torch.uint8)  # the same layout, not float_message's
    view = mine[wire.HEADER_BYTES + 10 :].view(torch.float16)
    view.copy_(torch.arange(n))
    message = wire.encode([view], specs)
    assert message.data_ptr() != mine.data_ptr() and not mine[: wire.HEADER_BYTES + 10].any()  # left alone
    field = container.float_message(Codec.F16, n)
    field.copy_(torch.arange(n))
    with_more = wire.encode([field, field], specs * 2)  # two sections: copied
    assert with_more.data_ptr() != field.data_ptr() - wire.HEADER_BYTES - 10
    assert torch.equal(wire.decode(with_more, specs * 2)[1], field)
    other = wire.encode([field[: n // 2]], [FieldSpec(Codec.F16, count=n // 2)])  # a shorter message: copied
    assert other.data_ptr() != field.data_ptr() - wire.HEADER_BYTES - 10
    assert torch.equal(wire.encode([field], specs), _plain_bytes([field], specs))
    assert wire.encode([field], specs).data_ptr() != field.data_ptr() - wire.HEADER_BYTES - 10  # used up


def _plain_bytes(fields, specs):
    return wire.encode([f.clone() for f in fields], specs)
