"""Golomb–Rice coding of sorted, strictly increasing positions (vectorized, CPU or CUDA).

Coding: positions ``p_0 < p_1 < ...`` become gaps ``g_0 = p_0`` and ``g_i = p_i - p_{i-1} - 1``. With Rice
parameter ``b`` each gap is written as ``q = g >> b`` one-bits, one zero-bit, then the remainder
``r = g & (2**b - 1)`` in ``b`` bits, most significant bit first. Codes are concatenated and the bit stream
is stored LSB-first in bytes (global bit ``k`` is bit ``k % 8`` of byte ``k // 8``, as in ``pack_bits``);
the unused high bits of the last byte (at most 7) are zero. Neither ``b`` nor the count is stored in the
stream; the caller transmits them (the container's section header does).

Decoding uses no loop over codes. Each code's unary part ends with a zero bit (its terminator); for the
``j``-th zero bit of the stream at position ``z_j`` the next code starts at ``z_j + 1 + b`` and its
terminator is the first zero at or after that position: ``succ(j)`` (found with a prefix count of zeros).
The terminators ``t_0 = 0, t_{i+1} = succ(t_i)`` are found by pointer doubling in
``O(N + Z log count)`` time and ``O(N)`` memory (``N = 8 * len(buf)`` bits, ``Z`` zero bits); ``q`` and ``r``
then follow from the terminator positions.

On a GPU, every read of a device value makes the host wait, so the wire's device path reads nothing here: the
encoder takes the stream's length from its caller (:func:`golomb_stream_bits`, read with the message's other sizes)
and defers its order check; the decoder takes every size from the section header and returns its checks as one
bool tensor instead of raising (:func:`_decode_deferred`).
"""

from __future__ import annotations

import functools
import math

import torch

from gradcomp.errors import ConfigError, WireError
from gradcomp.wire.bits import _as_uint8_buffer, _pack, _unpack, ints_on

__all__ = [
    "optimal_rice_parameter",
    "rice_parameter_on_device",
    "golomb_encode",
    "golomb_stream_bits",
    "golomb_decode",
    "MAX_RICE_PARAMETER",
    "MAX_UNIVERSE",
]

MAX_RICE_PARAMETER = 31
MAX_UNIVERSE = 1 << 62  # keeps every intermediate of the decoder inside int64
_LN_PHI_MINUS_1 = math.log((math.sqrt(5.0) + 1.0) / 2.0 - 1.0)


def optimal_rice_parameter(density: float) -> int:
    """Rice parameter for positions of the given density (Sattler et al., Sparse Binary Compression).

    ``b* = 1 + floor(log2(ln(phi - 1) / ln(1 - p)))`` with ``phi`` the golden ratio, clamped to [0, 31].
    ``p = 1`` gives 0 and ``p = 0`` gives 31 (the limits of the formula).
    """
    try:
        p = float(density)
    except (TypeError, ValueError):
        raise ConfigError(f"density must be a number in [0, 1], got {density!r}") from None
    if not 0.0 <= p <= 1.0:  # also rejects NaN
        raise ConfigError(f"density must be in [0, 1], got {density!r}")
    if p >= 1.0:
        return 0
    ln1mp = math.log1p(-p)
    if ln1mp == 0.0:
        return MAX_RICE_PARAMETER
    b = 1 + math.floor(math.log2(_LN_PHI_MINUS_1 / ln1mp))
    return int(min(MAX_RICE_PARAMETER, max(0, b)))


@functools.lru_cache(maxsize=1024)
def _rice_steps(universe: int) -> tuple[int, ...]:
    """For j = 0 .. 30, the smallest count c in [0, universe] whose ``optimal_rice_parameter(c / universe)`` is at
    most j (found by bisection: the parameter does not grow with the count; tests/test_wire_golomb.py checks it
    count by count). The parameter of a count c is then 31 minus the number of these steps that c reaches."""
    def rice(count: int) -> int:
        return optimal_rice_parameter(count / universe)

    steps = []
    for j in range(MAX_RICE_PARAMETER):
        low, high = 0, universe  # rice(universe) = 0 <= j
        while low < high:
            middle = (low + high) // 2
            if rice(middle) <= j:
                high = middle
            else:
                low = middle + 1
        steps.append(low)
    return tuple(steps)


