"""Position-sensitive 64-bit checksum of a uint8 buffer: numpy on CPU, torch integer ops on other devices.

Definition: the buffer is zero-padded to a multiple of 8 bytes and read as little-endian 64-bit words
``w_i`` (assembled with shifts, so host endianness does not matter). With ``mix`` the SplitMix64 finalizer
(a bijection on 64-bit words) and all arithmetic modulo 2**64::

    checksum = mix( sum_i w_i * ((2i + 1) * 0x9E3779B97F4A7C15) + (len + 1) * 0xD6E8FEB86659FD93 )

Every weight is odd, hence invertible modulo 2**64, so changing any single word (in particular any
single-bit flip) always changes the sum, and ``mix`` is a bijection; a different length always changes
it too. Swaps and other multi-word changes are detected unless (a − b)(weight_i − weight_j) happens to
vanish modulo 2**64. The sum is linear so that it costs a few passes over the buffer (an earlier version
mixed every word and ran at a few percent of memory-copy speed). Wrapping 64-bit addition is
order-independent, so the value is identical on CPU (numpy) and CUDA (torch); the final mix runs on the
host. This is an integrity check against corruption, not a cryptographic MAC.
"""

from __future__ import annotations

import sys

import numpy as np
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
    """64-bit checksum of a uint8 tensor (any shape, flattened); returns an int in [0, 2**64).

    CPU buffers go through numpy (whose uint64 arithmetic wraps modulo 2**64 natively: 2.6x faster than the
    int64 torch ops on 40 MB); other devices compute the weighted sum where the buffer lives.
    """
    buf = _as_uint8_buffer(buf)
    n = buf.numel()
    total = _weighted_sum_numpy(buf) if buf.device.type == "cpu" else _weighted_sum_torch(buf)
    return _mix((total + (n + 1) * _LEN_MUL) & _MASK64)


def _weighted_sum_numpy(buf: torch.Tensor) -> int:
    raw = buf.contiguous().numpy()
    pad = -raw.size % 8
    if pad or raw.ctypes.data % 8:
        raw = np.concatenate([raw, np.zeros(pad, dtype=np.uint8)])  # also realigns an unaligned view
    words = raw.view("<u8")
    with np.errstate(over="ignore"):
        weights = np.arange(words.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        weights *= np.uint64(_GOLDEN & _MASK64)
        return int((words * weights).sum(dtype=np.uint64))


def _weighted_sum_torch(buf: torch.Tensor) -> int:
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
    return int((words * weights).sum().item()) & _MASK64
