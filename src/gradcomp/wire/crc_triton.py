"""The wire checksum of a device buffer as Triton kernels, in two formulations.

:func:`checksum64` (``kernel="triton"``): two levels per launch, each byte read once. The same computation as the
torch formulation of :func:`gradcomp.wire.checksum.checksum64_tensor`, from the same tables (docs/wire.md), fused:
the torch operations materialise an int64 index and an int64 looked-up value per body byte (16 bytes of temporaries
per byte) and launch a dozen kernels per level. Here the first kernel reads the body's bytes and writes one raw CRC
pair per ``group`` blocks of ``block`` bytes (two levels in one program: 4 KB become one entry), and each later
launch makes one entry of ``group`` x ``group`` (two levels again), so a body of up to 4 KB takes one launch, up to
16 MB two, and a 40 MB body three, reading each byte once. Each program loads its tile (masked where the front
padding or the end falls), looks every byte (or every byte of every 64-bit entry) up in the level's table,
xor-reduces the rows, and does the same to the rows' results with the next level's table. The launch count matters
as much as the bandwidth: a launch from Python costs microseconds to tens of microseconds, a megabyte at a GPU's
bandwidth less than one. Positions are int64, so bodies of 2**31 bytes and more (the format allows up to 2**32)
index correctly.

:func:`checksum64_fast` (``kernel="triton-fast"``): one launch after a one-element fill, small nibble tables read
by all lanes of a warp together, each thread's rows combined by Horner's rule (why: the comment before
``_map_bytes`` below). Both give the bits of gradcomp.wire.checksum.checksum64.

Imported only where Triton can be (it ships with CUDA builds of torch); ``checksum64_tensor`` falls back to torch
operations otherwise. With ``TRITON_INTERPRET=1`` the kernels run on CPU tensors through Triton's interpreter,
which is how tests/test_wire_checksum.py checks them without a GPU, where Triton is installed.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

__all__ = ["checksum64", "checksum64_fast"]


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


# ------------------------------------------------------------------ the second formulation: kernel="triton-fast"
#
# Why this formulation. The work is table lookups (the CRC is GF(2)-linear: a byte's contribution depends on its
# value and on how many bytes follow it), and what bounds such a kernel is how many instructions and how much L1
# time each byte's lookups cost, not the memory traffic:
#
# - The first formulation looks every byte up in a (64, 256) table whose row depends on the byte's place in its
#   block, so the 32 lanes of a warp read 32 different 2 KB rows of a 128 KB table at each lookup, and then does
#   8 more lookups per 64-byte block in level tables, with two further launches for a 40 MB body.
# - Here every lane of a warp reads the same small table at the same instruction: each thread holds one row of 16
#   bytes (four 32-bit words, one coalesced 16-byte load per thread), and a table depends only on the place of
#   its index within the row. The index is a nibble: a table of 16 int64 is one 128-byte line, so a warp's 32
#   lookups hit one line whatever the data. Wider indices were tried on a GPU with the same loop: 5 and 6 bits
#   (tables of two and four lines) take fewer lookups but more L1 time and end up slower; whole bytes (16 lines
#   per table) halve the instructions but the L1 time grows more. With nibbles the kernel is bound by integer
#   instructions: per lookup a shift and a mask that cut the nibble out of a word already scaled by 8, one 32-bit
#   add (the tables never cross a 4 GiB boundary, so the high half of every address is a constant: see
#   _low_address and _lookup), the load, and a share of a 3-input xor. The data loads bypass L1 (".cg"), so that
#   the streamed bytes do not evict the tables (a few tens of KB).
# - Tensor cores were considered (the CRC of a 64-byte block is its 512 bits times a 512 x 64 0/1 matrix, the
#   parity of an int8 product): 512 multiply-adds per byte is more than an int8 tensor core does at memory speed,
#   and cutting 8 bit-planes out of every byte costs the same kind of integer instructions as the lookups.
# - No level tables in the loop: each thread combines its rows by Horner's rule. After each iteration (K tiles of
#   ROWS rows) its running CRC is advanced over one iteration's bytes (16 nibble lookups in one step table,
#   shared by all lanes) and the iteration's lookups are xored in. What depends on position is then done once:
#   per thread, its row's offset within an iteration (8 lookups in a per-row byte table), and per program, the
#   iterations after it (base-64 digits) and the alignment tail (see checksum64_fast).
# - One launch for any length: the programs (per_sm per multiprocessor, each an equal run of iterations) cover
#   the body in one wave, and each xors its share into the result with one int64 atomic; xor is associative and
#   commutative, so the order of the atomics does not change the result. The output is first filled with the
#   length's init/final-xor constant, the only other launch.


@triton.jit
def _map_bytes(x, table):
    """``x`` (int64) through a GF(2)-linear map of 64-bit pairs given by its flattened (8, 256) byte table (8
    lookups, xored); ``table`` may be a tensor of pointers, one table per element of ``x``."""
    acc = tl.load(table + (x & 0xFF))
    for lane in tl.static_range(1, 8):
        acc ^= tl.load(table + lane * 256 + ((x >> (8 * lane)) & 0xFF))
    return acc


@triton.jit
def _map_nibbles(x, table):
    """``x`` (int64) through a map given by its flattened (16, 16) nibble table: 16 lookups, xored."""
    acc = tl.load(table + (x & 15))
    for m in tl.static_range(1, 16):
        acc ^= tl.load(table + m * 16 + ((x >> (4 * m)) & 15))
    return acc


@triton.jit
def _nibble8(w0, w1, w2, w3, c: tl.constexpr):
    """8 x nibble c (bits 4c .. 4c + 3) of the little-endian value of the uint32 words w0, w1, ...: the byte
    offset of that nibble's entry in a table of 16 int64."""
    i: tl.constexpr = c // 8
    s: tl.constexpr = 4 * (c % 8)
    w = w0 if i == 0 else (w1 if i == 1 else (w2 if i == 2 else w3))
    if s == 0:
        v = (w << 3) & 120
    else:
        v = (w >> (s - 3)) & 120
    return v


