"""Sparsification: top-k, random-k and threshold.

- ``topk`` (exact): keep the k = ceil(p·d) entries of largest magnitude (``torch.topk``; ties broken by torch).
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

Choices where papers are silent: k is at least 1 for a non-empty tensor; random-k draws with ``torch.randperm``
on the tensor's device; positions are sorted before encoding so both position codecs apply.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradcomp.compressors.base import (
    Compressor,
    Fields,
    Slot,
    check_bool,
    check_density,
    check_int,
    kept_count,
    shared_generator,
)
from gradcomp.errors import ConfigError
from gradcomp.registry import register
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

    def __init__(self, density: float = 0.01, positions: str = "fixed"):
        self.density = check_density(density)
        self.positions = check_positions_codec(positions)

    def params(self) -> dict:
        return {"density": self.density, "positions": self.positions}

    def specs(self, slot: Slot) -> list[FieldSpec]:
        k = kept_count(self.density, slot.numel)
        return [position_spec(self.positions, slot.numel, k), FieldSpec(Codec.F32, count=k)]

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        flat = x.reshape(-1)
        k = kept_count(self.density, flat.numel())
        _, positions = torch.topk(flat.abs(), k, sorted=False)
        positions, _ = torch.sort(positions)
        return [positions, flat[positions].to(torch.float32)]


@register
class RandomK(Compressor):
    name = "randomk"
    summable = True

    def __init__(self, density: float = 0.01, scale: bool = False, seed: int = 0):
        self.density = check_density(density)
        self.scale = check_bool("scale", scale)
        self.seed = check_int("seed", seed, minimum=0)
        self.unbiased = self.scale  # instance attribute shadows the class default
        self.omega = (1.0 / self.density - 1.0) if self.scale else None

    def params(self) -> dict:
        return {"density": self.density, "scale": self.scale, "seed": self.seed}

    def positions(self, slot: Slot, step: int, device: torch.device) -> Tensor:
        k = kept_count(self.density, slot.numel)
        gen = shared_generator(self.seed, step, slot.index, device, salt="randomk")
        chosen = torch.randperm(slot.numel, generator=gen, device=device)[:k]
        return torch.sort(chosen).values

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return [FieldSpec(Codec.F32, count=kept_count(self.density, slot.numel))]

    def _factor(self, numel: int) -> float:
        k = kept_count(self.density, numel)
        return numel / k if (self.scale and k) else 1.0

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        flat = x.reshape(-1)
        return [flat[self.positions(slot, step, flat.device)].to(torch.float32)]

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        values = fields[0]
        positions = self.positions(slot, step, values.device)
        return scatter_dense(slot.numel, positions, values * self._factor(slot.numel))

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        values = fields[0]
        scatter_add(out, self.positions(slot, step, values.device), values * self._factor(slot.numel))


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
