"""The 64-bit body checksum of the wire container: CRC-32C and CRC-32 of the same bytes.

Definition (wire format version 2)::

    checksum64(body) = crc32(body) << 32 | crc32c(body)

``crc32c`` is CRC-32C (Castagnoli: polynomial 0x1EDC6F41, reflected, init and final xor 0xFFFFFFFF; check
value 0xE3069283 for b"123456789", the CRC of iSCSI, ext4 and SSE 4.2); ``crc32`` is the CRC-32 of zlib,
Ethernet and PNG (polynomial 0x04C11DB7, reflected, init and final xor 0xFFFFFFFF; check value 0xCBF43926).
Both read the bytes in order and each byte least significant bit first, which is also the order in which
:mod:`gradcomp.wire.bits` lays out its bit streams.

Why a CRC. The version-1 checksum was a weighted sum of 64-bit words modulo 2**64. It is linear over the
integers, so flipping the same bit in two words changes the sum by ±2^b·(w_i ± w_j), which vanishes modulo
2**64 whenever the weights agree in enough low bits: the fuzz found mutated buffers that decoded to other values
(docs/wire.md has the rate).
A CRC is linear over GF(2) instead: a change ``e`` of the body (a polynomial whose coefficients are the
flipped bits) goes unnoticed exactly when the generator polynomial divides ``e``.

What it detects. The pair of remainders is, by the Chinese remainder theorem, the remainder of the body
modulo the product ``G = G_C · G_I`` of the two generators (they share no factor), so the pair is a 64-bit
CRC with generator ``G`` computed as two 32-bit ones. ``G_C = (x + 1)·P31`` with ``P31`` primitive of degree 31
(the order of x modulo ``G_C`` is 2^31 − 1, a prime); ``G_I`` is primitive of degree 32 (order 2^32 − 1);
both facts are checked by tests/test_wire_checksum.py with polynomial arithmetic. Hence, for every body the
format can carry (the length field is a u32, so at most 2^35 bits):

- every single-bit error (``G`` has a nonzero constant term);
- every 2-bit error: x^i·(1 + x^s) is a multiple of ``G`` only when s is a multiple of the order of x
  modulo ``G``, lcm(2^31 − 1, 2^32 − 1) ≈ 9.2·10^18 bits, far beyond any body (CRC-32C alone would miss the
  pairs exactly 2^31 − 1 bits apart in bodies over 256 MiB, which gathered messages of large models reach);
- every error of an odd number of bits (``x + 1`` divides ``G``), so every 3-bit error too;
- every burst of up to 64 bits (deg ``G`` = 64), so certainly every burst of up to 32;
- any other change with probability 1 − 2^-64 for random corruption.

Speed, and why a wheel. CRC-32C comes from ``google-crc32c`` (Google's C library behind a small Python
extension, Apache-2.0, binary wheels on PyPI; it uses the SSE 4.2 / ARMv8 CRC instructions), CRC-32 from
Intel's ISA-L through ``isal`` (``isal.isal_zlib.crc32``: binary wheels on PyPI, PCLMUL folding, far faster than
zlib's table-driven CRC-32, which had been the largest part of encoding an fp16 message;
the standard library's ``zlib.crc32`` computes the same values and is used if ``isal`` cannot be imported,
``CRC32_IMPLEMENTATION`` says which). A vectorised numpy or torch CRC would need per-byte table lookups or GF(2)
matrix folding in many array passes and would run far below the wheels' memory speed. The speeds of both CRCs,
and of the version-1 sum they replaced, are measured by ``scripts/fuzz_wire.py --checksum-speed`` (docs/wire.md
has the tables). If the package's C extension cannot load,
``google_crc32c`` falls back to its pure-Python code (correct, slow, with a RuntimeWarning):
``CRC32C_IMPLEMENTATION`` says which one is in use.

Device buffers. :func:`checksum64` of a CUDA buffer copies it to the host first (:func:`to_host`, into pinned
memory that each thread reuses) and costs a synchronisation. The wire container does not use it for device
buffers: :func:`checksum64_tensor` computes the same 64 bits where the buffer is and returns them as a device
tensor, with Triton kernels on CUDA (gradcomp.wire.crc_triton) and torch operations elsewhere (the formulation and
why: docs/wire.md), so a message built on a GPU never crosses to the host for its checksum, and a message encoded on
either side decodes on the other. On the CPU both are far slower than the wheels above (measured
in docs/wire.md), which therefore keep computing the checksum of host buffers. This is an integrity check against
corruption, not a cryptographic MAC.
"""

