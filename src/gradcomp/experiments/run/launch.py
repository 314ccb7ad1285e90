"""Starting workers: spawned processes over gloo on 127.0.0.1, a torchrun launch, or the simulated cluster.

``launch(cfg)`` returns the summary dict on the calling process (for torchrun: on rank 0; other ranks get
None). Spawned workers find each other through a TCP store that the launcher binds on 127.0.0.1 (the OS picks
the port as it binds, so no other process can take it in between); every collective has a time-out
(``cfg.timeout_s``), so a worker that disappears makes the others fail instead of hanging, and the first
worker's error is re-raised in the launcher.

Spawned workers live and die with their launcher:

- each worker asks Linux for SIGKILL when the launcher dies (``prctl(PR_SET_PDEATHSIG)``, through ctypes),
  and leaves at once if the launcher died before it could ask; so ``kill -9`` of the launcher ends them too;
- the workers ignore SIGINT (held blocked from their spawn until their own code ignores it, so a Ctrl-C while
  they still import torch prints no traceback either): on Ctrl-C, SIGINT or SIGTERM the launcher stops them
  itself and raises ``Interrupted`` (the CLI prints one line and exits with 128 + the signal: 130 for Ctrl-C);
- nothing is written to disk for the launcher: rank 0 hands the result over through the rendezvous store,
  which lives in the launcher's memory, so a killed launcher leaves no temporary folder behind.

While it waits, the launcher watches its workers' process states (Linux ``/proc``): a worker that is stopped
(SIGSTOP, a debugger) makes it warn at once, naming the worker, and when the others give up on it at the
time-out, the error names the stopped worker rather than the one that noticed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import re
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradcomp.allocator import keep_freed_memory
from gradcomp.errors import GradcompError, Interrupted, WorkerLostError
from gradcomp.experiments.run.config import TrainConfig, launched_by_torchrun
from gradcomp.experiments.run.runner import run_simulated, run_worker, worker_threads
from gradcomp.experiments.run.summary import summarize
from gradcomp.transport.dist import DistTransport, bind_device


class WorkerFailedError(GradcompError):
    """A spawned worker raised or died; the message carries the worker's own error."""


