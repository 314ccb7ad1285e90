"""The state of the step a thread runs: one record per thread, the only ambient state of a step.

A worker's step runs in one thread (the simulated cluster runs one worker per thread; the DDP hook's communication
thread runs its backward passes), and while it runs, code deep in the call chain must know a few things about it:
where a refused message is noted instead of raised, which checks wait for the step's one device read, whether the
step's finiteness verdict is deferred, and which journal records the method's state before it changes so that an
abandoned step can be undone. They live in one :class:`StepState`, set for the extent of a ``with`` block
(:func:`setting`) by the modules that own each field, and read through :func:`step_state`.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

__all__ = ["StepState", "step_state", "setting"]


@dataclass
class StepState:
    """Everything kept about the step that a thread runs, in one record (one per thread: a step runs in one
    thread, the simulated cluster runs one worker per thread, the DDP hook's communication thread runs its passes).

    Set for the extent of a ``with`` block by the wire's refusal protocol (``wire.refusals``), its device path
    (``wire.device``) and the method state's journal (``compressors.state.journal``), never directly.
    """

    refusals: object | None = None  # a wire.refusals.Refusals, inside refusing_later: where refused messages are noted
    receiving: object | None = None  # a wire.device.DeviceChecks collecting check_received's checks
    pass_checks: object | None = None  # the wire.device.DeviceChecks holding a DDP backward pass's checks to its end
    verdict: torch.Tensor | None = None  # the deferred verdict no read has taken yet (True: abandon)
    deferring: bool = False  # between defer_verdict(flag) and defer_verdict(None)
    sender_checks: list = field(default_factory=list)  # device-path encodes' checks not yet read (wire.device)
    fetched: dict | None = None  # device.fetch_together's host copies, by (data_ptr, length)
    journal: object | None = None  # the compressors.state.Journal recording slot states before they change


_thread = threading.local()


def step_state() -> StepState:
    """This thread's :class:`StepState` (made on first use)."""
    state = getattr(_thread, "state", None)
    if state is None:
        state = _thread.state = StepState()
    return state


@contextlib.contextmanager
def setting(name: str, value: object):
    """``step_state().<name>`` is ``value`` while inside, then what it was before."""
    state = step_state()
    before = getattr(state, name)
    setattr(state, name, value)
    try:
        yield value
    finally:
        setattr(state, name, before)