from __future__ import annotations

import functools
import os
import threading
import zlib

import google_crc32c
import numpy as np
import torch

try:  # Intel ISA-L's CRC-32: the same function as zlib's, about ten times faster (PCLMUL folding)
    from isal.isal_zlib import crc32 as _crc32

    CRC32_IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values, slower
    _crc32 = zlib.crc32
    CRC32_IMPLEMENTATION = "zlib"

from gradcomp.wire.bits import _as_uint8_buffer

__all__ = [
    "checksum64", "checksum64_tensor", "RunningChecksum64", "crc32c", "crc32", "to_host", "CRC32C_IMPLEMENTATION", "CRC32_IMPLEMENTATION",
]

CRC32C_IMPLEMENTATION: str = google_crc32c.implementation  # "c" (hardware-accelerated) or "python"


_staging = threading.local()  # .buffer: this thread's pinned host buffer for device-to-host copies


def to_host(buf: torch.Tensor) -> torch.Tensor:
    """The uint8 buffer in host memory: itself on the CPU; from a CUDA device, a copy in pinned memory.

    The pinned buffer belongs to the calling thread and is reused by its next call: use the result before
    calling again, and do not keep it. It is replaced by a larger one when a larger buffer comes; torch's
    pinned-memory cache rounds sizes up to powers of two and keeps the outgrown blocks, so a thread holds up to
    about twice its largest message in pinned memory. Where pinned memory cannot be had (a container's
    locked-memory limit), the copy goes to ordinary memory, as ``tensor.cpu()`` does.
    """
    buf = _as_uint8_buffer(buf)
    if buf.device.type == "cpu":
        return buf
    if buf.device.type != "cuda":
        return buf.cpu()
    n = buf.numel()
    staged = getattr(_staging, "buffer", None)
    if staged is None or staged.numel() < n:
        try:
            staged = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no pinned memory to be had: pageable, as before
            return buf.cpu()
        _staging.buffer = staged
    out = staged[:n]
    out.copy_(buf)  # a pinned destination: synchronous for the host, and the fastest transfer
    return out


def _host_bytes(buf: torch.Tensor):
    """A contiguous CPU view of the uint8 buffer as a numpy array (no copy for a CPU tensor)."""
    return to_host(buf).numpy()


def crc32c(buf: torch.Tensor) -> int:
    """CRC-32C (Castagnoli) of a uint8 tensor, flattened; an int in [0, 2**32)."""
    return google_crc32c.value(_host_bytes(buf))


def crc32(buf: torch.Tensor) -> int:
    """CRC-32 (zlib / IEEE 802.3) of a uint8 tensor, flattened; an int in [0, 2**32)."""
    return _crc32(_host_bytes(buf))


def checksum64(buf: torch.Tensor) -> int:
    """The container's body checksum: ``crc32(buf) << 32 | crc32c(buf)``, an int in [0, 2**64).

    ``buf`` is a uint8 tensor of any shape (flattened) on any device; anything else raises WireError.
    """
    return _pair(_host_bytes(buf))


def _pair(data) -> int:
    """``crc32(data) << 32 | crc32c(data)`` of a host buffer (numpy array, bytes)."""
    return (_crc32(data) << 32) | google_crc32c.value(data)


