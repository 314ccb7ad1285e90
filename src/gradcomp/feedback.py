"""Error feedback (residual accumulation) as a wrapper around any compressor.

Seide et al. 2014 ("1-bit SGD"), Stich et al. 2018, Karimireddy et al. 2019 (EF-SGD); the "residual
accumulation" of Sattler et al.'s SBC. For every tensor the wrapper keeps a residual r:

    a = x + r          what this worker would like to send
    m = C(a)           the message actually sent
    r = a - D(m)       what was not sent, added to the next step's input

The wrapper is itself a Compressor with the inner one's wire layout and summability, so protocols need not
know that feedback is there. Residuals are keyed by the slot's name and size: a DDP bucket whose size changes
when DDP rebuilds its buckets after the first iteration simply starts a fresh residual.

Error feedback needs a contractive compressor (E||C(x) - x||^2 < ||x||^2). An unbiased compressor with
variance omega >= 1, such as random-k scaled by d/k, is not: every time an entry is picked its residual is
multiplied by -(d/k - 1), and the residual explodes. Wrapping one raises ConfigError.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Compressor, Fields, Slot
from gradcomp.errors import ConfigError
from gradcomp.wire import FieldSpec


class _FeedbackWrapper(Compressor):
    """What every feedback policy shares: it wraps a contractive compressor and keeps its wire layout,
    summability and aggregation, so protocols need not know that feedback is there."""

    unbiased = False
    omega = None

    def __init__(self, inner: Compressor, what: str):
        if isinstance(inner, _FeedbackWrapper):
            raise ConfigError("feedback is already applied to this compressor")
        if inner.unbiased and inner.omega is not None and inner.omega >= 1:
            raise ConfigError(
                f"{what} needs a contractive compressor, but {inner!r} is unbiased with variance "
                f"omega={inner.omega:g} >= 1: its memory grows without bound (for randomk use scale=False)"
            )
        self.inner = inner
        self.name = inner.name
        self.summable = inner.summable

    def bind_worker(self, worker: int) -> None:
        super().bind_worker(worker)
        self.inner.bind_worker(worker)

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return self.inner.specs(slot)

    @staticmethod
    def _key(slot: Slot) -> str:
        return f"{slot.name}#{slot.numel}"

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        return self.inner.decompress(fields, slot, step)

    def aggregate(self, total: Tensor, count: int) -> Tensor:
        return self.inner.aggregate(total, count)

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        self.inner.accumulate(fields, slot, step, out)


class ErrorFeedback(_FeedbackWrapper):
    def __init__(self, inner: Compressor):
        super().__init__(inner, "error feedback")
        self.owns_momentum = inner.owns_momentum
        self.residuals: dict[str, Tensor] = {}

    def params(self) -> dict[str, Any]:
        return {**self.inner.params(), "error_feedback": True}

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        key = self._key(slot)
        residual = self.residuals.get(key)
        wanted = x.reshape(-1).to(torch.float32)
        if residual is not None:
            wanted = wanted + residual
        fields = self.inner.compress(wanted, slot, step)
        self.residuals[key] = wanted - self.inner.decompress(fields, slot, step)
        return fields

    def retain(self, slots: list[Slot]) -> None:
        keep = {self._key(s) for s in slots}
        self.residuals = {k: v for k, v in self.residuals.items() if k in keep}
        self.inner.retain(slots)

    def state_dict(self) -> dict[str, Any]:
        return {
            "residuals": {k: v.detach().clone() for k, v in self.residuals.items()},
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"residuals", "inner"}
        if unknown:
            raise ConfigError(f"unexpected error-feedback state keys {sorted(unknown)}")
        self.residuals = {k: v.detach().clone() for k, v in state.get("residuals", {}).items()}
        self.inner.load_state_dict(state.get("inner", {}))

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"


FEEDBACK_POLICIES = ("none", "residual", "momentum_correction", "momentum_masking")


class MomentumCorrection(_FeedbackWrapper):
    """DGC's momentum correction (Lin et al., ICLR 2018), with momentum factor masking when ``masking``.

    The worker keeps the momentum itself and compresses the accumulated velocity, not the gradient:

        u = m·u + g        velocity (the outer optimizer runs without momentum: ``owns_momentum``)
        v = v + u          accumulated velocity: what this worker would like to send
        s = D(C(v))        what is sent
        v = v − s          the rest waits (for a sparsifier: v is cleared where it was sent)
        u = 0 where s ≠ 0  momentum factor masking (``masking=True``): a coordinate that was just released
                           starts its momentum afresh instead of pushing the same direction again

    With plain error feedback and the optimizer's momentum, a sparsifier releases a coordinate once per ~1/p
    steps with everything it accumulated, and the global momentum then multiplies that release for many
    steps; here the momentum acts before the release, as DGC argues. Needs a contractive compressor, like
    ``ErrorFeedback``.
    """

    owns_momentum = True

    def __init__(self, inner: Compressor, momentum: float = 0.9, masking: bool = False):
        super().__init__(inner, "momentum correction")
        if inner.owns_momentum:
            raise ConfigError(f"{inner.name!r} applies momentum itself: it takes no momentum correction")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ConfigError(f"momentum must be a number in [0, 1), got {momentum!r}")
        if not isinstance(masking, bool):
            raise ConfigError(f"masking must be true or false, got {masking!r}")
        self.momentum, self.masking = float(momentum), masking
        self.velocity: dict[str, Tensor] = {}
        self.accumulated: dict[str, Tensor] = {}

    @property
    def policy(self) -> str:
        return "momentum_masking" if self.masking else "momentum_correction"

    def params(self) -> dict[str, Any]:
        return {**self.inner.params(), "feedback": self.policy, "feedback_momentum": self.momentum}

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        key = self._key(slot)
        g = x.reshape(-1).to(torch.float32)
        u = self.velocity.get(key)
        u = g.clone() if u is None else u.mul_(self.momentum).add_(g)
        v = self.accumulated.get(key)
        v = u.clone() if v is None else v + u  # out of place: a message may hold a view of what it compressed
        fields = self.inner.compress(v, slot, step)
        sent = self.inner.decompress(fields, slot, step)
        if self.masking:
            u.masked_fill_(sent != 0, 0.0)
        self.velocity[key], self.accumulated[key] = u, v - sent
        return fields

    def retain(self, slots: list[Slot]) -> None:
        keep = {self._key(s) for s in slots}
        self.velocity = {k: v for k, v in self.velocity.items() if k in keep}
        self.accumulated = {k: v for k, v in self.accumulated.items() if k in keep}
        self.inner.retain(slots)

    def state_dict(self) -> dict[str, Any]:
        return {
            "velocity": {k: v.detach().clone() for k, v in self.velocity.items()},
            "accumulated": {k: v.detach().clone() for k, v in self.accumulated.items()},
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"velocity", "accumulated", "inner"}
        if unknown:
            raise ConfigError(f"unexpected momentum-correction state keys {sorted(unknown)}")
        self.velocity = {k: v.detach().clone() for k, v in state.get("velocity", {}).items()}
        self.accumulated = {k: v.detach().clone() for k, v in state.get("accumulated", {}).items()}
        self.inner.load_state_dict(state.get("inner", {}))

    def __repr__(self) -> str:
        return f"MomentumCorrection({self.inner!r}, momentum={self.momentum}, masking={self.masking})"


def apply_feedback(compressor: Compressor, policy: str, momentum: float = 0.9) -> Compressor:
    """Wrap ``compressor`` in the named feedback policy (``FEEDBACK_POLICIES``)."""
    if policy not in FEEDBACK_POLICIES:
        raise ConfigError(f"feedback must be one of {FEEDBACK_POLICIES}, got {policy!r}")
    if policy == "none":
        return compressor
    if policy == "residual":
        return ErrorFeedback(compressor)
    return MomentumCorrection(compressor, momentum=momentum, masking=policy == "momentum_masking")
