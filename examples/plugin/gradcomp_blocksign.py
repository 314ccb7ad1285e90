"""Blockwise scaled sign: the compressor of dist-EF-blockSGD, as a gradcomp plugin.

Paper: Shuai Zheng, Ziyue Huang, James T. Kwok, "Communication-Efficient Distributed Blockwise Momentum SGD
with Error-Feedback", NeurIPS 2019.

Algorithm: the gradient x is cut into blocks G_1, ..., G_B, and each block is sent as its signs and one scale,
the mean magnitude of its entries:

    C(x)[G_b] = (||x[G_b]||_1 / |G_b|) * sign(x[G_b])

The paper's blocks are the network's layers; with gradcomp's per-layer slots (the default granularity) that is
``block=None``, one block per slot. ``block=n`` cuts every slot into blocks of n entries (the last one shorter)
instead, so that a layer with entries of very different sizes gets several scales. The compressor is biased,
so the paper trains it with error feedback, on the workers and on the server: ``default_error_feedback`` is on
(``make("blocksign")`` wraps it in ``ErrorFeedback``), and ``--topology ps --server-compressor blocksign``
compresses the downlink too.

Message of a slot of d entries in B blocks: B float32 scales, then d sign bits (1 = negative; a zero entry is
sent as +scale: one bit has no room for a third value): 32·B + d bits, against 32·d for fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradcomp import Compressor, ConfigError, Slot
from gradcomp.wire import Codec, FieldSpec


class BlockSign(Compressor):
    name = "blocksign"
    default_error_feedback = True  # the paper's method is error feedback around this compressor

    def __init__(self, block: int | None = None):
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise ConfigError(f"block must be a positive number of entries or None (one block per slot), got {block!r}")
        self.block = block

    def params(self) -> dict:
        return {"block": self.block}

    def _block_size(self, numel: int) -> int:
        return max(1, numel if self.block is None else self.block)

    def specs(self, slot: Slot) -> list[FieldSpec]:
        blocks = -(-slot.numel // self._block_size(slot.numel))
        return [FieldSpec(Codec.F32, count=blocks), FieldSpec(Codec.BITS, count=slot.numel, width=1)]

    def compress(self, x: Tensor, slot: Slot, step: int) -> list[Tensor]:
        flat = x.reshape(-1).to(torch.float32)
        size = self._block_size(flat.numel())
        blocks = -(-flat.numel() // size)
        padded = torch.nn.functional.pad(flat.abs(), (0, blocks * size - flat.numel()))  # zeros add nothing
        counts = torch.full((blocks,), float(size), device=flat.device)
        if blocks:
            counts[-1] = flat.numel() - (blocks - 1) * size  # the last block's true length
        scales = padded.view(blocks, size).sum(dim=1) / counts
        return [scales, (flat < 0).to(torch.uint8)]

    def decompress(self, fields: list[Tensor], slot: Slot, step: int) -> Tensor:
        scales, negative = fields
        size = self._block_size(slot.numel)
        magnitude = scales.to(torch.float32).repeat_interleave(size)[: slot.numel]
        return torch.where(negative.reshape(-1).bool(), -magnitude, magnitude)