class RunningChecksum64:
    """:func:`checksum64` of host bytes given in pieces: after ``update(a); update(b)``, ``value()`` is
    ``checksum64`` of ``a + b``. Both CRCs continue from their previous value (the wheels take it as an argument),
    so a writer can checksum each piece of a message right after writing it, while the piece is still in the
    CPU's cache, instead of reading the whole body back from memory afterwards (``wire.encode`` does this for
    large float sections)."""

    __slots__ = ("_crc32", "_crc32c")

    def __init__(self) -> None:
        self._crc32 = self._crc32c = 0

    def update(self, data) -> None:
        """Appends ``data`` (a contiguous host buffer: a numpy array or bytes)."""
        self._crc32 = _crc32(data, self._crc32)
        self._crc32c = google_crc32c.extend(self._crc32c, data)

    def value(self) -> int:
        return (self._crc32 << 32) | self._crc32c


# ------------------------------------------------------------------ the same checksum in torch operations
#
# Used for buffers that are not on the CPU (see checksum64_tensor); works on any device, so CI checks it on CPU
# tensors against the host CRCs above. The two CRCs are carried together in one int64 lane, CRC-32 in the high
# 32 bits and CRC-32C in the low 32, exactly the layout of checksum64: both are linear over GF(2), so every
# table below holds the pair of images of an input and one xor updates both.

_POLY_C_REFLECTED = 0x82F63B78  # 0x1EDC6F41, bit-reversed (the CRCs read each byte LSB first)
_POLY_I_REFLECTED = 0xEDB88320  # 0x04C11DB7, bit-reversed
_MASK64 = (1 << 64) - 1
BLOCK_BYTES = 64  # bytes per block whose CRC is one gather and a 6-level xor tree


def _byte_table(poly: int) -> np.ndarray:
    """The 256-entry table of a reflected CRC: the register after clocking byte v in from state 0."""
    t = np.arange(256, dtype=np.uint64)
    for _ in range(8):
        t = (t >> np.uint64(1)) ^ np.where(t & np.uint64(1), np.uint64(poly), np.uint64(0))
    return t


_T_PAIR = (_byte_table(_POLY_I_REFLECTED) << np.uint64(32)) | _byte_table(_POLY_C_REFLECTED)
_LOW8, _LOW32 = np.uint64(0xFF), np.uint64(0xFFFFFFFF)


def _zero_byte(state: np.ndarray) -> np.ndarray:
    """Both registers (CRC-32 high, CRC-32C low) after one zero byte: s -> T[s & 0xff] ^ (s >> 8), per half."""
    lo, hi = state & _LOW32, state >> np.uint64(32)
    lo = (_T_PAIR[(lo & _LOW8).astype(np.intp)] & _LOW32) ^ (lo >> np.uint64(8))
    hi = (_T_PAIR[(hi & _LOW8).astype(np.intp)] >> np.uint64(32)) ^ (hi >> np.uint64(8))
    return (hi << np.uint64(32)) | lo


_BASIS = (np.arange(256, dtype=np.uint64)[None, :] << (np.uint64(8) * np.arange(8, dtype=np.uint64)[:, None]))


def _apply(table: np.ndarray, state: np.ndarray) -> np.ndarray:
    """A GF(2)-linear map of 64-bit states given by its (8, 256) byte table: xor of the images of the bytes."""
    out = np.zeros_like(state)
    for b in range(8):
        out ^= table[b, ((state >> np.uint64(8 * b)) & _LOW8).astype(np.intp)]
    return out


_shift_tables: list[np.ndarray] = [_zero_byte(_BASIS)]  # [j]: the map "2**j zero bytes" as an (8, 256) table


def _shift_table(j: int) -> np.ndarray:
    """The (8, 256) byte table of "append 2**j zero bytes" to both registers, by repeated squaring (cached)."""
    while len(_shift_tables) <= j:
        last = _shift_tables[-1]
        _shift_tables.append(_apply(last, last))
    return _shift_tables[j]


@functools.lru_cache(maxsize=4096)  # message lengths repeat from step to step
def _affine_constant(n: int) -> int:
    """What init and final xor add to the linear part for an n-byte body: shift_n(all ones) ^ all ones.

    That is the checksum of n zero bytes (whose linear part is 0), which the host CRCs give in microseconds for a
    short body; longer ones compose the "2**j zero bytes" tables (many small numpy calls, hence the cache).
    """
    if n <= 1 << 16:
        return _pair(bytes(n))
    state = np.array([_MASK64], dtype=np.uint64)
    j = 0
    while n >> j:
        if n >> j & 1:
            state = _apply(_shift_table(j), state)
        j += 1
    return int(state[0]) ^ _MASK64


