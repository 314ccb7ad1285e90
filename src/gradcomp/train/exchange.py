"""GradientExchange: compress → encode → protocol → decode → decompress → average, for one worker.

One object per worker. ``exchange(slots, tensors, step)`` returns, on every worker, the same list of averaged
dense float32 tensors. The protocol follows from the compressor and the chosen topology:

- ``allreduce`` (default for summable compressors): the fields of all slots are concatenated into one flat
  tensor and summed with a single allreduce; no header travels, the values are the message.
- ``allgather`` (default for the rest): all slots' fields become ONE encoded buffer (wire layer), gathered
  from every worker; each worker decodes all buffers in rank order, so every replica computes the same sum.
- ``ps``: parameter server at ``root``: it decodes and averages the gathered buffers, compresses the average
  with ``server_compressor`` (its own instance and residual; uncompressed fp32 when none is given), and
  broadcasts that one buffer, which every worker decodes.

Before anything is sent, each tensor is checked: floating point, the slot's size, finite (NaN / Inf raise
NonFiniteGradientError naming the slot).

Time is split honestly: ``communicate_s`` is the time inside collectives (the transport's clock), and
``compress_s`` is everything else this object does (compress, encode, decode, decompress, average); a
simulated worker's waits for the other workers' turns count as neither.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from gradcomp.compressors.base import Compressor, Fields, Slot
from gradcomp.compressors.dense import NoCompression
from gradcomp.errors import ConfigError, NonFiniteGradientError
from gradcomp.protocols import allgather_buffers, allreduce_sum, parameter_server
from gradcomp.transport.base import Transport
from gradcomp.wire import decode, encode

TOPOLOGIES = ("auto", "allreduce", "allgather", "ps")


def check_gradients(names: Sequence[str], tensors: Sequence[Tensor], exchange: int | None = None) -> None:
    """Raise before any communication if a tensor is not floating point or holds NaN / Inf.

    ``exchange`` is the 0-based index of this exchange (the training step when gradients are exchanged every
    step); it goes into the message and the error's ``step``.
    """
    for name, t in zip(names, tensors):
        if not t.is_floating_point():
            raise ConfigError(f"{name}: gradcomp compresses floating-point tensors, got dtype {t.dtype}")
    if not tensors:
        return
    finite = torch.stack([torch.isfinite(t).all() for t in tensors])
    if not bool(finite.all()):
        bad = [name for name, ok in zip(names, finite.tolist()) if not ok]
        where = f" at exchange {exchange}" if exchange is not None else ""
        raise NonFiniteGradientError(
            f"non-finite (NaN or Inf) gradient{where} in {', '.join(bad)}; nothing was sent", step=exchange
        )


class GradientExchange:
    def __init__(
        self,
        compressor: Compressor,
        transport: Transport,
        *,
        topology: str = "auto",
        server_compressor: Compressor | None = None,
        root: int = 0,
    ):
        if topology not in TOPOLOGIES:
            raise ConfigError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
        if topology == "auto":
            topology = "allreduce" if compressor.summable else "allgather"
        if topology == "allreduce" and not compressor.summable:
            raise ConfigError(
                f"compressor {compressor.name!r} is not summable: use topology 'allgather' or 'ps'"
            )
        if server_compressor is not None and topology != "ps":
            raise ConfigError("a server (downstream) compressor needs topology 'ps'")
        if not 0 <= root < transport.world_size:
            raise ConfigError(f"root {root} is not a rank of a world of size {transport.world_size}")
        self.compressor = compressor
        self.compressor.bind_worker(transport.rank)
        self.transport = transport
        self.topology = topology
        self.server_compressor = server_compressor if server_compressor is not None else NoCompression()
        self.server_compressor.bind_worker(transport.world_size)  # the server rounds independently of every worker
        self.root = root
        self.compress_s = 0.0

    @property
    def communicate_s(self) -> float:
        return self.transport.counter.seconds

    def exchange(
        self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int, *, validate: bool = True
    ) -> list[Tensor]:
        """The average over workers of the decompressed messages; ``validate=False`` if the caller checked."""
        if len(slots) != len(tensors):
            raise ConfigError(f"{len(slots)} slots but {len(tensors)} tensors")
        for slot, t in zip(slots, tensors):
            if t.numel() != slot.numel:
                raise ConfigError(f"{slot.name}: tensor has {t.numel()} elements, slot says {slot.numel}")
        if validate:
            check_gradients([s.name for s in slots], tensors)
        started, blocked_before = time.perf_counter(), self._blocked_seconds()
        if self.topology == "allreduce":
            result = self._allreduce(slots, tensors, step)
        elif self.topology == "allgather":
            result = self._allgather(slots, tensors, step)
        else:
            result = self._parameter_server(slots, tensors, step)
        blocked = self._blocked_seconds() - blocked_before
        self.compress_s += time.perf_counter() - started - blocked
        return result

    def _blocked_seconds(self) -> float:
        return self.transport.counter.seconds + self.transport.idle_seconds()

    # -- protocols -------------------------------------------------------------------------------------------

    def _allreduce(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> list[Tensor]:
        messages = [self.compressor.compress(t, s, step) for s, t in zip(slots, tensors)]
        sizes = [[f.numel() for f in fields] for fields in messages]
        if not messages:
            return []
        # Divide before summing (as torch's fp16 hook does): a half-precision sum of W large values would
        # overflow where their average does not. Summable messages decompress linearly, so this is the mean.
        flat = torch.cat([f.reshape(-1) for fields in messages for f in fields]) / self.transport.world_size
        summed = allreduce_sum(self.transport, flat)
        pieces = iter(torch.split(summed, [n for per_slot in sizes for n in per_slot]))
        return [
            self.compressor.decompress([next(pieces) for _ in per_slot], s, step) for s, per_slot in zip(slots, sizes)
        ]

    def _encode(self, compressor: Compressor, slots: Sequence[Slot], messages: Sequence[Fields]) -> Tensor:
        return encode(
            [f for fields in messages for f in fields],
            [spec for s in slots for spec in compressor.specs(s)],
        )

    def _decode(self, compressor: Compressor, slots: Sequence[Slot], buffer: Tensor) -> list[Fields]:
        specs_per_slot = [compressor.specs(s) for s in slots]
        fields = iter(decode(buffer, [spec for specs in specs_per_slot for spec in specs]))
        return [[next(fields) for _ in specs] for specs in specs_per_slot]

    def _average(self, slots: Sequence[Slot], buffers: Sequence[Tensor], step: int, device) -> list[Tensor]:
        totals = [torch.zeros(s.numel, dtype=torch.float32, device=device) for s in slots]
        for buffer in buffers:
            for s, fields, total in zip(slots, self._decode(self.compressor, slots, buffer), totals):
                self.compressor.accumulate(fields, s, step, total)
        return [total.div_(len(buffers)) for total in totals]

    def _allgather(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> list[Tensor]:
        messages = [self.compressor.compress(t, s, step) for s, t in zip(slots, tensors)]
        buffers = allgather_buffers(self.transport, self._encode(self.compressor, slots, messages))
        return self._average(slots, buffers, step, _device_of(tensors, self.transport))

    def _parameter_server(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> list[Tensor]:
        device = _device_of(tensors, self.transport)
        messages = [self.compressor.compress(t, s, step) for s, t in zip(slots, tensors)]

        def aggregate(buffers: list[Tensor]) -> Tensor:
            averages = self._average(slots, buffers, step, device)
            down = [self.server_compressor.compress(a, s, step) for s, a in zip(slots, averages)]
            return self._encode(self.server_compressor, slots, down)

        downstream = parameter_server(
            self.transport, self._encode(self.compressor, slots, messages), aggregate, self.root
        )
        return [
            self.server_compressor.decompress(fields, s, step)
            for s, fields in zip(slots, self._decode(self.server_compressor, slots, downstream))
        ]

    # -- checkpointing ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"compressor": self.compressor.state_dict(), "server": self.server_compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state.get("compressor", {}))
        self.server_compressor.load_state_dict(state.get("server", {}))


def _device_of(tensors: Sequence[Tensor], transport: Transport) -> torch.device:
    return tensors[0].device if tensors else transport.device
