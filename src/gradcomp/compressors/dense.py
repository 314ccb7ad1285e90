"""Dense baselines: uncompressed fp32 (``none``) and half-precision casting (``fp16``, ``bf16``).

All three are summable, so the exchange sends them with one plain allreduce. Both half formats saturate
instead of producing Inf: fp16 clamps to ±65504, bf16 (fp32's exponent, 8 mantissa bits) clamps to its
largest finite value ±3.39e38. Casting rounds to nearest, so fp16 / bf16 are deterministic and (slightly)
biased.

Speed (issue "make compressors fast enough"): compress is one cast, then (on the CPU) one read of the half-width
result (its sum, or its rows' sums, finite when nothing saturated) and an in-place clamp only when something saturated. On the
CPU the cast is written straight into the place its values take in a message buffer (``wire.container.float_message``),
so ``wire.encode`` of the field alone (a one-slot message) only writes the headers and checksums the body (CRC-32 and
CRC-32C): the message is that buffer, sharing its memory with the field. Encoding it with other fields copies it once
into the message, checksummed piece by piece as it is written, while each piece is in the cache. The fresh d-sized outputs (the cast, the message) cost page
faults on their first touch unless freed memory is kept for reuse (``gradcomp.allocator``; the times:
docs/host_performance.md).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gradcomp.compressors.base import Capabilities, Compressor, Fields, Slot
from gradcomp.wire import Codec, FieldSpec
from gradcomp.wire.bits import host_path
from gradcomp.wire.container import float_message

FP16_MAX = 65504.0
BF16_MAX = torch.finfo(torch.bfloat16).max


_ROW = 4096  # entries per partial sum of _all_finite


def _all_finite(out: Tensor) -> bool:
    """True only when no entry of the half-width ``out`` is ±Inf or NaN, from one read in the common case: its sum,
    finite only if every entry is (an Inf or NaN makes it Inf or NaN). The sum comes back in the half format, so a
    tensor of finite entries can overflow it (fp16's ±65504: ten million entries of mean magnitude 0.007); then the
    sums of rows of :data:`_ROW` entries (and of the tail) decide, which overflow only at a mean magnitude above 16
    in fp16, and a False from them only costs the clamp of a tensor that needed none, with the same bits. Only ±Inf
    (what rounded past ±limit) and NaN need the clamp. On the CPU a sum is the cheapest read of the result (on the
    project's machine about half of ``aminmax``, which had been a third of fp16's compress+encode, and cheaper than
    the row sums); summing in float32 instead (``sum(dtype=float32)``) converts first and is far slower."""
    flat = out.reshape(-1)
    if math.isfinite(float(flat.sum())):
        return True
    whole = flat.numel() - flat.numel() % _ROW
    if whole and not bool(torch.isfinite(flat[:whole].view(-1, _ROW).sum(1)).all()):
        return False
    return math.isfinite(float(flat[whole:].sum()))


class _DenseCast(Compressor):
    """Every entry sent in ``dtype`` (codec ``codec``), saturating at ±``limit`` instead of overflowing."""

    capabilities = Capabilities(subtract_sent=True)
    summable = True
    nan_in_result = True  # a NaN entry of the summed message is a NaN of the average
    codec: Codec = Codec.F32
    dtype: torch.dtype = torch.float32
    limit: float | None = None

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [FieldSpec(self.codec, count=slot.numel)]

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        flat = x.reshape(-1).to(torch.float32)
        if self.limit is not None and host_path(flat) and flat.numel():
            # On the host the cast goes straight into the place of the data in a message buffer (wire's
            # float_message, the same bits as ``to``), so that encoding this field alone copies nothing; then the
            # saturation, in place there.
            out = float_message(self.codec, flat.numel())
            out.copy_(flat)
            if not _all_finite(out):
                out.clamp_(-self.limit, self.limit)
            return [out]
        out = flat.to(self.dtype)
        if self.limit is not None:
            # Cast, then saturate the half-width result in place: the same bits as clamping in float32 and
            # casting (±limit is exact in both formats; what rounds past it became ±Inf and is clamped back;
            # NaNs are cast alike), for one pass over the fp32 input instead of a clamped fp32 copy (a fresh
            # 4·d-byte tensor, whose first touch cost more than the cast) followed by the cast.
            if out.data_ptr() == flat.data_ptr():  # never clamp the caller's tensor in place
                out = out.clone()
            if host_path(out) and out.numel() and _all_finite(out):  # one read decides whether to write
                return [out]
            out.clamp_(-self.limit, self.limit)
        return [out]

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        return fields[0].to(torch.float32)

    def subtract_sent(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        out.sub_(fields[0].reshape(-1))  # fp16/bf16 widened to float32 in the kernel: exact, as .to(float32)


class NoCompression(_DenseCast):
    """Uncompressed fp32: the reference every ratio is measured against."""

    capabilities = _DenseCast.capabilities
    name = "none"
    unbiased = True
    omega = 0.0


class Float16(_DenseCast):
    """Cast to IEEE half precision (16 bits per entry), saturating at ±65504."""

    capabilities = _DenseCast.capabilities
    name = "fp16"
    codec, dtype, limit = Codec.F16, torch.float16, FP16_MAX


class BFloat16(_DenseCast):
    """Cast to bfloat16 (16 bits per entry, 8 exponent bits like fp32), saturating at its largest finite value."""

    capabilities = _DenseCast.capabilities
    name = "bf16"
    codec, dtype, limit = Codec.BF16, torch.bfloat16, BF16_MAX
