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

In place. The three lines above, written out of place, build a, D(m) and a - D(m) afresh every step: on a
10M-entry gradient 120 MB of new pages, which cost several times the arithmetic on them (a fresh CPU tensor
is faulted in and zeroed on first touch) and made SBC, STC, EF-signSGD and 1-bit SGD several times slower
with feedback than without. The wrappers keep one buffer per slot instead and update it in place, with the
same IEEE operations, so residuals and messages are bit for bit those of the formulas above
(tests/test_feedback_inplace.py checks them against the out-of-place reference, tests/test_wire_stability.py
the messages):

- r = x + r is ``torch.add(x, r, out=r)``: the same operands in the same order (the first step copies x);
  with m = C(r) it is the inner compressor's ``compress_sum`` (``compressors/base.py``): EF-signSGD and 1-bit
  SGD, which read their input chunk by chunk, add each chunk just before reading it (the same sums; one pass
  over the residual fewer from memory: docs/methods/sign.md has the times);
- m = C(r): the inner compressor reads the buffer. A message field that is a view of it (uncompressed fp32
  returns its input itself) is copied before the buffer changes (``_detached``);
- r = r - D(m) (``subtract_sent`` of ``compressors/base.py``, which each compressor may override next to its
  ``decompress``): a sparse message (top-k, threshold, random-k, random-block, SBC, STC and their
  compositions) says which entries it sends (``sent_entries``) and decompresses to +0.0 everywhere else, and
  a - (+0.0) = a for every a, signed zeros and NaN included, so only r[i] - v_i at the k positions is
  computed; a dense cast (fp16, bf16, fp32) subtracts its field in place (the half-precision value is widened
  in the kernel, exactly as by ``.to(torch.float32)``); the sign family subtracts its decoded values chunk by
  chunk from a reused scratch buffer. Any other compressor (dithering, cnat, terngrad) still builds D(m) once
  and subtracts it in place: one d-sized temporary instead of three;
- should the inner compressor raise (non-finite input), the slot's buffer, already a = x + r, is dropped:
  the slot starts afresh rather than from half a step.

A shortcut is used only where the compressor's class declares it (``Compressor.capabilities``, set in each
class's own body and never inherited), so a subclass that decodes differently falls back to the generic route
instead of a wrong shortcut.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors import base
from gradcomp.compressors.base import (
    Capabilities,
    Compressor,
    Fields,
    SizedSelection,
    Slot,
    Tally,
    compress_each,
    compress_sum,
    new_tally,
    sent_entries,
    subtract_sent,
)
from gradcomp.errors import ConfigError
from gradcomp.compressors.state import Momentum, SlotState
from gradcomp.wire import FieldSpec
from gradcomp.wire.bits import host_path

# ------------------------------------------------------------------------------ in-place buffers


def _detached(fields: Fields, buffer: Tensor) -> Fields:
    """``fields``, with a copy of every field that shares memory with ``buffer``, the buffer the compressor
    was given and that is about to change in place.

    Only uncompressed fp32 does that among the built-ins (``x.to(torch.float32)`` is ``x`` itself); every
    other compressor builds its fields afresh (index_select, cat, casts, codes). Checked for every message all
    the same: a field that silently followed the residual would send what was kept, not what was sent.
    """
    if buffer.numel() == 0:
        return fields
    storage = buffer.untyped_storage().data_ptr()
    return [f.clone() if f.numel() and f.untyped_storage().data_ptr() == storage else f for f in fields]


def _fresh_copy(flat: Tensor, x: Tensor) -> Tensor:
    """A float32 buffer holding ``flat`` (the flat float32 view or conversion of ``x``) that does not share
    memory with ``x``: ``flat`` itself when the conversion already copied."""
    if flat.numel() and flat.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        return flat.contiguous()
    return flat.clone(memory_format=torch.contiguous_format)


def _float32_flat(x: Tensor) -> Tensor:
    return x.reshape(-1).to(torch.float32)


