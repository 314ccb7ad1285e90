"""Elias-gamma coding of positive integers (vectorized, CPU or CUDA).

Code: an integer ``v >= 1`` with ``N = floor(log2 v)`` is written as ``N`` zero-bits followed by the ``N + 1``
bits of ``v``, most significant bit first (that first bit is the 1 that ends the zero run): ``2N + 1`` bits.
1 → ``1``, 2 → ``010``, 3 → ``011``, 4 → ``00100``, 2^40 → 40 zeros, a one, 40 zeros. Codes are
concatenated and the bit stream is stored LSB-first in bytes (global bit ``k`` is bit ``k % 8`` of byte
``k // 8``, as in :func:`gradcomp.wire.pack_bits` and :mod:`gradcomp.wire.golomb`); the unused high bits of
the last byte (at most 7) are zero. The count of codes is not in the stream: the caller transmits it.
Values up to ``2**63 - 1`` (``MAX_VALUE``, the int64 maximum; codes of at most 125 bits) are supported.

Encoding writes the leading ones with one scatter and the ``N`` bits after them with one scatter per bit
slot (at most 62 slots, the largest ``N`` present; never a loop over codes). Decoding uses no loop over
codes either: a code that starts at bit ``t`` has its leading one at ``p(t)`` = the first one-bit at or after
``t`` and ends at ``succ(t) = 2·p(t) − t + 1`` — a function of ``t`` alone, found for every bit position with
a prefix count of ones. The code starts ``t_0 = 0, t_{i+1} = succ(t_i)`` are followed by pointer doubling
(as in the Golomb decoder) in ``O(N_bits · log count)`` time and ``O(N_bits)`` memory, with an absorbing
state for a code that runs past the end, so decoding always terminates (no loop runs more than
log2(count) + 1 or 62 times) and every bit of the stream must belong to exactly ``count`` codes plus at most
7 zero padding bits, or a :class:`~gradcomp.errors.WireError` is raised: a truncated stream and trailing
codes or bytes are always refused, a corruption that moves code boundaries unless the codes happen to
resynchronise into exactly ``count``. A flipped bit inside a code's value part gives another valid stream
of the same length, which no prefix code can tell apart; the container's 64-bit body checksum catches such
corruptions.

Errors: the encoder raises :class:`~gradcomp.errors.ConfigError` for misuse (not a tensor, a non-integer
dtype, a value < 1); the decoder raises only :class:`~gradcomp.errors.WireError` for bad bytes (truncated:
too few codes; trailing garbage: more than 7 bits left or a nonzero padding bit; a code longer than 125 bits)
or a bad ``count``.
"""

from __future__ import annotations

import torch

from gradcomp.errors import ConfigError, WireError
from gradcomp.wire.bits import _as_uint8_buffer, _pack, _unpack

__all__ = ["elias_gamma_encode", "elias_gamma_decode", "elias_gamma_lengths", "MAX_VALUE", "MAX_CODE_BITS"]

MAX_VALUE = (1 << 63) - 1
_MAX_N = 62  # floor(log2(MAX_VALUE))
MAX_CODE_BITS = 2 * _MAX_N + 1


def _floor_log2(v: torch.Tensor) -> torch.Tensor:
    """floor(log2 v) of positive int64 values, exact (no float rounding near large powers of two)."""
    n = torch.zeros_like(v)
    for shift in (32, 16, 8, 4, 2, 1):
        n += (v >> (n + shift) > 0).to(v.dtype) * shift
    return n


def _check_values(values: object) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        raise ConfigError(f"elias_gamma_encode expects a tensor, got {type(values).__name__}")
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ConfigError(f"Elias-gamma codes integers: expected an integer tensor, got dtype {values.dtype}")
    v = values.detach().reshape(-1)
    if v.dtype != torch.int64:
        # unsigned 64-bit values >= 2**63 wrap negative here and are rejected below
        v = v.to(torch.int64)
    if v.numel() and int(v.min()) < 1:
        raise ConfigError(f"Elias-gamma codes positive integers only, got the value {int(v.min())}")
    return v


def elias_gamma_lengths(values: torch.Tensor) -> torch.Tensor:
    """Code length in bits, ``2·floor(log2 v) + 1``, of every value (int64; same checks as the encoder)."""
    return 2 * _floor_log2(_check_values(values)) + 1