def rice_parameter_on_device(count: torch.Tensor, universe: int) -> torch.Tensor:
    """``optimal_rice_parameter(count / universe)`` (what the container encodes a GOLOMB field of that count with)
    for a 0-d int64 ``count`` on the device, as a 0-d int64 tensor there, not read: the stream's length of a
    selection whose count is not yet read (:func:`golomb_stream_bits` takes it as ``b``). Exactly the host's
    value: it is compared with the counts where the host's parameter steps down (:func:`_rice_steps`)."""
    if universe <= 0:
        return torch.zeros((), dtype=torch.int64, device=count.device)
    steps = ints_on(count.device, list(_rice_steps(int(universe))))
    return MAX_RICE_PARAMETER - (count.reshape(()) >= steps).sum()


def _check_b(b: object, exc: type[Exception]) -> int:
    if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_RICE_PARAMETER:
        raise exc(f"Rice parameter b must be an int in [0, {MAX_RICE_PARAMETER}], got {b!r}")
    return b


def _gaps(positions: torch.Tensor) -> torch.Tensor:
    """The gaps ``p_0`` and ``p_i - p_{i-1} - 1`` of the non-empty 1-D int64 ``positions`` (negative where they are
    not strictly increasing or the first is negative)."""
    prev = torch.cat([torch.full((1,), -1, dtype=torch.int64, device=positions.device), positions[:-1]])
    return positions - prev - 1


def _checked_positions(positions: object) -> torch.Tensor:
    if not isinstance(positions, torch.Tensor):
        raise ConfigError(f"golomb_encode expects a tensor, got {type(positions).__name__}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise ConfigError(f"positions must be an integer tensor, got dtype {positions.dtype}")
    return positions.detach().reshape(-1).to(torch.int64)


def golomb_stream_bits(
    positions: torch.Tensor, b: int | torch.Tensor, kept: torch.Tensor | None = None
) -> torch.Tensor:
    """The length in bits of ``golomb_encode(positions, b)``'s stream, as a 0-d int64 tensor on the positions'
    device, not read: the wire's device path reads those of every Golomb field of a message at once and passes
    each to :func:`golomb_encode` as ``total``. Garbage for positions that golomb_encode refuses.

    With ``kept`` (a bool tensor beside the positions), the length of ``golomb_encode(positions[kept], b)``'s
    stream, without making that selection, whose size would have to be read: each kept position's gap is taken
    from the last kept position before it (a running maximum of the kept ones: the positions increase). ``b`` may
    be a 0-d int64 tensor on the positions' device (:func:`rice_parameter_on_device`), in [0, 31]."""
    if not isinstance(b, torch.Tensor):
        b = _check_b(b, ConfigError)
    pos = _checked_positions(positions)
    if pos.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=pos.device)
    if kept is None:
        return (_gaps(pos).clamp(min=0) >> b).sum() + pos.numel() * (1 + b)
    kept = kept.reshape(-1)
    last = torch.cummax(torch.where(kept, pos, -1), 0).values  # the last kept position up to each one
    before = torch.cat([torch.full((1,), -1, dtype=torch.int64, device=pos.device), last[:-1]])
    quotients = torch.where(kept, (pos - before - 1).clamp(min=0) >> b, 0)
    return quotients.sum() + kept.sum() * (1 + b)


_ORDER = "positions must be non-negative and strictly increasing"


