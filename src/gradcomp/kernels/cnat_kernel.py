"""C_nat's codes in one compiled pass (see gradcomp.compressors.natural for the method and the wire format).

For float32 entry i with bit pattern b (magnitude bits m = b & 0x7FFFFFFF):

    u    = SplitMix64(key + (offset + i + 1) · γ) >> 41          a uniform 23-bit integer
    code = min((m + 2^23 − 1 − u) >> 23, 254)                    exponent, +1 with probability mantissa / 2^23
    out  = code | 256 · sign(b)  where code != 0, else 0

``offset`` lets a caller code a tensor in pieces and get the codes of the whole. ``cnat_codes`` returns the
largest magnitude bit pattern it read, so the caller's NaN/Inf check (>= 0x7F800000) costs no second pass.
``natural.uniform23`` is the same random number in torch operations, for other devices and for checking.
"""

import numpy as np
from numba import njit

from gradcomp.kernels import SPLITMIX_GAMMA, SPLITMIX_MIX1, SPLITMIX_MIX2

GAMMA = np.uint64(SPLITMIX_GAMMA)
MIX1 = np.uint64(SPLITMIX_MIX1)
MIX2 = np.uint64(SPLITMIX_MIX2)


@njit(cache=True, nogil=True, inline="always")
def _splitmix64(z):
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True)
def cnat_codes(bits, key, offset, out):
    """out[i] (int16) = the C_nat code of the float32 whose int32 bit pattern is bits[i]; returns max magnitude."""
    worst = np.int32(0)
    k = np.uint64(key)
    first = np.uint64(offset + 1)
    for i in range(bits.size):
        b = bits[i]
        magnitude = b & np.int32(0x7FFFFFFF)
        worst = max(worst, magnitude)
        u = np.int32(_splitmix64(k + (first + np.uint64(i)) * GAMMA) >> np.uint64(41))
        code = min((magnitude + (np.int32(0x7FFFFF) - u)) >> np.int32(23), np.int32(254))
        if code != 0:
            code |= (b >> np.int32(23)) & np.int32(256)
        out[i] = np.int16(code)
    return worst


@njit(cache=True, nogil=True)
def cnat_bit_patterns(codes, out):
    """out[i] (int32) = codes[i] << 23: the float32 bit pattern of the code's value (any integer dtype in)."""
    for i in range(codes.size):
        out[i] = np.int32(codes[i]) << np.int32(23)


@njit(cache=True, nogil=True)
def cnat_accumulate(codes, total):
    """total[i] += the float32 value of codes[i] (one float32 addition per entry, as ``total += values``)."""
    bits = np.empty(1, dtype=np.int32)
    value = bits.view(np.float32)
    for i in range(codes.size):
        bits[0] = np.int32(codes[i]) << np.int32(23)
        total[i] += value[0]