def elias_gamma_encode(values: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Elias-gamma code the positive integers ``values`` (any integer dtype and shape; flattened).

    Returns ``(bytes, total_bits)``: a uint8 tensor of ``ceil(total_bits / 8)`` bytes on the input's device
    and the number of meaningful bits. Raises ConfigError for a non-tensor, a non-integer dtype or a value
    < 1.
    """
    v = _check_values(values)
    device = v.device
    k = v.numel()
    if k == 0:
        return torch.empty(0, dtype=torch.uint8, device=device), 0
    n = _floor_log2(v)
    lengths = 2 * n + 1
    ends = torch.cumsum(lengths, 0)
    total = int(ends[-1])
    lead = ends - lengths + n  # position of each code's leading one
    # one scratch bit at the end takes the writes of codes that have no bit in a given slot
    bits = torch.zeros(total + 1, dtype=torch.uint8, device=device)
    bits[lead] = 1
    max_n = int(n.max())
    scratch = torch.full_like(lead, total)
    for j in range(1, max_n + 1):  # bit j after the leading one (MSB first); a loop over bit slots only
        active = n >= j
        where = torch.where(active, lead + j, scratch)
        bits[where] = ((v >> (n - j).clamp_(min=0)) & 1).to(torch.uint8)
    return _pack(bits[:total], 1), total


def elias_gamma_decode(buf: torch.Tensor, count: int) -> torch.Tensor:
    """Decode exactly ``count`` Elias-gamma codes from ``buf`` (a uint8 stream as the encoder writes it).

    Returns an int64 tensor of values >= 1 on the buffer's device. Raises WireError (only) when the stream is
    truncated (fewer than ``count`` complete codes), holds more than ``count`` codes or more than 7 padding
    bits, has a nonzero padding bit, holds a code of more than 125 bits (a value beyond int64), when ``buf``
    is not a uint8 tensor, or when ``count`` is not a non-negative int.
    """
    buf = _as_uint8_buffer(buf)
    device = buf.device
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise WireError(f"elias: invalid code count {count!r}")
    nbytes = buf.numel()
    if count == 0:
        if nbytes:
            raise WireError(f"elias: {nbytes} bytes given for 0 codes (expected an empty stream)")
        return torch.empty(0, dtype=torch.int64, device=device)
    n = 8 * nbytes
    if count > n:
        raise WireError(f"elias: truncated stream: {count} codes need at least {count} bits, got {n}")
    if n > count * MAX_CODE_BITS + 7:
        raise WireError(f"elias: stream of {n} bits is too long for {count} codes of at most {MAX_CODE_BITS} bits")
    bits = _unpack(buf, 1, n)  # uint8 0/1, length n
    ones = torch.nonzero(bits).reshape(-1)
    n_ones = ones.numel()
    if n_ones < count:
        raise WireError(f"elias: truncated stream: {count} codes need {count} one-bits, found {n_ones}")
    # before[t] = number of one-bits before bit t: the index (into ones) of the first one at or after t
    before = torch.cumsum(bits, 0, dtype=torch.int64).sub_(bits)
    t = torch.arange(n, dtype=torch.int64, device=device)
    has_one = before < n_ones
    lead = torch.index_select(ones, 0, before.clamp(max=n_ones - 1))
    end = 2 * lead - t + 1
    # states 0..n-1: a code starts there; n: exactly at the end of the stream; n + 1: ran past the end
    past = n + 1
    idx_dtype = torch.int32 if past < 2**31 else torch.int64  # halves the doubling's memory traffic
    succ = torch.where(has_one & (end <= n), end, torch.full_like(end, past)).to(idx_dtype)
    del t, has_one, end
    succ = torch.cat([succ, torch.full((2,), past, dtype=idx_dtype, device=device)])
    # pointer doubling: with the starts t_0..t_{m-1} known and jump = succ applied m times,
    # t_m..t_{2m-1} = jump[t_0..t_{m-1}]; count + 1 states (the last is where the last code ends)
    starts = torch.zeros(1, dtype=idx_dtype, device=device)
    jump = succ
    while starts.numel() < count + 1:
        need = count + 1 - starts.numel()
        starts = torch.cat([starts, torch.index_select(jump, 0, starts[:need])])
        if starts.numel() < count + 1:
            jump = torch.index_select(jump, 0, jump)
    del jump, succ
    stop = int(starts[-1])
    if stop > n:
        bad = int(torch.nonzero(starts == past)[0, 0]) - 1  # the code whose end lies beyond the stream
        raise WireError(f"elias: truncated stream: code {bad} of {count} runs past the end of the {n}-bit stream")
    left = n - stop
    if left > 7:
        raise WireError(
            f"elias: {left} bits left after {count} codes (at most 7 padding bits allowed): "
            "the stream holds more codes than expected or trailing garbage"
        )
    if left and bool(bits[stop:].any()):
        raise WireError("elias: nonzero padding bits after the last code")
    starts = starts[:count].to(torch.int64)
    lead = torch.index_select(ones, 0, torch.index_select(before, 0, starts))
    del before, ones
    width = lead - starts  # N: zeros before the leading one
    max_n = int(width.max())
    if max_n > _MAX_N:
        raise WireError(f"elias: a code of {2 * max_n + 1} bits encodes a value beyond int64 (at most 2**63 - 1)")
    values = torch.ones(count, dtype=torch.int64, device=device)
    last = torch.full_like(lead, n - 1)
    for j in range(1, max_n + 1):  # bit slots after the leading one, MSB first
        active = width >= j
        bit = torch.index_select(bits, 0, torch.minimum(lead + j, last)).to(torch.int64)
        values = torch.where(active, (values << 1) | bit, values)
    return values
