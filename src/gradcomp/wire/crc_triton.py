"""The wire checksum of a device buffer as Triton kernels: one launch per level, each byte read once.

The same computation as the torch formulation of :func:`gradcomp.wire.checksum.checksum64_tensor`, from the same
tables (docs/wire.md), fused: the torch operations materialise an int64 index and an int64 gathered value per body
byte (16 bytes of temporaries per byte) and launch a dozen kernels per level; here the first kernel reads the
body's bytes and writes one raw CRC pair per block of ``block`` bytes, and each later one reads ``group`` entries
and writes one, so a 40 MB body takes four launches and about 1.2 bytes of traffic per body byte. Each program
of a level handles ``ROWS`` rows: loads them (masked where the front padding or the end falls), looks every byte
(or every byte of every 64-bit entry) up in the level's table and xor-reduces the row. Positions are int64, so
bodies of 2**31 bytes and more (the format allows up to 2**32) index correctly.

Imported only where Triton can be (it ships with CUDA builds of torch); ``checksum64_tensor`` falls back to torch
operations otherwise. With ``TRITON_INTERPRET=1`` the kernels run on CPU tensors through Triton's interpreter,
which is how tests/test_wire_checksum.py checks them without a GPU, where Triton is installed.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

__all__ = ["checksum64"]

_ROWS_BYTES = 32  # blocks per program of the first level (32 x 64 bytes = 2 KB)
_ROWS_GROUPS = 8  # groups per program of a later level (8 x 64 entries x 8 lookups)


@triton.jit(do_not_specialize=["n", "pad", "blocks", "final"])  # one compilation for every length
def _blocks_kernel(body, table, out, n, pad, blocks, final, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """out[r] = the raw CRC pair of block r (xor of table[i, byte]), xor ``final`` (nonzero on the last level)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    q = rows[:, None] * BLOCK + cols[None, :] - pad  # position in the body; < 0 is front padding
    byte = tl.load(body + q, mask=(q >= 0) & (q < n), other=0).to(tl.int64)
    crc = tl.xor_sum(tl.load(table + cols[None, :] * 256 + byte), axis=1)  # a zero byte's entry is 0
    tl.store(out + rows, crc ^ final, mask=rows < blocks)


@triton.jit(do_not_specialize=["m", "pad", "groups", "final"])
def _groups_kernel(entries, table, out, m, pad, groups, final, ROWS: tl.constexpr, GROUP: tl.constexpr):
    """out[g] = xor over positions p of the level map of entry p of group g (8 byte lookups each), xor ``final``."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, GROUP)
    q = rows[:, None] * GROUP + cols[None, :] - pad
    entry = tl.load(entries + q, mask=(q >= 0) & (q < m), other=0)
    acc = tl.zeros((ROWS, GROUP), dtype=tl.int64)
    for lane in tl.static_range(8):
        byte = (entry >> (8 * lane)) & 0xFF
        acc ^= tl.load(table + (cols[None, :] * 8 + lane) * 256 + byte)
    tl.store(out + rows, tl.xor_sum(acc, axis=1) ^ final, mask=rows < groups)


def checksum64(buf: torch.Tensor, const: int, block_table: torch.Tensor, level_table: Callable[[int], torch.Tensor],
               block: int, group: int) -> torch.Tensor:
    """The checksum of the uint8 buffer ``buf`` (contiguous, non-empty) as an int64 tensor of shape ().

    ``const`` is the length's init/final-xor constant (signed int64), ``block_table`` the flattened
    (block, 256) table, ``level_table(span)`` the flattened (group, 8, 256) table of a level whose entries cover
    ``span`` bytes, all on ``buf``'s device (gradcomp.wire.checksum makes and caches them).
    """
    n = buf.numel()
    blocks = -(-n // block)
    out = torch.empty(blocks, dtype=torch.int64, device=buf.device)
    grid = (triton.cdiv(blocks, _ROWS_BYTES),)
    _blocks_kernel[grid](buf, block_table, out, n, blocks * block - n, blocks, const if blocks == 1 else 0,
                         ROWS=_ROWS_BYTES, BLOCK=block)
    span = block
    while out.numel() > 1:
        m = out.numel()
        groups = -(-m // group)
        nxt = torch.empty(groups, dtype=torch.int64, device=buf.device)
        grid = (triton.cdiv(groups, _ROWS_GROUPS),)
        _groups_kernel[grid](out, level_table(span), nxt, m, groups * group - m, groups, const if groups == 1 else 0,
                             ROWS=_ROWS_GROUPS, GROUP=group)
        out, span = nxt, span * group
    return out.view(())
