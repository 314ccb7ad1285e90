"""Worker momentum with error accumulation: the state that sketched SGD and its two top-k baselines share.

Ivkin et al. (NeurIPS 2019) keep, on every worker and for every compressed parameter,

    u ← ρ·u + g        momentum (the method applies it: ``owns_momentum``, the optimizer runs without)
    v ← v + u          error accumulation: everything not yet applied

and, after the exchange, set u and v to zero at the coordinates whose value went into the update (momentum
correction and momentum-factor masking in DGC's words). The three methods differ only in how the k
coordinates are chosen and summed:

- ``sketch`` (``gradcomp.schemes.sketch``): from a summed count sketch, then exact values of P·k candidates;
- ``local_topk`` (``gradcomp.schemes.topk_baselines``): each worker's own k largest, gathered;
- ``true_topk``: the k largest of the dense sum of all workers' v (an oracle that needs a dense allreduce).

This module holds what they share: parameter checks (``k`` or ``density``, ``momentum``, ``min_size``), the
per-slot k, the u and v tensors with their state dict, and the tie-breaking selection ``largest``.

A slot of fewer than ``min_size`` coordinates (a bias, a norm's scale: well under 1 % of a model) is not
compressed: it keeps momentum u ← ρ·u + g and sends u dense in the method's first round, so it gets exactly
momentum SGD on the mean gradient. (Zeroing u at every coordinate sent, i.e. every step, would lose the
momentum.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Slot, check_density, check_int, kept_count
from gradcomp.errors import ConfigError, WireError
from gradcomp.schemes.base import Scheme
from gradcomp.wire import Codec, FieldSpec


class AccumulatingScheme(Scheme):
    """Base of the methods that select k coordinates of worker momentum + error accumulation."""

    owns_momentum = True

    def __init__(self, k: int | None = None, density: float | None = None, momentum: float = 0.9, min_size: int = 1000):
        if k is not None and density is not None:
            raise ConfigError("give k or density, not both")
        self.k = None if k is None else check_int("k", k, minimum=1)
        self.density = None if k is not None else check_density(0.01 if density is None else density)
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not (0.0 <= momentum < 1.0):
            raise ConfigError(f"momentum must be a number in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.min_size = check_int("min_size", min_size, minimum=0)
        self._u: dict[str, Tensor] = {}
        self._v: dict[str, Tensor] = {}

    def params(self) -> dict[str, Any]:
        return {"k": self.k, "density": self.density, "momentum": self.momentum, "min_size": self.min_size}

    # -- sizes ----------------------------------------------------------------------------------------------------

    def kept(self, slot: Slot) -> int:
        """k for a compressed slot, 0 for a slot sent dense; ConfigError for k > d or a malformed slot."""
        d = slot.numel
        if slot.shape is not None and math.prod(slot.shape) != d:
            raise ConfigError(f"{slot.name}: shape {tuple(slot.shape)} does not hold {d} elements")
        if d < max(self.min_size, 1):
            return 0
        if self.k is not None:
            if self.k > d:
                raise ConfigError(f"{slot.name}: k={self.k} is larger than its {d} coordinates")
            return self.k
        return kept_count(self.density, d)  # type: ignore[arg-type]

    def check_slots(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            self.kept(slot)

    # -- state ----------------------------------------------------------------------------------------------------

    @staticmethod
    def key(slot: Slot) -> str:
        return f"{slot.name}#{slot.numel}"

    def _state(self, store: dict[str, Tensor], slot: Slot, device: torch.device) -> Tensor:
        key = self.key(slot)
        t = store.get(key)
        if t is None:
            t = store[key] = torch.zeros(slot.numel, dtype=torch.float32, device=device)
        elif t.device != device:
            t = store[key] = t.to(device)
        return t

    def accumulate(self, slots: Sequence[Slot], tensors: Sequence[Tensor], ks: Sequence[int]):
        """Update u (every slot) and v (compressed slots, k > 0) with this step's gradients; returns (us, vs)."""
        if len(slots) != len(tensors):
            raise ConfigError(f"{len(slots)} slots but {len(tensors)} tensors")
        us: list[Tensor] = []
        vs: list[Tensor | None] = []
        for slot, g, k in zip(slots, tensors, ks):
            u = self._state(self._u, slot, g.device)
            u.mul_(self.momentum).add_(g.reshape(-1).to(torch.float32))
            us.append(u)
            if k:
                vs.append(self._state(self._v, slot, g.device).add_(u))
            else:
                vs.append(None)
        return us, vs

    def retain(self, slots: Sequence[Slot]) -> None:
        keep = {self.key(s) for s in slots}
        self._u = {k: v for k, v in self._u.items() if k in keep}
        self._v = {k: v for k, v in self._v.items() if k in keep}

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentum": {k: v.detach().clone() for k, v in self._u.items()},
            "error": {k: v.detach().clone() for k, v in self._v.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"momentum", "error"}
        if unknown:
            raise ConfigError(f"unexpected {self.name} state keys {sorted(unknown)}")
        loaded = {}
        for part in ("momentum", "error"):
            tensors = dict(state.get(part, {}))
            for key, value in tensors.items():
                if not isinstance(key, str) or not isinstance(value, Tensor):
                    raise ConfigError(f"{self.name} state {part!r}: {key!r} must map a slot key to a tensor")
                try:
                    numel = int(key.rsplit("#", 1)[1])
                except (IndexError, ValueError):
                    raise ConfigError(f"bad {self.name} state key {key!r} (expected '<slot name>#<d>')") from None
                if value.numel() != numel:
                    raise ConfigError(f"{self.name} state {key!r}: {value.numel()} values, expected {numel}")
            loaded[part] = {k: v.detach().to(torch.float32).reshape(-1).clone() for k, v in tensors.items()}
        self._u, self._v = loaded["momentum"], loaded["error"]


