"""The transport interface: six collectives over tensors, and honest byte counters.

A transport moves tensors; it knows nothing of compressors. Every byte of every tensor handed to a collective
is counted, from the point of view of one worker:

- ``all_reduce_sum(t)`` / ``all_reduce_max(t)``: the worker sends t and receives the reduced t:
  up += t.nbytes, down += t.nbytes.
- ``all_gather(t)``: the worker sends t and receives the W - 1 other workers' tensors:
  up += t.nbytes, down += (W - 1) * t.nbytes.
- ``gather(t, root)`` (parameter-server uplink): every worker, the root's own worker role included, sends t
  (up += t.nbytes); the root's server role receives all W tensors (server_in += W * t.nbytes). The server is
  accounted as a separate logical machine even though it lives in the root's process.
- ``all_to_all(t)``: t holds W equal chunks, chunk j for worker j; the worker keeps its own chunk and
  receives one chunk from each other worker: up += (W - 1) * chunk, down += (W - 1) * chunk.
- ``broadcast(t, root)`` (parameter-server downlink): the root's server role sends t once per worker
  (server_out += W * t.nbytes, payload only) and every worker receives it (down += t.nbytes).
- ``broadcast(t, root, peer=True)`` (a worker sends to the others, e.g. LGC's leader): the root sends t
  (up += t.nbytes) and receives nothing; every other worker receives it (down += t.nbytes); no server role.

Each call names its kind: ``payload`` (messages), ``control`` (size exchanges). Once-per-run set-up checks (the
workers' slot lists, compared at the first exchange) are booked apart, in ``up_setup`` / ``down_setup``
(``book_setup``), and in nothing else: not in the step bytes, the collectives, ``ops`` or ``seconds``. Padding that equal-size
collectives need is passed in by the protocol (``pad_up``, ``pad_down``) and booked apart from the payload.
Wall-clock time spent inside collectives is accumulated in ``seconds``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields

import torch
from torch import Tensor

PAYLOAD = "payload"
CONTROL = "control"


@dataclass
class ByteCounter:
    up_payload: int = 0
    up_padding: int = 0
    up_control: int = 0
    down_payload: int = 0
    down_padding: int = 0
    down_control: int = 0
    server_in: int = 0
    server_out: int = 0
    # once-per-run set-up traffic (the slot check at the first exchange): not step bytes, apart from the rest
    up_setup: int = 0
    down_setup: int = 0
    collectives: int = 0
    seconds: float = 0.0
    # per collective: [calls, bytes of the tensors handed to it] — what the latency-bandwidth model prices
    ops: dict[str, list[int]] = field(default_factory=dict)

    def record(self, op: str, nbytes: int) -> None:
        calls_bytes = self.ops.setdefault(op, [0, 0])
        calls_bytes[0] += 1
        calls_bytes[1] += nbytes

    def book(self, kind: str, up: int, down: int, pad_up: int = 0, pad_down: int = 0) -> None:
        if kind == CONTROL:
            self.up_control += up
            self.down_control += down
        else:
            self.up_payload += up - pad_up
            self.down_payload += down - pad_down
            self.up_padding += pad_up
            self.down_padding += pad_down

    def book_setup(self, up: int, down: int) -> None:
        """Once-per-run set-up traffic: counted here only, apart from the steps' bytes."""
        self.up_setup += up
        self.down_setup += down

    @property
    def setup_bytes(self) -> int:
        """Set-up traffic this worker sent and received (once per run; not in ``bytes_up`` / ``bytes_down``)."""
        return self.up_setup + self.down_setup

    @property
    def bytes_up(self) -> int:
        """Everything this worker sent except padding: messages plus size exchanges."""
        return self.up_payload + self.up_control

    @property
    def bytes_down(self) -> int:
        return self.down_payload + self.down_control

    @property
    def padding_bytes(self) -> int:
        return self.up_padding + self.down_padding

    def as_dict(self) -> dict:
        return asdict(self)

    def report(self, fp32_bytes: int | None = None) -> str:
        """The counts with units, one line per direction; ``print(counter)`` shows this.

        ``fp32_bytes``: what uncompressed fp32 would have handed to its all-reduce over the same steps (4 bytes
        per parameter per step, up and down alike); given, each direction is compared with it.
        """

        def versus(sent: int) -> str:
            if fp32_bytes is None:
                return ""
            if not sent:
                return f"; fp32: {_human_bytes(fp32_bytes)}"
            if sent <= fp32_bytes:
                return f"; x{fp32_bytes / sent:,.1f} fewer than fp32 ({_human_bytes(fp32_bytes)})"
            return f"; x{sent / fp32_bytes:,.1f} more than fp32 ({_human_bytes(fp32_bytes)})"

        lines = [
            f"sent      {_human_bytes(self.bytes_up)} (payload {_human_bytes(self.up_payload)} + control "
            f"{_human_bytes(self.up_control)}){versus(self.bytes_up)}",
            f"received  {_human_bytes(self.bytes_down)} (payload {_human_bytes(self.down_payload)} + control "
            f"{_human_bytes(self.down_control)}){versus(self.bytes_down)}",
            f"padding   {_human_bytes(self.padding_bytes)} (up {_human_bytes(self.up_padding)}, down "
            f"{_human_bytes(self.down_padding)}; not in the counts above)",
        ]
        if self.up_setup or self.down_setup:
            lines.append(
                f"set-up    sent {_human_bytes(self.up_setup)}, received {_human_bytes(self.down_setup)} (once per "
                "run; not in the counts above)"
            )
        if self.server_in or self.server_out:
            lines.append(f"server    in {_human_bytes(self.server_in)}, out {_human_bytes(self.server_out)}")
        lines.append(f"{self.collectives} collectives, {self.seconds:.3g} s in them")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default_factory() if f.name == "ops" else f.default)

    def snapshot(self) -> ByteCounter:
        return ByteCounter(**{**asdict(self), "ops": {k: list(v) for k, v in self.ops.items()}})


