"""Dense baselines: uncompressed fp32 (``none``) and half-precision casting (``fp16``, ``bf16``).

All three are summable, so the exchange sends them with one plain allreduce. Both half formats saturate
instead of producing Inf: fp16 clamps to ±65504, bf16 (fp32's exponent, 8 mantissa bits) clamps to its
largest finite value ±3.39e38. Casting rounds to nearest, so fp16 / bf16 are deterministic and (slightly)
biased.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradcomp.compressors.base import Compressor, Fields, Slot
from gradcomp.registry import register
from gradcomp.wire import Codec, FieldSpec

FP16_MAX = 65504.0
BF16_MAX = torch.finfo(torch.bfloat16).max


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
        return [x.reshape(-1).to(torch.float32).clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16)]

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        return fields[0].to(torch.float32)
