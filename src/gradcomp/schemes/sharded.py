"""Sharded: every worker is the server for 1/W of every slot (BytePS-style bidirectional compression).

    Sharded(compressor, server_compressor=None)          # gradcomp train --topology sharded

BytePS (Jiang, Zhu, Lan, Yi, Cui, Guo, "A Unified Architecture for Accelerating Distributed DNN Training in
Heterogeneous GPU/CPU Clusters", OSDI 2020) removes the parameter server's bottleneck by partitioning every
tensor and spreading the partitions over many servers, so that no single machine receives W messages of the
whole model; its compression plug-in compresses on the way to the servers and again on the way back, each
side with its own error-feedback residual. Here the servers are the workers themselves: with W workers,
each is the owner of shard j = its rank of every slot, and the parameter server of ``SingleRound(ps)`` is
cut into W equal parts.

The rounds of one step, on worker r:

1. **Shard.** Every slot of n entries is cut into W contiguous shards, shard j = entries
   [j·q + min(j, m), (j+1)·q + min(j+1, m)) with q = n // W, m = n % W: the first m shards have one entry
   more (``torch.tensor_split``'s rule, sizes differ by at most one). A slot smaller than W has empty shards;
   an empty shard is not compressed and sends nothing (both ends know its size, so both skip it).
2. **Compress up.** Worker r compresses shard j of every slot with its compressor (its own residual when the
   compressor carries error feedback) and encodes all its shard-j messages into ONE wire buffer for owner j.
3. **All-to-all.** The W buffers travel by one all-to-all, which needs W equal chunks: first a control
   all-to-all of two int64 per destination, (length of my buffer for you, length of my longest buffer), tells
   each owner how long the buffers it will receive are and everyone the longest buffer of all; every buffer is
   padded to that length. This costs 16·(W−1) bytes each way instead of the 8·W·(W−1) an all-gather of the
   whole W×W size matrix would bring down, and it is all an owner needs: the lengths of what it receives
   (to cut the padding off) and the common chunk length. When every message has fixed-width fields (C_nat,
   signs, dithering, ...) every worker computes all these lengths from the specs (``fixed_sizes``) and the
   control round is skipped: one wait less per step.
4. **Serve.** Owner r decodes the W buffers it received in rank order, sums and aggregates them by the
   compressor's rule (``aggregate_buffers``: mean, or majority vote; overflow-safe), compresses each
   aggregated shard with the server compressor (its own instance and residual; uncompressed fp32
   ``NoCompression`` when none is given, as for ``ps``) and encodes ONE downstream buffer.
5. **All-gather.** The W downstream buffers come down by ``allgather_buffers`` (sizes unless the specs fix
   them, padding). Every worker decodes every owner's buffer in rank order and writes the shards back into
   place, so every replica holds the same float32 tensors bit for bit.

Choices where the paper is silent or differs:

- Shards are the W contiguous pieces of each slot, not fixed-size partitions assigned round-robin as BytePS
  does: every owner serves the same amount of every slot, and the layout needs no configuration. The price is
  a wire section per shard: a worker sends W buffers, each with a 20-byte header and one 10-byte section per
  field of every non-empty shard, so framing grows linearly with W (the table in docs/methods/sharded.md
  shows where it starts to count: small models at large W).
- Shard slots: shard j of ``Slot(name, index, n)`` is ``Slot(f"{name}/shard{j}", index·W + j, size_j)``
  (flat, no shape). Names and indices are identical on every worker and distinct for distinct (slot, shard),
  since index·W + j is injective for 0 <= j < W. Shared randomness (random-k positions, hash functions) is
  therefore shared between the workers that send shard j and differs between shards; per-worker randomness
  (C_nat's, dithering's stochastic rounding) also mixes in the worker number. Residuals are kept per shard
  slot (error feedback keys them by name and size).
- Worker numbers: the worker compressor is bound to the rank r, the server compressor to W + r, so an
  owner's stochastic rounding is independent of every worker's and of the other owners'.
- A compressor that keeps a fixed k per tensor keeps k per *shard* (W·k per slot); a density keeps
  ceil(p·size_j) per shard, which is at least the density of the whole slot.
- Validation: the shard slots' specs (worker and server compressor) are checked, for the bound W, before
  the first request is yielded, so a bad configuration (k larger than a shard, ...) raises ConfigError
  before anything is sent. ``check_slots`` does the same check; before ``bind`` (W = 1) it checks the whole
  slots.

Bytes, per worker and step, counted by the transport's rules (transport.base): up = the W−1 buffers to the
other owners (its own shard never leaves the process) + its downstream buffer once (an all-gather books t
up) + control; down = the W−1 buffers from the other workers + the W−1 other owners' downstream buffers +
control. The owner role lives in the worker's process and is counted in these per-worker numbers: there is
no separate server machine, so ``server_in`` / ``server_out`` stay 0. Padding to equal chunks is booked
apart (``up_padding`` / ``down_padding``). With a message of M bytes up and an aggregate of A bytes down
(both for the whole model), a worker sends about (W−1)/W·M + A/W and receives about (W−1)/W·(M + A): flat
in W apart from framing, where ``allgather`` brings (W−1)·M down and the root of ``ps`` receives W·M and
sends W·A. (Down is M + A rather than ``ps``'s A because the owner role receives shards; as everywhere in
this project, the traffic inside a collective's algorithm, e.g. a ring all-gather forwarding the others'
buffers, is not counted.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradcomp.compressors.base import Compressor, Slot, bind_worker
from gradcomp.compressors.dense import NoCompression
from gradcomp.errors import ConfigError
from gradcomp.protocols import allgather_buffers, alltoall_buffers
from gradcomp.schemes.base import Scheme
from gradcomp.schemes.single_round import (
    aggregate_buffers, decode_slots, encode_slots, fixed_buffer_size, read_result, serve_compressed,
)
from gradcomp.transport.requests import Rounds
from gradcomp.wire.device import DeviceChecks, fetch_together
from gradcomp.wire.format import max_encoded_size
from gradcomp.wire.refusals import AbandonedHere, abandon_flags, abandon_message, add_to_verdict, deferring


def shard_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """The W contiguous [start, stop) shards of ``numel`` entries; the first numel % W have one entry more."""
    q, m = divmod(int(numel), int(world_size))
    return [(j * q + min(j, m), (j + 1) * q + min(j + 1, m)) for j in range(world_size)]


def shard_slot(slot: Slot, j: int, world_size: int, size: int) -> Slot:
    """Shard ``j`` of ``slot`` as a slot of its own: same name and index on every worker, unique per shard."""
    return Slot(f"{slot.name}/shard{j}", slot.index * world_size + j, size)


@dataclass(frozen=True)
class _Layout:
    """One slot cut into W shards: bounds and the shard slots (None for an empty shard)."""

    bounds: list[tuple[int, int]]
    shards: list[Slot | None]


def _largest_sizes(compressor: Compressor, per_owner: Sequence[Sequence[Slot]]) -> list[int]:
    """The most bytes a buffer for (or from) owner j can have, for every j: bounds a size round's lengths."""
    return [
        max_encoded_size([spec for s in shard_slots for spec in compressor.specs(s)]) if shard_slots else 0
        for shard_slots in per_owner
    ]


