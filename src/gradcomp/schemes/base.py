"""The scheme interface: a method that owns its rounds of communication and its aggregation rule.

    class Scheme:
        def run(self, slots, tensors, step) -> Rounds   # a generator of collective requests
        def state_dict(self) / load_state_dict(state) / retain(slots)

``run`` yields requests (``gradcomp.transport.requests``) and receives their results; it returns, on every
worker, the aggregated dense float32 tensors, one per slot. Drivers decide *how* the requests are carried
out: ``drive`` blocks (``GradientAggregator``, the simulated cluster); the DDP hook runs the same generator on
a communication thread so that a bucket's rounds overlap the rest of backward. A scheme is bound to its
worker (``bind(rank, world_size)``) before its first round.

Single-message compressors need no scheme of their own: ``SingleRound`` (allreduce / allgather / parameter
server) and ``Sharded`` carry any ``Compressor``. Methods with several rounds (PowerSGD) subclass ``Scheme``
and register under a name like any compressor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from gradcomp.compressors.base import Slot
from gradcomp.errors import ConfigError
from gradcomp.transport.requests import Rounds


class Scheme(ABC):
    name: ClassVar[str] = ""
    # a method that applies momentum itself: the outer optimizer must run without momentum
    owns_momentum: ClassVar[bool] = False
    # topologies the scheme can run its rounds over besides its own default ("auto"); see use_topology
    topologies: ClassVar[tuple[str, ...]] = ()
    rank: int = 0
    world_size: int = 1

    def bind(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not a rank of a world of size {world_size}")
        self.rank, self.world_size = int(rank), int(world_size)

    def params(self) -> dict[str, Any]:
        return {}

    def use_topology(self, topology: str, root: int = 0) -> None:
        """Run the rounds over ``topology`` (one of ``topologies``), with a parameter server at ``root``."""
        raise ConfigError(f"{self.name!r} owns its rounds: it takes no topology")

    @abstractmethod
    def run(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        """The rounds of one exchange; returns the aggregated float32 tensors (flat, one per slot)."""

    def defers_verdict(self, slots: Sequence[Slot]) -> bool:
        """Whether the workers' verdict on the step's finiteness may be read after the rounds rather than at the
        first message (``train.agreement.drive_agreeing``): only for rounds whose sizes follow from the slots
        alone and which read no data of a message before the wire's own checks (which read the verdict with them).
        A non-finite step then runs its rounds to the end (the same collectives on every worker) and is abandoned
        at that read. False (read at the first message) unless a scheme says otherwise."""
        return False

    def passes_verdict_on(self, slots: Sequence[Slot]) -> bool:
        """Whether a deferred verdict may ride on a parameter server's gather (the step's first message): only the
        root reads it there, with its checks of what it gathered, so only a scheme whose server then broadcasts an
        abandoned message in place of its aggregate (``wire.refusals.AbandonedHere``) may say so. False unless a
        scheme says otherwise: the verdict is then read at the gather, on every worker."""
        return False

    def verdict_in_result(self, slots: Sequence[Slot]) -> bool:
        """Whether a step that one worker's non-finite gradients spoil ends with a NaN in every worker's result
        and changes no state: a GradScaler's own check of the result is then the workers' verdict, and the
        exchange need not read it (``GradientExchange.exchange(handed_on=True)``). False unless a scheme says so."""
        return False

    def check_slots(self, slots: Sequence[Slot]) -> None:  # noqa: B027 - optional hook
        """Raise ConfigError, before anything is sent, if this scheme cannot carry these slots."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ConfigError(f"scheme {self.name!r} keeps no state but got keys {sorted(state)}")

    def restore_where(self, snapshot: dict[str, Any], bad: Tensor) -> bool:
        """``load_state_dict(snapshot)`` (a ``state_dict()`` taken before) if the device flag ``bad`` (a bool
        tensor of shape ()) is True, else nothing, without reading it: every state tensor becomes ``torch.where(bad,
        saved, now)``. False, and nothing changed, when the state's layout is no longer the snapshot's (other keys,
        shapes or plain values: a slot's first step adds its state), which only a read of the flag can decide.
        This default goes through ``state_dict()`` and ``load_state_dict`` (two more copies of the state); a scheme
        whose state is one ``SlotState`` does it in place (``SlotState.restore_where``)."""
        merged = _where_same_layout(bad, snapshot, self.state_dict())
        if merged is _DIFFERS:
            return False
        self.load_state_dict(merged)
        return True

    def retain(self, slots: Sequence[Slot]) -> None:  # noqa: B027 - optional hook, nothing kept by default
        """Drop any per-slot state (residuals, warm starts) of slots not in ``slots``."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


_DIFFERS = object()  # _where_same_layout's answer for two layouts that differ


def _where_same_layout(bad: Tensor, saved: Any, now: Any) -> Any:
    """``now`` with each tensor replaced by ``torch.where(bad, its saved copy, it)``; ``_DIFFERS`` where the two
    layouts differ (keys, lengths, a tensor's shape, dtype or device, a plain value)."""
    if isinstance(saved, Tensor) and isinstance(now, Tensor):
        if (saved.shape, saved.dtype, saved.device) != (now.shape, now.dtype, now.device):
            return _DIFFERS
        return torch.where(bad, saved, now)
    if isinstance(saved, dict) and isinstance(now, dict):
        if saved.keys() != now.keys():
            return _DIFFERS
        merged = {k: _where_same_layout(bad, saved[k], now[k]) for k in saved}
        return _DIFFERS if any(v is _DIFFERS for v in merged.values()) else merged
    if isinstance(saved, (list, tuple)) and type(saved) is type(now) and len(saved) == len(now):
        items = [_where_same_layout(bad, a, b) for a, b in zip(saved, now)]
        return _DIFFERS if any(v is _DIFFERS for v in items) else type(saved)(items)
    if isinstance(saved, Tensor) or isinstance(now, Tensor) or type(saved) is not type(now) or saved != now:
        return _DIFFERS
    return now