def _block_table() -> np.ndarray:
    """(BLOCK_BYTES, 256): row i, column v = the pair of raw CRCs of a block holding v at byte i, zeros elsewhere."""
    rows = [_T_PAIR]
    for _ in range(BLOCK_BYTES - 1):
        rows.append(_zero_byte(rows[-1]))
    return np.stack(rows[::-1])  # the last byte of the block is followed by no zero byte


GROUP = 64  # entries combined per level above the first: log64 of the block count levels in all


def _level_table(span: int) -> np.ndarray:
    """(GROUP, 8, 256): [p, b, v] = the image of byte v in lane b of the entry at position p of a group whose
    entries cover ``span`` bytes each, under "append (GROUP - 1 - p) * span zero bytes" (cached by span)."""
    got = _level_tables.get(span)
    if got is None:
        step = _advance(span)
        rows = [_BASIS]  # position GROUP - 1: no shift
        for _ in range(GROUP - 1):
            rows.append(_apply(step, rows[-1]))
        got = _level_tables[span] = np.stack(rows[::-1])
    return got


_BLOCK_TABLE = _block_table()
_level_tables: dict[int, np.ndarray] = {}
_device_tables: dict = {}  # (device, key) -> int64 tensor on that device


def _on(device: torch.device, key, table: np.ndarray) -> torch.Tensor:
    """A host table as an int64 tensor on ``device``, copied there once per process and kept."""
    got = _device_tables.get((device, key))
    if got is None:
        got = torch.from_numpy(np.ascontiguousarray(table).view(np.int64).reshape(-1)).to(device)
        _device_tables[(device, key)] = got
    return got


def _xor_columns(v: torch.Tensor) -> torch.Tensor:
    """xor-reduce a (rows, 2**k) int64 tensor along its columns by a tree of halvings; returns (rows,)."""
    while v.shape[1] > 1:
        h = v.shape[1] // 2
        v = torch.bitwise_xor(v[:, :h], v[:, h:])
    return v[:, 0]


# Tables of the "triton-fast" kernel (gradcomp.wire.crc_triton.checksum64_fast). A is "append one zero byte" to both
# raw registers, the multiplication by x^8 modulo each generator; x has order (2^31 - 1)(2^32 - 1) modulo their
# product (see the module docstring), so A to that power is the identity and A^-t = A^(_ORDER - t).
_ORDER = (2**31 - 1) * (2**32 - 1)
_FAST_REACH = 2**36  # the digit tables cover bodies of up to this many bytes (the format's length field: 2**32)


@functools.lru_cache(maxsize=256)
def _advance(d: int) -> np.ndarray:
    """The (8, 256) byte table of A^d ("append d zero bytes"; d < 0: take d back off), by repeated squaring.
    Cached: do not modify the result."""
    d %= _ORDER
    table, j = _BASIS, 0
    while d >> j:
        if d >> j & 1:
            table = _apply(_shift_table(j), table)
        j += 1
    return table


