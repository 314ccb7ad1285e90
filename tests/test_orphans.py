"""`gradcomp train`'s workers die with their launcher, however it dies, and leave no temporary folder behind.

Each test starts the real command as a subprocess (2 workers, a run far longer than the test), waits until the
workers train (rank 0's progress bar is on stderr: every worker has joined the process group), signals the
launcher, and looks at the workers' PIDs in /proc.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; workers use prctl(PR_SET_PDEATHSIG)"),
]

TRAIN = ["train", "--dataset", "synthetic", "--model", "mlp", "--workers", "2", "--steps", "1000000"]


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as f:
                found |= {int(x) for x in f.read().split()}
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    """Running, or stopped; not a zombie (a dead child its dead parent's init has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except OSError:
        return False


class Launcher:
    """``gradcomp train`` in a subprocess of its own session, with TMPDIR in ``tmp_dir``; stderr collected."""

    def __init__(self, tmp_dir, *extra: str, ignore_sigint: bool = False):
        self.tmp_dir = str(tmp_dir)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TMPDIR": self.tmp_dir}

        def before_exec() -> None:
            if ignore_sigint:  # as for a background job (`gradcomp train &`) of a shell script
                signal.signal(signal.SIGINT, signal.SIG_IGN)

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gradcomp.cli", *TRAIN, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env=env, start_new_session=True, preexec_fn=before_exec,
        )
        self._err = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.spawned: set[int] = set()  # every child seen: workers and multiprocessing's resource tracker

    def _read(self) -> None:
        while chunk := os.read(self.proc.stderr.fileno(), 4096):
            self._err += chunk

    @property
    def err(self) -> str:
        return self._err.decode(errors="replace")

    def wait_until_training(self, workers: int = 2, within: float = 180.0) -> list[int]:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"gradcomp train ended early:\n{self.err[-3000:]}"
            self.spawned |= children(self.proc.pid)
            found = sorted(p for p in self.spawned if is_worker(p))
            if len(found) == workers and "step" in self.err:  # rank 0's progress bar: the group is complete
                return found
            time.sleep(0.2)
        raise AssertionError(f"no {workers} training workers after {within:.0f} s:\n{self.err[-3000:]}")

    def finish(self, within: float = 60.0) -> int:
        code = self.proc.wait(timeout=within)
        self._reader.join(timeout=10)
        return code

    def cleanup(self) -> None:
        """Whatever the test saw: no process of this launch survives it."""
        for pid in [self.proc.pid, *self.spawned]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def gone_within(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_workers_die_with_their_launcher_and_leave_no_folder(tmp_path, sig):
    # SIGINT ignored, as in a background job of a script: torch's own parent-death signal (SIGINT) does nothing
    launcher = Launcher(tmp_path, ignore_sigint=True)
    try:
        workers = launcher.wait_until_training()
        os.kill(launcher.proc.pid, sig)
        code = launcher.finish()
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM), launcher.err[-2000:]
        assert gone_within(workers, 10) == [], "workers outlived their launcher"
        assert gone_within(launcher.spawned, 10) == []  # multiprocessing's resource tracker too
        assert glob.glob(os.path.join(tmp_path, "gradcomp-*")) == []
        if sig == signal.SIGTERM:
            assert "Traceback" not in launcher.err
            assert launcher.err.rstrip().splitlines()[-1].startswith("gradcomp: stopped by SIGTERM")
    finally:
        launcher.cleanup()


def test_ctrl_c_stops_everything_with_one_line_and_exit_code_130(tmp_path):
    launcher = Launcher(tmp_path)
    try:
        workers = launcher.wait_until_training()
        os.killpg(launcher.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
        assert launcher.finish() == 130, launcher.err[-2000:]
        assert gone_within(workers, 10) == []
        err = launcher.err
        assert "Traceback" not in err and err.count("gradcomp:") == 1, err[-2000:]
        assert err.endswith("\ngradcomp: stopped by SIGINT (Ctrl-C); its 2 running workers were stopped\n"), err[-2000:]
        assert glob.glob(os.path.join(tmp_path, "gradcomp-*")) == []
    finally:
        launcher.cleanup()


def test_ctrl_c_while_the_workers_start_is_one_line_too(tmp_path):
    """Ctrl-C as soon as the workers exist, while they still import torch: before a spawned worker's own code runs,
    the default SIGINT handler would print a KeyboardInterrupt traceback from multiprocessing's bootstrap."""
    launcher = Launcher(tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len([p for p in children(launcher.proc.pid) if is_worker(p)]) < 2:
            assert time.monotonic() < deadline and launcher.proc.poll() is None, launcher.err[-3000:]
            time.sleep(0.01)
        launcher.spawned |= children(launcher.proc.pid)
        assert "step" not in launcher.err  # still starting
        os.killpg(launcher.proc.pid, signal.SIGINT)
        assert launcher.finish() == 130, launcher.err[-2000:]
        err = launcher.err
        assert "Traceback" not in err and err.count("gradcomp:") == 1, err[-2000:]
        assert err.endswith("\ngradcomp: stopped by SIGINT (Ctrl-C); its 2 running workers were stopped\n"), err[-2000:]
    finally:
        launcher.cleanup()
