"""The sign family's bitmap in one compiled pass each way (see gradcomp.compressors.sign for the methods).

``sign_bits(x, out)``: byte g of ``out`` (uint8) gets bit j set where x[8g + j] < 0 (−0.0 and NaN are not),
the unused high bits of a last partial byte stay 0; returns the number of negative entries. These are the
bytes of ``np.packbits(x < 0, bitorder="little")``.

``sign_add(packed, positive, negative, out)`` / ``sign_subtract(...)``: out[i] += (or −=) ``negative`` where
bit i of the bitmap is set, ``positive`` where it is not: one float32 addition or subtraction per entry, the
same as adding the decoded vector, so the same results bit for bit. ``packed`` may be any integer dtype
holding byte values (uint8 from the compressor, int16 from the wire).
"""

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def sign_bits(x, out):
    whole = x.size // 8
    negatives = 0
    for g in range(whole):
        o = 8 * g
        byte = (
            np.uint8(x[o] < 0)
            | (np.uint8(x[o + 1] < 0) << np.uint8(1))
            | (np.uint8(x[o + 2] < 0) << np.uint8(2))
            | (np.uint8(x[o + 3] < 0) << np.uint8(3))
            | (np.uint8(x[o + 4] < 0) << np.uint8(4))
            | (np.uint8(x[o + 5] < 0) << np.uint8(5))
            | (np.uint8(x[o + 6] < 0) << np.uint8(6))
            | (np.uint8(x[o + 7] < 0) << np.uint8(7))
        )
        out[g] = byte
        negatives += (
            np.int64(x[o] < 0) + np.int64(x[o + 1] < 0) + np.int64(x[o + 2] < 0) + np.int64(x[o + 3] < 0)
            + np.int64(x[o + 4] < 0) + np.int64(x[o + 5] < 0) + np.int64(x[o + 6] < 0) + np.int64(x[o + 7] < 0)
        )
    if whole * 8 < x.size:
        byte = np.uint8(0)
        for j in range(x.size - whole * 8):
            byte |= np.uint8(x[whole * 8 + j] < 0) << np.uint8(j)
            negatives += x[whole * 8 + j] < 0
        out[whole] = byte
    return negatives


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
