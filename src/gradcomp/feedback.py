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


class ErrorFeedback(Compressor):
    unbiased = False
    omega = None

    def __init__(self, inner: Compressor):
        if isinstance(inner, ErrorFeedback):
            raise ConfigError("error feedback is already applied to this compressor")
        if inner.unbiased and inner.omega is not None and inner.omega >= 1:
            raise ConfigError(
                f"error feedback needs a contractive compressor, but {inner!r} is unbiased with variance "
                f"omega={inner.omega:g} >= 1: its residual grows without bound (for randomk use scale=False)"
            )
        self.inner = inner
        self.name = inner.name
        self.summable = inner.summable
        self.owns_momentum = inner.owns_momentum
        self.residuals: dict[str, Tensor] = {}

    def bind_worker(self, worker: int) -> None:
        super().bind_worker(worker)
        self.inner.bind_worker(worker)

    def params(self) -> dict[str, Any]:
        return {**self.inner.params(), "error_feedback": True}

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return self.inner.specs(slot)

    @staticmethod
    def _key(slot: Slot) -> str:
        return f"{slot.name}#{slot.numel}"

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        key = self._key(slot)
        residual = self.residuals.get(key)
        wanted = x.reshape(-1).to(torch.float32)
        if residual is not None:
            wanted = wanted + residual
        fields = self.inner.compress(wanted, slot, step)
        self.residuals[key] = wanted - self.inner.decompress(fields, slot, step)
        return fields

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        return self.inner.decompress(fields, slot, step)

    def aggregate(self, total: Tensor, count: int) -> Tensor:
        return self.inner.aggregate(total, count)

    def retain(self, slots: list[Slot]) -> None:
        keep = {self._key(s) for s in slots}
        self.residuals = {k: v for k, v in self.residuals.items() if k in keep}
        self.inner.retain(slots)

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        self.inner.accumulate(fields, slot, step, out)

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
