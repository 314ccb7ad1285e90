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

This module holds what they share: parameter checks (``k`` or ``density``, ``min_size``), the per-slot k,
the tie-breaking selection ``largest`` and the sections of their container messages. The u and v tensors,
their arithmetic and their state dict are ``gradcomp.compressors.state.Momentum`` (shared with DGC's momentum correction).

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
from gradcomp.errors import ConfigError
from gradcomp.schemes.base import Scheme
from gradcomp.compressors.state import Momentum
from gradcomp.wire import Codec, FieldSpec
from gradcomp.wire.bits import host_path
from gradcomp.wire.refusals import check_received


class AccumulatingScheme(Scheme):
    """Base of the methods that select k coordinates of worker momentum + error accumulation."""

    owns_momentum = True

    def __init__(self, k: int | None = None, density: float | None = None, momentum: float = 0.9, min_size: int = 1000):
        if k is not None and density is not None:
            raise ConfigError("give k or density, not both")
        self.k = None if k is None else check_int("k", k, minimum=1)
        self.density = None if k is not None else check_density(0.01 if density is None else density)
        self.min_size = check_int("min_size", min_size, minimum=0)
        self.memory = Momentum(momentum, self.name, fields=("momentum", "error"))  # u and v per slot

    momentum = property(lambda self: self.memory.momentum)

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

    def accumulate(self, slots: Sequence[Slot], tensors: Sequence[Tensor], ks: Sequence[int]):
        """Update u (every slot) and v (compressed slots, k > 0) with this step's gradients; returns (us, vs)."""
        if len(slots) != len(tensors):
            raise ConfigError(f"{len(slots)} slots but {len(tensors)} tensors")
        steps = [self.memory.step(slot, g.reshape(-1).to(torch.float32), bool(k)) for slot, g, k in zip(slots, tensors, ks)]
        return [u for u, _ in steps], [v for _, v in steps]

    def retain(self, slots: Sequence[Slot]) -> None:
        self.memory.state.retain(slots)

    def state_dict(self) -> dict[str, Any]:
        return self.memory.state.state_dict()

    def restore_where(self, snapshot: dict[str, Any], bad: Tensor) -> bool:
        return self.memory.state.restore_where(snapshot, bad)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory.state.load_state_dict(state)


def largest(x: Tensor, n: int) -> Tensor:
    """Indices of the n largest |x|, ties broken by the lower index: the same on every worker given the same x.

    ``torch.topk`` makes no promise about *which* of equal values it returns, but the n-th largest value itself
    is well defined. So: every coordinate above it, then the lowest-indexed ones equal to it until there are n
    (ascending order within each group). A stable sort would give the same set at several times the cost. A NaN
    counts as the largest magnitude (as in ``torch.topk``), so there are always n.

    On the device path (``wire.bits.host_path`` False) nothing is read back: the n chosen coordinates are the
    ``nonzero_static`` (a known size) of the mask "above, or among the first n − #above ties" (the ties ranked by
    a cumulative sum), put in the same order by a stable sort of n flags; the same indices in the same order.
    """
    if n >= x.numel():
        return torch.arange(x.numel(), device=x.device)
    if not host_path(x):
        return _largest_on_device(x, n)
    magnitude = x.abs()
    threshold = torch.topk(magnitude, n, sorted=False).values.min()
    above = (magnitude > threshold).nonzero().flatten()
    ties = (magnitude == threshold).nonzero().flatten()[: n - above.numel()]
    chosen = torch.cat([above, ties])
    if chosen.numel() < n:  # a NaN among the n largest (topk ranks it first) makes the threshold NaN
        return largest(torch.nan_to_num(x, nan=float("inf")), n)
    return chosen


def _largest_on_device(x: Tensor, n: int) -> Tensor:
    """``largest`` (0 < n < d) with sizes known in advance: no host synchronisation."""
    magnitude = x.abs().nan_to_num_(nan=float("inf"))  # a NaN ranks first, as in torch.topk (and as largest's retry)
    threshold = torch.topk(magnitude, n, sorted=False).values.min()
    above = magnitude > threshold
    ties = magnitude == threshold
    room = n - above.sum()  # how many ties are taken: the lowest-indexed ones
    chosen = above | (ties & (torch.cumsum(ties, 0) <= room))  # exactly n
    index = torch.nonzero_static(chosen, size=n).flatten()
    return index[torch.sort(ties[index].to(torch.uint8), stable=True).indices]  # those above first, then the ties


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
    WireError otherwise, before any of them indexes a tensor.

    On the device path the check is handed to the decoding step's one read (``wire.refusals.check_received``;
    read at once where no step collects checks) and the parts are clamped into range, so that a bad coordinate
    never indexes out of bounds before that read raises (a sound message is unchanged by the clamp)."""
    starts = offsets_of(counts)
    parts = [field[starts[n] : starts[n + 1]] for n in range(len(counts))]
    if not host_path(field):
        for n, (part, bound) in enumerate(zip(parts, bounds)):
            if part.numel():
                check_received(part.max() < bound, f"{what}: part {n} holds a coordinate beyond its {bound}")
        return [part.clamp(0, max(bound - 1, 0)) for part, bound in zip(parts, bounds)]
    for n, (part, bound) in enumerate(zip(parts, bounds)):
        if part.numel() and int(part.max()) >= bound:  # (inside refusing_later: noted, the part made harmless)
            check_received(False, f"{what}: part {n} holds coordinate {int(part.max())}, beyond its {bound}")
            parts[n] = part.clamp(0, max(bound - 1, 0))
    return parts
