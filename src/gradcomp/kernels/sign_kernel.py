"""The sign family's bitmap in one compiled pass each way (see gradcomp.compressors.sign for the methods).

``sign_bits(x, out, below)``: byte g of ``out`` (uint8) gets bit j set where x[8g + j] < ``below`` (a scalar
of x's dtype), the unused high bits of a last partial byte stay 0; returns the number of set bits. With
``below`` = 0 (−0.0 and NaN are not set) these are the bytes of ``np.packbits(x < 0, bitorder="little")``;
with ``below`` = the dtype's smallest positive value they are those of ``x <= 0`` (nothing lies between 0
and it), the same pass for the majority vote's odd steps, which send a zero as −. 64 comparisons are OR-ed
into a 64-bit word at a time, and the set bits are counted from the bitmap afterwards: faster than packing a
byte at a time and counting while packing (docs/host_performance.md).

``sign_add(packed, positive, negative, out)`` / ``sign_subtract(...)``: out[i] += (or −=) ``negative`` where
bit i of the bitmap is set, ``positive`` where it is not: one float32 addition or subtraction per entry, the
same as adding the decoded vector, so the same results bit for bit. ``packed`` may be any integer dtype
holding byte values (uint8 from the compressor, int16 from the wire).
"""

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def sign_bits(x, out, below):
    whole = x.size // 64
    words = out[: whole * 8].view(np.uint64)  # little-endian: bit j of a word is bit j % 8 of its byte j // 8
    for w in range(whole):  # 64 comparisons OR-ed into one word (fewer stores than a byte per 8 entries)
        o = 64 * w
        word = np.uint64(0)
        for j in range(64):
            word |= np.uint64(x[o + j] < below) << np.uint64(j)
        words[w] = word
    for g in range(whole * 8, (x.size + 7) // 8):  # the last entries, a byte at a time
        byte = 0
        for j in range(min(8, x.size - 8 * g)):
            byte |= np.int32(x[8 * g + j] < below) << j
        out[g] = np.uint8(byte)
    return _count_set_bits(out[: (x.size + 7) // 8])  # the bytes written, not what else ``out`` may hold


@njit(cache=True, nogil=True)
def _count_set_bits(packed):
    """The number of set bits of a uint8 array: a SWAR popcount per 64-bit word."""
    m1, m2 = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333)
    m4, ones = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0x0101010101010101)
    whole = packed.size // 8
    words = packed[: whole * 8].view(np.uint64)
    total = 0
    for i in range(whole):
        v = words[i]
        v = v - ((v >> np.uint64(1)) & m1)
        v = (v & m2) + ((v >> np.uint64(2)) & m2)
        v = (v + (v >> np.uint64(4))) & m4
        total += np.int64((v * ones) >> np.uint64(56))
    for i in range(whole * 8, packed.size):
        byte = np.int64(packed[i])
        while byte:
            total += byte & 1
            byte >>= 1
    return total


@njit(cache=True, nogil=True, inline="always")
def _decoded(byte, j, positive, negative):
    return negative if (byte >> j) & 1 else positive


@njit(cache=True, nogil=True)
def sign_add(packed, positive, negative, out):
    whole = out.size // 8
    for g in range(whole):  # a byte's 8 entries together: the inner loop unrolls and vectorises
        byte = np.int64(packed[g])
        for j in range(8):
            out[8 * g + j] += _decoded(byte, j, positive, negative)
    for i in range(8 * whole, out.size):
        out[i] += _decoded(np.int64(packed[whole]), i - 8 * whole, positive, negative)


@njit(cache=True, nogil=True)
def sign_subtract(packed, positive, negative, out):
    whole = out.size // 8
    for g in range(whole):
        byte = np.int64(packed[g])
        for j in range(8):
            out[8 * g + j] -= _decoded(byte, j, positive, negative)
    for i in range(8 * whole, out.size):
        out[i] -= _decoded(np.int64(packed[whole]), i - 8 * whole, positive, negative)
