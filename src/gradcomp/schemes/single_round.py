"""One round for any single-message compressor: allreduce, allgather or a parameter server.

    SingleRound(compressor, topology="auto" | "allreduce" | "allgather" | "ps", server_compressor, root)

- ``allreduce`` (default for summable compressors): the fields of all slots are concatenated into one flat
  tensor, divided by W, and summed with a single allreduce; no header travels, the values are the message.
  Each field is checked against the compressor's spec (dtype and count) first, so a field of the wrong dtype
  is an error instead of being silently promoted by the concatenation.
- ``allgather`` (default for the rest): all slots' fields become ONE encoded buffer (wire layer), gathered
  from every worker; each worker decodes all buffers in rank order, so every replica computes the same sum.
- ``ps``: parameter server at ``root``: it decodes and aggregates the gathered buffers, compresses the
  aggregate with ``server_compressor`` (its own instance and residual; uncompressed fp32 when none is given),
  and broadcasts that one buffer, which every worker decodes.

The compressor owns its aggregation rule (``Compressor.aggregate``): the mean for most, the sign of the sum
for majority vote. A mean that overflows fp32 (only possible when the workers' values are near fp32's
largest finite value) is recomputed from messages divided by W before they are added, so W finite messages
never average to Inf.

``min_compression_rate`` (off by default; the DDP hook sets it): a slot whose compressed message would not be
at least that many times smaller than its fp32 values (biases, tiny tensors, a density that keeps almost
everything) travels uncompressed, in one allreduce that precedes the gathered round. A message whose size
depends on the data (threshold) always counts as worth compressing; Golomb-coded positions are estimated at
their fixed-width size, an upper bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import (
    Compressor,
    Fields,
    Slot,
    Tally,
    accumulate,
    bind_worker,
    compress_slots,
    new_tally,
    select_sized,
)
from gradcomp.compressors.dense import NoCompression
from gradcomp.errors import ConfigError, NonFiniteGradientError
from gradcomp.finite import all_finite, finite_flag
from gradcomp.protocols import allgather_buffers, allreduce_sum, parameter_server
from gradcomp.protocols.sizes import exchange_lengths
from gradcomp.schemes.base import Scheme
from gradcomp.transport.requests import Rounds
from gradcomp.transport.sim import Shared, computed_once
from gradcomp.wire import FLOAT_DTYPES, Codec, FieldSpec, decode, encode, encoded_size
from gradcomp.wire.device import (
    DeviceChecks,
    fetch_together,
    hold_for_the_pass,
    held_for_the_pass,
    holding_for_the_pass,
)
from gradcomp.wire.format import free_sections, layout_values, length_from_counts, length_on_device, max_encoded_size
from gradcomp.wire.refusals import (
    AbandonedHere,
    StepAbandoned,
    abandon_flags,
    abandon_later,
    abandon_message,
    add_to_verdict,
    deferring,
)
from gradcomp.wire.bits import bits_needed, host_path, packed_nbytes

TOPOLOGIES = ("auto", "allreduce", "allgather", "ps")  # what SingleRound carries


def resolve_topology(compressor: Compressor, topology: str, server_compressor: Compressor | None) -> str:
    """The concrete topology for ``compressor`` (``auto`` → allreduce if summable, else allgather); checks."""
    if topology == "auto":
        topology = "allreduce" if compressor.summable else "allgather"
    if topology == "allreduce" and not compressor.summable:
        raise ConfigError(f"compressor {compressor.name!r} is not summable: use topology 'allgather' or 'ps'")
    if server_compressor is not None and topology not in ("ps", "sharded"):
        raise ConfigError("a server (downstream) compressor needs topology ps or sharded")
    return topology


def message_nbytes(specs: Sequence[FieldSpec]) -> int | None:
    """Bytes of a message's field data, or None when its size depends on the data."""
    total = 0
    for spec in specs:
        if spec.count is None:
            return None
        codec = Codec(spec.codec)
        if codec in FLOAT_DTYPES:
            total += spec.count * FLOAT_DTYPES[codec].itemsize
        elif codec == Codec.BITS:
            total += packed_nbytes(spec.count, spec.width)
        else:  # POSITIONS, GOLOMB (estimated at the fixed width, an upper bound)
            total += packed_nbytes(spec.count, bits_needed(spec.universe))
    return total