def _fixed_sizes(compressor: Compressor, per_owner: Sequence[Sequence[Slot]]) -> list[int] | None:
    sizes = []
    for shard_slots in per_owner:
        size = fixed_buffer_size(compressor, shard_slots) if shard_slots else 0
        if size is None:
            return None
        sizes.append(size)
    return sizes


class Sharded(Scheme):
    name = "sharded"
    topology = "sharded"

    def __init__(self, compressor: Compressor, server_compressor: Compressor | None = None):
        if not isinstance(compressor, Compressor):
            raise ConfigError(
                f"topology 'sharded' carries a compressor, got {type(compressor).__name__} "
                "(a method that owns its rounds takes no topology)"
            )
        if server_compressor is not None and not isinstance(server_compressor, Compressor):
            raise ConfigError(f"the server compressor must be a compressor, got {type(server_compressor).__name__}")
        if server_compressor is compressor:
            raise ConfigError("the server compressor must be its own instance (it keeps its own residual)")
        self.compressor = compressor
        self.server_compressor = server_compressor if server_compressor is not None else NoCompression()
        self._layouts: dict[Slot, _Layout] = {}
        self._sizes: dict[tuple[Slot, ...], tuple[list[int] | None, list[int] | None]] = {}
        self._limits: dict[tuple[Slot, ...], tuple[list[int], int]] = {}  # what bounds their size rounds

    def bind(self, rank: int, world_size: int) -> None:
        super().bind(rank, world_size)
        self._layouts = {}
        self._sizes, self._limits = {}, {}
        bind_worker(self.compressor, rank)
        bind_worker(self.server_compressor, world_size + rank)  # independent of every worker and other owner

    def params(self) -> dict:
        return {"compressor": self.compressor, "topology": self.topology, "server_compressor": self.server_compressor}

    # -- shards ----------------------------------------------------------------------------------------------

    def layout(self, slot: Slot) -> _Layout:
        """The shards of ``slot`` for the bound W; their specs are checked (ConfigError) the first time."""
        found = self._layouts.get(slot)
        if found is None:
            if slot.numel < 0:
                raise ConfigError(f"{slot.name}: a slot cannot have {slot.numel} elements")
            bounds = shard_bounds(slot.numel, self.world_size)
            shards = [
                shard_slot(slot, j, self.world_size, stop - start) if stop > start else None
                for j, (start, stop) in enumerate(bounds)
            ]
            for shard in shards:
                if shard is not None:
                    self.compressor.specs(shard)
                    self.server_compressor.specs(shard)
            found = self._layouts[slot] = _Layout(bounds, shards)
        return found

    def owned(self, slots: Sequence[Slot], owner: int) -> list[tuple[int, Slot]]:
        """(slot position, shard slot) of every non-empty shard ``owner`` serves, in slot order."""
        out = []
        for i, slot in enumerate(slots):
            shard = self.layout(slot).shards[owner]
            if shard is not None:
                out.append((i, shard))
        return out

    def check_slots(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            self.layout(slot)

    def defers_verdict(self, slots: Sequence[Slot]) -> bool:
        """Messages of sizes the specs fix both ways: the workers' verdict rides on the all-to-all and is read with
        the owner's checks of the buffers it received (``aggregate_buffers``), before it compresses its aggregate
        again, in the one read the owner makes there anyway; a bad step is abandoned there on every worker. Not where
        some worker owns no entry (slots smaller than W): it makes no such read, and would go on to the all-gather
        that the others abandoned."""
        up, down = self.fixed_sizes(slots)
        return up is not None and down is not None and all(up)  # (an owner of nothing is sent 0 bytes)

    def fixed_sizes(self, slots: Sequence[Slot]) -> tuple[list[int] | None, list[int] | None]:
        """Bytes of the buffer every worker sends to owner j, and of owner j's downstream buffer, for every j,
        when the specs fix them (fixed-width messages; None when a message's size depends on the data): every
        worker computes the same lengths, so neither collective needs a size round."""
        key = tuple(slots)
        if key not in self._sizes:
            per_owner = [[s for _, s in self.owned(slots, j)] for j in range(self.world_size)]
            self._sizes[key] = tuple(_fixed_sizes(c, per_owner) for c in (self.compressor, self.server_compressor))
        return self._sizes[key]

    def _bounds(self, slots: Sequence[Slot], per_owner: Sequence) -> tuple[list[int], int]:
        """The most bytes a buffer for owner j can have, for every j, and the most any owner's downstream buffer
        can have: what bounds the size rounds' lengths (computed once per slot list, as ``fixed_sizes``)."""
        key = tuple(slots)
        if key not in self._limits:
            shards = [[s for _, s in owned] for owned in per_owner]
            self._limits[key] = (_largest_sizes(self.compressor, shards),
                                 max(_largest_sizes(self.server_compressor, shards)))
        return self._limits[key]

    # -- the rounds ------------------------------------------------------------------------------------------

    def run(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        if not slots:
            return []
        world, rank = self.world_size, self.rank
        device = tensors[0].device
        self.check_slots(slots)  # every spec, before anything is sent
        per_owner = [self.owned(slots, j) for j in range(world)]
        if not any(per_owner):  # every slot is empty: nothing to send
            return [torch.zeros(s.numel, dtype=torch.float32, device=device) for s in slots]
        flats = [t.reshape(-1) for t in tensors]

        # 1-2. compress shard j of every slot, one buffer per owner j
        up = []
        for j, owned in enumerate(per_owner):
            if not owned:
                up.append(torch.empty(0, dtype=torch.uint8, device=device))
                continue
            shard_slots = [s for _, s in owned]
            messages = []
            for i, shard in owned:
                start, stop = self.layout(slots[i]).bounds[j]
                messages.append(self.compressor.compress(flats[i][start:stop], shard, step))
            up.append(encode_slots(self.compressor, shard_slots, messages))

        # 3. all-to-all: owner r receives every worker's buffer for shard r
        up_sizes, down_sizes = self.fixed_sizes(slots)
        up_limits, down_limit = self._bounds(slots, per_owner)
        received = yield from alltoall_buffers(rank, up, up_sizes, None if up_sizes is not None else up_limits)

        # 4. serve: aggregate my shards, compress them again, one downstream buffer
        mine = [s for _, s in per_owner[rank]]
        if mine:
            try:
                aggregates = aggregate_buffers(self.compressor, mine, received, step, device)
                downstream = serve_compressed(self.server_compressor, mine, aggregates, step,
                                              None if down_sizes is None else down_sizes[rank], device)
            except AbandonedHere:  # (a deferred verdict: fixed sizes) my aggregate is not finite: the others must
                downstream = abandon_message(down_sizes[rank], device)  # learn it from my buffer
        else:
            downstream = torch.empty(0, dtype=torch.uint8, device=device)

        # 5. all-gather of the owners' buffers; everyone puts every shard in place
        down_bound = None if down_sizes is not None else down_limit
        gathered = yield from allgather_buffers(rank, downstream, down_sizes, down_bound)
        if deferring():  # an owner's abandoned buffer abandons the step on every worker, at the step's end's read
            add_to_verdict(abandon_flags(gathered))
        results = [torch.empty(s.numel, dtype=torch.float32, device=device) for s in slots]
        specs = [[spec for _, s in owned for spec in self.server_compressor.specs(s)] for owned in per_owner]
        # every owner's buffer decoded on the device and its checks read once with the others' (or held for the
        # step's or the DDP hook's pass's one read: these shards are this worker's result, sent on to no one)
        later = DeviceChecks()
        served = [(buffer, sp) for buffer, sp, owned in zip(gathered, specs, per_owner) if owned]
        with later.collecting(), fetch_together(served):
            for j, (owned, buffer) in enumerate(zip(per_owner, gathered)):
                if not owned:
                    continue
                shard_slots = [s for _, s in owned]
                decoded = decode_slots(self.server_compressor, shard_slots, buffer, later)
                for (i, shard), fields in zip(owned, decoded):
                    start, stop = self.layout(slots[i]).bounds[j]
                    results[i][start:stop] = self.server_compressor.decompress(fields, shard, step)
        read_result(later, results, self.server_compressor)
        return results

    # -- state -----------------------------------------------------------------------------------------------

    def _shard_slots(self, slots: Sequence[Slot], owner: int | None = None) -> list[Slot]:
        out = []
        for slot in slots:
            shards = self.layout(slot).shards
            out.extend(s for j, s in enumerate(shards) if s is not None and (owner is None or j == owner))
        return out

    def retain(self, slots: Sequence[Slot]) -> None:
        self.compressor.retain(self._shard_slots(slots))
        self.server_compressor.retain(self._shard_slots(slots, owner=self.rank))
        self._layouts = {s: self._layouts[s] for s in slots if s in self._layouts}
        kept = set(slots)
        self._sizes = {key: sizes for key, sizes in self._sizes.items() if kept.issuperset(key)}
        self._limits = {key: limits for key, limits in self._limits.items() if kept.issuperset(key)}

    def state_dict(self) -> dict:
        return {"compressor": self.compressor.state_dict(), "server": self.server_compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state) - {"compressor", "server"}
        if unknown:
            raise ConfigError(f"unexpected sharded-scheme state keys {sorted(unknown)}")
        self.compressor.load_state_dict(state.get("compressor", {}))
        self.server_compressor.load_state_dict(state.get("server", {}))
