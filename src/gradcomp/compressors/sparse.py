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
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradcomp.catalog import register
from gradcomp.compressors.base import (
    Compressor,
    Fields,
    Slot,
    check_bool,
    check_density,
    check_int,
    kept_count,
    shared_generator,
    shared_seed,
)
from gradcomp.errors import ConfigError
from gradcomp.wire import Codec, FieldSpec

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

    def fraction(self, numel: int) -> float:
        """The density for a tensor of ``numel`` elements (k / d when a fixed k is given)."""
        return self.density if self.k is None else self.k / max(1, numel)


def sample_without_replacement(n: int, k: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """k distinct positions drawn uniformly from range(n), in O(k) work when k is small.

    For k >= n/4 a permutation's prefix. Otherwise draw with replacement, in rounds of about 1.25·k, and keep
    the first k distinct values in draw order: the first k distinct values of an i.i.d. uniform sequence are
    a uniform k-subset. (A full ``randperm(n)`` to keep 1 % costs 100× more.)
    """
    if 4 * k >= n:
        return torch.randperm(n, generator=gen, device=device)[:k]
    draws = torch.empty(0, dtype=torch.int64, device=device)
    while True:
        draws = torch.cat([draws, torch.randint(n, (k + k // 4 + 16,), generator=gen, device=device)])
        values, inverse = torch.unique(draws, return_inverse=True)
        if values.numel() >= k:
            break
    order = torch.arange(draws.numel(), device=device)
    first = torch.full((values.numel(),), draws.numel(), dtype=torch.int64, device=device)
    first.scatter_reduce_(0, inverse, order, reduce="amin")
    return values[torch.argsort(first)[:k]]


def scatter_add(out: Tensor, positions: Tensor, values: Tensor) -> None:
    out.index_add_(0, positions, values.to(out.dtype))


def scatter_dense(numel: int, positions: Tensor, values: Tensor) -> Tensor:
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    out[positions] = values.to(torch.float32)
    return out


class _PositionsAndValues(Compressor):
    """Shared decoding of messages made of [sorted positions, fp32 values]."""

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        positions, values = fields
        return scatter_dense(slot.numel, positions, values)

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        positions, values = fields
        scatter_add(out, positions, values)


@register
class TopK(_PositionsAndValues):
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
        k = self.count(slot)
        _, positions = torch.topk(flat.abs(), k, sorted=False)
        positions, _ = torch.sort(positions)
        return [positions, flat[positions].to(torch.float32)]


class _SharedRandomSelection(Compressor):
    """k coordinates chosen from a seed all workers share: values only on the wire, summable by allreduce.

    ``scale=True`` multiplies the values by d/k, which is unbiased when every coordinate is chosen with
    probability k/d (omega = d/k - 1; with a fixed k it depends on d, so no single value is declared).
    """

    summable = True

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


@register
class RandomK(_SharedRandomSelection):
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
        positions = torch.sort(sample_without_replacement(slot.numel, self.count(slot), gen, device)).values
        self._cache[key] = positions
        return positions

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        flat = x.reshape(-1)
        return [flat[self.positions(slot, step, flat.device)].to(torch.float32)]

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        values = fields[0]
        positions = self.positions(slot, step, values.device)
        return scatter_dense(slot.numel, positions, values * self._factor(slot))

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        values = fields[0]
        scatter_add(out, self.positions(slot, step, values.device), values * self._factor(slot))


@register
class Threshold(_PositionsAndValues):
    name = "threshold"

    def __init__(self, threshold: float = 1e-3, positions: str = "fixed"):
        threshold = float(threshold)
        if not threshold > 0.0 or threshold == float("inf"):
            raise ConfigError(f"threshold must be a positive finite number, got {threshold}")
        self.threshold = threshold
        self.positions = check_positions_codec(positions)

    def params(self) -> dict:
        return {"threshold": self.threshold, "positions": self.positions}

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [position_spec(self.positions, slot.numel), FieldSpec(Codec.F32, max_count=slot.numel)]

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        flat = x.reshape(-1)
        positions = torch.nonzero(flat.abs() > self.threshold).reshape(-1)
        return [positions, flat[positions].to(torch.float32)]


@register
class RandomBlock(_SharedRandomSelection):
    """One contiguous block of k coordinates per tensor, placed by a seed every worker shares."""

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

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        if slot.numel == 0:
            return
        values, done = fields[0].to(out.dtype) * self._factor(slot), 0
        for a, n in self._pieces(slot, step):
            out[a : a + n] += values[done : done + n]
            done += n