def fixed_buffer_size(compressor: Compressor, slots: Sequence[Slot]) -> int | None:
    """Bytes of ``encode_slots(compressor, slots, ...)`` when its layout follows from the specs alone (every field
    of a fixed count and width), or None when it depends on the data (a threshold's count, Golomb codes).

    Every worker computes the same number from the same slots and specs, so a collective of such buffers needs
    no size round."""
    specs = [spec for s in slots for spec in compressor.specs(s)]
    if any(spec.count is None for spec in specs):
        return None
    return encoded_size(specs)


def encode_slots(compressor: Compressor, slots: Sequence[Slot], messages: Sequence[Fields]) -> Tensor:
    """All slots' messages as ONE wire buffer."""
    return encode([f for fields in messages for f in fields], [spec for s in slots for spec in compressor.specs(s)])


def decode_slots(
    compressor: Compressor, slots: Sequence[Slot], buffer: Tensor, later: DeviceChecks | None = None,
    layout: Sequence[int] | None = None,
) -> list[Fields]:
    specs_per_slot = [compressor.specs(s) for s in slots]
    fields = iter(decode(buffer, [spec for specs in specs_per_slot for spec in specs], later, layout))
    return [[next(fields) for _ in specs] for specs in specs_per_slot]


def aggregate_buffers(
    compressor: Compressor, slots: Sequence[Slot], buffers: Sequence[Tensor], step: int, device: torch.device,
    final: bool = False, layouts: Sequence[Sequence[int]] | None = None,
) -> list[Tensor]:
    """Decode every buffer (in order), add the messages up and aggregate them by the compressor's rule.

    One buffer is decoded at a time and added into every slot's running sum before the next is decoded, so
    one worker's decoded message is in memory, not W of them (a dense message's codes decoded to int64 were 8
    bytes per entry, W of them 2·W fp32 gradients; BITS fields now decode to int16 up to 15 bits). Each slot's
    sum still adds the workers in rank order: the same sums, bit for bit. The finiteness check reads each slot's
    sum of sums in float64 (finite exactly when the tensor is: float32 entries cannot overflow it) instead of
    building |sum| and three d-sized masks (``torch.isfinite``), and all slots' in one read, together with the
    checks of every decoded device buffer (``wire.device.DeviceChecks``): one host synchronisation per exchange,
    not one per slot and message. A compressor
    with its own compact tally (``base.new_tally``: majority vote counts sign bits) adds the messages there
    instead.

    ``final``: the aggregate is this worker's result of the exchange (an all-gather's), not something it sends on (a
    server's, a shard's). Only then may the checks wait for the DDP hook's backward pass (``hold_for_the_pass``): a
    message sent on from unread checks would carry a corruption to workers that never see its checks.

    ``layouts``: each buffer's layout values from the size exchange (``wire.format.layout_values``): buffers whose
    layout depends on the data are then decoded on the device like fixed ones, none brought to the host.
    """
    tallies = [new_tally(compressor, slot, device) for slot in slots]  # None: add up float32 messages
    totals = [
        torch.zeros(slot.numel, dtype=torch.float32, device=device) if tally is None else tally
        for slot, tally in zip(slots, tallies)
    ]
    later = DeviceChecks()  # device buffers: every message's checks and the sums' finiteness read in one transfer
    specs = [spec for slot in slots for spec in compressor.specs(slot)]
    # the compressors' own checks of what they decode (sign padding) join the one read; messages whose layout
    # depends on the data come to the host for their headers in one transfer, not one per worker
    given = list(layouts) if layouts is not None else [None] * len(buffers)
    with later.collecting(), fetch_together([(b, specs) for b, layout in zip(buffers, given) if layout is None]):
        for buffer, layout in zip(buffers, given):
            _add_buffer(compressor, slots, buffer, step, totals, later, layout)
    results = []
    sums = [total for total in totals if not isinstance(total, Tally)]  # a compact count is finite by construction
    # a float64 sum of float32 entries cannot overflow: finite exactly when every entry is
    finite_sums = torch.stack([total.sum(dtype=torch.float64) for total in sums]).isfinite() if sums else None
    # Inside the DDP hook's backward pass (device path): the checks and "some sum is not finite" wait for the pass's
    # one read, where such a sum abandons the step on every worker: no rescue of an overflow below.
    if final and hold_for_the_pass(later, None if finite_sums is None else ~finite_sums.all()):
        return [total.result(len(buffers)) if isinstance(total, Tally) else compressor.aggregate(total, len(buffers))
                for total in totals]  # fmt: skip
    finite = iter(later.read([] if finite_sums is None else list(finite_sums.unbind())))
    for i, (slot, total) in enumerate(zip(slots, totals)):
        if isinstance(total, Tally):  # a compact count (majority vote): finite by construction
            results.append(total.result(len(buffers)))
            continue
        if next(finite):
            results.append(compressor.aggregate(total, len(buffers)))
            continue
        # the sum of finite messages overflowed: add them divided by W instead (decoding the buffers again:
        # a rare path). The rule then sees one "worker" holding that sum: the mean is the sum itself, and a
        # sign is unchanged by the division.
        total.zero_()
        one = torch.empty_like(total)
        for buffer in buffers:
            one.zero_()
            accumulate(compressor, decode_slots(compressor, slots, buffer)[i], slot, step, one)
            total += one.div_(len(buffers))
        if not all_finite(total):
            # Not an overflow: a message itself held NaN / Inf (on the device path compressors do not refuse one: a
            # NaN / Inf in g + residual, a norm that overflows float32 travels in the message instead; on either
            # path a compressor may make one that no check of its own sees). Every worker sees the same messages,
            # so every worker abandons the step here, its state restored, instead of applying it. A server's or a
            # shard owner's aggregate (not final) is seen by this worker alone: it sends an abandoned message in its
            # place (AbandonedHere, while the verdict is deferred), from which every worker learns it at its next
            # read; else it goes on as it is, noted for the step's end agreement (abandon_later, settle), which
            # abandons the step on every worker (outside one, as before: the others could not learn of it).
            if final:
                raise StepAbandoned
            if deferring():
                raise AbandonedHere
            abandon_later()
        results.append(compressor.aggregate(total, 1))
    return results


