"""Sparsification: top-k, random-k, threshold and random-block.

- ``topk`` (exact): keep the k = ceil(p·d) entries of largest magnitude (``torch.topk``; ties broken by
  torch), or a fixed ``k`` per tensor (k > d is an error).
  The message is the sorted positions plus their fp32 values. Positions travel compactly: bit-packed with
  ceil(log2 d) bits each (``positions="fixed"``) or Golomb–Rice coded gaps (``positions="golomb"``, the
  divisor chosen from the density as in Sattler et al.'s SBC paper). Never int64.
- ``randomk``: keep k positions drawn uniformly without replacement from a generator seeded by
  (run seed, step, tensor index), so every worker draws the same positions without talking: no positions on
  the wire, and the values of different workers sum by plain allreduce. ``scale=True`` multiplies the kept
  values by d/k, which makes the compressor unbiased (omega = d/k - 1); the default ``scale=False`` is the
  biased variant usually paired with error feedback.
- ``threshold``: keep every entry with |x| > tau (Strom 2015; the threshold scheme of Eghlidi & Jaggi 2020).
  The count varies per step and per worker, so messages are gathered, not summed.

- ``randomblock`` (Eghlidi & Jaggi 2020): one contiguous block of k coordinates per tensor, its start drawn
  uniformly from [0, d) by a hash of (run seed, step, tensor index): every worker picks the same block
  without talking, selection costs nothing, memory access is contiguous, no positions travel, and the
  blocks sum by plain allreduce. The block wraps around the end of the tensor (then it is two contiguous
  pieces), so every coordinate is covered with probability exactly k/d and ``scale=True`` (×d/k) is
  unbiased; the default is unscaled, for error feedback.

Choices where papers are silent: k is at least 1 for a non-empty tensor; random-k draws its positions on
the tensor's device with ``sample_without_replacement`` (O(k) for small k); positions are sorted before
encoding so both position codecs apply.

Speed (issue "make compressors fast enough"; benchmarks/README.md has the numbers). Top-k selects by a
sampled threshold with exact selection among the few candidates above it (``topk_positions``, shared with
sbc, stc and dgc), falling back to ``torch.topk`` wherever it could not vouch for the same set; threshold and
the candidates' scan run in chunks through reused scratch buffers (``magnitude_candidates``, ``workspace``);
random-k finds its first k distinct draws with one sort (on the CPU, with a bitmap and a radix sort instead:
``kernels.sample_kernel``, the same positions); gathers use ``index_select`` (several times faster
than advanced indexing on the CPU). Every message is bit-identical to what the straightforward torch
expressions produced before (tests/test_wire_stability.py).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from gradcomp import kernels
from gradcomp.compressors.base import (
    Capabilities,
    Compressor,
    Fields,
    SizedSelection,
    Slot,
    check_bool,
    check_density,
    check_int,
    compress_each,
    kept_count,
    shared_generator,
    shared_seed,
)
from gradcomp.errors import ConfigError
from gradcomp.wire import Codec, FieldSpec
from gradcomp.wire.bits import bits_needed, host_device, host_path

POSITION_CODECS = {"fixed": Codec.POSITIONS, "golomb": Codec.GOLOMB}


def position_spec(positions: str, universe: int, count: int | None = None) -> FieldSpec:
    """Wire spec of a sorted position list: exact ``count`` if known, else at most ``universe`` entries."""
    codec = POSITION_CODECS[positions]
    if count is None:
        return FieldSpec(codec, max_count=universe, universe=universe)
    return FieldSpec(codec, count=count, universe=universe)


def check_positions_codec(positions: str) -> str:
    if positions not in POSITION_CODECS:
        raise ConfigError(f"positions must be one of {sorted(POSITION_CODECS)}, got {positions!r}")
    return positions


class KeptCount:
    """How many entries a sparsifier keeps per slot: a density p (k = ceil(p·d)) or a fixed count k."""

    def __init__(self, density: float | None, k: int | None, default_density: float = 0.01):
        if density is not None and k is not None:
            raise ConfigError("give either density or k, not both")
        self.k = check_int("k", k, minimum=1) if k is not None else None
        self.density = None if self.k is not None else check_density(default_density if density is None else density)

    def params(self) -> dict:
        return {"k": self.k} if self.k is not None else {"density": self.density}

    def __call__(self, slot: Slot) -> int:
        if self.k is None:
            return kept_count(self.density, slot.numel)
        if self.k > slot.numel:
            raise ConfigError(f"k={self.k} exceeds the {slot.numel} elements of {slot.name}")
        return self.k


def sample_without_replacement(n: int, k: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """k distinct positions drawn uniformly from range(n), in increasing order; O(k) work when k is small.

    For k >= n/4 a permutation's prefix. Otherwise draw with replacement, in rounds of about 1.25·k, and keep
    the first k distinct values in draw order: the first k distinct values of an i.i.d. uniform sequence are
    a uniform k-subset. (A full ``randperm(n)`` to keep 1 % does about n / k times the work.) The answer is a
    function of the generator's stream alone, so it is looked for in a prefix of the first round first, just
    longer than k (``_draw_sizes``): the first k distinct values lie there unless more than about k²/n draws
    repeat. Drawing a round in two calls draws the same numbers as in one.

    On the CPU with the compiled kernels, from 4097 positions and down to a density of 1/1024
    (``kernels.sample``), they are found with a bitmap of n bits and a radix sort instead
    (``_first_distinct_compiled``): the same draws, the same positions. Otherwise, which values are the first
    k distinct ones is found with ONE stable sort of the draws (32-bit keys where n
    allows): among equal values the earliest draw comes first, so each distinct value's first draw is known,
    and the k values whose first draws come earliest are those whose first draw is at most the k-th smallest
    first draw. They come out of the sort already in increasing order. The draws are the same numbers as
    ever, so the positions are those of every earlier version (tests/test_wire_stability.py); only the
    generator may be left further back (fewer numbers drawn), which matters to no caller: random-k seeds a
    fresh generator per slot and step.

    The device path (``wire.bits.host_device`` False) reads nothing back, so it cannot decide how many rounds to
    draw: it draws the first two rounds at once and finds their first k distinct values with sizes known in
    advance (``_first_distinct_fixed``): the same positions whenever those draws hold k distinct values. They hold
    about 1.86·k of them on average (2.5·k + 32 uniform draws from more than 4·k positions), so fewer than k is
    vanishingly rare; in that event the missing positions are the smallest ones not drawn (still k distinct
    positions, the same on every worker, but not uniform in that event alone).
    """
    if 4 * k >= n:
        return torch.sort(torch.randperm(n, generator=gen, device=device)[:k]).values
    if not host_device(device):
        return _first_distinct_fixed(n, k, gen, device)
    marker = kernels.sample(n, k) if host_device(device) else None
    if marker is not None:
        return _first_distinct_compiled(marker, n, k, gen)
    draws = torch.empty(0, dtype=torch.int64, device=device)
    rounds = _draw_sizes(n, k)
    while True:
        draws = torch.cat([draws, torch.randint(n, (next(rounds),), generator=gen, device=device)])
        keys = draws.to(torch.int32) if n <= 2**31 else draws
        ordered, order = torch.sort(keys, stable=True)
        if _numpy_path(ordered):  # the same steps in numpy: its masks and compress cost a fraction of torch's
            s, o = ordered.numpy(), order.numpy()
            first = np.empty(s.size, dtype=np.bool_)
            first[0] = True
            np.not_equal(s[1:], s[:-1], out=first[1:])
            distinct = int(np.count_nonzero(first))
            if distinct < k:
                continue
            if distinct > k:
                # The k-th distinct value is first drawn at index j = k − 1 + (repeats drawn before j), a
                # repeat being a draw of a value drawn earlier (not first in its group: the sort is stable).
                # Repeats are few (about k²/2n): a fixed-point iteration over their sorted indices finds j.
                repeats = np.sort(np.compress(~first, o))
                j = k - 1
                while (moved := k - 1 + int(np.searchsorted(repeats, j, side="right"))) != j:
                    j = moved
                np.logical_and(first, o <= j, out=first)
            return torch.from_numpy(np.compress(first, s).astype(np.int64))
        first = torch.ones(ordered.numel(), dtype=torch.bool, device=device)
        torch.ne(ordered[1:], ordered[:-1], out=first[1:])
        distinct = int(first.sum())
        if distinct >= k:
            break
    values, first_draw = ordered[first], order[first]
    if distinct > k:
        cutoff = torch.kthvalue(first_draw, k).values
        values = values[first_draw <= cutoff]
    return values.to(torch.int64)


def _first_distinct_fixed(n: int, k: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """``sample_without_replacement`` (0 < 4k < n) on the device path: the first two rounds of draws, the first k
    distinct values among them (ascending) with no host read: a stable sort, each value's first draw, the k-th
    earliest of those (``kthvalue``), and ``nonzero_static`` of the mask of the values first drawn by then."""
    round_size, sizes, drawn = k + k // 4 + 16, [], 0
    for size in _draw_sizes(n, k):  # the host path's calls, in its order, up to two full rounds
        if drawn >= 2 * round_size:
            break
        sizes.append(size)
        drawn += size
    draws = torch.cat([torch.randint(n, (size,), generator=gen, device=device) for size in sizes])
    keys = draws.to(torch.int32) if n <= 2**31 else draws
    ordered, order = torch.sort(keys, stable=True)
    first = torch.ones(drawn, dtype=torch.bool, device=device)
    torch.ne(ordered[1:], ordered[:-1], out=first[1:])  # the earliest draw of each value (the sort is stable)
    first_draw = torch.where(first, order, torch.full_like(order, drawn))  # (drawn: past every draw)
    cutoff = torch.kthvalue(first_draw, k).values  # the k-th distinct value's first draw (drawn if fewer than k)
    chosen = first & (order <= cutoff)
    have = chosen.sum()  # k, unless the draws hold fewer distinct values
    values = ordered[torch.nonzero_static(chosen, size=k, fill_value=0).flatten()].to(torch.int64)
    # fewer than k (see the caller): the smallest positions not drawn (among the first 2k, at most k − 1 drawn)
    candidates = torch.arange(min(n, 2 * k), device=device, dtype=ordered.dtype)
    at = torch.searchsorted(ordered, candidates).clamp_(max=drawn - 1)
    free = torch.nonzero_static(ordered[at] != candidates, size=k, fill_value=0).flatten()
    rank = torch.arange(k, device=device)
    missing = candidates[free[(rank - have).clamp_(min=0)]].to(torch.int64)
    return torch.sort(torch.where(rank < have, values, missing)).values


def _first_distinct_compiled(marker, n: int, k: int, gen: torch.Generator) -> Tensor:
    """``sample_without_replacement``'s positions from the same rounds of draws, found with a bitmap of n bits
    and a radix sort (kernels/sample_kernel.py) instead of a stable sort of the draws: the same positions.

    Memory per call: the bitmap's n/8 bytes (1.25 MB for 10M entries; ``kernels.sample`` keeps it to at most
    1024 bits per position, 16 times the draws' 8 bytes each) and two int64 arrays of k."""
    bitmap = np.zeros((n + 63) // 64, dtype=np.uint64)
    distinct, scratch = np.empty(k, dtype=np.int64), np.empty(k, dtype=np.int64)
    found = 0
    for size in _draw_sizes(n, k):
        draws = torch.randint(n, (size,), generator=gen).numpy()
        found = marker.mark_first_distinct(draws, bitmap, found, k, distinct)
        if found == k:
            break
    return torch.from_numpy(marker.radix_sort(distinct, scratch, bits_needed(n)))


def _draw_sizes(n: int, k: int):
    """Sizes of the successive ``randint`` calls of ``sample_without_replacement``: its rounds of
    k + k // 4 + 16 draws, the first split into a prefix of k plus about twice the expected number of repeats
    among k draws (k²/2n) and the rest of the round."""
    size = k + k // 4 + 16
    prefix = min(size, k + k * k // n + 64)
    yield prefix
    if size > prefix:
        yield size - prefix
    while True:
        yield size


def scatter_add(out: Tensor, positions: Tensor, values: Tensor) -> None:
    out.index_add_(0, positions, values.to(out.dtype))


def scatter_dense(numel: int, positions: Tensor, values: Tensor) -> Tensor:
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    out[positions] = values.to(torch.float32)
    return out


# ------------------------------------------------------------------------------------- selection helpers
#
# Shared by the top-k family (topk, threshold, sbc, stc, dgc). A float32 CPU tensor is scanned in chunks of
# _CHUNK entries through small per-thread scratch buffers (numpy's comparison and flatnonzero kernels, which
# on one thread run several times faster than torch's bool comparison and nonzero): no d-sized temporary is
# allocated, and fresh multi-megabyte tensors are what costs most on the CPU (their pages are faulted in and
# zeroed on first touch, which costs more than the arithmetic on them: docs/host_performance.md). Other devices
# and dtypes use the plain torch expressions, which give the same positions.

_CHUNK = 1 << 18  # entries per chunk: 1 MB of float32 scratch plus 256 kB of mask, cache-resident
FAST_MIN = 1 << 16  # smaller tensors use torch.topk / nonzero directly: fixed costs would dominate
_SAMPLE_KEPT = 256  # the sampled threshold keeps about this many sampled values (the expected count)


class _Workspace(threading.local):
    def __init__(self) -> None:
        self.buffers: dict[tuple, Tensor] = {}


_WORKSPACE = _Workspace()


def workspace(tag: str, numel: int, dtype: torch.dtype) -> Tensor:
    """A CPU scratch tensor of ``numel`` entries, reused by every later call with the same tag on this thread.

    Grow-only; one per (tag, dtype) and thread, so compressors running in several threads (the simulated
    cluster, the DDP hook's communication thread) never share one. The contents are garbage.
    """
    key = (tag, dtype)
    buf = _WORKSPACE.buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        _WORKSPACE.buffers[key] = buf
    return buf[:numel]


def _numpy_path(t: Tensor) -> bool:
    """Whether the helpers below do their work in numpy (CPU tensors) or in torch ops (any device).

    Both give the same results; tests switch the numpy path off to check the torch one on the CPU.
    """
    return host_path(t)


def magnitude_candidates(flat: Tensor, tau: float | Tensor, mode: str = "ge") -> Tensor:
    """Increasing int64 positions i of the 1-D ``flat`` with |flat[i]| >= tau (``"ge"``), > tau (``"gt"``), or
    >= tau or NaN (``"ge_or_nan"``: NaN counts as the largest magnitude, as in ``torch.topk``).

    ``tau`` is compared in ``flat``'s dtype (a Python float is rounded to float32 for float32 input, exactly as
    torch compares a float32 tensor with a Python scalar). It may be a 0-d tensor of ``flat``'s dtype on the torch
    path (not on the CPU's numpy path): the threshold then need not be read back from a GPU.
    """
    if not (_numpy_path(flat) and flat.dtype == torch.float32 and flat.numel() >= FAST_MIN):
        magnitude = flat.abs()
        if mode == "gt":
            mask = magnitude > tau
        elif mode == "ge":
            mask = magnitude >= tau
        else:
            mask = ~(magnitude < tau)
        return torch.nonzero(mask).reshape(-1)
    x = flat.detach().contiguous().numpy()
    d = x.size
    width = min(d, _CHUNK)
    scratch = workspace("magnitude", width, torch.float32).numpy()
    mask = workspace("mask", width, torch.bool).numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        t = np.float32(tau)
    parts = []
    for start in range(0, d, _CHUNK):
        piece = x[start : start + _CHUNK]
        a, m = scratch[: piece.size], mask[: piece.size]
        np.abs(piece, out=a)
        with np.errstate(invalid="ignore"):
            if mode == "gt":
                np.greater(a, t, out=m)
            elif mode == "ge":
                np.greater_equal(a, t, out=m)
            else:
                np.less(a, t, out=m)
                np.logical_not(m, out=m)
        found = np.flatnonzero(m)
        if found.size:
            found += start
            parts.append(found)
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=flat.device)
    return torch.from_numpy(np.concatenate(parts) if len(parts) > 1 else parts[0]).to(torch.int64)


def keep_largest(positions: Tensor, scores: Tensor, k: int) -> tuple[Tensor, Tensor] | None:
    """(positions, scores) of the k largest ``scores``, in the given (increasing) position order.

    The k largest form one set unless the k-th largest score is tied with an unselected one, or a score is NaN;
    then which of the tied entries ``torch.topk`` keeps is its own choice, and None is returned so that the
    caller can ask torch.topk itself (the same call as before, on the same tensor: the same pick). With k or
    fewer candidates all of them are returned. On the CPU numpy does the work (on arrays of about k entries
    its selection and compress kernels cost a fraction of torch's kthvalue and boolean indexing).
    """
    c = positions.numel()
    if c <= k:
        return positions, scores
    if _numpy_path(positions):
        p, v = positions.detach().numpy(), scores.detach().numpy()
        if np.isnan(v).any():
            return None
        keep = v >= np.partition(v, c - k)[c - k]
        if int(np.count_nonzero(keep)) != k:
            return None
        return torch.from_numpy(np.compress(keep, p)), torch.from_numpy(np.compress(keep, v))
    kth = torch.kthvalue(scores, c - k + 1).values
    keep = scores >= kth
    # one read for both conditions (a GPU waits once), and no boolean indexing: the count is then known to be k
    nan, kept = torch.stack([torch.isnan(scores).any().to(torch.int64), keep.sum()]).tolist()
    if nan or kept != k:
        return None
    at = compact(keep, k)
    return positions[at], scores[at]


def compact(mask: Tensor, count: int) -> Tensor:
    """Increasing int64 indices of the ``count`` true entries of the 1-D bool ``mask`` (``count`` known to the
    caller): what ``torch.nonzero`` gives, with an output size that does not depend on the data, so that a GPU need
    not tell the host how many there are. Each true entry is scattered to its rank among the true ones; the false
    ones all go to one spare slot past the end, dropped."""
    rank = torch.cumsum(mask, 0) - 1
    rank = torch.where(mask, rank, torch.full_like(rank, count))
    out = torch.empty(count + 1, dtype=torch.int64, device=mask.device)
    out.scatter_(0, rank, torch.arange(mask.numel(), dtype=torch.int64, device=mask.device))
    return out[:count]


def strided_sample(flat: Tensor, k: int) -> Tensor:
    """About ``_SAMPLE_KEPT · d / k`` evenly spaced entries of ``flat``, always a new tensor (never a view: callers
    work on it in place): a sample expected to hold about ``_SAMPLE_KEPT`` of the k largest. Evenly spaced
    rather than random: no generator to draw from, and a layered gradient is sampled in every layer; the
    selection stays exact whatever the sample (see :func:`topk_positions`)."""
    d = flat.numel()
    n = min(d, max(4096, math.ceil(_SAMPLE_KEPT * d / max(1, k))))
    stride = d // n
    return flat[stride // 2 :: stride][:n].clone(memory_format=torch.contiguous_format)


def sample_rank(n: int, k: int, d: int, margin: float = 4.0) -> int:
    """How many of n sampled values to keep so that, w.h.p., at least k of d entries pass the threshold.

    The number of the k largest entries that fall into a uniform sample is about Binomial(n, k/d); keeping its
    mean plus ``margin`` standard deviations (and 4) makes a threshold below the k-th largest entry unless
    the sample is ``margin`` sigmas off.
    """
    mean = n * k / d
    return min(n, math.ceil(mean + margin * math.sqrt(mean) + 4))


def kth_largest(values: Tensor, r: int) -> float:
    """The r-th largest of ``values`` (a 1-D float tensor, 1 <= r <= numel; NaN counts as largest) as a float."""
    n = values.numel()
    if _numpy_path(values):
        return float(np.partition(values.detach().numpy(), n - r)[n - r])
    return float(torch.kthvalue(values, n - r + 1).values)


def fast_topk_applies(flat: Tensor, k: int) -> bool:
    """Whether :func:`topk_positions` takes its sampled path: a float32 CPU tensor of at least FAST_MIN entries
    and k <= d / 64, where ``torch.topk`` on the CPU takes its slow partial-sort path (and returns its values in
    decreasing order, which sbc and stc rely on to reproduce their means bit for bit)."""
    d = flat.numel()
    return host_path(flat) and flat.dtype == torch.float32 and d >= FAST_MIN and 0 < 64 * k <= d


def topk_positions(flat: Tensor, k: int) -> Tensor:
    """Increasing int64 positions of the k entries of largest |x|: the set ``torch.topk(flat.abs(), k)`` picks.

    Sampled threshold, then exact selection among the few candidates above it: tau is the r-th largest
    magnitude of :func:`strided_sample` (r from :func:`sample_rank`), the candidates are every entry with
    |x| >= tau or NaN (one chunked pass), and the k largest candidates (:func:`keep_largest`) are the top k
    of the whole tensor, because every other entry is below tau. Whenever that argument does not hold — fewer
    than k candidates (twice: the second try keeps four times as many sampled values), a tie at the k-th
    largest magnitude, a NaN, tau = 0 — the answer is ``torch.topk`` over everything, as it always was. So the
    positions are identical to those of ``torch.topk`` in every case (tests/test_wire_stability.py).
    """
    if fast_topk_applies(flat, k):
        d = flat.numel()
        sample = strided_sample(flat, k).abs_()
        r = sample_rank(sample.numel(), k, d)
        for _ in range(2):
            tau = kth_largest(sample, r)
            if not tau > 0.0:  # zero (mostly-zero tensor: ties) or NaN
                break
            candidates = magnitude_candidates(flat, tau, "ge_or_nan")
            if candidates.numel() >= k:
                kept = keep_largest(candidates, torch.index_select(flat, 0, candidates).abs_(), k)
                if kept is not None:
                    return kept[0]
                break
            r = min(sample.numel(), 4 * r)
    return torch.sort(torch.topk(flat.abs(), k, sorted=False).indices).values


class _PositionsAndValues(Compressor):
    """Shared decoding of messages made of [sorted positions, fp32 values]."""

    capabilities = Capabilities(accumulate=True, sent_entries=True)

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        positions, values = fields
        return scatter_dense(slot.numel, positions, values)

    def sent_entries(self, fields: Fields, slot: Slot, step: int) -> tuple[Tensor, Tensor]:
        positions, values = fields
        return positions, values.to(torch.float32)

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        positions, values = fields
        scatter_add(out, positions, values)


class TopK(_PositionsAndValues):
    capabilities = _PositionsAndValues.capabilities
    name = "topk"

    def __init__(self, density: float | None = None, positions: str = "fixed", *, k: int | None = None):
        self.count = KeptCount(density, k)
        self.positions = check_positions_codec(positions)

    def params(self) -> dict:
        return {**self.count.params(), "positions": self.positions}

    @property
    def density(self) -> float | None:
        """The configured density (None when a fixed k was given)."""
        return self.count.density

    def specs(self, slot: Slot) -> list[FieldSpec]:
        k = self.count(slot)
        return [position_spec(self.positions, slot.numel, k), FieldSpec(Codec.F32, count=k)]

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        flat = x.reshape(-1)
        positions = topk_positions(flat, self.count(slot))
        return [positions, torch.index_select(flat, 0, positions).to(torch.float32)]


class _SharedRandomSelection(Compressor):
    """k coordinates chosen from a seed all workers share: values only on the wire, summable by allreduce.

    ``scale=True`` multiplies the values by d/k, which is unbiased when every coordinate is chosen with
    probability k/d (omega = d/k - 1; with a fixed k it depends on d, so no single value is declared).
    """

    summable = True
    nan_in_result = True  # a NaN value of the summed message lands at its (shared) position of the average

    def __init__(
        self, density: float | None = None, scale: bool = False, seed: int = 0, *, k: int | None = None
    ):
        self.count = KeptCount(density, k)
        self.scale = check_bool("scale", scale)
        self.seed = check_int("seed", seed, minimum=0)
        self.unbiased = self.scale  # instance attribute shadows the class default
        self.omega = (1.0 / self.count.density - 1.0) if (self.scale and self.count.density) else None

    def params(self) -> dict:
        return {**self.count.params(), "scale": self.scale, "seed": self.seed}

    @property
    def density(self) -> float | None:
        """The configured density (None when a fixed k was given)."""
        return self.count.density

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [FieldSpec(Codec.F32, count=self.count(slot))]

    def _factor(self, slot: Slot) -> float:
        k = self.count(slot) if slot.numel else 0
        return slot.numel / k if (self.scale and k) else 1.0


class RandomK(_SharedRandomSelection):
    capabilities = Capabilities(accumulate=True, sent_entries=True)
    name = "randomk"

    def __init__(
        self, density: float | None = None, scale: bool = False, seed: int = 0, *, k: int | None = None
    ):
        super().__init__(density, scale, seed, k=k)
        self._cache_step: int | None = None
        self._cache: dict[tuple, Tensor] = {}

    def positions(self, slot: Slot, step: int, device: torch.device) -> Tensor:
        """The k shared positions of this slot and step.

        Cached for every slot of the latest step: compress, error feedback and the decode of the summed
        message all ask, and at layer granularity the decode comes after every slot was compressed.
        """
        if step != self._cache_step:
            self._cache_step, self._cache = step, {}
        key = (slot.index, slot.numel, str(device))
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        gen = shared_generator(self.seed, step, slot.index, device, salt="randomk")
        positions = sample_without_replacement(slot.numel, self.count(slot), gen, device)  # increasing
        self._cache[key] = positions
        return positions

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        flat = x.reshape(-1)
        return [torch.index_select(flat, 0, self.positions(slot, step, flat.device)).to(torch.float32)]

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        values = fields[0]
        positions = self.positions(slot, step, values.device)
        return scatter_dense(slot.numel, positions, values * self._factor(slot))

    def sent_entries(self, fields: Fields, slot: Slot, step: int) -> tuple[Tensor, Tensor]:
        values = fields[0]
        return self.positions(slot, step, values.device), (values * self._factor(slot)).to(torch.float32)

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        values = fields[0]
        scatter_add(out, self.positions(slot, step, values.device), values * self._factor(slot))


class Threshold(_PositionsAndValues):
    capabilities = dataclasses.replace(_PositionsAndValues.capabilities, select_sized=True, compress_slots=True)
    name = "threshold"

    def __init__(self, threshold: float = 1e-3, positions: str = "fixed"):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise ConfigError(f"threshold must be a positive finite number, got {threshold!r}")
        threshold = float(threshold)
        if not threshold > 0.0 or threshold == float("inf"):
            raise ConfigError(f"threshold must be a positive finite number, got {threshold}")
        self.threshold = threshold
        self.positions = check_positions_codec(positions)

    def params(self) -> dict:
        return {"threshold": self.threshold, "positions": self.positions}

    def specs(self, slot: Slot) -> list[FieldSpec]:
        # one value per position: the decoder refuses sections whose counts disagree
        values = FieldSpec(Codec.F32, max_count=slot.numel, same_count_as=-1)
        return [position_spec(self.positions, slot.numel), values]

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        flat = x.reshape(-1)
        positions = magnitude_candidates(flat, self.threshold, "gt")
        return [positions, torch.index_select(flat, 0, positions).to(torch.float32)]

    def compress_slots(self, tensors: Sequence[Tensor], slots: Sequence[Slot], step: int) -> list[Fields]:
        """The slots' selections with ONE read of their sizes on the torch path (a GPU's): every slot's mask
        |x| > threshold first, their counts stacked and read together, then each slot's positions by
        :func:`compact` with its count known (what ``compress`` would have read slot by slot through ``nonzero``).
        The masks of all the slots are alive at once meanwhile (one byte per entry). The CPU's numpy path keeps
        ``compress``."""
        flats = [x.reshape(-1) for x in tensors]
        if not flats or _numpy_path(flats[0]):
            return compress_each(self, tensors, slots, step)
        masks = [flat.abs() > self.threshold for flat in flats]
        counts = torch.stack([mask.sum() for mask in masks]).tolist()  # the one read of this message's counts
        return self._compacted(flats, masks, counts)

    def select_sized(self, tensors: Sequence[Tensor], slots: Sequence[Slot], step: int) -> SizedSelection | None:
        """The masks |x| > threshold of every slot with their counts left on the device; the positions are
        compacted once the caller has read the counts (with the size exchange). Fixed-width positions only: a
        Golomb stream's length depends on the positions themselves (None, then ``compress_slots``)."""
        if self.positions != "fixed":
            return None
        flats = [x.reshape(-1) for x in tensors]
        masks = [flat.abs() > self.threshold for flat in flats]
        counts = [mask.sum() for mask in masks]

        def finish(values: list[int]) -> list[Fields]:
            return self._compacted(flats, masks, values[::2])  # (the positions' count, then the values')

        return SizedSelection([[c, c] for c in counts], finish)

    @staticmethod
    def _compacted(flats: list[Tensor], masks: list[Tensor], counts: Sequence[int]) -> list[Fields]:
        out = []
        for flat, mask, count in zip(flats, masks, counts):
            positions = compact(mask, count)
            out.append([positions, torch.index_select(flat, 0, positions).to(torch.float32)])
        return out


class RandomBlock(_SharedRandomSelection):
    """One contiguous block of k coordinates per tensor, placed by a seed every worker shares."""

    capabilities = Capabilities(accumulate=True, sent_entries=True)
    name = "randomblock"

    def start(self, slot: Slot, step: int) -> int:
        """The block's first coordinate, uniform in [0, d), the same on every worker."""
        return shared_seed(self.seed, step, slot.index, "randomblock") % slot.numel

    def _pieces(self, slot: Slot, step: int) -> list[tuple[int, int]]:
        """(start, length) of the one or two contiguous pieces of the (wrapping) block."""
        start, k = self.start(slot, step), self.count(slot)
        head = min(k, slot.numel - start)
        return [(start, head)] + ([(0, k - head)] if k > head else [])

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        if slot.numel == 0:
            return [torch.zeros(0, dtype=torch.float32, device=x.device)]
        flat = x.reshape(-1)
        return [torch.cat([flat[a : a + n] for a, n in self._pieces(slot, step)]).to(torch.float32)]

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        out = torch.zeros(slot.numel, dtype=torch.float32, device=fields[0].device)
        self.accumulate(fields, slot, step, out)
        return out

    def sent_entries(self, fields: Fields, slot: Slot, step: int) -> tuple[Tensor, Tensor]:
        values = fields[0]
        if slot.numel == 0:
            return torch.zeros(0, dtype=torch.int64, device=values.device), values.to(torch.float32)
        positions = [torch.arange(a, a + n, device=values.device) for a, n in self._pieces(slot, step)]
        scaled = values.to(torch.float32) * self._factor(slot)
        return torch.cat(positions), torch.zeros_like(scaled).add_(scaled)  # 0 + v, as decompress adds into zeros

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        if slot.numel == 0:
            return
        values, done = fields[0].to(out.dtype) * self._factor(slot), 0
        for a, n in self._pieces(slot, step):
            out[a : a + n] += values[done : done + n]
            done += n
