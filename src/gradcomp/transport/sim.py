"""A simulated cluster: W workers inside one process, one thread each, running the real protocol code.

Each worker gets a ``SimTransport`` whose collectives meet at a shared rendezvous (a ``threading.Barrier``):
every worker deposits its tensor, one worker combines, everyone takes a private copy of the result. Sums are
taken in rank order, so results are deterministic and identical on every worker.

Only one worker computes at a time: a worker holds the cluster's baton (a lock) while it runs and lets go of
it only while it waits at a rendezvous. Workers thus take turns between collectives instead of fighting over
the GIL and the CPU cores (which made a 4-worker step several times slower than 4 sequential workers), and
each torch operation still gets all of torch's intra-op threads. Byte counting is the base
class's, the same as for the process-group transport, so a simulated run reports the same bits as a real one.

A simulated worker's communication time is the time it spends inside collectives minus the time it waits
for the other workers' turns: the cost of moving its tensors in memory, not of a network (see the latency-
bandwidth model for that).

Work that every worker repeats on the same gathered data — each worker decoding all W messages of an
all-gather and adding them up in rank order, which gives the same aggregate on every worker — is done once per
cluster when the scheme asks for it through :func:`computed_once`: the first worker to get there computes it,
the others take a copy of the result. Each of them is charged the time it took (``charged_s``, counted as its
own compression time, not as idle), so every worker's measured compression time stays what a real worker
spends, while the simulation does that work once instead of W times (with all-gather methods the decoding
grew as W² and made a 64-worker simulation spend most of its time there). Results are bit-identical: the
result is what every worker computes from the same buffers in the same order.

A worker that raises aborts the rendezvous; the others fail fast with ``WorkerLostError`` instead of
hanging, and ``SimulatedCluster.run`` re-raises the original error. A rendezvous that waits longer than
``timeout`` seconds fails the same way.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from torch import Tensor

from gradcomp.errors import ConfigError, WorkerLostError
from gradcomp.transport.base import Transport

T = TypeVar("T")

_local = threading.local()  # the SimTransport of the simulated worker running in this thread, if any


def computed_once(label: str, compute: Callable[[], T]) -> T:
    """``compute()``, a function of the data this worker's last all-gather returned and identical on every worker.

    On a simulated cluster it is computed once per all-gather (the first worker to ask computes it; the others
    get a copy of its result and are charged its time); anywhere else, a plain call. ``label`` tells apart two
    such computations after one all-gather. ``compute`` must give every worker the same result from the same
    gathered data, and its result must be tensors (or lists / tuples of tensors, or :class:`Shared` objects).
    """
    transport = getattr(_local, "transport", None)
    if transport is None:
        return compute()
    return transport.cluster.once(transport, label, compute)


class Shared:
    """A part of a :func:`computed_once` result that every worker gets as it is, not a copy: an object the workers
    only read (the checks a computation left to be read later, for each worker to take its own share of)."""

    def __init__(self, value: object):
        self.value = value


def _copy(result):
    if isinstance(result, Shared):
        return result
    if isinstance(result, Tensor):
        return result.clone()
    if isinstance(result, (list, tuple)):
        return type(result)(_copy(r) for r in result)
    raise TypeError(f"computed_once: results must be tensors or lists of tensors, got {type(result).__name__}")


class SimulatedCluster:
    def __init__(self, world_size: int, timeout: float = 300.0):
        if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
            raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
        self.world_size = int(world_size)
        self.timeout = float(timeout)
        self._barrier = threading.Barrier(self.world_size, timeout=self.timeout)
        self._slots: list[Tensor | None] = [None] * self.world_size
        self._combined: object = None
        self._baton = threading.Lock()
        self._memo: dict[tuple[int, str], list] = {}  # computed_once: key -> [private copy, seconds, workers served]
        self._pool = ThreadPoolExecutor(max_workers=self.world_size, thread_name_prefix="gradcomp-sim")
        self.transports = [SimTransport(self, rank) for rank in range(self.world_size)]

    def run(self, fn: Callable[[SimTransport], T]) -> list[T]:
        """Run ``fn(transport)`` once per worker, concurrently; results in rank order."""
        if self._barrier.broken:
            self._barrier.reset()
        self._memo.clear()
        futures = [self._pool.submit(self._guarded, fn, t) for t in self.transports]
        try:
            errors = [f.exception() for f in futures]
        except BaseException:  # Ctrl-C in the calling thread: every worker stops at its next rendezvous
            self._barrier.abort()
            raise
        primary = [e for e in errors if e is not None and not isinstance(e, WorkerLostError)]
        if primary:
            raise primary[0]
        lost = [e for e in errors if e is not None]
        if lost:
            raise lost[0]
        return [f.result() for f in futures]

    def _guarded(self, fn: Callable[[SimTransport], T], transport: SimTransport) -> T:
        self._baton.acquire()
        _local.transport = transport
        try:
            return fn(transport)
        except BaseException:
            self._barrier.abort()
            raise
        finally:
            _local.transport = None
            self._baton.release()

    def once(self, transport: SimTransport, label: str, compute: Callable[[], T]) -> T:
        """See :func:`computed_once`. Runs with the baton held: no other worker runs meanwhile."""
        key = (transport.gathers, label)
        entry = self._memo.get(key)
        if entry is None:
            started = time.perf_counter()
            result = compute()
            seconds = time.perf_counter() - started
            if self.world_size > 1:
                self._memo[key] = [_copy(result), seconds, 1]
            return result
        entry[2] += 1
        if entry[2] == self.world_size:
            del self._memo[key]
            result = entry[0]
        else:
            result = _copy(entry[0])
        transport.charge(entry[1])
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> SimulatedCluster:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            self._barrier.abort()  # leaving on an error: no worker waits for a rendezvous that cannot come
        self.close()

    def _wait(self, rank: int) -> None:
        started = time.perf_counter()
        self._baton.release()
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise WorkerLostError(
                f"simulated worker {rank}: another worker failed or the rendezvous timed out "
                f"after {self.timeout:.0f}s"
            ) from None
        finally:
            self._baton.acquire()
            self.transports[rank].idle_s += time.perf_counter() - started

    def rendezvous(self, rank: int, tensor: Tensor, combine: Callable[[list[Tensor]], object]):
        """Deposit ``tensor``; once all arrived, rank 0 computes ``combine(all tensors)``; all get it back."""
        self._slots[rank] = tensor
        self._wait(rank)
        if rank == 0:
            self._combined = combine(list(self._slots))  # type: ignore[arg-type]
        self._wait(rank)
        combined = self._combined
        self._wait(rank)  # nobody may overwrite the slots before everyone has read
        return combined


def _sum_in_rank_order(tensors: list[Tensor]) -> Tensor:
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


def _max_in_rank_order(tensors: list[Tensor]) -> Tensor:
    total = tensors[0].clone()
    for t in tensors[1:]:
        torch.maximum(total, t, out=total)
    return total


class SimTransport(Transport):
    def __init__(self, cluster: SimulatedCluster, rank: int):
        super().__init__()
        self.cluster = cluster
        self.rank = rank
        self.world_size = cluster.world_size
        self.idle_s = 0.0
        self.gathers = 0  # all-gathers so far: the n-th of every worker is the same collective
        self.charged_s = 0.0  # time of work another worker did for this one (computed_once)

    def idle_seconds(self) -> float:
        return self.idle_s

    def charge(self, seconds: float) -> None:
        """Count ``seconds`` of work done for this worker by another as this worker's own (not idle) time."""
        self.idle_s -= seconds
        self.charged_s += seconds

    def _all_reduce_sum(self, t: Tensor, inplace: bool = False) -> Tensor:
        return self.cluster.rendezvous(self.rank, t, _sum_in_rank_order).clone()

    def _all_reduce_max(self, t: Tensor) -> Tensor:
        return self.cluster.rendezvous(self.rank, t, _max_in_rank_order).clone()

    def _all_to_all(self, t: Tensor) -> Tensor:
        everyone = self.cluster.rendezvous(self.rank, t, list)
        return torch.cat([x.chunk(self.world_size)[self.rank] for x in everyone])

    def _all_gather(self, t: Tensor) -> list[Tensor]:
        self.gathers += 1
        return [x.clone() for x in self.cluster.rendezvous(self.rank, t, list)]

    def _gather(self, t: Tensor, root: int) -> list[Tensor] | None:
        everyone = self.cluster.rendezvous(self.rank, t, list)
        return [x.clone() for x in everyone] if self.rank == root else None

    def _broadcast(self, t: Tensor, root: int) -> Tensor:
        return self.cluster.rendezvous(self.rank, t, lambda ts: ts[root]).clone()
