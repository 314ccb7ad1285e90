"""The refusal protocol: how a worker refuses a received message, or abandons a step, without leaving the others.

A worker whose received message fails its checks, or whose aggregate is not finite, must not raise while the other
workers still wait for its next message: every worker runs the step's rounds to their end and all of them learn of the
fault together, at the same point. This module holds what a thread running a step notes for that, and the messages
and exceptions that carry it:

- :class:`Refusals` and :func:`refusing_later`: the messages refused during a step (or a backward pass), noted instead
  of raised, for the workers to agree on with one more collective (``train.agreement.settle``); :func:`abandon_later`
  where only this worker found the step must be abandoned.
- The step's deferred verdict (:func:`defer_verdict`, :func:`add_to_verdict`, :func:`take_verdict`): whether some
  worker's gradients were not finite, a device flag that the next device read takes in its own transfer
  (:class:`StepAbandoned` if it is bad).
- :class:`AbandonedHere`, :func:`abandon_message` and :func:`abandon_flags`: a server that alone finds its aggregate
  not finite sends a marked message in its place, and every receiver learns of it at its next read.
- :func:`check_received`: a receiver's check of a decoded field, read now on the host path or handed to the
  ``device.DeviceChecks`` collecting on this thread.

The state is the thread's ``gradcomp.step_state.StepState`` (one step runs in one thread; the simulated cluster runs
one worker per thread).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from gradcomp.errors import WireError
from gradcomp.step_state import setting, step_state
from gradcomp.wire.bits import host_path

__all__ = [
    "Refusals",
    "refusing_later",
    "abandon_later",
    "check_received",
    "check_received_range",
    "collecting_received",
    "StepAbandoned",
    "AbandonedHere",
    "ABANDON_MARK",
    "abandon_message",
    "abandon_flags",
    "defer_verdict",
    "add_to_verdict",
    "deferring",
    "take_verdict",
    "verdict_pending",
]


class Refusals:
    """The messages a worker refused during a step (or a backward pass), kept instead of raised
    (:func:`refusing_later`), and how many messages it encoded or decoded: a step that used the wire on one worker
    used it on every worker, so the workers can agree on the refusals with one more collective, and only then.
    """

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.used = 0
        self.abandoned = False  # this worker alone found that the step must be abandoned (``abandon_later``)




def abandon_later() -> bool:
    """Notes, in the step's Refusals, that this worker alone found that the step must be abandoned (a server's or a
    shard owner's aggregate that a message made non-finite, where the verdict is not deferred), for the workers to
    agree on at the step's end with the refusals (``train.agreement.settle``); False outside
    :func:`refusing_later` (the caller then goes on as before)."""
    refusals = step_state().refusals
    if refusals is None:
        return False
    refusals.abandoned = True
    return True


def refusing_later(refusals: Refusals | None):
    """While inside, a received message that fails its checks on this thread is noted in ``refusals`` instead of
    raising WireError (:func:`decode` returns stand-ins, :meth:`DeviceChecks.read` and :func:`check_received` go
    on), so that this worker runs the step's rounds to their end like every other and all of them learn of it
    together (``train.agreement.settle``). None: raise at once, as outside."""
    return setting("refusals", refusals)


def _note_use() -> Refusals | None:
    """Counts one message encoded or decoded in the step under way; its Refusals, if any."""
    refusals = step_state().refusals
    if refusals is not None:
        refusals.used += 1
    return refusals


def _refuse(error: WireError) -> None:
    """Raises ``error``, or notes it in the step's Refusals (inside :func:`refusing_later`)."""
    refusals = step_state().refusals
    if refusals is None:
        raise error
    refusals.messages.append(str(error))






def collecting_received(checks: object):
    """While inside, :func:`check_received` on this thread hands its checks to ``checks`` (a ``device.DeviceChecks``,
    through its ``add_received``), to be read with them."""
    return setting("receiving", checks)


@contextlib.contextmanager
def verdict_pending(flag: torch.Tensor):
    """While inside, ``flag`` is the step's pending verdict (as :func:`defer_verdict` leaves it, without starting a
    deferred step): the next device read takes it in its transfer. Withdrawn on the way out, read or not."""
    state = step_state()
    state.verdict = flag
    try:
        yield
    finally:
        state.verdict = None


class StepAbandoned(Exception):
    """A device read found the step's deferred verdict bad (some worker's gradients were not finite): the step is
    abandoned there, on every worker (``train.agreement.drive_agreeing`` catches it; nothing of the step is applied).
    """


class AbandonedHere(Exception):
    """Only this worker found that the step must be abandoned, as a server (a parameter server's root, a shard's
    owner) whose aggregate of finite-looking messages is not finite, or the only worker to read a gathered verdict
    (the root). Raised only while the verdict is deferred (``deferring``): the server then sends an abandoned
    message (``abandon_message``) in place of its aggregate, and every worker learns of it from that message at its
    next read, at the same point (``abandon_flags``, ``add_to_verdict``)."""


