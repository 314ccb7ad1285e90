"""Fixed-width bit packing of non-negative integers.

Layout: value ``i`` of an array packed with ``width`` bits occupies the global bit positions
``[i * width, (i + 1) * width)``; its least significant bit comes first. Global bit ``k`` is bit
``k % 8`` (counted from the least significant bit) of byte ``k // 8``. The output therefore has
``ceil(n * width / 8)`` bytes and the unused high bits of the last byte are zero. For widths that are
multiples of 8 this is exactly the little-endian byte representation of each value; width 1 is the
usual LSB-first bitmap.

Implementation: every group of 8 values fills exactly ``width`` bytes, so the arrays are padded to a
multiple of 8 values, reshaped to ``(groups, 8)`` (values) or ``(groups, width)`` (bytes) and each
byte column is assembled from the (statically known) value columns that overlap it with shifts and
ORs. The Python loops run over the at most ``width + 8`` (byte, value) pairs of one group, never over
elements; every operation is a vectorized torch op on the input's device.

On the CPU, widths 2-7 and 9-15 are packed and unpacked by compiled kernels (``gradcomp.kernels``, numba:
straight-line code per width, 64 values to ``width`` 64-bit words, whose little-endian bytes are this layout),
whole blocks of 64 read and written in place at any byte offset and the last partial block through a zero-padded
block; the pack kernel returns the OR of all values, so the range check is one comparison, and
:func:`pack_bits_into` packs straight into a caller's buffer (``wire.encode`` uses it to write BITS fields
into the message without a copy). Without numba (or with ``GRADCOMP_KERNELS=0``), the numpy paths below
produce the same bytes: arrays of more than ``_SMALL`` values of width at most 16 are packed by
:func:`_pack_chunked`: the same bytes, by integer arithmetic only, in chunks of ``_CHUNK`` values (cache-sized
scratch; no array as large as the input is allocated). Each chunk is narrowed to uint8 (uint16 above 8 bits)
and read as uint64 words; SWAR steps on whole words merge neighbouring lanes pairwise — (v0, v1) into 2w bits,
pairs into 4w, quads into 8w — so that every 8 values (4 above 8 bits) become one integer, and each 64 values
fill exactly ``width`` output words, which take the integers overlapping their 64 bits shifted into place;
their little-endian bytes are the packed bytes. Width 1 is ``np.packbits`` (the same LSB-first order), widths
8 and 16 are casts. ``pack_bits`` checks the value range on the same chunks while they are in cache (one
OR-reduction per chunk: all values lie in [0, 2**width) exactly when the OR of all of them does), instead of
a separate min/max pass. Unpacking widths 9 to 16 on the CPU reads each value column of a chunk as one
strided 32-bit window per value position (:func:`_unpack_windows`); narrower widths keep the torch path, which
works in uint8 there and is as fast. Big-endian hosts keep the torch path.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

from gradcomp import kernels
from gradcomp.errors import ConfigError, WireError

__all__ = [
    "pack_bits", "pack_bits_into", "packs_into", "unpack_bits", "decoded_dtype", "bits_needed", "pack_bool",
    "unpack_bool", "packed_nbytes", "host_path", "host_device",
]

_MAX_WIDTH = 32
# Dtypes on which min/max are available; other integer dtypes (uint16/32/64) are widened to int64 first.
_NATIVE_INT = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def host_path(t: torch.Tensor) -> bool:
    """Whether the wire code treats ``t`` as host memory (numpy, struct, compiled kernels, host CRCs).

    True for CPU tensors, False for device tensors, which take the torch path that reads nothing back
    (docs/gpu.md). :func:`set_device_path_on_cpu` sends CPU tensors down the device path too: for tests
    (tests/test_sync_count.py counts what that path reads back; tests/test_wire_checksum.py decodes on one path
    what the other encoded), since the host path is the faster one on the CPU.
    """
    return host_device(t.device)


def ints_on(device: torch.device, values: list[int]) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, in one host-to-device transfer that does not make the host wait
    on CUDA (pinned memory: torch's pinned allocator keeps the block until the copy is done)."""
    host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


_device_path_on_cpu = False  # set_device_path_on_cpu; a module setting, not read from the environment per call


