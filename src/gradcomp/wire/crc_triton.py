"""The wire checksum of a device buffer as Triton kernels: two levels per launch, each byte read once.

The same computation as the torch formulation of :func:`gradcomp.wire.checksum.checksum64_tensor`, from the same
tables (docs/wire.md), fused: the torch operations materialise an int64 index and an int64 looked-up value per
body byte (16 bytes of temporaries per byte) and launch a dozen kernels per level. Here the first kernel reads
the body's bytes and writes one raw CRC pair per ``group`` blocks of ``block`` bytes (two levels in one program:
4 KB become one entry), and each later launch makes one entry of ``group`` x ``group`` (two levels again), so a
body of up to 4 KB takes one launch, up to 16 MB two, and a 40 MB body three, reading each byte once. Each program
loads its tile (masked where the front padding or the end falls), looks every byte (or every byte of every 64-bit
entry) up in the level's table, xor-reduces the rows, and does the same to the rows' results with the next level's
table. The launch count matters as much as the bandwidth: a launch from Python costs microseconds to tens of
microseconds, a megabyte at a GPU's bandwidth less than one. Positions are int64, so bodies of 2**31 bytes and more
(the format allows up to 2**32) index correctly.

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


@triton.jit
def _advanced(entries, table, positions):
    """Each raw CRC pair of ``entries`` advanced by its position's "zero bytes" map in the level ``table`` (8
    lookups, one per byte of the 64-bit pair, xored); ``positions`` broadcasts to the entries' shape."""
    acc = tl.zeros_like(entries)
    for lane in tl.static_range(8):
        acc ^= tl.load(table + (positions * 8 + lane) * 256 + ((entries >> (8 * lane)) & 0xFF))
    return acc


@triton.jit(do_not_specialize=["n", "pad", "final"])  # one compilation for every length
def _bytes_kernel(body, block_table, group_table, out, n, pad, final, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """out[pid] = the raw CRC pair of the program's GROUP blocks of BLOCK bytes (two levels), xor ``final``."""
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, GROUP)
    cols = tl.arange(0, BLOCK)
    q = pid * (GROUP * BLOCK) + rows[:, None] * BLOCK + cols[None, :] - pad  # < 0: front padding
    byte = tl.load(body + q, mask=(q >= 0) & (q < n), other=0).to(tl.int64)
    crcs = tl.xor_sum(tl.load(block_table + cols[None, :] * 256 + byte), axis=1)  # a zero byte's entry is 0
    tl.store(out + pid, tl.xor_sum(_advanced(crcs, group_table, rows), axis=0) ^ final)


@triton.jit(do_not_specialize=["m", "pad", "final"])
def _entries_kernel(entries, inner_table, outer_table, out, m, pad, final, GROUP: tl.constexpr):
    """out[pid] = the program's GROUP x GROUP entries combined by rows (inner_table), then the rows' results
    (outer_table): two levels, 8 byte lookups per entry each; xor ``final``."""
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, GROUP)
    q = pid * (GROUP * GROUP) + rows[:, None] * GROUP + rows[None, :] - pad
    entry = tl.load(entries + q, mask=(q >= 0) & (q < m), other=0)
    sub = tl.xor_sum(_advanced(entry, inner_table, rows[None, :]), axis=1)
    tl.store(out + pid, tl.xor_sum(_advanced(sub, outer_table, rows), axis=0) ^ final)


def checksum64(buf: torch.Tensor, const: int, block_table: torch.Tensor, level_table: Callable[[int], torch.Tensor],
               block: int, group: int) -> torch.Tensor:
    """The checksum of the uint8 buffer ``buf`` (contiguous, non-empty) as an int64 tensor of shape ().

    ``const`` is the length's init/final-xor constant (signed int64), ``block_table`` the flattened
    (block, 256) table, ``level_table(span)`` the flattened (group, 8, 256) table of a level whose entries cover
    ``span`` bytes, all on ``buf``'s device (gradcomp.wire.checksum makes and caches them). Every launch does two
    levels: the body is zero-padded at the front to whole programs of group x block bytes (group x group entries
    later), so that the groups of both levels fall inside one program.
    """
    n = buf.numel()
    programs = -(-n // (group * block))
    out = torch.empty(programs, dtype=torch.int64, device=buf.device)
    _bytes_kernel[(programs,)](buf, block_table, level_table(block), out, n, programs * group * block - n,
                               const if programs == 1 else 0, BLOCK=block, GROUP=group)
    span = block * group
    while out.numel() > 1:
        m = out.numel()
        programs = -(-m // (group * group))
        nxt = torch.empty(programs, dtype=torch.int64, device=buf.device)
        _entries_kernel[(programs,)](out, level_table(span), level_table(span * group), nxt, m,
                                     programs * group * group - m, const if programs == 1 else 0, GROUP=group)
        out, span = nxt, span * group * group
    return out.view(())
