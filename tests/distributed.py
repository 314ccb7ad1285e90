"""Starting real gloo workers on 127.0.0.1 for tests, with a hard time-out so nothing hangs.

Workers are forked from multiprocessing's fork server, not spawned: the server imports torch and gradcomp once per
test session, and each worker is a fork of it (a fraction of a second, where a spawned worker imports torch afresh:
two to four seconds per test on two cores). The server never runs any of gradcomp, so every worker starts from a
fresh import, as a spawned one does. What a worker would have inherited from the test at spawn time is handed to it
instead: the environment (``GRADCOMP_KERNELS`` and the like, set by the test) and the wire's device path on CPU
tensors (tests/wire_paths.py), applied before ``fn`` runs. Its
standard output and error are the server's, not the test's: a test that needs a worker's output returns it.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradcomp.experiments.run.launch import join_group, rendezvous_store

# imported once by the fork server, so that a forked worker has them already
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "numpy", "gradcomp", "distributed"])


def _entry(
    rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple, teardown: bool = True,
    environment: dict | None = None,
) -> None:
    if environment is not None:  # the test's environment, as a spawned worker would have inherited it
        os.environ.clear()
        os.environ.update(environment)
        from wire_paths import WORKER_ENV

        from gradcomp.wire.bits import set_device_path_on_cpu

        set_device_path_on_cpu(environment.get(WORKER_ENV) == "1")
    torch.set_num_threads(1)
    join_group("gloo", port, rank, world_size, timeout_s=60)
    result = fn(rank, world_size, *args)
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if teardown:
        dist.barrier()  # every worker is done talking
    # Leave without gloo's destructors: they may abort ("terminate called without an active exception") after
    # the result was written, both when a peer vanished and, seen under load, after a clean barrier.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_workers(fn, world_size: int, *args, timeout: float = 240.0, teardown: bool = True) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; results in rank order.

    A worker that fails makes this raise (torch.multiprocessing's error, with the worker's traceback);
    a run that exceeds ``timeout`` seconds is killed and raises TimeoutError.
    """
    store = rendezvous_store(world_size, timeout_s=60)  # kept alive by this frame while the workers run
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry, args=(fn, world_size, store.port, out_dir, args, teardown, dict(os.environ)), nprocs=world_size,
            join=False, start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in context.processes:
                    p.kill()
                raise TimeoutError(f"workers still running after {timeout:.0f}s")
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append(None)  # the worker left without a result (tests of vanishing workers)
        return results


def same(a, b) -> bool:
    """Nested state dicts equal, tensors bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def corrupting(aggregate, rank: int, calls: list):
    """``aggregate`` (``aggregate_buffers``) as rank ``rank`` sees it when rank 1 receives a corrupted copy of rank
    0's message (one bit of its body flipped: the checksum no longer matches) in the first aggregation of step 1;
    ``calls`` collects every aggregation's step."""

    def wrapped(compressor, slots, buffers, step, device, **kwargs):
        calls.append(step)
        if rank == 1 and step == 1 and calls.count(1) == 1:
            bad = buffers[0].clone()
            bad[-1] ^= 4
            buffers = [bad, *buffers[1:]]
        return aggregate(compressor, slots, buffers, step, device, **kwargs)

    return wrapped