@triton.jit
def _keep(b, begin, end):
    """The int32 mask of those of the bytes b .. b + 3 of a word that lie in [begin, end)."""
    keep = tl.where((b >= begin) & (b < end), 0xFF, 0)
    keep |= tl.where((b + 1 >= begin) & (b + 1 < end), 0xFF00, 0)
    keep |= tl.where((b + 2 >= begin) & (b + 2 < end), 0xFF0000, 0)
    keep |= tl.where((b + 3 >= begin) & (b + 3 < end), -16777216, 0)  # 0xFF000000 as an int32
    return keep


@triton.jit
def _lookup(hi, lo):
    """The int64 at the address whose high 32 bits are those of ``hi`` (int64, low half zero) and low ones ``lo``."""
    return tl.load((hi | lo.to(tl.int64)).to(tl.pointer_type(tl.int64)))


@triton.jit(do_not_specialize=["front", "begin", "end", "iters"])
def _fast_kernel(body, table, out, front, begin, end, iters, ROWS: tl.constexpr, K: tl.constexpr,
                 DIGITS: tl.constexpr):
    """``out ^=`` the raw CRC pair of this program's iterations, advanced over everything after them.

    ``body`` starts 16-byte aligned; the real bytes are body[begin:end]. The virtual stream is ``front`` * 16
    leading zeros, then body up to the 16-byte boundary at or after ``end`` (bytes outside [begin, end) read as
    zeros), cut into iterations of K * ROWS * 16 bytes; the program takes ``iters`` of them, the last ones
    belonging to the last program (the first program's run may start before the stream: those iterations read
    nothing). Row r of tile k holds piece k * ROWS + r (16 bytes, four uint32 words) of an iteration.

    ``table`` holds, flattened: the nibble tables (K, 32, 16): [k, c, v] = the raw CRC pair of a 16-byte piece
    whose bits 4c .. 4c + 3 are v, the others 0, advanced over (K - 1 - k) * ROWS * 16 bytes (where its tile lies
    in the iteration, less the row's own offset (ROWS - 1 - r) * 16, which the row tables apply once after the
    loop); the step table (16, 16), the same for a 64-bit pair and "advance over one iteration"; the row tables
    (ROWS, 8, 256), byte tables; the tail tables (16, 16, 16), nibble tables of A^-t; the digit tables (DIGITS or
    more, 64, 16, 16): [d, m] = A^(m * 64^d iterations). After the rows are xored together, the digit tables
    advance the sum over the iterations after the program (base-64 digits of their count) and the tail tables
    take it back over the zero bytes that the aligned end added; the result is xored into ``out``.
    """
    words = body.to(tl.pointer_type(tl.uint32))
    stop = (end.to(tl.int64) + 15) // 16  # in 16-byte vectors: the aligned end
    total = (front + stop) // (K * ROWS)  # iterations in the virtual stream
    pid = tl.program_id(0).to(tl.int64)
    after = (tl.num_programs(0) - 1 - pid) * iters  # iterations after this program's
    it_begin = total - after - iters  # < 0 for the first program when iters does not divide total
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, 4)
    piece = rows[:, None] * 4 + cols[None, :]
    base = table.to(tl.int64)
    hi = base & -4294967296  # the tables' addresses share these high 32 bits (see _low_address)
    lo = (base & 0xFFFFFFFF).to(tl.uint32)
    last = stop * 4  # one past the last word read
    acc = tl.zeros([ROWS], dtype=tl.int64)
    it = it_begin
    while it < it_begin + iters:  # an iteration before the first (it < 0) reads nothing and leaves acc at 0
        first = it * (K * ROWS * 4) - front.to(tl.int64) * 4  # index in words of the iteration's first word
        part = tl.zeros([ROWS], dtype=tl.int64)
        for k in tl.static_range(K):
            q = first + k * (ROWS * 4) + piece
            x = tl.load(words + q, mask=(q >= 0) & (q < last), other=0, cache_modifier=".cg")
            if (it == 0) | (it == total - 1):  # only these hold bytes before begin or from end on
                x = x & _keep(q * 4, begin, end).to(tl.uint32)
            even, odd = tl.split(tl.reshape(x, [ROWS, 2, 2]))
            w0, w2 = tl.split(even)
            w1, w3 = tl.split(odd)
            for c in tl.static_range(32):
                part ^= _lookup(hi, lo + (k * 32 + c) * 128 + _nibble8(w0, w1, w2, w3, c))
        a0 = acc.to(tl.uint32)
        a1 = (acc >> 32).to(tl.uint32)
        step = _lookup(hi, lo + (K * 32) * 128 + _nibble8(a0, a1, a1, a1, 0))
        for c in tl.static_range(1, 16):
            step ^= _lookup(hi, lo + (K * 32 + c) * 128 + _nibble8(a0, a1, a1, a1, c))
        acc = step ^ part
        it += 1
    row_table = table + (K * 32 + 16) * 16
    tail_table = row_table + ROWS * 2048
    digit_table = tail_table + 16 * 256
    crc = tl.xor_sum(_map_bytes(acc, row_table + rows * 2048), axis=0)
    for d in tl.static_range(DIGITS):
        crc = _map_nibbles(crc, digit_table + (d * 64 + ((after >> (6 * d)) & 63)) * 256)
    crc = _map_nibbles(crc, tail_table + (stop * 16 - end) * 256)
    tl.atomic_xor(out, crc)


