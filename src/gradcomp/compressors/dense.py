"""Dense baselines: uncompressed fp32 (``none``) and half-precision casting (``fp16``, ``bf16``).

All three are summable, so the exchange sends them with one plain allreduce. Both half formats saturate
instead of producing Inf: fp16 clamps to ±65504, bf16 (fp32's exponent, 8 mantissa bits) clamps to its
largest finite value ±3.39e38. Casting rounds to nearest, so fp16 / bf16 are deterministic and (slightly)
biased.

Speed (issue "make compressors fast enough"): compress is one cast, then (on the CPU) a min/max pass over
the half-width result and an in-place clamp only when something saturated. What remains of fp16's
compress+encode on the CPU is the container's: ``wire.encode`` copies the 2·d-byte body once into the
message and checksums it (CRC-32 and CRC-32C). The fresh d-sized outputs (the cast, the message) cost page
faults on their first touch unless freed memory is kept for reuse (``gradcomp.allocator``; the times:
docs/host_performance.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradcomp.compressors.base import Capabilities, Compressor, Fields, Slot
from gradcomp.wire import Codec, FieldSpec
from gradcomp.wire.bits import host_path

FP16_MAX = 65504.0
BF16_MAX = torch.finfo(torch.bfloat16).max


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
        out = flat.to(self.dtype)
        if self.limit is not None:
            # Cast, then saturate the half-width result in place: the same bits as clamping in float32 and
            # casting (±limit is exact in both formats; what rounds past it became ±Inf and is clamped back;
            # NaNs are cast alike), for one pass over the fp32 input instead of a clamped fp32 copy (a fresh
            # 4·d-byte tensor, whose first touch cost more than the cast) followed by the cast.
            if out.data_ptr() == flat.data_ptr():  # never clamp the caller's tensor in place
                out = out.clone()
            if host_path(out) and out.numel():  # one read pass decides whether a write pass is needed
                low, high = torch.stack(torch.aminmax(out)).float().tolist()
                if low >= -self.limit and high <= self.limit:  # (False for NaN: then clamped, as always)
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