def set_device_path_on_cpu(on: bool) -> bool:
    """Send CPU tensors down the device path (True) or the host path (False, the default) from now on, in this
    process; returns the previous setting. For tests: the device path is the GPU's code, run on CPU tensors."""
    global _device_path_on_cpu
    previous, _device_path_on_cpu = _device_path_on_cpu, bool(on)
    return previous


def host_device(device: torch.device) -> bool:
    """:func:`host_path` for tensors on ``device``."""
    return device.type == "cpu" and not _device_path_on_cpu


def _check_width(width: object, exc: type[Exception] = ConfigError) -> int:
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= _MAX_WIDTH:
        raise exc(f"bit width must be an int in [1, {_MAX_WIDTH}], got {width!r}")
    return width


def packed_nbytes(count: int, width: int) -> int:
    """Number of bytes ``pack_bits`` produces for ``count`` values of ``width`` bits."""
    return (count * width + 7) // 8


def bits_needed(n: int) -> int:
    """Bits needed to store any value in ``0 .. n-1`` (at least 1)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"bits_needed expects a non-negative int, got {n!r}")
    return max(1, (n - 1).bit_length())


def _work_dtype(width: int) -> torch.dtype:
    # Largest intermediate: a value shifted left by up to 7 bits (pack) or a byte shifted left by
    # up to width - 1 bits (unpack), i.e. < 2**(width + 8). uint8 arithmetic is fine for width <= 8
    # because everything above bit 7 is discarded anyway.
    if width <= 8:
        return torch.uint8
    if width <= 16:
        return torch.int32
    return torch.int64


# Up to this many values on the CPU, numpy's packbits / unpackbits (LSB-first bit order: the same layout)
# do the work: a handful of numpy calls instead of ~3·width torch ops, whose fixed cost per call dominates the
# small messages of per-layer compression (a bias's top-k positions; docs/host_performance.md).
_SMALL = 4096
_BIT_WEIGHTS = {w: 1 << np.arange(w, dtype=np.int64) for w in range(1, _MAX_WIDTH + 1)}


def _pack_small(values: torch.Tensor, width: int) -> torch.Tensor:
    v = values.numpy().astype(np.int64, copy=False)
    bits = ((v[:, None] >> np.arange(width, dtype=np.int64)) & 1).astype(np.uint8)
    return torch.from_numpy(np.packbits(bits.reshape(-1), bitorder="little"))


def _unpack_small(buf: torch.Tensor, width: int, count: int) -> torch.Tensor:
    bits = np.unpackbits(buf.numpy(), bitorder="little")
    if bits[count * width :].any():
        raise WireError(f"nonzero padding bits after {count} values of {width} bits")
    values = bits[: count * width].reshape(count, width).astype(np.int64) @ _BIT_WEIGHTS[width]
    return torch.from_numpy(values).to(_work_dtype(width))


_CHUNK = 1 << 17  # values per chunk of _pack_chunked (a multiple of 8: every chunk starts on a byte)
_CHUNKED_MAX_WIDTH = 16
# numpy integer dtypes the chunked packer reads directly (torch's uint16/32/64 are widened to int64 first)
_NUMPY_INT = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _chunked(values: torch.Tensor, width: int) -> bool:
    return (
        host_path(values)
        and values.numel() > _SMALL
        and width <= _CHUNKED_MAX_WIDTH
        and values.dtype in _NUMPY_INT
        and sys.byteorder == "little"
    )


_U64 = np.uint64


def _swar_merge(words: np.ndarray, lane: int, shift: int, tmp: np.ndarray) -> None:
    """In place, in every ``2·lane``-bit lane of the uint64 ``words``: low half | high half << ``shift``."""
    mask = _U64(sum(((1 << lane) - 1) << (2 * lane * i) for i in range(64 // (2 * lane))))
    np.right_shift(words, _U64(lane), out=tmp)
    np.bitwise_and(tmp, mask, out=tmp)
    np.left_shift(tmp, _U64(shift), out=tmp)
    np.bitwise_and(words, mask, out=words)
    np.bitwise_or(words, tmp, out=words)


def _kernel_pack(values: torch.Tensor, width: int):
    """The compiled packer for ``values`` (gradcomp.kernels), or None: CPU, little-endian, a numpy integer dtype,
    a width with a kernel, and a large array or numba already loaded (``kernels.bitpack``)."""
    if not host_path(values) or sys.byteorder != "little" or values.dtype not in _NUMPY_INT:
        return None
    kernel = kernels.bitpack(width, values.numel())
    return None if kernel is None else kernel[0]


def _range_error(v: np.ndarray, width: int) -> ConfigError:
    lo, hi = int(v.min()), int(v.max())
    return ConfigError(f"values must lie in [0, 2**{width}) to be packed with {width} bits, got range [{lo}, {hi}]")


def _pack_kernel(values: torch.Tensor, width: int, check: bool, pack) -> torch.Tensor:
    """The compiled packer into a fresh output (see :func:`_pack_kernel_into`)."""
    n = values.numel()
    out = torch.empty(packed_nbytes(n, width), dtype=torch.uint8)
    _pack_kernel_into(values.detach().reshape(-1).contiguous().numpy(), width, check, pack, out.numpy())
    return out


def _pack_kernel_into(v: np.ndarray, width: int, check: bool, pack, dest: np.ndarray) -> None:
    """The compiled packer (gradcomp.kernels) into the uint8 array ``dest`` of exactly packed_nbytes bytes, at any
    alignment: whole blocks of 64 values straight into ``dest``'s 64-bit words, the last partial block through a
    zero-padded block of 64 (so the padding bits are zero). The kernel returns the OR of every value as uint64,
    so the range check is one comparison (made before the caller uses ``dest``)."""
    n = v.size
    whole = n // 64 * 64
    head = whole // 64 * width * 8
    seen = int(pack(v[:whole], dest[:head].view(np.uint64)))
    if whole < n:
        block = np.zeros(64, dtype=v.dtype)
        block[: n - whole] = v[whole:]
        words = np.empty(width, dtype=np.uint64)
        seen |= int(pack(block, words))
        dest[head:] = words.view(np.uint8)[: dest.size - head]
    if check and seen >= 1 << width:  # a negative value reads as a huge uint64
        raise _range_error(v, width)


def packs_into(values: torch.Tensor, width: int) -> bool:
    """Whether :func:`pack_bits_into` can take ``values`` (a CPU integer array, a width with a compiled kernel):
    then a caller can pack straight into its own buffer instead of copying ``pack_bits``' output."""
    return _kernel_pack(values, width) is not None


