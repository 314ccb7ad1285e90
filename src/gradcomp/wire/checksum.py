"""Position-sensitive 64-bit checksum of a uint8 buffer, computed with torch integer ops on its device.

Definition: the buffer is zero-padded to a multiple of 8 bytes and read as little-endian 64-bit words
``w_i`` (assembled with shifts, so host endianness does not matter). With ``mix`` the SplitMix64 finalizer
(a bijection on 64-bit words) and all arithmetic modulo 2**64::

    checksum = mix( sum_i w_i * ((2i + 1) * 0x9E3779B97F4A7C15) + (len + 1) * 0xD6E8FEB86659FD93 )

Every weight is odd, hence invertible modulo 2**64, so changing any single word (in particular any
single-bit flip) always changes the sum, and ``mix`` is a bijection; a different length always changes
it too. Swaps and other multi-word changes are detected unless (a − b)(weight_i − weight_j) happens to
vanish modulo 2**64. The sum is linear so that it costs a few passes over the buffer (an earlier version
mixed every word and ran at a few percent of memory-copy speed). Wrapping int64 addition is
order-independent, so the value is identical on CPU and CUDA. This is an integrity check against
corruption, not a cryptographic MAC.
"""

from __future__ import annotations

import sys

import torch

from gradcomp.wire.bits import _as_uint8_buffer

__all__ = ["checksum64"]

_MASK64 = (1 << 64) - 1


def _s64(c: int) -> int:
    """Unsigned 64-bit constant as the int64 with the same bits."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_LEN_MUL = 0xD6E8FEB86659FD93
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _mix(z: int) -> int:
    """SplitMix64 finalizer on an unsigned 64-bit Python int (host arithmetic: one scalar, no device ops)."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def checksum64(buf: torch.Tensor) -> int:
    """64-bit checksum of a uint8 tensor (any shape, flattened); returns an int in [0, 2**64)."""
    buf = _as_uint8_buffer(buf)
    n = buf.numel()
    device = buf.device
    nwords = (n + 7) // 8
    if nwords * 8 != n:
        buf = torch.cat([buf, torch.zeros(nwords * 8 - n, dtype=torch.uint8, device=device)])
    elif buf.storage_offset() % 8 != 0:
        buf = buf.clone()  # .view(int64) needs 8-byte aligned storage
    if sys.byteorder == "little":
        words = buf.view(torch.int64)
    else:  # assemble little-endian words explicitly
        b = buf.view(nwords, 8)
        words = b[:, 0].to(torch.int64)
        for k in range(1, 8):
            words = words | (b[:, k].to(torch.int64) << (8 * k))
    weights = torch.arange(nwords, dtype=torch.int64, device=device).mul_(2).add_(1).mul_(_GOLDEN)
    total = int((words * weights).sum().item()) & _MASK64
    return _mix((total + (n + 1) * _LEN_MUL) & _MASK64)
