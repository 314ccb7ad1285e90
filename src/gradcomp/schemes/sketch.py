"""Sketched SGD: count sketches of the accumulated momentum, then the exact values of the heavy candidates.

Ivkin, Rothchild, Ullah, Braverman, Stoica, Arora, "Communication-efficient Distributed SGD with Sketching",
NeurIPS 2019 (arXiv:1903.04488): the two-round variant with worker momentum, below.

    gradcomp.make("sketch", density=0.01)
    gradcomp train --compressor sketch --param density=0.01 [--topology ps]

Per step, on every worker, for every compressed slot (d coordinates, k = ``k`` or ceil(density·d)):

    u ← ρ·u + g, v ← v + u          worker momentum and error accumulation (``gradcomp.schemes.accumulation``;
                                     ``owns_momentum``: the optimizer runs without momentum)
    round 1: S = Σ_workers sketch(v)                     one allreduce of every slot's r×c sketch
             candidates = the P·k largest |estimates of S|   the same on every worker (same S, stable order)
    round 2: V = Σ_workers v[candidates]                 one allreduce of every slot's P·k exact values
             g̃ = (the k largest |V| among the candidates) / W, zero elsewhere
    u, v ← 0 where g̃ is nonzero; the slot's result is g̃ (dense)

Zeroing follows the reference code (``u[weightUpdate.nonzero()] = 0``): a selected coordinate whose sum is
exactly 0 (the workers' v cancel, or every v is 0 there and it was taken as a tie) applied nothing, so it keeps
its u and v; zeroing them would drop momentum that has not gone out.

``rounds=1`` skips round 2 (as FetchSGD does): g̃ is the k largest |estimates of S| divided by W (the sketch's
estimates, not exact values). u is zeroed where g̃ is nonzero, but v is not: every worker subtracts g̃ from
its v, so the sum of the workers' v drops by exactly what was applied, and what the estimate missed (or
overshot) stays to go out later. This is FetchSGD's error accumulation (S_e ← S_e − S(Δ)) written on the
workers' side, which the sketch's linearity makes the same thing. Zeroing v instead, as round 2's exact
values allow, loses the estimation error for good: it made the default MNIST job diverge (docs/methods/sketch.md).

**Whole slots.** With two rounds and P·k ≥ d every coordinate is a candidate, so the sketch would decide
nothing: such a slot sends v itself in round 1 instead of a sketch (d floats, beside the dense slots' u) and
takes the k largest of the summed v at once. That is what round 2 would have given (the exact sums of all d
coordinates, the same tie rule: true top-k), bit for bit on the simulated cluster; the slot takes no part in
round 2, and a step with no other compressed slot has no round 2 (then it costs exactly true_topk's bytes).

Topologies. ``allreduce`` (the default): two allreduces per step, whatever the number of slots (one when no
slot is sketched, or with ``rounds=1``); a worker hands 4·(Σ r·c over sketched slots + Σ d over whole and dense
slots) bytes to round 1 and 4·Σ P·k over sketched slots to round 2, and receives as much. ``ps`` (``--topology
ps``; the paper's server, through ``protocols.parameter_server``): the root gathers round 1 and sums it (in
rank order), broadcasts the sketched slots' candidates' coordinates (32 bits each), gathers the workers' exact
values there, and broadcasts the result: the dense slots' sums and, per compressed slot, k float32 values and k
coordinates. Up per worker: 4·(sketch + whole + dense + P·k) bytes; down: 4·P·k + 4·dense + 8·k (P·k over
sketched slots); each of these messages is a container (``gradcomp.wire``: checksummed, every section checked
against the sizes the receiver expects, coordinates against their slot's size), which adds 20 bytes and 10 per
section (one or two). ``rounds=1`` over ps sends no candidates: one gather, one broadcast.

Choices (each a parameter):

- **Count sketch** (``gradcomp.compressors.countsketch``): random hash tables drawn from the scheme's ``seed``
  parameter (default 0, the same on every worker; ``--param seed=N``; the run's own seed does not reach it) and
  the slot's index, built once per slot and cached; the docstring there says why that family.
- ``rows`` (default 5, as in the paper's experiments): the median over 5 rows fails only when 3 of 5
  independent rows are badly hit, so one bad collision does not move an estimate.
- ``cols`` (default per slot: min(10·k, ⌊d / (2·rows)⌋)): a count-sketch row estimates a coordinate within
  about ‖v_tail‖₂/√c, so c = k/ε² columns find the coordinates whose square exceeds ε²·‖tail‖²/k; 10·k is
  ε² = 0.1. Capped so that the sketch is at most half the vector it compresses: a larger sketch would cost
  more than sending the slot. A slot of d < 2·rows coordinates (reachable only with ``min_size`` below
  2·rows) has no sketch within that cap (⌊d / (2·rows)⌋ = 0 columns) and goes dense, like a slot under
  ``min_size``. A ``cols`` given explicitly is used for every compressed slot; a sketch larger
  than its slot (rows·cols > d) is a ConfigError. A heavy coordinate that shares buckets with other heavy ones
  in most rows can miss the candidates (docs/methods/sketch.md has the worst case measured); it is not lost: it
  stays in v and goes out at a later step.
- ``candidates`` P (default 10): round 2 costs P·k floats, a fifth of the default sketch (5·10·k); it must be
  large enough that the true top k sit among the P·k largest estimates although the estimates are noisy by
  about the k-th value itself: with P = 10 a heavy coordinate is missed only if 9·k light ones are
  estimated above it. P·k is capped at d; at d the slot is whole (above).
- ``min_size`` (default 1000): smaller slots go dense in round 1 (see ``gradcomp.schemes.accumulation``).
- **Ties** in both selections are broken by the lower coordinate (a stable sort), so every worker, given
  the same summed values, takes the same coordinates.
- **Mean**: sums are divided by W after the allreduce (g̃ is the mean of the workers' v at the selected
  coordinates).

The paper's compression factor, 2d / (sketch size + P·k + k) (d + k for a whole slot), is
``paper_compression(slots)``; gradcomp's is measured from the bytes that crossed the process group, like every
other method's.

State (``state_dict``): u and v of every compressed slot and u of every dense one, keyed by
``"<slot name>#<d>"``. The hash tables are derived from the seed and are not saved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Slot, check_int
from gradcomp.compressors.countsketch import CountSketch
from gradcomp.errors import ConfigError
from gradcomp.protocols import parameter_server
from gradcomp.schemes.accumulation import (
    AccumulatingScheme,
    floats_spec,
    indices_spec,
    largest,
    offsets_of,
    split_indices,
)
from gradcomp.transport.requests import AllReduce, Rounds
from gradcomp.compressors.state import slot_key
from gradcomp.wire import decode, encode, encoded_size

DEFAULT_COLS_PER_K = 10.0  # table columns per selected coordinate when cols is not given


@dataclass(frozen=True)
class SlotPlan:
    """How one slot travels: compressed (k, cols, P·k candidates) or dense (k = cols = candidates = 0).

    A compressed slot whose candidates are all of its coordinates (P·k ≥ d, two rounds) is ``whole``: its v is
    sent in round 1 instead of a sketch, and it takes no part in round 2.
    """

    compressed: bool
    k: int = 0
    cols: int = 0
    candidates: int = 0
    whole: bool = False

    @property
    def sketched(self) -> bool:
        return self.compressed and not self.whole


class SketchedSGD(AccumulatingScheme):
    name = "sketch"
    topologies = ("allreduce", "ps")

    def __init__(
        self,
        k: int | None = None,
        density: float | None = None,
        rows: int = 5,
        cols: int | None = None,
        cols_per_k: float | None = None,
        candidates: int = 10,
        momentum: float = 0.9,
        rounds: int = 2,
        seed: int = 0,
        min_size: int = 1000,
    ):
        super().__init__(k=k, density=density, momentum=momentum, min_size=min_size)
        self.rows = check_int("rows", rows, minimum=1)
        self.cols = None if cols is None else check_int("cols", cols, minimum=1)
        if cols is not None and cols_per_k is not None:
            raise ConfigError(f"give cols ({cols}) or cols_per_k ({cols_per_k}), not both: cols would win unseen")
        if cols_per_k is None:
            cols_per_k = DEFAULT_COLS_PER_K
        if isinstance(cols_per_k, bool) or not isinstance(cols_per_k, (int, float)) or not cols_per_k > 0:
            raise ConfigError(f"cols_per_k must be a positive number, got {cols_per_k!r}")
        self.cols_per_k = float(cols_per_k)
        self.candidates = check_int("candidates", candidates, minimum=1)
        self.rounds = check_int("rounds", rounds, minimum=1)
        if self.rounds not in (1, 2):
            raise ConfigError(f"rounds must be 1 or 2, got {rounds}")
        self.seed = check_int("seed", seed, minimum=0)
        self.topology, self.root = "allreduce", 0
        self._sketches: dict[tuple[str, int, int, torch.device], CountSketch] = {}
        self._candidates: dict[int, Tensor] = {}  # this step's candidates per compressed slot (position in slots)
        # the last step's selection per compressed slot name: (candidates, the k coordinates sent); diagnostics
        self.last_selection: dict[str, tuple[Tensor, Tensor]] = {}

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "rows": self.rows,
            "cols": self.cols,
            "cols_per_k": None if self.cols is not None else self.cols_per_k,  # unused beside cols
            "candidates": self.candidates,
            "rounds": self.rounds,
            "seed": self.seed,
        }

    def use_topology(self, topology: str, root: int = 0) -> None:
        if topology not in self.topologies:
            raise ConfigError(f"{self.name!r} runs over {' or '.join(self.topologies)}, not {topology!r}")
        self.topology, self.root = topology, check_int("root", root, minimum=0)

    def bind(self, rank: int, world_size: int) -> None:
        if self.topology == "ps" and self.root >= world_size:
            raise ConfigError(f"parameter-server root {self.root} is not a rank of a world of size {world_size}")
        super().bind(rank, world_size)

    # -- sizes ----------------------------------------------------------------------------------------------------

    def plan(self, slot: Slot) -> SlotPlan:
        """The slot's k, columns and number of candidates; ConfigError for sizes that cannot work."""
        k = self.kept(slot)
        if not k:
            return SlotPlan(compressed=False)
        d = slot.numel
        if self.cols is not None:
            cols = self.cols
        else:
            cols = min(math.ceil(self.cols_per_k * k), d // (2 * self.rows))
            if cols < 1:  # d < 2·rows: no sketch is at most half the slot, so it goes dense
                return SlotPlan(compressed=False)
        if self.rows * cols > d:
            raise ConfigError(
                f"{slot.name}: a {self.rows}×{cols} sketch ({self.rows * cols} floats) is larger than the "
                f"{d} coordinates it compresses"
            )
        candidates = min(self.candidates * k, d)
        whole = self.rounds == 2 and candidates == d
        return SlotPlan(compressed=True, k=k, cols=cols, candidates=candidates, whole=whole)

    def check_slots(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            self.plan(slot)

    def paper_compression(self, slots: Sequence[Slot]) -> float:
        """The paper's compression factor 2d / (sketch size + P·k + k) over the compressed slots (d + k if whole)."""
        plans = [self.plan(s) for s in slots]
        d = sum(s.numel for s, p in zip(slots, plans) if p.compressed)
        cost = sum(
            (p.candidates if p.whole else self.rows * p.cols + (p.candidates if self.rounds == 2 else 0)) + p.k
            for p in plans
        )
        return 2 * d / cost if cost else 1.0

    def _sketch(self, slot: Slot, cols: int, device: torch.device) -> CountSketch:
        key = (slot_key(slot), slot.index, cols, device)
        cs = self._sketches.get(key)
        if cs is None:
            cs = self._sketches[key] = CountSketch(slot.numel, self.rows, cols, self.seed, slot.index, device)
        return cs

    # -- the rounds -----------------------------------------------------------------------------------------------

    def defers_verdict(self, slots: Sequence[Slot]) -> bool:
        return self.topology == "allreduce"  # fixed sizes; over ``ps`` the root reads the gathered verdict itself

    def run(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        if not slots:
            return []
        plans = [self.plan(s) for s in slots]  # raises before anything is sent
        us, vs = self.accumulate(slots, tensors, [p.k for p in plans])
        device = us[0].device
        squeezed = [i for i, p in enumerate(plans) if p.compressed]
        dense = [i for i, p in enumerate(plans) if not p.compressed]

        # round 1, in slot order in one float32 buffer: a sketch of v per sketched slot, v itself per whole slot,
        # u per dense slot
        sizes = [self.rows * p.cols if p.sketched else s.numel for s, p in zip(slots, plans)]
        offsets = offsets_of(sizes)
        buf = torch.empty(offsets[-1], dtype=torch.float32, device=device)
        sketches: dict[int, CountSketch] = {}
        for i, (slot, plan) in enumerate(zip(slots, plans)):
            part = buf[offsets[i] : offsets[i + 1]]
            if plan.sketched:
                sketches[i] = self._sketch(slot, plan.cols, device)
                sketches[i].sketch(vs[i], out=part)  # type: ignore[arg-type]
            elif plan.whole:
                part.copy_(vs[i])  # type: ignore[arg-type]
            else:
                part.copy_(us[i])
        if self.topology == "allreduce":
            summed = yield AllReduce(buf, inplace=True)
            selected = yield from self._select_allreduce(slots, plans, vs, sketches, summed, offsets)
        else:
            selected = yield from self._select_ps(slots, plans, vs, sketches, buf, offsets)
        # selected: per slot, (coordinates, summed values) for compressed slots, the summed dense u otherwise

        world = self.world_size
        out: list[Tensor] = []
        for i, slot in enumerate(slots):
            if i in dense:
                out.append(selected[i].div(world))
                continue
            coords, values = selected[i]
            result = torch.zeros(slot.numel, dtype=torch.float32, device=device)
            result[coords] = values.div(world)
            out.append(result)
            # a selected sum can be exactly 0: nothing went out there (a mask, not a boolean index: sizes known)
            applied = result[coords]
            if self.rounds == 2:
                self.memory.sent(slot, coords, only=applied != 0)  # u, v = 0 where something went out
            else:  # an estimate went out: the rest of the sum (or an overshoot) stays in the accumulation
                self.memory.sent(slot, coords, applied)  # (subtracting a 0 leaves v as it was)
        self.last_selection = {
            slots[i].name: (self._candidates.get(i, selected[i][0]), selected[i][0]) for i in squeezed
        }
        return out

    def _candidates_of(self, sketches, i: int, plan: SlotPlan, table: Tensor) -> tuple[Tensor, Tensor]:
        """(coordinates, estimates there) of the slot's P·k (rounds=2) or k (rounds=1) largest estimates."""
        estimates = sketches[i].estimate(table)
        take = plan.candidates if self.rounds == 2 else plan.k
        coords = largest(estimates, take)
        return coords, estimates[coords]

    def _whole(self, plan: SlotPlan, summed_v: Tensor) -> tuple[Tensor, Tensor]:
        """(coordinates, sums there) of the k largest of a whole slot's summed v: round 2's result, at once."""
        top = largest(summed_v, plan.k)
        return top, summed_v[top]

    def _select_allreduce(self, slots, plans, vs, sketches, summed, offsets) -> Rounds:
        """Every worker holds the summed sketch: the same candidates; round 2 allreduces their exact values."""
        selected: list[Any] = [None] * len(slots)
        self._candidates = {}
        order = []  # the slots that need round 2
        for i, plan in enumerate(plans):
            part = summed[offsets[i] : offsets[i + 1]]
            if not plan.compressed:
                selected[i] = part
            elif plan.whole:
                selected[i] = self._whole(plan, part)
                self._candidates[i] = torch.arange(part.numel(), device=part.device)
            else:
                selected[i] = self._candidates_of(sketches, i, plan, part)
                self._candidates[i] = selected[i][0]
                order.append(i)
        if self.rounds == 1 or not order:
            return selected
        values = torch.cat([vs[i][self._candidates[i]] for i in order])
        exact = yield AllReduce(values, inplace=True)
        pos = 0
        for i in order:
            coords = self._candidates[i]
            vals = exact[pos : pos + coords.numel()]
            pos += coords.numel()
            top = largest(vals, plans[i].k)
            selected[i] = (coords[top], vals[top])
        return selected

    def _select_ps(self, slots, plans, vs, sketches, buf, offsets) -> Rounds:
        """A parameter server at ``root`` (``protocols.parameter_server``, once or twice): it sums the round-1
        messages and, with two rounds, sends the sketched slots' candidates and sums their exact values; its
        last message holds the dense slots' sums and, per compressed slot, the k float32 values and coordinates.
        Every message is a container (``gradcomp.wire``) of float32 and 32-bit coordinate sections."""
        device, world = buf.device, self.world_size
        squeezed = [i for i, p in enumerate(plans) if p.compressed]
        sketched = [i for i in squeezed if not plans[i].whole] if self.rounds == 2 else []  # need round 2
        dense = [i for i, p in enumerate(plans) if not p.compressed]
        self._candidates = {i: torch.arange(slots[i].numel, device=device) for i in squeezed if plans[i].whole}
        chosen: dict[int, tuple[Tensor, Tensor]] = {}  # the server's, per compressed slot
        summed: list[Tensor] = []
        n_k = sum(plans[i].k for i in squeezed)
        last = [floats_spec(sum(slots[i].numel for i in dense) + n_k), indices_spec(n_k)]

        def result() -> Tensor:  # the server's last message
            floats = torch.cat([summed[0][offsets[i] : offsets[i + 1]] for i in dense] + [chosen[i][1] for i in squeezed])
            return encode([floats, torch.cat([chosen[i][0] for i in squeezed] + [_no_ints(device)])], last)

        def sketches_in(buffers: list[Tensor]) -> Tensor:
            summed.append(_sum_in_rank_order([decode(b, up)[0] for b in buffers]))
            for i in squeezed:
                part = summed[0][offsets[i] : offsets[i + 1]]
                chosen[i] = self._whole(plans[i], part) if plans[i].whole else self._candidates_of(sketches, i, plans[i], part)
            return encode([torch.cat([chosen[i][0] for i in sketched])], candidates) if sketched else result()

        def values_in(buffers: list[Tensor]) -> Tensor:
            exact = _sum_in_rank_order([decode(b, values_specs)[0] for b in buffers])
            for n, i in enumerate(sketched):
                vals = exact[starts[n] : starts[n + 1]]
                top = largest(vals, plans[i].k)
                chosen[i] = (self._candidates[i][top], vals[top])
            return result()

        up = [floats_spec(buf.numel())]
        lengths = [plans[i].candidates for i in sketched]
        starts = offsets_of(lengths)
        candidates, values_specs = [indices_spec(starts[-1])], [floats_spec(starts[-1])]
        down = last if not sketched else candidates
        message = yield from parameter_server(self.rank, encode([buf], up), sketches_in, self.root,
                                              [encoded_size(up)] * world, encoded_size(down))  # fmt: skip
        if sketched:
            (flat,) = decode(message, candidates)
            parts = split_indices(flat, lengths, [slots[i].numel for i in sketched], "sketch candidates")
            self._candidates.update(zip(sketched, parts))
            values = torch.cat([vs[i][self._candidates[i]] for i in sketched])
            message = yield from parameter_server(self.rank, encode([values], values_specs), values_in, self.root,
                                                  [encoded_size(values_specs)] * world, encoded_size(last))  # fmt: skip
        floats, ints = decode(message, last)
        coords = split_indices(ints, [plans[i].k for i in squeezed], [slots[i].numel for i in squeezed], "sketch result")
        starts = offsets_of([slots[i].numel for i in dense] + [plans[i].k for i in squeezed])
        parts = [floats[starts[n] : starts[n + 1]] for n in range(len(starts) - 1)]
        selected: list[Any] = [None] * len(slots)
        for i, part in zip(dense, parts):
            selected[i] = part
        for i, c, part in zip(squeezed, coords, parts[len(dense) :]):
            selected[i] = (c, part)
        return selected

    # -- state ----------------------------------------------------------------------------------------------------

    def retain(self, slots: Sequence[Slot]) -> None:
        super().retain(slots)
        keep = {slot_key(s) for s in slots}
        self._sketches = {k: v for k, v in self._sketches.items() if k[0] in keep}


def _sum_in_rank_order(tensors: Sequence[Tensor]) -> Tensor:
    total = tensors[0].clone()
    for t in tensors[1:]:
        total.add_(t)
    return total


def _no_ints(device: torch.device) -> Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)