_programs: dict = {}  # (device, per_sm) -> how many programs of the fast kernel a launch aims for


def _target_programs(device: torch.device, per_sm: int) -> int:
    got = _programs.get((device, per_sm))
    if got is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
        got = _programs[(device, per_sm)] = sms * per_sm
    return got


def _low_address(t: torch.Tensor) -> torch.Tensor:
    """``t`` (int64, on its device) where all its bytes share the high 32 bits of their address: itself, or
    else a copy placed inside a larger allocation so that it does not cross a 4 GiB boundary."""
    nbytes = t.numel() * 8
    if t.data_ptr() >> 32 == (t.data_ptr() + nbytes - 1) >> 32:
        return t
    room = torch.empty(2 * t.numel(), dtype=torch.int64, device=t.device)
    start = 0 if room.data_ptr() >> 32 == (room.data_ptr() + nbytes - 1) >> 32 else t.numel()
    room[start: start + t.numel()] = t
    return room[start: start + t.numel()]


def checksum64_fast(buf: torch.Tensor, const: int, tables: Callable[[int, int], torch.Tensor], rows: int = 256,
                    k: int = 2, programs: int | None = None, per_sm: int = 2,
                    maxnreg: int | None = None) -> torch.Tensor:
    """The checksum of the uint8 buffer ``buf`` (contiguous, non-empty) as an int64 tensor of shape (), in one
    kernel launch after a one-element fill.

    ``const`` is the length's init/final-xor constant (signed int64), ``tables(rows, k)`` the kernel's tables,
    one flattened int64 tensor on ``buf``'s device that crosses no 4 GiB boundary (gradcomp.wire.checksum makes
    and caches it; the layout is _fast_kernel's). ``rows`` (a power of two, one row per thread: num_warps =
    rows / 32) and ``k`` set the iteration (k * rows * 16 bytes); ``programs`` the number of programs aimed at
    (default ``per_sm`` per multiprocessor), each taking an equal run of whole iterations; ``maxnreg`` caps the
    registers per thread (for experiments: the compiler then spills). The defaults keep every tile's loads and
    lookups in registers with two programs of eight warps resident per multiprocessor.

    The loads are 16-byte vectors, so the kernel reads the buffer from the aligned address at or before its
    start (a view of the same storage) and up to the aligned address at or after its end (within the same
    16 bytes, hence the same page), zeroing the bytes outside the buffer in registers: leading zeros do not
    change a raw CRC, and the trailing ones (0 to 15) are undone by the inverse of "append a zero byte" (x has a
    finite order modulo the generator).
    """
    n = buf.numel()
    a = buf.data_ptr() % 16
    if a > buf.storage_offset():  # no aligned address inside the storage before it (a foreign buffer): copy
        buf = buf.clone()
        a = buf.data_ptr() % 16
        if a > buf.storage_offset():
            raise ValueError("checksum64_fast needs a buffer whose storage starts 16-byte aligned")
    view = buf.as_strided((a + n,), (1,), buf.storage_offset() - a)
    stop = -(-(a + n) // 16)
    size = k * rows
    total = -(-stop // size)  # iterations
    iters = -(-total // (programs or _target_programs(buf.device, per_sm)))
    grid = -(-total // iters)
    digits = 1
    while 64**digits <= (grid - 1) * iters:
        digits += 1
    out = torch.full((), const, dtype=torch.int64, device=buf.device)
    _fast_kernel[(grid,)](view, tables(rows, k), out, total * size - stop, a, a + n, iters, ROWS=rows, K=k,
                          DIGITS=digits, num_warps=max(1, rows // 32), num_stages=1,
                          **({"maxnreg": maxnreg} if maxnreg else {}))
    return out
