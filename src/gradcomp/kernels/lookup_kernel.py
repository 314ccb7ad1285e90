"""Dense quantizers' receiving side in one compiled pass: a code's value from a table, times a scale.

The ditherings' codes are ``sign · 2^sign_shift + level index`` and a level's value is a float32 that depends
on the index alone (``gradcomp.compressors.natural``); TernGrad's codes 0, 1, 2 stand for 0, +1, −1. Both are
decoded as ``±scale · table[code & mask]``: ``table`` holds the float32 value of every index the mask lets
through (so any code the wire can carry has one) and bit ``sign_shift`` of the code negates. One float32
multiplication per entry and an exact negation, as the torch paths compute it, so the same values bit for bit.

``lookup(codes, mask, sign_shift, table, scale, out, add)``: out[i] = that value (float32), or with ``add``
out[i] += it (one float32 addition, as ``out += decompress(...)``).

``scale`` is a one-element float32 array, so the product stays in float32 (a Python float would be float64).
``codes`` may be any integer dtype (int16 up to 15 bits, from the wire and from the compressors).
"""

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def lookup(codes, mask, sign_shift, table, scale, out, add):
    s = scale[0]
    for i in range(codes.size):
        c = np.int64(codes[i])
        value = s * table[c & mask]
        if (c >> sign_shift) & 1:
            value = -value
        if add:
            out[i] += value
        else:
            out[i] = value
