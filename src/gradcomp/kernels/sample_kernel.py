"""Random-k's positions: the first k distinct values of a stream of draws, in increasing order.

``sample_without_replacement`` (gradcomp.compressors.sparse) defines random-k's positions as the first k
distinct values of a sequence of uniform draws from range(n), sorted. Its numpy/torch path finds them with a
stable sort of all the draws and masks over the sorted copy; these kernels take two cheaper steps:

- ``mark_first_distinct(draws, bitmap, found, k, out)`` walks the draws in order, tests and sets each value's
  bit in a bitmap of n bits, and appends each value seen for the first time to ``out``, stopping at the k-th;
  it returns how many distinct values ``out`` now holds (``found`` of them from earlier calls: a caller that
  runs short draws another round and calls again with the same bitmap, as the torch path draws more);
- ``radix_sort(keys, scratch, bits)`` sorts those k values (non-negative, below 2**bits) with an LSD radix
  sort of at most 12-bit digits: two passes for tensors of up to 2^24 entries, three up to 2^36.

Same positions as the stable sort, for fewer operations (tests/test_kernels.py compares both paths); a scan
of the bitmap for its set bits instead of the radix sort was slower (a mispredicted branch or two per 64-bit
word). docs/host_performance.md has the times.
"""

import numpy as np
from numba import njit

RADIX_DIGIT_BITS = 12  # 4096 counters: 32 KB, in the L1/L2 cache


@njit(cache=True, nogil=True)
def mark_first_distinct(draws, bitmap, found, k, out):
    """Append to out[found:] each value of ``draws`` not yet marked in ``bitmap`` (uint64 words, bit v % 64 of
    word v // 64), marking it, until k values are held; returns the number held."""
    one = np.uint64(1)
    for i in range(draws.size):
        if found >= k:
            break
        value = draws[i]
        word = value >> 6
        bit = one << np.uint64(value & 63)
        if (bitmap[word] & bit) == 0:
            bitmap[word] |= bit
            out[found] = value
            found += 1
    return found


@njit(cache=True, nogil=True)
def radix_sort(keys, scratch, bits):
    """Sort the int64 ``keys`` (each in [0, 2**bits)) with ``scratch`` of the same size; returns whichever of
    the two arrays holds the result."""
    passes = (bits + RADIX_DIGIT_BITS - 1) // RADIX_DIGIT_BITS
    if passes == 0 or keys.size < 2:
        return keys
    digit = (bits + passes - 1) // passes
    mask = (1 << digit) - 1
    counts = np.empty(1 << digit, dtype=np.int64)
    source, target = keys, scratch
    for p in range(passes):
        shift = p * digit
        counts[:] = 0
        for i in range(source.size):
            counts[(source[i] >> shift) & mask] += 1
        start = 0
        for b in range(counts.size):  # counts become each digit's first slot in the target
            c = counts[b]
            counts[b] = start
            start += c
        for i in range(source.size):  # stable: equal digits keep their order
            value = source[i]
            b = (value >> shift) & mask
            target[counts[b]] = value
            counts[b] += 1
        source, target = target, source
    return source
