"""Shared test helper: the bit-exact wire round trip every compressor's tests run."""

from __future__ import annotations

import torch

from gradcomp import Slot
from gradcomp.compressors.base import accumulate
from gradcomp.wire import decode, encode


def f32_bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a float32 tensor, so that -0.0 != 0.0 and NaN payloads compare too."""
    assert t.dtype == torch.float32
    return t.contiguous().view(torch.int32)


def round_trip(compressor, x: torch.Tensor, slot: Slot, step: int = 0) -> torch.Tensor:
    """encode → decode → decompress equals decompress of the raw fields, bit for bit; so does accumulate.

    Integer fields come back with equal values; float fields come back with their dtype and bytes.
    Returns the decompressed tensor.
    """
    fields = compressor.compress(x, slot, step)
    direct = compressor.decompress(fields, slot, step)
    assert direct.dtype == torch.float32 and direct.shape == (slot.numel,)
    specs = compressor.specs(slot)
    buf = encode(fields, specs)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    decoded = decode(buf, specs)
    assert len(decoded) == len(fields)
    for got, sent in zip(decoded, fields):
        assert got.numel() == sent.numel()
        if sent.dtype.is_floating_point:
            assert got.dtype == sent.dtype
            assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).contiguous().view(torch.uint8))
        else:
            # codes may be any integer dtype (C_nat's are int16); the wire decodes BITS fields to the narrowest
            # signed dtype of their width and positions to int64
            assert not sent.dtype.is_complex and got.dtype in (torch.int16, torch.int32, torch.int64)
            assert torch.equal(got.reshape(-1).to(torch.int64), sent.reshape(-1).to(torch.int64))
    via_wire = compressor.decompress(decoded, slot, step)
    assert via_wire.dtype == torch.float32 and via_wire.shape == (slot.numel,)
    assert torch.equal(f32_bits(via_wire), f32_bits(direct))
    out = torch.empty(slot.numel).fill_(0.25)
    accumulate(compressor, fields, slot, step, out)
    assert torch.equal(f32_bits(out), f32_bits(0.25 + direct))
    return direct
