"""``crash_at(monkeypatch, K)``: a worker fails before step K (tests/faults/crash_injection.py), in this process's
simulated workers and in every process the test starts; ``monkeypatch`` undoes it."""

from __future__ import annotations

import os
import sys

FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")
sys.path.insert(0, FAULTS)
import crash_injection  # noqa: E402

sys.path.remove(FAULTS)
STEP_ENV, RANK_ENV = crash_injection.STEP_ENV, crash_injection.RANK_ENV


def environment(step: int, base: dict | None = None) -> dict:
    """``base`` (os.environ) with the fault set for the processes a test starts itself (subprocess, torchrun)."""
    env = dict(os.environ if base is None else base)
    env[STEP_ENV] = str(step)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (FAULTS, env.get("PYTHONPATH", "")) if p)
    return env


def crash_at(patch, step: int | None) -> None:
    """Rank 1 (rank 0 with one worker) fails before ``step``; None: no fault from here on."""
    from gradcomp.experiments.run import runner

    crash_injection.install(runner)
    if step is None:
        patch.delenv(STEP_ENV, raising=False)
        return
    patch.setenv(STEP_ENV, str(step))
    patch.setenv("PYTHONPATH", os.pathsep.join(p for p in (FAULTS, os.environ.get("PYTHONPATH", "")) if p))