def golomb_encode(
    positions: torch.Tensor, b: int, flags: list | None = None, total: int | None = None
) -> tuple[torch.Tensor, int]:
    """Golomb–Rice code strictly increasing non-negative ``positions`` with parameter ``b``.

    Returns ``(bytes, total_bits)``: a uint8 tensor of ``ceil(total_bits / 8)`` bytes on the input's device
    and the number of meaningful bits. Raises ConfigError for an invalid ``b`` or positions that are not
    integers, negative, or not strictly increasing.

    The wire's device path reads nothing back: ``flags`` (a list) receives the order check as ``(bool tensor,
    message)`` instead of raising (the positions are then the caller's bug, raised when it reads its checks), and
    ``total``, the stream's length in bits (:func:`golomb_stream_bits`, read with the message's others), sizes the
    stream; without it the length is read here.
    """
    b = _check_b(b, ConfigError)
    pos = _checked_positions(positions)
    device = pos.device
    k = pos.numel()
    if k == 0:
        return torch.empty(0, dtype=torch.uint8, device=device), 0
    gaps = _gaps(pos)
    if flags is not None:
        flags.append(((gaps >= 0).all(), _ORDER))
        gaps = gaps.clamp(min=0)  # refused later; meanwhile a stream of the length golomb_stream_bits gave
    elif bool((gaps < 0).any()):
        raise ConfigError(_ORDER)
    q = gaps >> b
    lengths = q + (1 + b)
    ends = torch.cumsum(lengths, 0)
    if total is None:
        total = int(ends[-1])
    starts = ends - lengths
    # Unary parts: +1 at the start of each run of ones, -1 at its terminating zero; the running sum is then 1
    # exactly on the ones. Runs never touch each other, so no position gets two marks; an empty run (q = 0) writes 0
    # twice at its terminator, where no other code writes (integer indices: no size depends on the data).
    delta = torch.zeros(total + 1, dtype=torch.int8, device=device)
    ones = (q > 0).to(torch.int8)
    delta[starts] = ones
    delta[starts + q] = -ones
    bits = torch.cumsum(delta[:total], 0, dtype=torch.int8).view(torch.uint8)
    if b:
        r = gaps & ((1 << b) - 1)
        rstart = starts + q + 1
        for i in range(b):  # remainder bit i (MSB first); loop over the b bit slots, not over codes
            bits[rstart + i] = ((r >> (b - 1 - i)) & 1).to(torch.uint8)
    return _pack(bits, 1), total