def largest(x: Tensor, n: int) -> Tensor:
    """Indices of the n largest |x|, ties broken by the lower index: the same on every worker given the same x.

    ``torch.topk`` makes no promise about *which* of equal values it returns, but the n-th largest value itself
    is well defined. So: every coordinate above it, then the lowest-indexed ones equal to it until there are n
    (ascending order within each group). A stable sort would give the same set at 6–9× the time. A NaN
    counts as the largest magnitude (as in ``torch.topk``), so there are always n.
    """
    if n >= x.numel():
        return torch.arange(x.numel(), device=x.device)
    magnitude = x.abs()
    threshold = torch.topk(magnitude, n, sorted=False).values.min()
    above = (magnitude > threshold).nonzero().flatten()
    ties = (magnitude == threshold).nonzero().flatten()[: n - above.numel()]
    chosen = torch.cat([above, ties])
    if chosen.numel() < n:  # a NaN among the n largest (topk ranks it first) makes the threshold NaN
        return largest(torch.nan_to_num(x, nan=float("inf")), n)
    return chosen


def offsets_of(sizes: Sequence[int]) -> list[int]:
    """Start offsets of consecutive parts of the given sizes, plus the total at the end."""
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def floats_spec(count: int) -> FieldSpec:
    """A section of ``count`` float32 values in a multi-round scheme's container message."""
    return FieldSpec(Codec.F32, count=count)


def indices_spec(count: int) -> FieldSpec:
    """A section of ``count`` coordinates, 32 bits each: the int32 positions these schemes sent before their
    messages were framed, in the same bytes (the order is the sender's, so no sorted-positions codec)."""
    return FieldSpec(Codec.BITS, count=count, width=32)


def split_indices(field: Tensor, counts: Sequence[int], bounds: Sequence[int], what: str) -> list[Tensor]:
    """A decoded ``indices_spec`` field cut into parts of ``counts``, each checked to lie in [0, bound):
    WireError otherwise, before any of them indexes a tensor."""
    starts = offsets_of(counts)
    parts = [field[starts[n] : starts[n + 1]] for n in range(len(counts))]
    for n, (part, bound) in enumerate(zip(parts, bounds)):
        if part.numel() and int(part.max()) >= bound:
            raise WireError(f"{what}: part {n} holds coordinate {int(part.max())}, beyond its {bound}")
    return parts
