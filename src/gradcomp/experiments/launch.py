"""Starting workers: spawned processes over gloo on 127.0.0.1, a torchrun launch, or the simulated cluster.

``launch(cfg)`` returns the summary dict on the calling process (for torchrun: on rank 0; other ranks get
None). Spawned workers find each other through a TCP store that the launcher binds on 127.0.0.1 (the OS picks
the port as it binds, so no other process can take it in between); every collective has a time-out
(``cfg.timeout_s``), so a worker that disappears makes the others fail instead of hanging, and
torch.multiprocessing re-raises the first worker's error in the parent.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradcomp.errors import GradcompError, WorkerLostError
from gradcomp.experiments.runner import TrainConfig, run_simulated, run_worker, summarize, worker_threads
from gradcomp.transport.dist import DistTransport


class WorkerFailedError(GradcompError):
    """A spawned worker raised or died; the message carries the worker's own error."""


def rendezvous_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """A TCP store on 127.0.0.1 that the launching process owns, on a port the OS picks while binding it.

    The workers join it as clients, so no port is chosen first and bound later (the race in which another
    process takes a "free" port in between, which made gloo abort a worker now and then).
    """
    return dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_group(backend: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _device_for(cfg: TrainConfig, local_rank: int) -> torch.device:
    if cfg.device == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _train_in_group(cfg: TrainConfig, device: torch.device, started: float) -> dict[str, Any] | None:
    """Runs inside an initialised process group; rank 0 returns the summary."""
    transport = DistTransport()
    stats = run_worker(cfg, transport, device)
    everyone: list[Any] = [None] * transport.world_size
    dist.all_gather_object(everyone, stats)  # after training: not booked on the transport's counters
    if transport.rank != 0:
        return None
    return summarize(cfg, everyone, time.perf_counter() - started, backend=transport.backend)


def _spawned_worker(rank: int, cfg: TrainConfig, port: int, result_path: str, started: float) -> None:
    torch.set_num_threads(worker_threads(cfg.workers))
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    device = _device_for(cfg, rank)
    join_group(backend, port, rank, cfg.workers, cfg.timeout_s)
    result = _train_in_group(cfg, device, started)
    if result is not None:
        with open(result_path + ".part", "w") as f:
            json.dump(result, f)
        os.replace(result_path + ".part", result_path)  # complete or absent
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
    with tempfile.TemporaryDirectory(prefix="gradcomp-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        try:
            store = rendezvous_store(cfg.workers, cfg.timeout_s)
            mp.spawn(_spawned_worker, args=(cfg, store.port, result_path, started), nprocs=cfg.workers, join=True)
        except mp.ProcessRaisedException as exc:
            # the worker's traceback was printed on stderr; its last line says what went wrong
            last = str(exc).strip().splitlines()[-1]
            raise WorkerFailedError(f"worker {exc.error_index} failed: {last}") from None
        except mp.ProcessExitedException as exc:
            if not os.path.exists(result_path):
                raise WorkerLostError(f"worker {exc.error_index} died: {exc}") from None
            # rank 0 writes the result only after every worker's statistics reached it: training was over
            print(
                f"gradcomp: warning: worker {exc.error_index} died after the run was complete ({exc}); "
                "the result is kept",
                file=sys.stderr,
            )
        with open(result_path) as f:
            return json.load(f)


def _launched_worker(cfg: TrainConfig, started: float) -> dict[str, Any] | None:
    world = int(os.environ["WORLD_SIZE"])
    if world != cfg.workers:
        cfg.workers = world  # torchrun decides the world size
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device_for(cfg, local_rank)
    if not dist.is_initialized():
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s))
    if int(os.environ["RANK"]) != 0:
        cfg.progress = False
    result = _train_in_group(cfg, device, started)
    _leave_group()
    return result