def serve_compressed(
    server: Compressor, slots: Sequence[Slot], aggregates: Sequence[Tensor], step: int, size: int | None,
    device: torch.device,
) -> Tensor:
    """A server's (or a shard owner's) downstream buffer: its aggregates compressed again by ``server`` and encoded.

    A server compressor that refuses a finite aggregate (the host path's QSGD: a 2-norm above float32's range) does so
    on this worker alone, after the step's first message: while the verdict is deferred the worker sends an abandoned
    message of the downstream ``size`` instead; elsewhere it notes it for the step's end agreement (``abandon_later``)
    and sends a stand-in (zeros compressed), and every worker abandons the step there; outside an agreement it
    raises, as before."""
    try:
        down = [server.compress(a, s, step) for s, a in zip(slots, aggregates)]
    except NonFiniteGradientError:
        if deferring():
            return abandon_message(size, device)
        if not abandon_later():
            raise
        down = [server.compress(torch.zeros_like(a), s, step) for s, a in zip(slots, aggregates)]
    return encode_slots(server, slots, down)


def read_result(later: DeviceChecks, results: Sequence[Tensor], server: Compressor) -> None:
    """The checks of a downstream message this worker decoded into ``results`` (the same on every worker), read, or
    held for the DDP hook's pass. On the device path the results' finiteness is read with them: a server compressor
    there sends what it would refuse on the host (QSGD's Inf norm) and the result is not finite on every worker alike,
    which abandons the step (StepAbandoned) instead of applying it. Not for the default server (``NoCompression``):
    it sends the aggregate as it is, whose finiteness the server checked already (no pass over the result then)."""
    checked = not results or host_path(results[0]) or isinstance(server, NoCompression)
    bad = None if checked else ~finite_flag(results)
    if not hold_for_the_pass(later, bad) and later.read([] if bad is None else [bad]) == [True]:
        raise StepAbandoned