def pack_bits_into(values: torch.Tensor, width: int, dest: np.ndarray) -> None:
    """``pack_bits(values, width)`` written into ``dest`` (uint8, exactly ``packed_nbytes`` long, any alignment),
    for values that :func:`packs_into` accepts. Raises ConfigError for a value outside [0, 2**width)."""
    pack = _kernel_pack(values, width)
    if pack is None or dest.size != packed_nbytes(values.numel(), width):  # callers ask packs_into first
        raise ConfigError(
            f"pack_bits_into: no compiled kernel for these values or width {width}, or wrong destination size"
        )
    _pack_kernel_into(values.detach().reshape(-1).contiguous().numpy(), width, True, pack, dest)


def _pack_chunked(values: torch.Tensor, width: int, check: bool) -> torch.Tensor:
    """``_pack`` (and, with ``check``, pack_bits' range check) on the CPU; see the module docstring.

    Each chunk is cast to uint8 (width <= 8) or uint16 values and read as uint64 words of 8 or 4 values;
    SWAR steps (shift, mask, or on whole words) merge neighbouring lanes pairwise until each group of 8
    values is one integer of 8·width bits (two words for width > 8). Eight consecutive groups then fill
    exactly ``width`` output words: word t gets the groups that overlap its 64 bits, shifted into place
    (:func:`_spread`), and those words' little-endian bytes are the packed bytes. Raises ConfigError,
    naming the whole array's range, if ``check`` finds a value outside [0, 2**width).
    """
    v = values.detach().reshape(-1).contiguous().numpy()
    n = v.size
    out = torch.empty(packed_nbytes(n, width), dtype=torch.uint8)
    o = out.numpy()
    limit = 1 << width
    full = (min(n, _CHUNK) + 63) // 64 * 64
    narrow = np.zeros(full, dtype=np.uint8 if width <= 8 else np.uint16)  # zero-padded to whole super groups
    tmp = np.empty(full * narrow.itemsize // 8, dtype=_U64)
    spread = np.empty((full // 64, width), dtype=_U64)
    for start in range(0, n, _CHUNK):
        piece = v[start : start + _CHUNK]
        m = piece.size
        if check:
            seen = int(np.bitwise_or.reduce(piece))
            if seen < 0 or seen >= limit:
                raise _range_error(v, width)
        nbytes = packed_nbytes(m, width)
        dest = o[start * width // 8 : start * width // 8 + nbytes]
        if width == 8:
            dest[:] = piece
            continue
        supers = (m + 63) // 64
        u = narrow[: 64 * supers]
        np.copyto(u[:m], piece, casting="unsafe")
        u[m:] = 0
        if width == 16:
            dest[:] = u.view(np.uint8)[:nbytes]
            continue
        if width == 1:
            dest[:] = np.packbits(u, bitorder="little")[:nbytes]
            continue
        words = u.view(_U64)  # width <= 8: one word per group of 8 values; else two (values 0-3, 4-7)
        t = tmp[: words.size]
        if width <= 8:
            _swar_merge(words, 8, width, t)  # pairs: 2w bits in each 16-bit lane
            _swar_merge(words, 16, 2 * width, t)  # quads: 4w bits in each 32-bit lane
            _swar_merge(words, 32, 4 * width, t)  # the group: 8w bits
            groups = words.reshape(supers, 8)
            pieces = [(groups[:, i], 8 * width * i) for i in range(8)]
        else:
            _swar_merge(words, 16, width, t)  # pairs: 2w bits in each 32-bit lane
            _swar_merge(words, 32, 2 * width, t)  # quads: 4w bits per word
            quads = words.reshape(supers, 16)
            pieces = [(quads[:, j], 4 * width * j) for j in range(16)]
        packed = spread[:supers]
        _spread(pieces, 4 * width if width > 8 else 8 * width, packed, t[:supers])
        dest[:] = packed.view(np.uint8).reshape(-1)[:nbytes]
    return out


def _spread(pieces: list[tuple[np.ndarray, int]], length: int, out: np.ndarray, tmp: np.ndarray) -> None:
    """out[:, t] = OR of every piece overlapping bits [64t, 64t + 64) of a row, shifted into place.

    ``pieces`` are (column, bit offset): uint64 columns of ``length``-bit integers (length <= 64), one entry
    per row, at the given offset within the row's ``64 · out.shape[1]`` bits.
    """
    out[...] = 0
    for column, offset in pieces:
        for word in range(offset // 64, (offset + length - 1) // 64 + 1):
            shift = offset - 64 * word
            if shift >= 0:
                np.left_shift(column, _U64(shift), out=tmp)
            else:
                np.right_shift(column, _U64(-shift), out=tmp)
            np.bitwise_or(out[:, word], tmp, out=out[:, word])


def _pack(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack a 1-D tensor whose values are already known to lie in [0, 2**width)."""
    n = values.numel()
    nbytes = packed_nbytes(n, width)
    device = values.device
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if width == 8:
        return values.to(torch.uint8)
    kernel = _kernel_pack(values, width)
    if kernel is not None:
        return _pack_kernel(values, width, False, kernel)
    if n <= _SMALL and host_path(values):
        return _pack_small(values, width)
    if _chunked(values, width):
        return _pack_chunked(values, width, check=False)
    if width > 8:
        return _pack_gathered(values, width, n, nbytes)
    v = values.to(torch.uint8)  # widths 1 to 7: uint8 arithmetic, whatever is shifted past bit 7 is dropped
    groups = (n + 7) // 8
    if groups * 8 != n:
        v = torch.cat([v, torch.zeros(groups * 8 - n, dtype=torch.uint8, device=device)])
    v = v.reshape(groups, 8)
    cols = []
    for t in range(width):  # byte t of each group covers bits [8t, 8t + 8) of the group
        acc = None
        for j in range(max(0, (8 * t) // width), min(7, (8 * t + 7) // width) + 1):
            shift = j * width - 8 * t
            part = v[:, j] << shift if shift >= 0 else v[:, j] >> (-shift)
            acc = part if acc is None else acc | part
        cols.append(acc)
    out = torch.stack(cols, dim=1).reshape(-1)
    return out[:nbytes]


def _pack_gathered(values: torch.Tensor, width: int, n: int, nbytes: int) -> torch.Tensor:
    """``_pack`` in a fixed number of torch operations, for widths 9 to 32 (the device path's packer).

    Byte t holds bits [8t, 8t + 8) of the stream, where value i holds bits [i·width, (i + 1)·width): it is
    touched by value 8t // width and at most the next few (7 // width + 2 in all), whose sum after shifting each
    to its place in a window is their or (their bits are disjoint: no carries; int64 wraps, bits kept); the byte is
    that window shifted down by the first value's bits before it. One gather and a few elementwise passes, where the
    per-byte-column loop below launches three or four operations per byte of a group (about 50 at width 16).
    """
    device = values.device
    m = 7 // width + 2
    v = values.reshape(-1).to(torch.int64)
    v = torch.cat([v, v.new_zeros(8 * ((n + 7) // 8) - n + m)])  # padding values are zeros
    bit = torch.arange(0, 8 * nbytes, 8, dtype=torch.int64, device=device)
    first = bit // width
    lanes = torch.arange(m, dtype=torch.int64, device=device)
    window = (v[first[:, None] + lanes] << (lanes * width)).sum(1)
    return ((window >> (bit - first * width)) & 0xFF).to(torch.uint8)


def _unpack_gathered(buf: torch.Tensor, width: int, total: int) -> torch.Tensor:
    """``total`` values of ``width`` bits (9 to 32) from the stream ``buf`` (whole groups), as int64, in a fixed
    number of torch operations: value i's bits start at bit (i·width) % 8 of byte (i·width) // 8 and lie within
    the ceil((width + 7) / 8) bytes from there, joined into one window (disjoint bits: the sum is the or)."""
    device = buf.device
    k = (width + 14) // 8
    b = torch.cat([buf.reshape(-1), buf.new_zeros(total * width // 8 - buf.numel() + k)]).to(torch.int64)
    bit = torch.arange(total, dtype=torch.int64, device=device) * width
    lanes = torch.arange(k, dtype=torch.int64, device=device)
    window = (b[(bit >> 3)[:, None] + lanes] << (lanes * 8)).sum(1)
    return (window >> (bit & 7)) & ((1 << width) - 1)


def _unpack_windows(buf: torch.Tensor, width: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``_unpack`` on the CPU for widths 9 to 16, by 32-bit windows, into ``dtype`` (int16 for widths to 15).

    Value j of a group of 8 starts at bit j·width, i.e. at bit (j·width) % 8 of byte (j·width) // 8 of the
    group's ``width`` bytes, and fits in the 32 bits read from that byte on (7 + 16 < 32). So, chunk by chunk
    (the chunk's bytes copied into a scratch buffer with 4 zero bytes after them), value j of every group is
    one strided, unaligned uint32 view of the scratch, shifted and masked: two numpy passes per value column
    instead of the torch path's widening of every byte and its 8 shift-or columns.
    """
    b = buf.numpy()
    groups = (count + 7) // 8
    out = np.empty(groups * 8, dtype=_NUMPY_OUT[dtype])
    columns = out.reshape(groups, 8)
    per_chunk = _CHUNK // 8
    scratch = np.zeros(per_chunk * width + 4, dtype=np.uint8)
    rows = np.empty((8, per_chunk), dtype=np.uint32)  # value j of the chunk's groups in row j, then transposed
    mask = np.uint32((1 << width) - 1)
    for g0 in range(0, groups, per_chunk):
        g = min(per_chunk, groups - g0)
        nbytes = min(g * width, b.size - g0 * width)
        scratch[:nbytes] = b[g0 * width : g0 * width + nbytes]
        scratch[nbytes : g * width + 4] = 0
        r = rows[:, :g]
        for j in range(8):
            byte, shift = divmod(j * width, 8)
            window = np.ndarray(shape=(g,), dtype=np.uint32, buffer=scratch, offset=byte, strides=(width,))
            np.right_shift(window, np.uint32(shift), out=r[j])
        np.bitwise_and(r, mask, out=r)
        columns[g0 : g0 + g] = r.T
    if groups * 8 != count and out[count:].any():  # every bit after the last value is in a padding slot
        raise WireError(f"nonzero padding bits after {count} values of {width} bits")
    return torch.from_numpy(out[:count])


_NUMPY_OUT = {torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}


def _unpack_kernel(buf: torch.Tensor, width: int, count: int, unpack, dtype: torch.dtype) -> torch.Tensor:
    """The compiled unpacker (gradcomp.kernels) into ``dtype`` (int16, int32 or int64, wide enough for
    ``width``): whole blocks of 64 values read as ``width`` 64-bit words straight from the buffer (at any byte
    offset), the last partial block from a zero-padded copy, whose values past ``count`` must be 0 (they hold
    the padding bits)."""
    b = buf.numpy()
    whole = count // 64 * 64
    out = np.empty(count, dtype=_NUMPY_OUT[dtype])
    unpack(b[: whole // 64 * width * 8].view(np.uint64), out[:whole])
    if whole < count:
        tail = np.zeros(8 * width, dtype=np.uint8)
        rest = b[whole // 64 * width * 8 :]
        tail[: rest.size] = rest
        values = np.empty(64, dtype=np.int64)
        unpack(tail.view(np.uint64), values)
        if values[count - whole :].any():
            raise WireError(f"nonzero padding bits after {count} values of {width} bits")
        out[whole:] = values[: count - whole]
    return torch.from_numpy(out)


def decoded_dtype(width: int) -> torch.dtype:
    """The integer dtype that decoded BITS values of ``width`` bits come in: the narrowest signed one that holds
    [0, 2^width) with room for small arithmetic: int16 up to 15 bits, int32 up to 31, int64 for 32."""
    if width <= 15:
        return torch.int16
    if width <= 31:
        return torch.int32
    return torch.int64


def _unpack(
    buf: torch.Tensor, width: int, count: int, dtype: torch.dtype | None = None, flags: list | None = None
) -> torch.Tensor:
    """Unpack ``count`` values (length already checked); checks padding. Returns ``dtype`` when given (int16,
    int32 or int64: the compiled kernels and the windowed path write it directly), else the work dtype, or
    int64 from those two paths. With ``flags`` (a list), the torch path does not read the padding check back: it
    appends a bool tensor, true when the padding is clear, for the caller to read with its others."""
    device = buf.device
    host = host_path(buf)
    wd = _work_dtype(width)
    if count == 0:
        return torch.empty(0, dtype=dtype or wd, device=device)
    if width == 8:
        return buf.to(dtype or wd)
    direct = dtype or torch.int64
    kernel = kernels.bitpack(width, count) if host and sys.byteorder == "little" else None
    if kernel is not None:
        return _unpack_kernel(buf, width, count, kernel[1], direct)
    if count <= _SMALL and host:
        out = _unpack_small(buf, width, count)
        return out if dtype is None else out.to(dtype)
    if 8 < width <= _CHUNKED_MAX_WIDTH and host and sys.byteorder == "little":
        return _unpack_windows(buf, width, count, direct)
    groups = (count + 7) // 8
    if width > 8:
        out = _unpack_gathered(buf, width, groups * 8)
        out = out if dtype is not None else out.to(wd)
    else:
        out = _unpack_columns(buf, width, groups)
    if groups * 8 != count:
        # Every bit after the last value lies in one of the padding value slots.
        if flags is not None:
            flags.append(out[count:].any().logical_not())
        elif bool(out[count:].any()):
            raise WireError(f"nonzero padding bits after {count} values of {width} bits")
        out = out[:count]
    return out if dtype is None else out.to(dtype)


def _unpack_columns(buf: torch.Tensor, width: int, groups: int) -> torch.Tensor:
    """``groups`` groups of 8 values of ``width`` bits (1 to 7) as uint8, one value column at a time."""
    device = buf.device
    b = buf
    if groups * width != b.numel():
        b = torch.cat([b, torch.zeros(groups * width - b.numel(), dtype=torch.uint8, device=device)])
    b = b.reshape(groups, width)
    mask = (1 << width) - 1
    cols = []
    for j in range(8):  # value j of each group covers bits [j*width, (j+1)*width)
        acc = None
        for t in range((j * width) // 8, (j * width + width - 1) // 8 + 1):
            shift = 8 * t - j * width
            part = b[:, t] << shift if shift >= 0 else b[:, t] >> (-shift)
            acc = part if acc is None else acc | part
        cols.append(acc & mask)
    return torch.stack(cols, dim=1).reshape(-1)


def _as_uint8_buffer(buf: object) -> torch.Tensor:
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8:
        raise WireError(
            f"expected a uint8 tensor, got {type(buf).__name__}"
            + (f" of dtype {buf.dtype}" if isinstance(buf, torch.Tensor) else "")
        )
    return buf.reshape(-1).contiguous()


def pack_bits(values: torch.Tensor, width: int, flags: list | None = None) -> torch.Tensor:
    """Pack non-negative integers into ``width`` bits each (LSB-first); returns a 1-D uint8 tensor.

    ``values`` may have any integer (or bool) dtype and shape; it is flattened. Raises ConfigError for a
    width outside [1, 32], a non-integer tensor, or a value outside [0, 2**width). With ``flags`` (a list), a
    range check on the torch path is not read back: ``(bool tensor, message)`` is appended for the caller to
    read with its other checks and raise ConfigError(message) on false (wire.encode's device path).
    """
    width = _check_width(width)
    if not isinstance(values, torch.Tensor):
        raise ConfigError(f"pack_bits expects a tensor, got {type(values).__name__}")
    if values.dtype.is_floating_point or values.dtype.is_complex:
        raise ConfigError(f"pack_bits expects an integer tensor, got dtype {values.dtype}")
    v = values.detach().reshape(-1)
    if width == 8 and v.dtype == torch.uint8:  # bytes already (the sign bitmaps): every value fits
        return v.contiguous()
    if v.dtype == torch.bool:
        v = v.to(torch.uint8)
    elif v.dtype not in _NATIVE_INT:
        v = v.to(torch.int64)  # unsigned 16/32/64-bit: values >= 2**63 wrap negative and are rejected
    if v.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=v.device)
    kernel = _kernel_pack(v, width)
    if kernel is not None:
        return _pack_kernel(v, width, True, kernel)
    if _chunked(v, width):
        return _pack_chunked(v, width, check=True)
    lo, hi = torch.aminmax(v)
    if flags is not None:  # the device path: the range is checked later, with the caller's other checks
        message = f"values must lie in [0, 2**{width}) to be packed with {width} bits"
        flags.append(((lo >= 0) & (hi < (1 << width)), message))
        return _pack(v, width)
    lo, hi = torch.stack([lo.to(torch.int64), hi.to(torch.int64)]).tolist()
    if lo < 0 or hi >= (1 << width):
        raise ConfigError(f"values must lie in [0, 2**{width}) to be packed with {width} bits, got range [{lo}, {hi}]")
    return _pack(v, width)


def unpack_bits(buf: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: read ``count`` values of ``width`` bits; returns int64.

    Raises WireError if the buffer length is not exactly ``ceil(count * width / 8)`` or a padding bit is set.
    """
    width = _check_width(width)
    buf = _as_uint8_buffer(buf)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise WireError(f"invalid value count {count!r}")
    expected = packed_nbytes(count, width)
    if buf.numel() != expected:
        raise WireError(
            f"bit-packed buffer has {buf.numel()} bytes, expected {expected} for {count} values of {width} bits"
        )
    return _unpack(buf, width, count, torch.int64)


def pack_bool(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean (or 0/1 integer) tensor into a bitmap, 8 entries per byte, LSB-first."""
    if not isinstance(mask, torch.Tensor):
        raise ConfigError(f"pack_bool expects a tensor, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return _pack(mask.detach().reshape(-1).to(torch.uint8), 1)
    return pack_bits(mask, 1)


def unpack_bool(buf: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bool`; returns a bool tensor of ``count`` entries."""
    buf = _as_uint8_buffer(buf)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise WireError(f"invalid value count {count!r}")
    if buf.numel() != packed_nbytes(count, 1):
        raise WireError(f"bitmap has {buf.numel()} bytes, expected {packed_nbytes(count, 1)} for {count} bits")
    return _unpack(buf, 1, count).to(torch.bool)
