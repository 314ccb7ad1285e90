"""Per-slot state: one store for the tensors a method keeps between steps, and the momentum arithmetic.

``SlotState`` holds named fields ("residuals", "velocity", "q", ...), each a tensor per slot, and writes once
what every stateful method needs: lookup (moved to the gradient's device once, then kept), ``retain`` (drop
the slots no longer exchanged), ``state_dict`` (detached copies) and ``load_state_dict``, which checks every
field, key, dtype and shape first and changes nothing unless all of them are right.

Keyed one way: by ``slot_key(slot)`` = ``"<slot name>#<number of elements>"``. The name, because it is what
identifies a tensor on every worker and across runs (a checkpoint is resumed by parameter name; an index
would move to another tensor when a parameter is added in front, and a DDP bucket's index says nothing of its
content); the size, because the same name can hold another tensor (a flattened DDP bucket after DDP rebuilds
its buckets): a slot whose size changed starts afresh instead of meeting a tensor of another shape, and
``load_state_dict`` can check a tensor's size before its slot is ever seen.

``journal()`` records, while it is open on a thread, every slot's state as it was before the first time any
``SlotState`` touched it there (a copy of that slot's tensors, or their absence), so that ``undo()`` puts back
exactly the state of the slots a step changed, at the price of one copy of those slots' state and nothing for
the others: what FSDP's compressed reduce-scatter needs to undo one module's compression when the ranks learn,
at its first message, that some rank's gradients were not finite (``train.fsdp``; ``snapshot``/``restore`` of
the whole state serve the other drivers, which undo a whole step).

A method's state that is not a tensor goes in ``held`` fields, keyed the same way, kept, dropped, saved and
loaded by the same code: an object that changes in place (LGC's autoencoder, whose "slot" is a slot list: one
``Slot`` of the list's names joined by ``|`` and its compressed size) or a plain value (a flag). Such an object
is saved by its own ``state_dict()``; loading puts a saved state into the object that holds the key (the same
object stays, on its device), and keeps it as saved where none does, for the method to make its object from when
it needs it (on the gradient's device).

``Momentum`` is the worker momentum with error accumulation that DGC's momentum correction
(``feedback.MomentumCorrection``, ``compressors.dgc``) and the sketched-SGD paper's methods
(``schemes.accumulation``) share, in place on a ``SlotState`` (no d-sized temporary per step):

    u ← m·u + g          velocity (u = g at a slot's first step)
    v ← v + u            accumulated velocity: what the worker would like to send (v = u at first)
    after sending:       v ← v − sent at the sent coordinates; u ← 0 where a nonzero value went out
                         (momentum factor masking)

``MovingAverage`` is Signum's momentum, the exponential moving average m ← β·m + (1 − β)·g (m = 0 before a
slot's first step), in place too.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Slot, subtract_at
from gradcomp.errors import ConfigError
from gradcomp.step_state import setting, step_state


def plain_name(name: str) -> str:
    """A parameter's name without the ``_orig_mod.`` that ``torch.compile``'s wrapper puts before it: a model and
    its compiled self give a parameter the same slot, so a state saved with one loads into the other (states saved
    under the compiled names load too: their keys are read through this as well). Only a whole name component
    ``_orig_mod`` goes (``blocks.0._orig_mod.w`` → ``blocks.0.w``; ``enc_orig_mod.w`` stays)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def slot_key(slot: Slot) -> str:
    """The key of a slot's state: ``"<name>#<numel>"`` (the module docstring says why)."""
    return f"{slot.name}#{slot.numel}"


def key_numel(key: object) -> int | None:
    """The number of elements a key names, or None when it is not a ``slot_key``."""
    try:
        n = int(key.rsplit("#", 1)[1]) if isinstance(key, str) else -1
    except (IndexError, ValueError):
        return None
    return n if n >= 0 else None