RESULT_KEY = "gradcomp/result"  # rank 0's summary, in the launcher's rendezvous store
STOPPED_WARNING_S = 2.0  # a worker stopped this long is reported while the others still wait
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def rendezvous_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """A TCP store on 127.0.0.1 that the launching process owns, on a port the OS picks while binding it.

    The workers join it as clients, so no port is chosen first and bound later (the race in which another
    process takes a "free" port in between, which made gloo abort a worker now and then).
    """
    return dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_group(
    backend: str, port: int, rank: int, world_size: int, timeout_s: float, device: torch.device | None = None
) -> dist.TCPStore:
    """Join the process group through the launcher's store; returns this worker's client of that store."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s),
        **bind_device(backend, device),
    )
    return store


def die_with_parent(parent_pid: int) -> None:
    """Linux: this process gets SIGKILL when its parent dies, however the parent dies (SIGKILL included).

    SIGKILL, not a signal Python handles: a worker blocked inside a collective never returns to the
    interpreter to run a handler, and a launcher started with SIGINT ignored (a background job of a script)
    would pass that on. The parent may already have died before the request took effect: then leave now.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device_for(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _train_in_group(cfg: TrainConfig, device: torch.device, started: float) -> dict[str, Any] | None:
    """Runs inside an initialised process group; rank 0 returns the summary."""
    transport = DistTransport()
    if cfg.fsdp:  # FSDP2 with a compressed reduce-scatter: its own loop, which uses the runner's helpers
        from gradcomp.experiments.run.fsdp_run import run_fsdp_worker

        stats = run_fsdp_worker(cfg, transport, device)
    else:
        stats = run_worker(cfg, transport, device)
    everyone: list[Any] = [None] * transport.world_size
    dist.all_gather_object(everyone, stats)  # after training: not booked on the transport's counters
    if transport.rank != 0:
        return None
    return summarize(cfg, everyone, time.perf_counter() - started, backend=transport.backend)


def _spawned_worker(rank: int, cfg: TrainConfig, port: int, launcher_pid: int, started: float) -> None:
    die_with_parent(launcher_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the launcher stops us
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # held since the spawn (_sigint_held); now ignored
    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing semaphore; a worker ended by its launcher would leak it, and
    # multiprocessing's resource tracker would print a warning after the launcher's last line. One process
    # draws the bar: a thread lock is enough.
    tqdm.set_lock(threading.RLock())
    keep_freed_memory()  # a process of gradcomp's own: unless GRADCOMP_KEEP_FREED_MEMORY=0 (allocator.py)
    torch.set_num_threads(worker_threads(cfg.workers))
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    device = _device_for(cfg, rank)
    store = join_group(backend, port, rank, cfg.workers, cfg.timeout_s, device)
    result = _train_in_group(cfg, device, started)
    if result is not None:
        store.set(RESULT_KEY, json.dumps(result))  # one value: complete or absent
    dist.barrier()  # every worker is done talking
    # Leave without running gloo's destructors: seen once in a finished run, one worker aborted in them
    # ("terminate called without an active exception") after the result was written, which lost the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave_group() -> None:
    """Tear the group down together: gloo aborts a process whose peers vanish while it still talks to them.

    Only after success: a failing worker just raises, and torch.multiprocessing stops the others.
    """
    dist.barrier()
    dist.destroy_process_group()


def launch(cfg: TrainConfig) -> dict[str, Any] | None:
    cfg.validate()
    started = time.perf_counter()
    if cfg.simulate:
        return run_simulated(cfg, torch.device(cfg.device))
    if launched_by_torchrun():
        return _launched_worker(cfg, started)
    return _spawn_and_wait(cfg, started)


def _spawn_and_wait(cfg: TrainConfig, started: float) -> dict[str, Any]:
    store = rendezvous_store(cfg.workers, cfg.timeout_s)
    context = None
    try:
        with _signals_raise_interrupted():
            with _sigint_held():
                context = mp.start_processes(
                    _spawned_worker, args=(cfg, store.port, os.getpid(), started), nprocs=cfg.workers, join=False,
                    start_method="spawn",
                )
            _wait_for(context, cfg, store)
    except Interrupted as exc:
        stopped = _stop_workers(context)
        how = " (Ctrl-C)" if exc.signum == signal.SIGINT else ""
        exc.args = (f"stopped by {signal.Signals(exc.signum).name}{how}; its {stopped} running workers were stopped",)
        raise
    finally:
        _stop_workers(context)  # nothing left to stop after a finished run, or after torch stopped them
    return json.loads(store.get(RESULT_KEY))


def _wait_for(context: mp.ProcessContext, cfg: TrainConfig, store: dist.TCPStore) -> None:
    """Join the workers; a failure becomes WorkerFailedError / WorkerLostError, naming a stopped worker."""
    stopped: dict[int, float] = {}  # rank -> when it was first seen stopped (and still is)
    warned: set[int] = set()
    while True:
        # wait here, not in context.join: on a failure, join at once stops the others and gives a stopped one
        # (which keeps SIGTERM pending) a 30 s grace; a stopped worker has to be named and killed first
        ended = multiprocessing.connection.wait([p.sentinel for p in context.processes if p.exitcode is None], 0.5)
        for process in context.processes:
            if process.sentinel in ended:
                process.join()  # it is exiting (its end of the pipe closed): wait for its exit code
        now = time.monotonic()
        for rank, process in enumerate(context.processes):
            if process.exitcode is None and _is_stopped(process.pid):
                stopped.setdefault(rank, now)
            else:
                stopped.pop(rank, None)
        for rank in sorted(stopped):
            if rank not in warned and now - stopped[rank] >= STOPPED_WARNING_S:
                warned.add(rank)
                print(
                    f"gradcomp: warning: worker {rank} (pid {context.processes[rank].pid}) is stopped (SIGSTOP or a "
                    f"debugger); the others wait for it up to --timeout {cfg.timeout_s:g} s",
                    file=sys.stderr, flush=True,
                )
        if stopped and any(p.exitcode not in (None, 0) for p in context.processes):
            for rank in stopped:  # another worker gave up on it; a stopped process would ignore SIGTERM
                context.processes[rank].kill()
                context.processes[rank].join()
        try:
            if context.join(timeout=0):
                return
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            if stopped:
                raise WorkerLostError(_stopped_message(context, stopped, cfg, exc)) from None
            if isinstance(exc, mp.ProcessRaisedException):
                # the worker's traceback is in the exception; its last line says what went wrong
                last = _QUALIFIED_ERROR_NAME.sub("", str(exc).strip().splitlines()[-1])
                raise WorkerFailedError(f"worker {exc.error_index} failed: {last}") from None
            if not store.check([RESULT_KEY]):
                raise WorkerLostError(f"worker {exc.error_index} died: {exc}") from None
            # rank 0 hands the result over only after every worker's statistics reached it: training was over
            print(
                f"gradcomp: warning: worker {exc.error_index} died after the run was complete ({exc}); "
                "the result is kept",
                file=sys.stderr,
            )
            return


# "gradcomp.experiments.run.checkpoint.CheckpointError: ..." -> "CheckpointError: ...": the user's words, not a module path
_QUALIFIED_ERROR_NAME = re.compile(r"^gradcomp(?:\.\w+)*\.(?=\w+Error: )")


class _NoTerminatingNotice(logging.Filter):
    """Drops torch's 'Terminating process N via signal SIGTERM' notices: the launcher reports the failure itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Terminating process")


logging.getLogger("torch.multiprocessing.spawn").addFilter(_NoTerminatingNotice())


def _stopped_message(context: mp.ProcessContext, stopped: dict[int, float], cfg: TrainConfig,
                     exc: Exception) -> str:
    names = ", ".join(f"worker {rank} (pid {context.processes[rank].pid})" for rank in sorted(stopped))
    text = (
        f"{names} {'was' if len(stopped) == 1 else 'were'} stopped (SIGSTOP or a debugger: process state T) and "
        f"did not answer; the other workers gave up after the --timeout of {cfg.timeout_s:g} s"
    )
    if isinstance(exc, mp.ProcessRaisedException) and exc.error_index not in stopped:
        text += f"; worker {exc.error_index} noticed: {str(exc).strip().splitlines()[-1]}"
    return text


def _is_stopped(pid: int) -> bool:
    """Linux: the process is stopped (state T) or stopped by a tracer (t); False where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _stop_workers(context: mp.ProcessContext | None) -> int:
    """End every worker still running (SIGTERM, SIGKILL for a stopped one or after 3 s); returns how many."""
    if context is None:
        return 0
    alive = [p for p in context.processes if p.is_alive()]
    for p in alive:
        if _is_stopped(p.pid):
            p.kill()  # a stopped process would keep a SIGTERM pending
        else:
            p.terminate()  # the workers handle no SIGTERM: it ends them at once, even inside a collective
    deadline = time.monotonic() + 3.0
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()
    return len(alive)


@contextlib.contextmanager
def _sigint_held():
    """SIGINT blocked in this thread while it spawns workers, which inherit the blocked mask through the exec.

    A spawned worker imports torch for about a second before its own code ignores SIGINT; a Ctrl-C then (it
    reaches the whole process group) printed a KeyboardInterrupt traceback from Python's start-up or
    multiprocessing's bootstrap above the launcher's one line. Blocked, the signal waits: the worker discards it
    when it ignores SIGINT and unblocks it (``_spawned_worker``); the launcher gets it as soon as this block
    ends, as ``Interrupted`` (``_signals_raise_interrupted``), and stops the workers.
    """
    # multiprocessing starts its resource tracker with the first spawned process, and unblocks SIGINT after
    # starting it (resource_tracker.ensure_running): started first, it cannot undo the block below.
    multiprocessing.resource_tracker.ensure_running()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


@contextlib.contextmanager
def _signals_raise_interrupted():
    """SIGINT and SIGTERM raise ``Interrupted`` in the launcher while it runs workers (main thread only).

    A signal the process ignores (SIGINT in a background job of a script) stays ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        current = signal.getsignal(sig)
        if current == signal.SIG_IGN:
            continue
        previous[sig] = signal.SIG_DFL if current is None else current
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


def _join_launched_group(backend: str, timeout: timedelta, device: torch.device) -> None:
    """torchrun's env:// initialisation, with each restart attempt's keys apart in the rendezvous store.

    torchrun's workers share the agent's TCPStore (TORCHELASTIC_USE_AGENT_STORE=True) and torch (2.13) adds no
    per-attempt prefix to it, so after ``--max-restarts`` the restarted gloo workers read the previous
    attempt's addresses and fail to connect. The prefix ``gradcomp/attempt-N`` (N = TORCHELASTIC_RESTART_COUNT)
    gives every attempt fresh keys.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        dist.init_process_group(backend, timeout=timeout, **bind_device(backend, device))
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shared = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"gradcomp/attempt-{attempt}", shared)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, **bind_device(backend, device)
    )


def _launched_worker(cfg: TrainConfig, started: float) -> dict[str, Any] | None:
    world = int(os.environ["WORLD_SIZE"])
    if world != cfg.workers:
        cfg.workers = world  # torchrun decides the world size
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device_for(cfg, local_rank)
    if not dist.is_initialized():
        _join_launched_group("nccl" if cfg.device == "cuda" else "gloo", timedelta(seconds=cfg.timeout_s), device)
    if int(os.environ["RANK"]) != 0:
        cfg.progress = False
    result = _train_in_group(cfg, device, started)
    _leave_group()
    return result