class _FeedbackWrapper(Compressor):
    """What every feedback policy shares: it wraps a contractive compressor and keeps its wire layout,
    summability and aggregation, so protocols need not know that feedback is there."""

    capabilities = Capabilities(accumulate=True, tally=True)
    wraps = ("inner",)
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
        self.scale_free = getattr(inner, "scale_free", False)  # a majority vote stays one (LocalUpdateExchange)

    def specs(self, slot: Slot) -> list[FieldSpec]:
        return self.inner.specs(slot)

    def decompress(self, fields: Fields, slot: Slot, step: int) -> Tensor:
        return self.inner.decompress(fields, slot, step)

    def aggregate(self, total: Tensor, count: int) -> Tensor:
        return self.inner.aggregate(total, count)

    def accumulate(self, fields: Fields, slot: Slot, step: int, out: Tensor) -> None:
        base.accumulate(self.inner, fields, slot, step, out)

    def new_tally(self, slot: Slot, device: torch.device) -> Tally | None:
        return new_tally(self.inner, slot, device)  # messages, decoding and aggregation are the inner's

    # the per-slot state (``self.state``, a SlotState) beside the inner compressor's
    def retain(self, slots: list[Slot]) -> None:
        self.state.retain(slots)
        self.inner.retain(slots)

    def state_dict(self) -> dict[str, Any]:
        return {**self.state.state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict({k: v for k, v in state.items() if k != "inner"})  # checked: unchanged if bad
        self.inner.load_state_dict(state.get("inner", {}))


class ErrorFeedback(_FeedbackWrapper):
    """Error feedback around ``inner``: one residual buffer per slot, updated in place (module docstring)."""

    # (compress_slots: its own goes through the inner compressor's where that declares one, else slot by slot)
    capabilities = dataclasses.replace(_FeedbackWrapper.capabilities, select_sized=True, compress_slots=True)

    def __init__(self, inner: Compressor):
        super().__init__(inner, "error feedback")
        self.owns_momentum = inner.owns_momentum
        self.state = SlotState("error-feedback", ["residuals"])

    residuals = property(lambda self: self.state["residuals"], doc="the residual per slot key (``name#numel``)")

    def params(self) -> dict[str, Any]:
        return {**self.inner.params(), "error_feedback": True}

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        """a = x + r, m = C(a), r = a - D(m), all in the slot's one residual buffer (module docstring)."""
        flat = _float32_flat(x)
        residual = self.state.get("residuals", slot, flat)
        first = residual is None
        if first:
            residual = _fresh_copy(flat, x)  # a = x: a buffer of our own, never the caller's tensor
        self.state.put("residuals", slot, residual)
        try:
            # a = x + r (the operands in the reference's order), added in place, chunk by chunk where the
            # compressor reads its input in chunks; then m = C(a)
            sent = self.inner.compress(residual, slot, step) if first else compress_sum(
                self.inner, flat, residual, slot, step)
            fields = _detached(sent, residual)
            subtract_sent(self.inner, fields, slot, step, residual)  # r = a - D(m)
        except BaseException:
            self.state.drop(slot)  # it holds x + r by now: a defined state is a fresh start, not a half step
            raise
        return fields

    def compress_slots(self, tensors: Sequence[Tensor], slots: Sequence[Slot], step: int) -> list[Fields]:
        """:meth:`compress` for the slots of one message, through the inner compressor's ``compress_slots`` where it
        declares its own (``capabilities.compress_slots``: it reads all the slots' sizes back from a GPU at once)
        and the tensors are not on
        the CPU's host path (whose fused, chunked a = x + r keeps :meth:`compress`): every a = x + r first, then the
        inner messages of all of them, then every r = a - D(m). The same arithmetic, so the same messages."""
        if not tensors or host_path(tensors[0]) or not self.inner.capabilities.compress_slots:
            return compress_each(self, tensors, slots, step)
        residuals = self._added(tensors, slots)
        return self._subtracted(lambda: self.inner.compress_slots(residuals, slots, step), residuals, slots, step)

    def _subtracted(self, messages, residuals: list[Tensor], slots: Sequence[Slot], step: int) -> list[Fields]:
        """The inner messages that ``messages()`` makes of the a's, each r = a - D(m) after it (the slots' state
        dropped if anything fails: x + r by now, or half of a step; a defined state is a fresh start)."""
        out = []
        with self._fresh_start_on_failure(slots):
            for fields, residual, slot in zip(messages(), residuals, slots):
                fields = _detached(fields, residual)
                subtract_sent(self.inner, fields, slot, step, residual)  # r = a - D(m)
                out.append(fields)
        return out

    @contextlib.contextmanager
    def _fresh_start_on_failure(self, slots: Sequence[Slot]):
        """Drops the slots' residuals if the body raises: they hold x + r by then, or half of a step."""
        try:
            yield
        except BaseException:
            for slot in slots:
                self.state.drop(slot)
            raise

    def _added(self, tensors: Sequence[Tensor], slots: Sequence[Slot]) -> list[Tensor]:
        """Every slot's a = x + r, in its residual buffer (the slots' state dropped if anything fails)."""
        residuals = []
        with self._fresh_start_on_failure(slots):
            for x, slot in zip(tensors, slots):
                flat = _float32_flat(x)
                residual = self.state.get("residuals", slot, flat)
                if residual is None:
                    residual = _fresh_copy(flat, x)  # a = x: a buffer of our own, never the caller's tensor
                else:
                    torch.add(flat, residual, out=residual)  # a = x + r, the operands in compress_sum's order
                self.state.put("residuals", slot, residual)
                residuals.append(residual)
        return residuals

    def select_sized(self, tensors: Sequence[Tensor], slots: Sequence[Slot], step: int) -> SizedSelection | None:
        """:meth:`compress_slots` in two halves where the inner compressor selects with its sizes on the device
        (``Capabilities.select_sized``; None otherwise, before anything is touched): every a = x + r, the inner
        selection of them, and in ``finish`` the inner messages and every r = a - D(m). Where the inner compressor
        declines at run time, its ``compress_slots`` of the a's stands in (its counts are then known)."""
        if not self.inner.capabilities.select_sized or host_path(tensors[0]):
            return None
        residuals = self._added(tensors, slots)
        with self._fresh_start_on_failure(slots):
            inner = self.inner.select_sized(residuals, slots, step)
            if inner is None:
                inner = SizedSelection.made(self.inner, slots, base.compress_slots(self.inner, residuals, slots, step))

        return dataclasses.replace(
            inner, finish=lambda values: self._subtracted(lambda: inner.finish(values), residuals, slots, step)
        )

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

    capabilities = _FeedbackWrapper.capabilities
    owns_momentum = True

    def __init__(self, inner: Compressor, momentum: float = 0.9, masking: bool = False):
        super().__init__(inner, "momentum correction")
        if inner.owns_momentum:
            raise ConfigError(f"{inner.name!r} applies momentum itself: it takes no momentum correction")
        if not isinstance(masking, bool):
            raise ConfigError(f"masking must be true or false, got {masking!r}")
        self.masking = masking
        self.memory = Momentum(momentum, self.policy.replace("_", "-"))
        self.state = self.memory.state

    momentum = property(lambda self: self.memory.momentum)
    velocity = property(lambda self: self.state["velocity"], doc="u per slot key (``name#numel``)")
    accumulated = property(lambda self: self.state["accumulated"], doc="v per slot key (``name#numel``)")

    @property
    def policy(self) -> str:
        return "momentum_masking" if self.masking else "momentum_correction"

    def params(self) -> dict[str, Any]:
        return {**self.inner.params(), "feedback": self.policy, "feedback_momentum": self.momentum}

    def compress(self, x: Tensor, slot: Slot, step: int) -> Fields:
        """The update rule of the class docstring on the slot's u and v buffers, in place (``state.Momentum``:
        no d-sized temporary for a sparse or sign message; the masking of a sparse message touches its k
        positions only)."""
        _, v = self.memory.step(slot, _float32_flat(x))
        try:
            fields = _detached(self.inner.compress(v, slot, step), v)  # a field may be a view of what it compressed
            sparse = sent_entries(self.inner, fields, slot, step)
            if sparse is not None:
                self.memory.sent(slot, *sparse, masking=self.masking)
            elif self.masking:
                self.memory.sent_dense(slot, self.inner.decompress(fields, slot, step))
            else:
                subtract_sent(self.inner, fields, slot, step, v)
        except BaseException:
            self.state.drop(slot)  # half updated: start the slot afresh (as ErrorFeedback)
            raise
        return fields

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
