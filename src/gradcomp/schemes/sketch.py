"""Sketched SGD: count sketches of the accumulated momentum, then the exact values of the heavy candidates.

Ivkin, Rothchild, Ullah, Braverman, Stoica, Arora, "Communication-efficient Distributed SGD with Sketching",
NeurIPS 2019 (arXiv:1903.04488); the variant of SPEC.md section 5.

    gradcomp.make("sketch", density=0.01)
    gradcomp train --compressor sketch --param density=0.01

Per step, on every worker, for every compressed slot (d coordinates, k = ``k`` or ceil(density·d)):

    u ← ρ·u + g                    momentum, kept on the worker (``owns_momentum``: the optimizer runs without)
    v ← v + u                      error accumulation, kept on the worker
    round 1: S = allreduce-sum(sketch(v))             one allreduce of every slot's r×c sketch
             candidates = the P·k largest |estimates of S|   the same on every worker (same S, stable order)
    round 2: V = allreduce-sum(v[candidates])          one allreduce of every slot's P·k exact values
             g̃ = (the k largest |V| among the candidates) / W, zero elsewhere
    u, v ← 0 where g̃ is nonzero; the slot's result is g̃ (dense)

``rounds=1`` skips round 2: g̃ is the k largest |estimates of S| divided by W (the sketch's estimates, not
exact values); u and v are zeroed there as well.

Per step a worker hands 4·(Σ r·c over compressed slots + Σ d over uncompressed slots) bytes to round 1 and
4·Σ min(P·k, d) bytes to round 2: two allreduces, whatever the number of slots.

Choices (each a parameter):

- **Count sketch** (``gradcomp.compressors.countsketch``): random hash tables drawn from the shared seed
  and the slot's index, built once per slot and cached; the docstring there says why that family.
- ``rows`` (default 5, as in the paper's experiments): the median over 5 rows fails only when 3 of 5
  independent rows are badly hit, so one bad collision does not move an estimate.
- ``cols`` (default per slot: min(10·k, ⌊d / (2·rows)⌋), at least 1): a count-sketch row estimates a
  coordinate within about ‖v_tail‖₂/√c, so c = k/ε² columns find the coordinates whose square exceeds
  ε²·‖tail‖²/k; 10·k is ε² = 0.1. Capped so that the sketch is at most half the vector it compresses: a
  larger sketch would cost more than sending the slot. A ``cols`` given explicitly is used for every
  compressed slot; a sketch larger than its slot (rows·cols > d) is a ConfigError. Measured worst case
  (k equal heavy coordinates planted in N(0, 1) noise, d = 20,000, k = 200, defaults): in 2 of 20 seeds one
  of the 200 was not among the candidates — it shared buckets with other heavy ones in 3 of the 5 rows and
  its median estimate cancelled out. It is not lost: it stays in v and goes out at a later step.
- ``candidates`` P (default 10): round 2 costs P·k floats, a fifth of the default sketch (5·10·k); it must be
  large enough that the true top k sit among the P·k largest estimates although the estimates are noisy by
  about the k-th value itself: with P = 10 a heavy coordinate is missed only if 9·k light ones are
  estimated above it. P·k is capped at d.
- ``min_size`` (default 1000): a slot of fewer coordinates (a bias, a norm's scale: well under 1 % of a
  model) is sent as it is in round 1's allreduce: its sketch would save next to nothing. Such a slot keeps
  momentum u ← ρ·u + g and sends u, so it gets exactly momentum SGD on the mean gradient (the sketched
  rule would zero u at every coordinate it sends, i.e. every step, and lose the momentum).
- **Ties** in both selections are broken by the lower coordinate (a stable sort), so every worker, given
  the same summed values, takes the same coordinates.
- **Mean**: sums are divided by W after the allreduce (g̃ is the mean of the workers' v at the selected
  coordinates).

State (``state_dict``): u and v of every compressed slot and u of every uncompressed one, keyed by
``"<slot name>#<d>"``. The hash tables are derived from the seed and are not saved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradcomp.catalog import register
from gradcomp.compressors.base import Slot, check_density, check_int, kept_count
from gradcomp.compressors.countsketch import CountSketch
from gradcomp.errors import ConfigError
from gradcomp.schemes.base import Scheme
from gradcomp.schemes.requests import AllReduce, Rounds


@dataclass(frozen=True)
class SlotPlan:
    """How one slot travels: sketched (k, cols, P·k candidates) or dense (k = cols = candidates = 0)."""

    compressed: bool
    k: int = 0
    cols: int = 0
    candidates: int = 0


@register
class SketchedSGD(Scheme):
    name = "sketch"
    owns_momentum = True

    def __init__(
        self,
        k: int | None = None,
        density: float | None = None,
        rows: int = 5,
        cols: int | None = None,
        candidates: int = 10,
        momentum: float = 0.9,
        rounds: int = 2,
        seed: int = 0,
        min_size: int = 1000,
    ):
        if k is not None and density is not None:
            raise ConfigError("give k or density, not both")
        self.k = None if k is None else check_int("k", k, minimum=1)
        self.density = None if k is not None else check_density(0.01 if density is None else density)
        self.rows = check_int("rows", rows, minimum=1)
        self.cols = None if cols is None else check_int("cols", cols, minimum=1)
        self.candidates = check_int("candidates", candidates, minimum=1)
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not (0.0 <= momentum < 1.0):
            raise ConfigError(f"momentum must be a number in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.rounds = check_int("rounds", rounds, minimum=1)
        if self.rounds not in (1, 2):
            raise ConfigError(f"rounds must be 1 or 2, got {rounds}")
        self.seed = check_int("seed", seed, minimum=0)
        self.min_size = check_int("min_size", min_size, minimum=0)
        self._u: dict[str, Tensor] = {}
        self._v: dict[str, Tensor] = {}
        self._sketches: dict[tuple[str, int, int, torch.device], CountSketch] = {}
        # the last step's selection per compressed slot name: (candidates, the k coordinates sent); diagnostics
        self.last_selection: dict[str, tuple[Tensor, Tensor]] = {}

    def params(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "density": self.density,
            "rows": self.rows,
            "cols": self.cols,
            "candidates": self.candidates,
            "momentum": self.momentum,
            "rounds": self.rounds,
            "seed": self.seed,
            "min_size": self.min_size,
        }

    # -- sizes ----------------------------------------------------------------------------------------------------

    def plan(self, slot: Slot) -> SlotPlan:
        """The slot's k, columns and number of candidates; ConfigError for sizes that cannot work."""
        d = slot.numel
        if slot.shape is not None and math.prod(slot.shape) != d:
            raise ConfigError(f"{slot.name}: shape {tuple(slot.shape)} does not hold {d} elements")
        if d < max(self.min_size, 1):
            return SlotPlan(compressed=False)
        if self.k is not None:
            if self.k > d:
                raise ConfigError(f"{slot.name}: k={self.k} is larger than its {d} coordinates")
            k = self.k
        else:
            k = kept_count(self.density, d)  # type: ignore[arg-type]
        if self.cols is None:
            cols = max(1, min(10 * k, d // (2 * self.rows)))
        else:
            cols = self.cols
        if self.rows * cols > d:
            raise ConfigError(
                f"{slot.name}: a {self.rows}×{cols} sketch ({self.rows * cols} floats) is larger than the "
                f"{d} coordinates it compresses"
            )
        return SlotPlan(compressed=True, k=k, cols=cols, candidates=min(self.candidates * k, d))

    def check_slots(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            self.plan(slot)

    @staticmethod
    def _key(slot: Slot) -> str:
        return f"{slot.name}#{slot.numel}"

    def _sketch(self, slot: Slot, cols: int, device: torch.device) -> CountSketch:
        key = (self._key(slot), slot.index, cols, device)
        cs = self._sketches.get(key)
        if cs is None:
            cs = CountSketch(slot.numel, self.rows, cols, self.seed, slot.index, device)
            self._sketches[key] = cs
        return cs

    def _state(self, store: dict[str, Tensor], slot: Slot, device: torch.device) -> Tensor:
        key = self._key(slot)
        t = store.get(key)
        if t is None or t.device != device:
            t = torch.zeros(slot.numel, dtype=torch.float32, device=device) if t is None else t.to(device)
            store[key] = t
        return t

    # -- the rounds -----------------------------------------------------------------------------------------------

    def run(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        if not slots:
            return []
        if len(slots) != len(tensors):
            raise ConfigError(f"{len(slots)} slots but {len(tensors)} tensors")
        plans = [self.plan(s) for s in slots]  # raises before anything is sent
        device = tensors[0].device
        world = self.world_size

        # momentum and error accumulation; round 1's buffer: sketches of v, then the dense slots' u
        sizes = [self.rows * p.cols if p.compressed else s.numel for s, p in zip(slots, plans)]
        buf = torch.empty(sum(sizes), dtype=torch.float32, device=device)
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        us, vs, sketches = [], [], []
        for i, (slot, plan, g) in enumerate(zip(slots, plans, tensors)):
            u = self._state(self._u, slot, device)
            u.mul_(self.momentum).add_(g.reshape(-1).to(torch.float32))
            us.append(u)
            part = buf[offsets[i] : offsets[i + 1]]
            if plan.compressed:
                v = self._state(self._v, slot, device)
                v.add_(u)
                cs = self._sketch(slot, plan.cols, device)
                cs.sketch(v, out=part)
                vs.append(v)
                sketches.append(cs)
            else:
                part.copy_(u)
                vs.append(None)
                sketches.append(None)
        summed = yield AllReduce(buf, inplace=True)

        out: list[Tensor] = [torch.empty(0)] * len(slots)
        chosen: list[Tensor | None] = [None] * len(slots)
        candidates: list[Tensor | None] = [None] * len(slots)
        for i, (slot, plan) in enumerate(zip(slots, plans)):
            part = summed[offsets[i] : offsets[i + 1]]
            if not plan.compressed:
                out[i] = part.div(world)
                continue
            estimates = sketches[i].estimate(part)
            take = plan.candidates if self.rounds == 2 else plan.k
            chosen[i] = _largest(estimates, take)
            candidates[i] = chosen[i]
            if self.rounds == 1:
                result = torch.zeros(slot.numel, dtype=torch.float32, device=device)
                result[chosen[i]] = estimates[chosen[i]].div_(world)
                out[i] = result
        if self.rounds == 2 and any(p.compressed for p in plans):
            values = torch.cat([vs[i][c] for i, c in enumerate(chosen) if c is not None])
            exact = yield AllReduce(values, inplace=True)
            pos = 0
            for i, (slot, plan) in enumerate(zip(slots, plans)):
                if not plan.compressed:
                    continue
                c = chosen[i]
                vals = exact[pos : pos + c.numel()]
                pos += c.numel()
                top = _largest(vals, plan.k)
                result = torch.zeros(slot.numel, dtype=torch.float32, device=device)
                result[c[top]] = vals[top].div(world)
                chosen[i] = c[top]
                out[i] = result
        self.last_selection = {}
        for i, plan in enumerate(plans):
            if plan.compressed:
                self.last_selection[slots[i].name] = (candidates[i], chosen[i])
                us[i][chosen[i]] = 0.0
                vs[i][chosen[i]] = 0.0
        return out

    # -- state ----------------------------------------------------------------------------------------------------

    def retain(self, slots: Sequence[Slot]) -> None:
        keep = {self._key(s) for s in slots}
        self._u = {k: v for k, v in self._u.items() if k in keep}
        self._v = {k: v for k, v in self._v.items() if k in keep}
        self._sketches = {k: v for k, v in self._sketches.items() if k[0] in keep}

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentum": {k: v.detach().clone() for k, v in self._u.items()},
            "error": {k: v.detach().clone() for k, v in self._v.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"momentum", "error"}
        if unknown:
            raise ConfigError(f"unexpected sketch state keys {sorted(unknown)}")
        loaded = {}
        for part in ("momentum", "error"):
            tensors = dict(state.get(part, {}))
            for key, value in tensors.items():
                if not isinstance(key, str) or not isinstance(value, Tensor):
                    raise ConfigError(f"sketch state {part!r}: {key!r} must map a slot key to a tensor")
                try:
                    numel = int(key.rsplit("#", 1)[1])
                except (IndexError, ValueError):
                    raise ConfigError(f"bad sketch state key {key!r} (expected '<slot name>#<d>')") from None
                if value.numel() != numel:
                    raise ConfigError(f"sketch state {key!r}: {value.numel()} values, expected {numel}")
            loaded[part] = {k: v.detach().to(torch.float32).reshape(-1).clone() for k, v in tensors.items()}
        self._u, self._v = loaded["momentum"], loaded["error"]


def _largest(x: Tensor, n: int) -> Tensor:
    """Indices of the n largest |x|, ties broken by the lower index (a stable sort): the same on every worker."""
    if n >= x.numel():
        return torch.arange(x.numel(), device=x.device)
    order = torch.sort(x.abs(), descending=True, stable=True).indices
    return order[:n]