def flat_of_numel(field: str, key: str, numel: int, t: Tensor) -> str | None:
    """The default shape check of a loaded tensor: flat, the slot's size; else the reason it does not fit."""
    return None if tuple(t.shape) == (numel,) else f"shape {tuple(t.shape)}, expected ({numel},)"


class Journal:
    """The slots' state as it was before the open journal's first touch of each (``journal()``)."""

    def __init__(self) -> None:
        self._before: dict[tuple[int, str, str], tuple[SlotState, str, str, Tensor | None]] = {}

    def note(self, state: SlotState, field: str, key: str) -> None:
        if (id(state), field, key) not in self._before:
            t = state._fields[field].get(key)
            self._before[id(state), field, key] = (state, field, key, None if t is None else _saved(t))

    def undo(self) -> None:
        """Put every noted slot's state back as it was (a slot that had none has none again)."""
        for state, field, key, t in self._before.values():
            values = state._fields[field]
            if t is None:
                values.pop(key, None)
            elif not _loaded_into(values.get(key), t):
                values[key] = t
        self._before.clear()


def _saved(value: Any) -> Any:
    """A copy of a field's value, as a state dict holds it: a tensor's clone, an object's ``state_dict()`` (the
    object's own copy), else a deep copy."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    return value.state_dict() if hasattr(value, "state_dict") else copy.deepcopy(value)


def _loaded_into(now: Any, saved: Any) -> bool:
    """Whether ``now`` is a held object (one with ``load_state_dict``) and has taken ``saved`` in place."""
    if isinstance(now, Tensor) or not hasattr(now, "load_state_dict"):
        return False
    now.load_state_dict(saved)
    return True


@contextlib.contextmanager
def journal(record: Journal | None = None) -> Iterator[Journal]:
    """While open on this thread, every ``SlotState`` notes a slot's state before it first touches it (into
    ``record``, to go on with one opened before: FSDP's pass of several calls, ``train.fsdp``; else a new one)."""
    with setting("journal", record if record is not None else Journal()) as opened:
        yield opened


def _note(state: SlotState, fields: Iterable[str], key: str) -> None:
    record = step_state().journal
    if record is not None:
        for field in fields:
            record.note(state, field, key)