def _nibble_table(table: np.ndarray) -> np.ndarray:
    """The nibble form of a byte table of images, (w, 256) -> (2w, 16): [c, v] = table[c // 2, v << 4 (c % 2)],
    the image of nibble c of a value being v (the others 0). An (8, 256) map table gives the (16, 16) one."""
    v = np.arange(16)
    return np.stack([table[c // 2, v << (4 * (c % 2))] for c in range(2 * len(table))])


def _fast_host_tables(rows: int, k: int) -> np.ndarray:
    """The fast kernel's tables for iterations of ``k`` tiles of ``rows`` pieces of 16 bytes (size = 16 k rows),
    flattened into one uint64 array in this order:

    pieces (k, 32, 16): [t, c, v] = the raw CRC pair of a 16-byte piece whose nibble c (bits 4c .. 4c + 3) is v,
    the others 0, advanced over (k - 1 - t) * rows * 16 zero bytes (its tile's place in the iteration, without
    the piece's row offset); step (16, 16): A^size as a nibble table; rows (rows, 8, 256): row r's
    A^((rows - 1 - r) * 16) as a byte table; tail (16, 16, 16): [t] = A^-t as a nibble table; digits (D, 64, 16,
    16): [d, m] = A^(m * 64^d * size) as nibble tables, D digits reaching _FAST_REACH bytes.
    """
    size = 16 * k * rows
    lone = [_T_PAIR]  # lone[j]: byte b followed by j zero bytes
    for _ in range(15):
        lone.append(_zero_byte(lone[-1]))
    piece = _nibble_table(np.stack(lone[::-1]))  # (32, 16): no bytes after the piece
    pieces = np.stack([_apply(_advance((k - 1 - t) * rows * 16), piece) for t in range(k)])
    step = _nibble_table(_advance(size))
    row = np.empty((rows, 8, 256), dtype=np.uint64)
    cur, step16 = _BASIS, _advance(16)
    for r in range(rows - 1, -1, -1):
        row[r] = cur
        cur = _apply(step16, cur)
    digits = 1
    while 64**digits * size < _FAST_REACH:
        digits += 1
    digit = np.empty((digits, 64, 16, 16), dtype=np.uint64)
    for d in range(digits):
        cur, step_d = _BASIS, _advance(64**d * size)
        for m in range(64):
            digit[d, m] = _nibble_table(cur)
            cur = _apply(step_d, cur)
    tail = np.stack([_nibble_table(_advance(-t)) for t in range(16)])
    return np.concatenate([t.reshape(-1) for t in (pieces, step, row, tail, digit)])


def _fast_tables(device: torch.device, rows: int, k: int) -> torch.Tensor:
    """:func:`_fast_host_tables` as a flattened int64 tensor on ``device`` that crosses no 4 GiB boundary (the
    kernel's 32-bit address arithmetic needs that), made once per process and kept."""
    got = _device_tables.get((device, ("fast", rows, k)))
    if got is None:
        got = torch.from_numpy(_fast_host_tables(rows, k).view(np.int64)).to(device)
        got = _device_tables[(device, ("fast", rows, k))] = _triton_kernel()._low_address(got)
    return got


def _lane_offsets(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The shifts that take the 8 bytes out of an int64 entry, and each (position, lane)'s offset in a level
    table, as (8,) and (GROUP, 8) int64 tensors on ``device`` (made once)."""
    got = _device_tables.get((device, "lanes"))
    if got is None:
        shifts = torch.arange(0, 64, 8, dtype=torch.int64, device=device)
        offsets = torch.arange(0, GROUP * 8 * 256, 256, dtype=torch.int64, device=device).view(GROUP, 8)
        got = _device_tables[(device, "lanes")] = (shifts, offsets)
    return got


def _triton_kernel():
    """gradcomp.wire.crc_triton, or None where Triton cannot be imported (CPU-only builds of torch)."""
    global _TRITON
    if _TRITON is False:
        try:
            from gradcomp.wire import crc_triton
        except ImportError:
            crc_triton = None
        _TRITON = crc_triton
    return _TRITON


_TRITON = False  # not looked for yet
KERNEL_ENV = "GRADCOMP_CHECKSUM_KERNEL"
_CUDA_KERNELS = ("triton-fast", "triton", "torch")


def cuda_kernel() -> str:
    """The kernel a CUDA buffer's checksum uses by default (where Triton can be imported): "triton-fast", or what
    the environment variable GRADCOMP_CHECKSUM_KERNEL names ("triton", "torch"): a way back to the earlier
    kernels, should the fast one not compile or misbehave on some GPU, with no change to the bytes."""
    name = os.environ.get(KERNEL_ENV, "triton-fast")
    if name not in _CUDA_KERNELS:
        raise ValueError(f"{KERNEL_ENV} must be one of {', '.join(_CUDA_KERNELS)}, not {name!r}")
    return name


FAST_CONFIG: dict = {}  # keyword arguments of crc_triton.checksum64_fast (rows, k, programs, per_sm, maxnreg)


def checksum64_tensor(buf: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
    """:func:`checksum64` of a uint8 tensor computed on its own device, with nothing read back to the host.

    Returns an int64 tensor of shape () on ``buf``'s device whose 64 bits are those of ``checksum64(buf)``
    (read as unsigned: ``int(t) & (2**64 - 1)``; its little-endian bytes are the header's checksum field).
    ``kernel``: "triton" (gradcomp.wire.crc_triton: one fused launch per two levels), "triton-fast"
    (gradcomp.wire.crc_triton.checksum64_fast: one launch after a one-element fill, small nibble tables read by a
    whole warp at once, Horner's rule per thread; FAST_CONFIG sets its tiles), "torch" (torch operations, any
    device), or None: :func:`cuda_kernel` ("triton-fast" unless GRADCOMP_CHECKSUM_KERNEL says otherwise) for a CUDA
    buffer where Triton can be imported, else torch. "triton" and "torch" compute the same levels from the same
    tables (docs/wire.md): the raw CRC (no init, no final xor) is GF(2)-linear in the bytes and leading zero bytes
    leave it at zero, so the body is zero-padded at the front to whole blocks of BLOCK_BYTES; each block's raw CRC
    pair is the xor of one (BLOCK_BYTES, 256) table entry per byte (byte i of value v contributes the CRC of v
    followed by BLOCK_BYTES - 1 - i zero bytes); then, level by level, groups of GROUP entries (a leading group
    padded with zero entries) become one, each entry advanced over the bytes of the entries after it in its group by
    a "zero bytes" operator applied as 8 lookups, one per byte of the 64-bit pair, in a (GROUP, 8, 256) table;
    finally the constant that init and final xor contribute for this length (computed on the host from the length
    alone) is xored in.
    """
    buf = _as_uint8_buffer(buf)
    device, n = buf.device, buf.numel()
    const = _affine_constant(n)
    const = const - (1 << 64) if const >> 63 else const  # as a signed int64
    if n == 0:
        return torch.full((), const, dtype=torch.int64, device=device)
    if kernel is None:
        kernel = cuda_kernel() if device.type == "cuda" and _triton_kernel() is not None else "torch"
    if kernel == "triton":
        tables = _on(device, "block", _BLOCK_TABLE), lambda span: _on(device, ("level", span), _level_table(span))
        return _triton_kernel().checksum64(buf, const, *tables, BLOCK_BYTES, GROUP)
    if kernel == "triton-fast":
        return _triton_kernel().checksum64_fast(buf, const, functools.partial(_fast_tables, device), **FAST_CONFIG)
    if kernel != "torch":
        raise ValueError(f"kernel must be 'triton', 'triton-fast', 'torch' or None, not {kernel!r}")
    blocks = -(-n // BLOCK_BYTES)
    pad = blocks * BLOCK_BYTES - n
    index = torch.empty(blocks * BLOCK_BYTES, dtype=torch.int64, device=device)
    if pad:
        index[:pad] = 0  # a zero byte contributes nothing, wherever it is
    index[pad:] = buf
    index = index.view(blocks, BLOCK_BYTES)
    index += torch.arange(0, BLOCK_BYTES * 256, 256, dtype=torch.int64, device=device)
    crcs = _xor_columns(_on(device, "block", _BLOCK_TABLE)[index])  # (blocks,): each block's raw CRC pair
    shifts, offsets = _lane_offsets(device)
    span = BLOCK_BYTES  # bytes covered by each entry of crcs
    while crcs.numel() > 1:
        groups = -(-crcs.numel() // GROUP)
        pad = groups * GROUP - crcs.numel()
        if pad:  # leading all-zero entries: raw CRC 0, and they change nothing after them
            crcs = torch.cat([crcs.new_zeros(pad), crcs])
        index = ((crcs.view(groups, GROUP, 1) >> shifts) & 0xFF) + offsets  # (groups, GROUP, 8)
        crcs = _xor_columns(_on(device, ("level", span), _level_table(span))[index].view(groups, GROUP * 8))
        span *= GROUP
    return torch.bitwise_xor(crcs[0], const)
