"""Dense baselines: uncompressed fp32 (``none``) and half-precision casting (``fp16``, ``bf16``).

All three are summable, so the exchange sends them with one plain allreduce. fp16 saturates values beyond its
range (|x| > 65504) to ±65504 instead of turning them into Inf; bf16 keeps fp32's range with 8 mantissa bits.
bf16 rounds the largest finite fp32 values (above about 3.39e38) to Inf; the exchange's finite check runs
on the input, so such a gradient is not caught there. Casting rounds to nearest, so fp16 / bf16 are deterministic and (slightly) biased.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradcomp.compressors.base import Compressor, Fields, Slot
from gradcomp.registry import register
from gradcomp.wire import Codec, FieldSpec

FP16_MAX = 65504.0


@register
class NoCompression(Compressor):
    """Uncompressed fp32: the reference every ratio is measured against."""

    name = "none"
    summable = True
    unbiased = True
    omega = 0.0

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [FieldSpec(Codec.F32, count=slot.numel)]

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        return [x.reshape(-1).to(torch.float32)]

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        return fields[0].to(torch.float32)


@register
class Float16(Compressor):
    """Cast to IEEE half precision (16 bits per entry), saturating at ±65504."""

    name = "fp16"
    summable = True

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [FieldSpec(Codec.F16, count=slot.numel)]

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        return [x.reshape(-1).to(torch.float32).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)]

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        return fields[0].to(torch.float32)


@register
class BFloat16(Compressor):
    """Cast to bfloat16 (16 bits per entry, 8 exponent bits like fp32)."""

    name = "bf16"
    summable = True

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [FieldSpec(Codec.BF16, count=slot.numel)]

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        return [x.reshape(-1).to(torch.bfloat16)]

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        return fields[0].to(torch.float32)
