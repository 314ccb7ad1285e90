"""The ditherings' codes of one chunk in one compiled pass (see gradcomp.compressors.natural for the methods).

Inputs are what the torch path has at that point: ``y`` = |x_i| / ||x||_p (float32, computed by torch), ``u``
the chunk's uniform draws (float32, from the method's seeded generator, drawn by torch so that the numbers
stay the same), ``x`` the entries themselves (for the sign). Each code is sign·2^level_bits + level index, the
sign only where the index is not 0, written to ``out`` (int16 or int32, as the caller allocates it). Every
float32 operation is the torch path's, in the same order, so the codes are the same bit for bit
(tests/test_kernels.py compares them):

``random_codes(y, u, x, levels, level_bits, out)``: standard dithering, index = floor(y·s) + (u < y·s − floor(y·s)),
clamped to [0, s].

``natural_codes(y, u, x, levels, level_bits, out)``: natural dithering, levels 0, 2^(1−s), …, 1/2, 1: with
y = m·2^e (m in [1/2, 1), torch.frexp), the upper level is j = e + s and p_up = 2m − 1; below level 1 (j <= 1,
or y = 0) j = 1 and p_up = y·2^(s−1); index = j − (u >= p_up), clamped to [0, s]. e and 2m are read from
y's float32 bits (a subnormal y, below 2^−126, is always below level 1 since s <= 126).

``ternary_codes(p, u, x, out)``: TernGrad, code = 0 where u >= p, else 1, or 2 where x < 0.
"""

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def random_codes(y, u, x, levels, level_bits, out):
    s = np.float32(levels)
    for i in range(y.size):
        scaled = y[i] * s
        lower = np.float32(math.floor(scaled))
        index = lower + np.float32(u[i] < scaled - lower)
        index = min(max(index, np.float32(0.0)), s)
        code = np.int64(index)
        if code > 0 and x[i] < 0:
            code += np.int64(1) << level_bits
        out[i] = code


@njit(cache=True, nogil=True)
def natural_codes(y, u, x, levels, level_bits, out):
    below = np.float32(2.0 ** (levels - 1))
    ybits = y.view(np.int32)
    scratch = np.empty(1, dtype=np.int32)
    as_float = scratch.view(np.float32)
    for i in range(y.size):
        b = ybits[i]  # y >= 0: no sign bit
        exponent = (b >> 23) & 0xFF
        upper = exponent - 126 + levels  # frexp's e + s for a normal y; subnormals and 0 fall below level 1
        if exponent == 0 or upper <= 1:
            upper = 1
            p_up = y[i] * below
        else:
            scratch[0] = (b & 0x007FFFFF) | (127 << 23)  # 2m, in [1, 2): frexp's mantissa doubled, exactly
            p_up = as_float[0] - np.float32(1.0)
        index = upper - (1 if u[i] >= p_up else 0)
        index = min(max(index, 0), levels)
        code = np.int64(index)
        if code > 0 and x[i] < 0:
            code += np.int64(1) << level_bits
        out[i] = code


@njit(cache=True, nogil=True)
def ternary_codes(p, u, x, out):
    for i in range(p.size):
        if u[i] < p[i]:
            out[i] = 2 if x[i] < 0 else 1
        else:
            out[i] = 0
