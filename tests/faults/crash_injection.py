"""Fault injection for tests: a worker that fails when it is about to run step K, as a crashed machine does.

``GCTEST_CRASH_AT_STEP=K`` (with ``GCTEST_CRASH_RANK=r``; default rank 1, or 0 with one worker) makes that rank
fail when it fetches the batch of step K, before it computes anything of that step, on the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` unset or 0): under torchrun it kills itself with SIGKILL, as a lost machine
dies; elsewhere it raises :class:`InjectedCrash`, a CommunicationError, which is what the other workers see of
a lost peer. The checkpoints written before step K are in place, so the run can be resumed.

In the test's own process :func:`install` patches the training loop's batches (``crash_at`` in tests/crash.py);
in processes a test starts (gradcomp's launcher, torchrun, gradcomp race's hosts) ``sitecustomize.py`` beside this
file does, when ``PYTHONPATH`` holds this directory. gradcomp itself has no fault injection.
"""

from __future__ import annotations

import os
import signal
import sys

STEP_ENV = "GCTEST_CRASH_AT_STEP"
RANK_ENV = "GCTEST_CRASH_RANK"


def _crash_class():
    from gradcomp.errors import CommunicationError

    class InjectedCrash(CommunicationError):
        """The failure GCTEST_CRASH_AT_STEP asked for."""

    return InjectedCrash


def install(runner) -> None:
    """Wrap ``runner.Batches.get`` (once): the fault, read from the environment at every call."""
    batches = runner.Batches
    if getattr(batches.get, "injects_crash", False):
        return
    original = batches.get

    def get(self, step, device):
        raw = os.environ.get(STEP_ENV)
        if raw and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and step == int(raw):
            rank = int(os.environ.get(RANK_ENV, "1" if self.cfg.workers > 1 else "0"))
            if rank == self.rank:
                message = f"rank {self.rank}: stopped before step {step}, as {STEP_ENV} asked"
                if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # a torchrun worker: die as a killed process does
                    print(f"gradcomp: {message} (SIGKILL)", file=sys.stderr, flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                raise _crash_class()(message)
        return original(self, step, device)

    get.injects_crash = True
    batches.get = get