def _code_boundaries(
    bits: torch.Tensor, b: int, count: int, n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the ``count`` codes of the ``n``-bit stream ``bits`` (uint8 0/1) lie: ``(the bit of each code's unary
    terminator, each code's end)``, int64, found by pointer doubling over the zero bits. WireError for a stream cut
    short, one holding more codes than ``count``, or nonzero padding bits."""
    idx_dtype = torch.int32 if n + 2 * MAX_RICE_PARAMETER + 4 < 2**31 else torch.int64
    is_zero = bits == 0
    # Every code ends its unary part with a zero bit, its "terminator". Work on terminator candidates:
    # zpos[j] is the position of the j-th zero bit; rank[i] = number of zeros before bit i, which is the
    # index (into zpos) of the first zero at or after i, or nzeros if there is none.
    zpos = torch.nonzero(is_zero).reshape(-1).to(idx_dtype)
    nzeros = zpos.numel()
    if nzeros < count:
        raise WireError(f"golomb: truncated stream: {count} codes need {count} terminating zero bits, found {nzeros}")
    rank = torch.cat([torch.zeros(1, dtype=idx_dtype, device=device), torch.cumsum(is_zero, 0, dtype=idx_dtype)])
    del is_zero
    # succ[j]: terminator of the code that follows the code terminated by zero j, whose start is
    # zpos[j] + 1 + b; nzeros is an absorbing "no such code" sentinel (ran off the end of the stream).
    nstart = zpos + (1 + b)
    succ = torch.where(nstart < n, rank[torch.clamp(nstart, max=n)], torch.full_like(nstart, nzeros))
    del rank, nstart
    succ = torch.cat([succ, torch.full((1,), nzeros, dtype=idx_dtype, device=device)])
    # The first code starts at bit 0, so its terminator is zero 0. Pointer doubling: with terminators
    # t_0..t_{m-1} known and jump = succ applied m times, t_m..t_{2m-1} = jump[t_0..t_{m-1}].
    term = _orbit(succ, count)
    del succ
    bad = term == nzeros
    if bool(bad.any()):
        j = int(torch.nonzero(bad)[0, 0])
        raise WireError(f"golomb: truncated stream: code {j} of {count} runs past the end of the {n}-bit stream")
    zero_at = zpos[term].to(torch.int64)
    del zpos, term
    ends = zero_at + (1 + b)  # every end but the last is < n by construction of succ
    end = int(ends[-1])
    if end > n:
        raise WireError(
            f"golomb: truncated stream: code {count - 1} of {count} runs past the end of the {n}-bit stream"
        )
    left = n - end
    if left > 7:
        raise WireError(
            f"golomb: {left} bits left after {count} codes (at most 7 padding bits allowed): "
            "the stream holds more codes than expected or is oversized"
        )
    if left and bool(bits[end:].any()):
        raise WireError("golomb: nonzero padding bits after the last code")
    return zero_at, ends


def _positions_from_codes(
    bits: torch.Tensor, zero_at: torch.Tensor, ends: torch.Tensor, b: int, universe: int, device: torch.device
) -> torch.Tensor:
    """The positions the codes between :func:`_code_boundaries`' bits encode: each gap's quotient (the unary run) and
    ``b`` remainder bits, summed; WireError for a position at or past ``universe``."""
    starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), ends[:-1]])
    q = zero_at - starts
    # Clamp q so that q << b cannot overflow; any clamped gap is >= universe and rejected below.
    q = torch.clamp(q, max=(universe >> b) + 1)
    gaps = q << b
    if b:
        r = torch.zeros_like(q)
        for i in range(b):  # b bit slots, MSB first
            r = (r << 1) | bits[zero_at + 1 + i].to(torch.int64)
        gaps = gaps | r
    gaps = torch.clamp(gaps, max=universe)
    positions = torch.cumsum(gaps + 1, 0) - 1
    # Partial sums grow by at most universe + 1 <= 2**62 + 1 per step, so the first position that
    # reaches the universe is exact (no int64 wrap before it) and the max check below catches it.
    last = int(positions.max())
    if last >= universe:
        raise WireError(f"golomb: decoded position {last} is outside the universe [0, {universe})")
    return positions


def golomb_decode(buf: torch.Tensor, b: int, count: int, universe: int, flags: list | None = None) -> torch.Tensor:
    """Decode ``count`` positions in ``[0, universe)`` from a Golomb–Rice stream with parameter ``b``.

    Returns an int64 tensor on the buffer's device. Raises WireError when the stream is truncated, holds
    more codes than ``count`` (more than 7 bits left over), has nonzero padding bits, decodes a position
    ``>= universe``, or when ``count`` or ``b`` is invalid; ConfigError for an invalid ``universe``.

    With ``flags`` (a list: the wire's device path), nothing is read back: the checks that depend on the stream's
    bits are appended to it as one bool tensor (true when the stream is sound) for the caller to read with its
    others, and the positions returned are then meaningful only if it is true, though always in [0, universe) so
    that they can index before the read (see :func:`_decode_deferred`). The
    checks on the sizes alone (count, bytes, b, universe) still raise at once: they read nothing.
    """
    if isinstance(universe, bool) or not isinstance(universe, int) or not 0 <= universe <= MAX_UNIVERSE:
        raise ConfigError(f"universe must be an int in [0, 2**62], got {universe!r}")
    b = _check_b(b, WireError)
    buf = _as_uint8_buffer(buf)
    device = buf.device
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise WireError(f"golomb: invalid position count {count!r}")
    nbytes = buf.numel()
    if count == 0:
        if nbytes:
            raise WireError(f"golomb: {nbytes} bytes given for 0 positions (expected an empty stream)")
        return torch.empty(0, dtype=torch.int64, device=device)
    if count > universe:
        raise WireError(f"golomb: {count} distinct positions cannot fit in a universe of {universe}")
    n = 8 * nbytes
    if count * (1 + b) > n:
        raise WireError(f"golomb: truncated stream: {count} codes need at least {count * (1 + b)} bits, got {n}")
    if n > universe + count * b + 7:
        # A valid stream has sum(q) <= universe - count, hence at most universe + count * b + 7 bits.
        raise WireError(f"golomb: stream of {n} bits is too long for {count} positions below {universe}")
    if flags is not None:
        return _decode_deferred(buf, b, count, universe, n, flags)
    bits = _unpack(buf, 1, n)  # uint8 0/1, length n
    zero_at, ends = _code_boundaries(bits, b, count, n, device)
    return _positions_from_codes(bits, zero_at, ends, b, universe, device)


def _decode_deferred(buf: torch.Tensor, b: int, count: int, universe: int, n: int, flags: list) -> torch.Tensor:
    """:func:`golomb_decode` with no read back: every output size follows from ``count`` and ``n`` (the stream's
    bits), which the caller knows from the section header, and the validity of the stream is appended to
    ``flags`` as one bool tensor instead of being raised.

    ``nonzero`` (whose size, the number of zero bits, depends on the data) is not used: instead of the list of zero
    bits, every bit position ``p`` gets ``nz[p]``, the first zero at or after it (a reverse running minimum), and
    ``step[p] = nz[p] + 1 + b``, where the code after one starting at ``p`` starts; a sentinel ``S = n + 1`` absorbs
    codes that run off the end. Code starts ``s_0 = 0, s_{i+1} = step[s_i]`` follow by pointer doubling as in the
    host decoder, over ``n + 2`` positions instead of the zero bits: ``O(n log count)`` time, ``O(n)`` memory.
    A stream passes exactly when the host decoder accepts it, and then gives the same positions (tests/test_golomb.py).
    """
    device = buf.device
    bits = _unpack(buf, 1, n)  # uint8 0/1, length n
    idx_dtype = torch.int32 if n + 2 * MAX_RICE_PARAMETER + 4 < 2**31 else torch.int64
    sentinel = n + 1
    at = torch.arange(n, dtype=idx_dtype, device=device)
    zeros_at = torch.where(bits == 0, at, torch.full_like(at, sentinel))
    nz = torch.full((n + 2,), sentinel, dtype=idx_dtype, device=device)
    nz[:n] = torch.flip(torch.cummin(torch.flip(zeros_at, (0,)), 0).values, (0,))
    del zeros_at
    nxt = nz + (1 + b)
    step = torch.where(nxt <= n, nxt, torch.full_like(nxt, sentinel))  # step[S] = S: nz[S] = S > n - 1 - b
    del nxt
    starts = _orbit(step, count)
    del step
    zero_at = nz[starts].to(torch.int64)  # each code's terminating zero; S when it has none
    del nz
    ok = (zero_at < n).all()  # every code found its terminator (a code starting at S has none)
    end = zero_at[-1] + (1 + b)  # the last code's end; every other code ends where the next starts
    ok = ok & (end <= n) & (end >= n - 7)  # at most 7 padding bits
    ok = ok & ~(bits.bool() & (at.to(torch.int64) >= end)).any()  # and they are zero
    q = zero_at - starts.to(torch.int64)
    q = torch.clamp(q, max=(universe >> b) + 1)  # as in the host decoder: q << b cannot overflow
    gaps = q << b
    if b:
        r = torch.zeros_like(q)
        for i in range(b):  # b bit slots, MSB first; clamped reads for codes that ran off (their flag is false)
            r = (r << 1) | bits[torch.clamp(zero_at + 1 + i, max=n - 1)].to(torch.int64)
        gaps = gaps | r
    gaps = torch.clamp(gaps, max=universe)
    positions = torch.cumsum(gaps + 1, 0) - 1
    flags.append(ok & (positions.max() < universe))
    return positions.clamp_(max=universe - 1)  # a refused stream's positions stay inside the slot until the read


def _orbit(step: torch.Tensor, count: int) -> torch.Tensor:
    """0, step[0], step[step[0]], ...: the first ``count`` points of 0's orbit under ``step``, by pointer doubling
    (with the first m points known and ``jump`` = step applied m times, the next m are jump of the first m), in
    about log2(count) rounds of gathers with sizes known beforehand: no read back to the host."""
    points = torch.zeros(1, dtype=step.dtype, device=step.device)
    jump = step
    while points.numel() < count:
        points = torch.cat([points, jump[points[: count - points.numel()]]])
        if points.numel() < count:
            jump = jump[jump]
    return points