class SlotState:
    """Per-slot float32 tensors of one method, in named ``fields``, keyed by ``slot_key``; ``owner`` names the
    method in errors, ``check`` (field, key, numel, tensor) → reason or None is the shape a loaded tensor must
    have (flat, the slot's size, unless the method keeps another: PowerSGD's Q). ``held``: fields of values that
    are not tensors (the module docstring), loaded unchecked but for their keys."""

    def __init__(
        self, owner: str, fields: Iterable[str], check: Callable[..., str | None] = flat_of_numel,
        held: Iterable[str] = (),
    ):
        self.owner, self._check, self._held = owner, check, tuple(held)
        self._fields: dict[str, dict[str, Any]] = {name: {} for name in (*fields, *self._held)}

    def __getitem__(self, field: str) -> dict[str, Any]:
        """A field's values by key (to read; change them through ``put`` / ``drop``)."""
        return self._fields[field]

    def get(self, field: str, slot: Slot, like: Tensor | None = None) -> Any:
        """The slot's value, or None. With ``like`` (a flat float32 tensor; tensor fields only): ready to be
        updated in place next to it, a tensor restored elsewhere being moved to its device, flat, contiguous, once
        and kept so."""
        key = slot_key(slot)
        _note(self, (field,), key)
        t = self._fields[field].get(key)
        if t is not None and like is not None:
            if t.device != like.device or t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
                t = self._fields[field][key] = t.to(device=like.device, dtype=torch.float32).reshape(-1).contiguous()
        return t

    def put(self, field: str, slot: Slot, t: Any) -> Any:
        key = slot_key(slot)
        _note(self, (field,), key)
        self._fields[field][key] = t
        return t

    def drop(self, slot: Slot) -> None:
        """Forget every field of the slot (a step that failed half way starts the slot afresh)."""
        key = slot_key(slot)
        _note(self, self._fields, key)
        for tensors in self._fields.values():
            tensors.pop(key, None)

    def retain(self, slots: Sequence[Slot]) -> None:
        """Keep only the state of ``slots`` (the slots still exchanged)."""
        keep = {slot_key(s) for s in slots}
        self._fields = {name: {k: v for k, v in ts.items() if k in keep} for name, ts in self._fields.items()}

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {name: {k: _saved(v) for k, v in ts.items()} for name, ts in self._fields.items()}

    def restore_where(self, saved: dict[str, Any], bad: Tensor) -> bool:
        """In place, without reading ``bad`` (a bool tensor of shape ()): every tensor becomes ``torch.where(bad,
        its copy in saved (a state_dict()), itself)``, keeping its identity (a buffer that holds it still does).
        False, and nothing changed, when ``saved`` has other fields, keys, shapes, dtypes or devices."""
        if not isinstance(saved, dict) or saved.keys() != self._fields.keys():
            return False
        pairs = []
        for name, tensors in self._fields.items():
            if not isinstance(saved[name], dict) or saved[name].keys() != tensors.keys():
                return False
            pairs += [(t, saved[name][k]) for k, t in tensors.items()]
        if any(not isinstance(s, Tensor) or (s.shape, s.dtype, s.device) != (t.shape, t.dtype, t.device)
               for t, s in pairs):
            return False
        for t, s in pairs:
            torch.where(bad, s, t, out=t)  # elementwise, into itself: no temporary
        return True

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copies of ``state``'s tensors, after checking all of it: ConfigError, and nothing changed, for an
        unknown field, a key that is not a slot key, a value that is not a float32 tensor of the right shape.
        A held field's saved values go into the objects that hold their keys, last (where one refuses its state,
        it raises as its own ``load_state_dict`` does), else are kept as deep copies."""
        unknown = set(state) - set(self._fields) if isinstance(state, dict) else {"<not a dict>"}
        if unknown:
            raise ConfigError(f"unexpected {self.owner} state keys {sorted(map(str, unknown))}")
        # (keys of a state saved under a compiled model's names: the slots' names now, see plain_name)
        state = {name: {plain_name(k): t for k, t in v.items()} if isinstance(v, dict) else v
                 for name, v in state.items()}
        for name in self._fields:
            tensors = state.get(name, {})
            if not isinstance(tensors, dict):
                raise ConfigError(f"{self.owner} state {name!r} must map slot keys to tensors")
            for key, t in tensors.items():
                numel = key_numel(key)
                if numel is None:
                    raise ConfigError(f"bad {self.owner} state key {key!r} in {name!r} (expected '<slot name>#<d>')")
                if name in self._held:
                    continue
                if not isinstance(t, Tensor):
                    raise ConfigError(f"{self.owner} state {name!r} must map slot keys to tensors; {key!r} does not")
                if t.dtype != torch.float32:
                    raise ConfigError(f"{self.owner} state {name!r}: {key!r} is {t.dtype}, expected torch.float32")
                reason = self._check(name, key, numel, t)
                if reason is not None:
                    raise ConfigError(f"{self.owner} state {name!r}: {key!r} has {reason}")
        loaded = {name: {k: t.detach().clone() for k, t in state.get(name, {}).items()} for name in self._fields
                  if name not in self._held}
        for name in self._held:
            now = self._fields[name]
            loaded[name] = {k: now[k] if _loaded_into(now.get(k), v) else copy.deepcopy(v)
                            for k, v in state.get(name, {}).items()}
        self._fields = {name: loaded[name] for name in self._fields}


def check_momentum(momentum: object) -> float:
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
        raise ConfigError(f"momentum must be a number in [0, 1), got {momentum!r}")
    return float(momentum)


class Momentum:
    """Worker momentum with error accumulation (the module docstring's arithmetic) on ``self.state``, a
    ``SlotState`` whose two fields (the names of u and v in the state dict) are ``fields``."""

    def __init__(self, momentum: float, owner: str, fields: tuple[str, str] = ("velocity", "accumulated")):
        self.momentum = check_momentum(momentum)
        self.u_field, self.v_field = fields
        self.state = SlotState(owner, fields)

    def step(self, slot: Slot, g: Tensor, accumulate: bool = True) -> tuple[Tensor, Tensor | None]:
        """u ← m·u + g and, with ``accumulate``, v ← v + u, in place; returns (u, v or None). ``g``: flat
        float32. A slot that only keeps momentum (sent dense, every coordinate every step) has no v."""
        u = self.state.get(self.u_field, slot, g)
        u = self.state.put(self.u_field, slot, g.clone() if u is None else u.mul_(self.momentum).add_(g))
        if not accumulate:
            return u, None
        v = self.state.get(self.v_field, slot, g)
        return u, self.state.put(self.v_field, slot, u.clone() if v is None else v.add_(u))

    def sent(
        self, slot: Slot, positions: Tensor, values: Tensor | None = None, masking: bool = True,
        only: Tensor | None = None,
    ) -> None:
        """What went out at ``positions`` (distinct) leaves: v ← v − values there, and u ← 0 where a value is
        nonzero (with ``masking``). ``values`` None: all of v went out there; v and u are zeroed (with ``only``, a
        bool per position, only where it is True). Sizes never depend on the data (no boolean indexing: no host
        synchronisation on a GPU)."""
        u, v = self.state.get(self.u_field, slot), self.state.get(self.v_field, slot)
        if values is None:
            if only is None:
                u.index_fill_(0, positions, 0.0)  # not u[positions] = 0.0: on a GPU that copies the 0 there
                v.index_fill_(0, positions, 0.0)  # from the host and waits (a sync per slot)
            else:
                for t in (u, v):
                    t.index_copy_(0, positions, torch.index_select(t, 0, positions).masked_fill_(only, 0.0))
            return
        if masking:  # u ← 0 where sent != 0 (NaN included)
            u.index_copy_(0, positions, torch.index_select(u, 0, positions).masked_fill_(values != 0, 0.0))
        subtract_at(v, positions, values)

    def sent_dense(self, slot: Slot, sent: Tensor, masking: bool = True) -> None:
        """The same for a dense message ``sent`` (its decompression): v ← v − sent, u ← 0 where sent ≠ 0."""
        if masking:
            self.state.get(self.u_field, slot).masked_fill_(sent != 0, 0.0)
        self.state.get(self.v_field, slot).sub_(sent)


class MovingAverage:
    """The exponential moving average m ← β·m + (1 − β)·g of a slot's gradients (Signum's momentum; m = 0 before
    the slot's first step) on ``self.state``, a ``SlotState`` of one field, ``field``."""

    def __init__(self, beta: float, owner: str, field: str = "momentum"):
        self.beta = check_momentum(beta)
        self.field = field
        self.state = SlotState(owner, (field,))

    def step(self, slot: Slot, g: Tensor) -> tuple[Tensor, Callable[[int, int], None] | None]:
        """(m, None) with m updated; or, for a flat ``g`` that meets the m of an earlier step, (m, update): m not
        yet updated, ``update(start, end)`` the same update (elementwise, in place) of m[start:end] only, which the
        caller runs over every chunk (Signum packs each chunk's signs right after its update, while it is in cache)."""
        m = self.state.get(self.field, slot, g)
        if m is None:
            return self.state.put(self.field, slot, g.reshape(-1) * (1.0 - self.beta)), None  # from m = 0
        if m.shape != g.shape:
            return m.mul_(self.beta).add_(g.reshape(-1), alpha=1.0 - self.beta), None

        def update(start: int, end: int) -> None:
            m[start:end].mul_(self.beta).add_(g[start:end], alpha=1.0 - self.beta)

        return m, update