def _add_buffer(
    compressor: Compressor,
    slots: Sequence[Slot],
    buffer: Tensor,
    step: int,
    totals: list[Tensor | Tally],
    later: DeviceChecks | None = None,
    layout: Sequence[int] | None = None,
) -> None:
    """Add one worker's decoded messages into the slots' sums (or tallies). A function of its own, so that
    nothing of the decoded message outlives it (a loop variable would keep the last slot's fields alive through
    the next buffer's decoding)."""
    for slot, fields, total in zip(slots, decode_slots(compressor, slots, buffer, later, layout), totals):
        if isinstance(total, Tally):
            total.add(fields)
        else:
            accumulate(compressor, fields, slot, step, total)


def _from(rounds: Rounds, first: Any) -> Rounds:
    """The rest of ``rounds``, which has yielded ``first`` already (its first request): ``yield from`` it."""
    request = first
    try:
        while True:
            request = rounds.send((yield request))
    except StopIteration as done:
        return done.value


class SingleRound(Scheme):
    name = "single-round"

    def __init__(
        self,
        compressor: Compressor,
        topology: str = "auto",
        server_compressor: Compressor | None = None,
        root: int = 0,
        min_compression_rate: float | None = None,
    ):
        if topology not in TOPOLOGIES:
            raise ConfigError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
        self.topology = resolve_topology(compressor, topology, server_compressor)
        if min_compression_rate is not None and (
            isinstance(min_compression_rate, bool)
            or not isinstance(min_compression_rate, (int, float))
            or not math.isfinite(min_compression_rate)
            or min_compression_rate <= 0
        ):
            raise ConfigError(f"min_compression_rate must be a finite number > 0, got {min_compression_rate!r}")
        if server_compressor is not None and server_compressor is compressor:
            raise ConfigError(
                "the server compressor must be its own instance (it keeps its own residual and randomness): "
                "build it with a second gradcomp.make(...)"
            )
        self.compressor = compressor
        self.server_compressor = server_compressor if server_compressor is not None else NoCompression()
        self.root = root
        self.min_compression_rate = min_compression_rate
        self._worth: dict[Slot, bool] = {}
        # (server?, slots) -> (fixed_buffer_size, the most bytes a message can have: max_encoded_size)
        self._sizes: dict[tuple[bool, tuple[Slot, ...]], tuple[int | None, int]] = {}

    def bind(self, rank: int, world_size: int) -> None:
        super().bind(rank, world_size)
        if not 0 <= self.root < world_size:
            raise ConfigError(f"root {self.root} is not a rank of a world of size {world_size}")
        bind_worker(self.compressor, rank)
        bind_worker(self.server_compressor, world_size)  # the server rounds independently of every worker
        self._sizes = {}

    def params(self) -> dict:
        return {"compressor": self.compressor, "topology": self.topology}

    def defers_verdict(self, slots: Sequence[Slot]) -> bool:
        """Messages of a size the specs fix: all-reduced, all-gathered, or through a parameter server whose downstream
        message's size the server compressor's specs fix too (``passes_verdict_on``)."""
        if self._fixed_size(self.compressor, slots) is None:
            return False
        return self.topology != "ps" or self._fixed_size(self.server_compressor, slots) is not None

    def passes_verdict_on(self, slots: Sequence[Slot]) -> bool:
        """A parameter server of fixed sizes both ways: the verdict rides on the gather, the root reads it with its
        checks of the gathered messages (the read it makes before it compresses their aggregate again) and, if it
        is bad, broadcasts an abandoned message of the downstream size instead; every worker reads that message's
        mark with its checks at the step's end (or the DDP hook's pass's), and all abandon the step there."""
        return self.topology == "ps" and self.defers_verdict(slots)

    def verdict_in_result(self, slots: Sequence[Slot]) -> bool:
        """All-reduced by a compressor that declares it (``nan_in_result``: none, fp16, bf16, random-k and random
        block without error feedback): the NaN that marks a bad worker's first message is in every worker's sum."""
        return self.topology == "allreduce" and self.compressor.nan_in_result and self.defers_verdict(slots)

    def check_slots(self, slots: Sequence[Slot]) -> None:
        for slot in slots:
            self.compressor.specs(slot)
            self.server_compressor.specs(slot)

    # -- which slots are worth compressing --------------------------------------------------------------------

    def worth_compressing(self, slot: Slot) -> bool:
        if self.min_compression_rate is None or self.topology == "allreduce":
            return True
        if slot not in self._worth:
            compressed = message_nbytes(self.compressor.specs(slot))
            self._worth[slot] = compressed is None or compressed * self.min_compression_rate < 4 * slot.numel
        return self._worth[slot]

    def run(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        if not slots:
            return []
        keep = [self.worth_compressing(s) for s in slots]
        if all(keep):
            return (yield from self._compressed(slots, tensors, step))
        results: list[Tensor | None] = [None] * len(slots)
        dense = [i for i, k in enumerate(keep) if not k]
        chosen = [i for i, k in enumerate(keep) if k]
        # The chosen slots are compressed before the dense all-reduce is sent (their rounds run up to their first
        # request): a compressor that refuses this worker's finite gradients (QSGD's norm above float32's range)
        # then raises before anything of the step is sent, where the exchange turns it into this worker's verdict,
        # not after the all-reduce, on this worker alone, with the others waiting in the next collective.
        compressed = self._compressed([slots[i] for i in chosen], [tensors[i] for i in chosen], step)
        try:
            first = next(compressed) if chosen else None
        except StopIteration as done:
            first, out = None, done.value
        flat = torch.cat([tensors[i].reshape(-1).to(torch.float32) for i in dense]).div_(self.world_size)
        summed = yield from allreduce_sum(flat, inplace=True)
        for i, piece in zip(dense, torch.split(summed, [slots[i].numel for i in dense])):
            results[i] = piece
        if first is not None:
            out = yield from _from(compressed, first)
        if chosen:
            for i, r in zip(chosen, out):
                results[i] = r
        return results

    def _compressed(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        if self.topology == "allreduce":
            return (yield from self._allreduce(slots, tensors, step))
        if self.topology == "allgather":
            return (yield from self._allgather(slots, tensors, step))
        return (yield from self._parameter_server(slots, tensors, step))

    # -- the three topologies --------------------------------------------------------------------------------

    def _allreduce(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        messages = [self.compressor.compress(t, s, step) for s, t in zip(slots, tensors)]
        dtype = None
        for s, fields in zip(slots, messages):
            for f, spec in zip(fields, self.compressor.specs(s)):
                want = FLOAT_DTYPES.get(Codec(spec.codec))
                if want is None or f.dtype != want or f.numel() != spec.count:
                    raise ConfigError(
                        f"{self.compressor.name}: {s.name}: a summed field must be {spec.count} values of "
                        f"{want}, got {f.numel()} of {f.dtype}"
                    )
                if dtype is None:
                    dtype = f.dtype
                elif f.dtype != dtype:
                    raise ConfigError(f"{self.compressor.name}: summed fields mix {dtype} and {f.dtype}")
        sizes = [[f.numel() for f in fields] for fields in messages]
        # Divide before summing (as torch's fp16 hook does): a half-precision sum of W large values would
        # overflow where their average does not. Summable messages decompress linearly, so this is the mean.
        pieces = [f.reshape(-1) for fields in messages for f in fields]
        flat = pieces[0] / self.world_size if len(pieces) == 1 else torch.cat(pieces).div_(self.world_size)
        summed = yield from allreduce_sum(flat, inplace=True)
        split = iter(torch.split(summed, [n for per_slot in sizes for n in per_slot]))
        return [
            self.compressor.decompress([next(split) for _ in per_slot], s, step) for s, per_slot in zip(slots, sizes)
        ]

    def _encoded(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Tensor:
        """This worker's messages of all slots as one wire buffer. The messages themselves (for a dense method
        its codes, int16 for most, half an fp32 gradient's worth) are dropped as soon as they are encoded, not
        kept alive through the collectives and the decoding that follow."""
        return encode_slots(self.compressor, slots, compress_slots(self.compressor, tensors, slots, step))

    def _sized_on_device(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        """The device path of a message whose size depends on the data: its length and layout values (the free
        sections' counts, the Golomb streams' lengths: ``wire.format.layout_values``) computed on the device,
        sent in the size exchange and read with the others' and with its own Golomb streams' lengths (one read),
        then encoded without a read of its own; every receiver then decodes every message on the device, its
        layout known, with nothing brought to the host. Returns (this worker's buffer, every worker's length,
        every worker's layout values); the bytes are encode's."""
        specs = [spec for slot in slots for spec in self.compressor.specs(slot)]
        device = tensors[0].device
        sized = select_sized(self.compressor, tensors, slots, step)
        if sized is not None:  # (threshold, STC) the selections' counts are read with the size exchange too
            counts = sized.device_counts()
            per_field = [c for per_slot in sized.counts for c in per_slot]
            bits = sized.stream_bits
            bits = torch.zeros(0, dtype=torch.int64, device=device) if bits is None else bits.reshape(-1)
            length = length_from_counts(specs, per_field, bits)
            layout = layout_values(specs, per_field, bits, device)
            read = torch.cat([torch.stack(counts).reshape(-1) if counts else bits[:0], bits])
            sizes, layouts, values = yield from exchange_lengths(length, read, layout, max_encoded_size(specs))
            fields = [f for message in sized.finish(values[: len(counts)]) for f in message]
            streams = dict(zip(free_sections(specs)[1], values[len(counts) :]))
            return encode(fields, specs, stream_bits=streams or None), sizes, layouts
        messages = compress_slots(self.compressor, tensors, slots, step)
        fields = [f for message in messages for f in message]
        del messages
        length, which, bits = length_on_device(fields, specs)
        layout = layout_values(specs, [f.numel() for f in fields], bits, device)
        sizes, layouts, streams = yield from exchange_lengths(length, bits, layout, max_encoded_size(specs))
        return encode(fields, specs, stream_bits=dict(zip(which, streams))), sizes, layouts

    def _largest(self, compressor: Compressor, slots: Sequence[Slot]) -> int:
        """The most bytes a message of ``compressor`` for ``slots`` can have (bounds a size round's lengths)."""
        return self._size_and_bound(compressor, slots)[1]

    def _fixed_size(self, compressor: Compressor, slots: Sequence[Slot]) -> int | None:
        return self._size_and_bound(compressor, slots)[0]

    def _size_and_bound(self, compressor: Compressor, slots: Sequence[Slot]) -> tuple[int | None, int]:
        key = (compressor is self.server_compressor, tuple(slots))
        if key not in self._sizes:
            specs = [spec for slot in slots for spec in compressor.specs(slot)]
            self._sizes[key] = (fixed_buffer_size(compressor, slots), max_encoded_size(specs))
        return self._sizes[key]

    def _allgather(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        size, layouts = self._fixed_size(self.compressor, slots), None
        if size is None and tensors and not host_path(tensors[0]):
            buffer, sizes, layouts = yield from self._sized_on_device(slots, tensors, step)
        else:  # (the host path reads a variable message's headers where it is: its size exchange sends lengths only)
            buffer, sizes = self._encoded(slots, tensors, step), None if size is None else [size] * self.world_size
        limit = None if sizes is not None else self._largest(self.compressor, slots)
        buffers = yield from allgather_buffers(self.rank, buffer, sizes, limit)
        # the same aggregate on every worker: a simulated cluster computes it once (transport.sim), and the checks it
        # leaves for the pass's read go to every worker's pass
        pass_checks = held_for_the_pass()

        def aggregate() -> list:
            if pass_checks is None:
                return aggregate_buffers(self.compressor, slots, buffers, step, tensors[0].device, final=True,
                                         layouts=layouts)
            left = DeviceChecks()
            with holding_for_the_pass(left):
                out = aggregate_buffers(self.compressor, slots, buffers, step, tensors[0].device, final=True,
                                        layouts=layouts)
            return [out, Shared(left)]

        result = computed_once("aggregate", aggregate)
        if pass_checks is None:
            return result
        pass_checks.copy_from(result[1].value)
        return result[0]

    def _parameter_server(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        device = tensors[0].device

        def serve(buffers: list[Tensor]) -> Tensor:
            try:
                aggregates = aggregate_buffers(self.compressor, slots, buffers, step, device)
            except (StepAbandoned, AbandonedHere):  # a deferred verdict (fixed sizes both ways), read here alone:
                if not deferring():  # a bad one, or an aggregate that is not finite, goes to every worker in place
                    raise  # of the downstream message
                return abandon_message(downstream_size, device)
            return serve_compressed(self.server_compressor, slots, aggregates, step, downstream_size, device)

        size = self._fixed_size(self.compressor, slots)
        sizes = None if size is None else [size] * self.world_size
        downstream_size = self._fixed_size(self.server_compressor, slots)
        downstream = yield from parameter_server(
            self.rank, self._encoded(slots, tensors, step), serve, self.root, sizes, downstream_size,
            limit=None if sizes is not None else self._largest(self.compressor, slots),
            downstream_limit=None if downstream_size is not None else self._largest(self.server_compressor, slots),
        )
        if deferring():  # the root's abandoned message abandons the step on every worker, at the read below
            add_to_verdict(abandon_flags([downstream]))
        # this worker's result, sent on to no one: its checks may wait for the step's (or the pass's) one read
        later = DeviceChecks()
        with later.collecting():
            result = [
                self.server_compressor.decompress(fields, s, step)
                for s, fields in zip(slots, decode_slots(self.server_compressor, slots, downstream, later))
            ]
        read_result(later, result, self.server_compressor)
        return result

    # -- state -----------------------------------------------------------------------------------------------

    def retain(self, slots: Sequence[Slot]) -> None:
        kept = set(slots)
        self._sizes = {key: size for key, size in self._sizes.items() if kept.issuperset(key[1])}
        self._worth = {slot: worth for slot, worth in self._worth.items() if slot in kept}
        self.compressor.retain(list(slots))
        self.server_compressor.retain(list(slots))

    def state_dict(self) -> dict:
        return {"compressor": self.compressor.state_dict(), "server": self.server_compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        unexpected = sorted(set(state) - {"compressor", "server"})
        if unexpected:  # another method's state (PowerSGD's q and error, ...): its values would be dropped
            raise ConfigError(f"a single-round exchange's state has keys compressor and server, got {unexpected}")
        self.compressor.load_state_dict(state.get("compressor", {}))
        self.server_compressor.load_state_dict(state.get("server", {}))