ABANDON_MARK = b"NF"  # the first two bytes of a message that says "abandon this step" (a container starts with MAGIC)


def abandon_message(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` (at least 2; a fixed-size message's length, which every receiver expects) that
    says "abandon this step" and nothing else: ``ABANDON_MARK``, then zeros."""
    out = torch.zeros(int(nbytes), dtype=torch.uint8, device=device)
    out[0], out[1] = ABANDON_MARK
    return out


def abandon_flags(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether any of the received uint8 ``buffers`` says "abandon this step" (starts with ``ABANDON_MARK``): a
    one-element bool tensor on their device, nothing read (an empty buffer says nothing)."""
    heads = [b[:2] for b in buffers if b.numel() >= 2]
    if not heads:
        device = buffers[0].device if buffers else None
        return torch.zeros((), dtype=torch.bool, device=device)
    head = torch.stack(heads)
    return ((head[:, 0] == ABANDON_MARK[0]) & (head[:, 1] == ABANDON_MARK[1])).any()




def defer_verdict(flag: torch.Tensor | None) -> None:
    """Hands the step's agreed verdict (a one-element bool tensor on the device, True when some worker's gradients
    were not finite) to this thread's next device read in this module, which reads it in the same transfer and
    raises StepAbandoned if it is True; None withdraws it and ends the deferred step (``deferring``)."""
    state = step_state()
    state.verdict = flag
    state.deferring = flag is not None


def deferring() -> bool:
    """Whether this thread runs a step whose verdict was deferred (from ``defer_verdict(flag)`` until
    ``defer_verdict(None)``, whether or not a read has taken the flag yet): such a step may be abandoned by
    raising StepAbandoned on every worker at the same point."""
    return step_state().deferring


def add_to_verdict(flag: torch.Tensor) -> None:
    """Adds ``flag`` (a one-element bool tensor, True: abandon) to the step's deferred verdict: the next device read
    reads both (the pending verdict or'ed with it, or ``flag`` alone where a read took the verdict already)."""
    pending = take_verdict()
    defer_verdict(flag.reshape(()) if pending is None else pending.reshape(()) | flag.reshape(()).to(pending.device))


def take_verdict() -> torch.Tensor | None:
    """The verdict :func:`defer_verdict` left that no read has taken yet (and withdraws it), or None."""
    state = step_state()
    flag, state.verdict = state.verdict, None
    return flag


def _read_bytes(t: torch.Tensor) -> bytes:
    """The uint8 tensor ``t`` read back in one transfer, with the step's pending verdict if there is one (one byte
    more in the same transfer): StepAbandoned if that verdict is bad."""
    flag = take_verdict()
    if flag is None:
        return bytes(t.tolist())
    got = bytes(torch.cat([t.reshape(-1), flag.reshape(1).to(torch.uint8)]).tolist())
    if got[-1]:
        raise StepAbandoned
    return got[:-1]


def check_received(ok: torch.Tensor | bool, message: str) -> None:
    """A receiver's check of a decoded field (``ok``: a one-element bool tensor, True for a sound message, such as
    the zero padding bits of a sign bitmap): handed to the :class:`DeviceChecks` collecting on this thread (read
    with its one transfer: no host synchronisation here), or read now where none is collecting or ``ok`` is a
    Python bool (the host path's). WireError(message) for a failed one (inside :func:`refusing_later`: noted)."""
    later = step_state().receiving
    if later is not None and isinstance(ok, torch.Tensor):
        later.add_received(ok, message)
    elif not bool(ok):
        _refuse(WireError(message))


def check_received_range(values: torch.Tensor, low: float | None, high: float | None, message: str) -> None:
    """A receiver's check that a decoded field lies in ``[low, high]`` (None: unbounded), through
    :func:`check_received`: one read now on the host path, handed to the collecting :class:`DeviceChecks` on the
    device path. Non-finite values pass (NaN, and ±Inf for floats): a non-finite scale is how the device path sends
    a non-finite gradient (a C_nat-coded NaN norm decodes to ±Inf), and the finiteness check of the sums deals with
    it. For values a sender never makes (a negative norm, a level above the method's), which a checksum cannot
    catch when the sender itself is wrong. On the device path a check is made only where a DeviceChecks collects
    it (every receiving path decodes inside one); elsewhere, as for a worker's own message decoded for error
    feedback, it is left out rather than read at once (a host synchronisation for a message this worker made)."""
    if values.numel() == 0:
        return
    if not host_path(values) and step_state().receiving is None:
        return
    if values.is_floating_point():  # (scales: a few entries)
        out = torch.zeros_like(values, dtype=torch.bool)
        if low is not None:
            out |= values < low
        if high is not None:
            out |= values > high
        bad = (out & torch.isfinite(values)).any()
    else:  # (codes: one min/max pass)
        least, most = torch.aminmax(values)
        bad = torch.zeros((), dtype=torch.bool, device=values.device)
        if low is not None:
            bad = bad | (least < low)
        if high is not None:
            bad = bad | (most > high)
    check_received(not bool(bad) if host_path(values) else ~bad, message)