def _human_bytes(n: float) -> str:
    """Bytes with a decimal unit: 512 B, 13.40 kB, 2.10 MB, 1.25 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


class Transport(ABC):
    """One worker's view of the collectives. Subclasses implement the underscored primitives."""

    rank: int
    world_size: int

    def __init__(self) -> None:
        self.counter = ByteCounter()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _timed(self, fn, *args):
        start, idle_before = time.perf_counter(), self.idle_seconds()
        result = fn(*args)
        self._sync()
        idle = self.idle_seconds() - idle_before
        self.counter.seconds += time.perf_counter() - start - idle
        self.counter.collectives += 1
        return result

    def idle_seconds(self) -> float:
        """Time spent waiting for other (simulated) workers to take their turn; not communication."""
        return 0.0

    def _sync(self) -> None:  # noqa: B027 - a hook with a do-nothing default, not an abstract method
        """Wait for asynchronous device work so timings are true (CUDA); nothing to do on the CPU."""

    def all_reduce_sum(self, t: Tensor, kind: str = PAYLOAD, inplace: bool = False) -> Tensor:
        """Elementwise sum over workers, identical on every worker; ``inplace`` lets it overwrite ``t``."""
        result = self._timed(self._all_reduce_sum, t.contiguous(), inplace)
        self.counter.book(kind, up=t.nbytes, down=t.nbytes)
        self.counter.record("all_reduce", t.nbytes)
        return result

    def all_reduce_max(self, t: Tensor, kind: str = PAYLOAD) -> Tensor:
        """Elementwise maximum over workers; returns a new tensor, identical on every worker."""
        result = self._timed(self._all_reduce_max, t.contiguous())
        self.counter.book(kind, up=t.nbytes, down=t.nbytes)
        self.counter.record("all_reduce", t.nbytes)
        return result

    def all_to_all(self, t: Tensor, kind: str = PAYLOAD, pad_up: int = 0, pad_down: int = 0) -> Tensor:
        """``t`` is W equal chunks along dim 0, chunk j for worker j; returns W chunks, chunk i from worker i.

        ``pad_up`` / ``pad_down``: padding inside the chunks sent to / received from the other workers.
        """
        if t.shape[0] % self.world_size:
            raise ValueError(f"all_to_all needs a multiple of {self.world_size} rows, got {t.shape[0]}")
        result = self._timed(self._all_to_all, t.contiguous())
        crossing = t.nbytes // self.world_size * (self.world_size - 1)
        self.counter.book(kind, up=crossing, down=crossing, pad_up=pad_up, pad_down=pad_down)
        self.counter.record("all_to_all", t.nbytes)
        return result

    def all_gather(self, t: Tensor, kind: str = PAYLOAD, pad_up: int = 0, pad_down: int = 0) -> list[Tensor]:
        """Every worker's tensor, in rank order. All workers must pass tensors of the same shape and dtype."""
        result = self._timed(self._all_gather, t.contiguous())
        self.counter.book(kind, up=t.nbytes, down=(self.world_size - 1) * t.nbytes, pad_up=pad_up, pad_down=pad_down)
        self.counter.record("all_gather", t.nbytes)
        return result

    def gather(
        self, t: Tensor, root: int, kind: str = PAYLOAD, pad_up: int = 0, pad_in: int = 0
    ) -> list[Tensor] | None:
        """The root gets every worker's tensor in rank order; the others get None. Equal shapes required.

        ``pad_in`` (root only) is the padding in all the tensors the server receives, not booked as server input.
        """
        result = self._timed(self._gather, t.contiguous(), root)
        self.counter.book(kind, up=t.nbytes, down=0, pad_up=pad_up)
        self.counter.record("gather", t.nbytes)
        if self.rank == root:
            self.counter.server_in += self.world_size * t.nbytes - pad_in
        return result

    def broadcast(self, t: Tensor, root: int, kind: str = PAYLOAD, peer: bool = False) -> Tensor:
        """The root's ``t`` on every worker; the others pass a tensor of the right shape and dtype to fill.

        ``peer``: the root is a worker sending to its peers, not the parameter server's downlink (see the
        module docstring for how each is booked).
        """
        result = self._timed(self._broadcast, t.contiguous(), root)
        if peer:
            sender = self.rank == root
            self.counter.book(kind, up=t.nbytes if sender else 0, down=0 if sender else t.nbytes)
        else:
            self.counter.book(kind, up=0, down=t.nbytes)
            if self.rank == root and kind != CONTROL:
                self.counter.server_out += self.world_size * t.nbytes
        self.counter.record("broadcast", t.nbytes)
        return result

    @abstractmethod
    def _all_reduce_sum(self, t: Tensor, inplace: bool = False) -> Tensor: ...

    @abstractmethod
    def _all_reduce_max(self, t: Tensor) -> Tensor: ...

    @abstractmethod
    def _all_to_all(self, t: Tensor) -> Tensor: ...

    @abstractmethod
    def _all_gather(self, t: Tensor) -> list[Tensor]: ...

    @abstractmethod
    def _gather(self, t: Tensor, root: int) -> list[Tensor] | None: ...

    @abstractmethod
    def _broadcast(self, t: Tensor, root: int) -> Tensor: ...
