"""The wire's device path on CPU tensors, for tests: the code a GPU runs (deferred checks, nothing read back),
exercised on this machine's CPU.

``device_path(monkeypatch)`` switches it on for the test (``monkeypatch`` undoes it) in this process, its
simulated workers' threads, and the gloo workers tests/distributed.py starts, which apply ``WORKER_ENV`` before
the test's function runs (they are forked from a server that imported gradcomp before the test began).
"""

from __future__ import annotations

from gradcomp.wire import bits

WORKER_ENV = "GCTEST_DEVICE_PATH"  # read by tests/distributed.py only; gradcomp reads no environment for this


def device_path(patch, on: bool = True) -> None:
    patch.setattr(bits, "_device_path_on_cpu", bool(on))
    patch.setenv(WORKER_ENV, "1" if on else "0")
