"""Transport over a torch.distributed process group: gloo on CPU, NCCL on GPU.

Tensors must live where the backend wants them (CPU for gloo, the rank's CUDA device for NCCL); the
exchange keeps everything on the gradients' device, so DDP and plain training loops need no copies.

A collective that fails because a peer vanished (its connection closed) or stayed silent past the group's
time-out raises WorkerLostError naming the collective, instead of the backend's bare RuntimeError.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import Tensor

from gradcomp.errors import ConfigError, WorkerLostError
from gradcomp.transport.base import Transport


def bind_device(backend: str, device: torch.device | None) -> dict:
    """Keyword arguments of ``init_process_group`` that bind an NCCL group to this rank's GPU.

    With ``device_id`` NCCL sets up its communicator for that GPU at once and collectives such as
    ``barrier`` need not guess the device (torch warns when they do). torch before 2.3 has no such argument;
    gloo needs none.
    """
    if backend != "nccl" or device is None or device.type != "cuda":
        return {}
    if "device_id" not in inspect.signature(dist.init_process_group).parameters:  # pragma: no cover - torch < 2.3
        return {}
    return {"device_id": device}


class DistTransport(Transport):
    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "torch.distributed is not initialized: call torch.distributed.init_process_group first "
                "(or use gradcomp.SimulatedCluster for an in-process run)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self._in_flight: list = []  # (start, end) CUDA events of NCCL collectives whose time is not booked yet

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _timed(self, fn, *args):
        try:
            if self.backend == "nccl":
                return self._timed_on_stream(fn, *args)
            return super()._timed(fn, *args)
        except RuntimeError as exc:  # gloo / NCCL: a peer closed its connection, or the collective timed out
            raise WorkerLostError(
                f"rank {self.rank}: {fn.__name__.strip('_')} over {self.backend} failed; a worker disappeared "
                f"or did not answer within the process group's time-out ({exc})"
            ) from exc

    def _timed_on_stream(self, fn, *args):
        """An NCCL collective, timed with CUDA events instead of a ``torch.cuda.synchronize()`` after it.

        Ordering needs no synchronisation: a blocking (``async_op=False``) NCCL collective makes NCCL's stream wait
        for the current stream before it starts and the current stream wait for NCCL's before anything queued after
        it, so the result is ready for every later operation on the stream, and the host never waits. The time is
        the stream time between two events recorded around the collective; it is added to ``counter.seconds`` once
        both events have completed (checked without waiting, at each later collective, and by
        :meth:`settle_timing`), so the seconds reported lag by the collectives still in flight.
        """
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(*args)
        end.record()
        self.counter.collectives += 1
        self._in_flight.append((start, end))
        while self._in_flight and self._in_flight[0][1].query():
            first, last = self._in_flight.pop(0)
            self.counter.seconds += first.elapsed_time(last) / 1000.0
        return result

    def settle_timing(self) -> None:
        """Waits for the timing events of the collectives still in flight and books their seconds (a sync)."""
        while self._in_flight:
            first, last = self._in_flight.pop(0)
            last.synchronize()
            self.counter.seconds += first.elapsed_time(last) / 1000.0

    def _group_rank(self, rank: int) -> int:
        """torch.distributed's gather/broadcast take global ranks; translate a rank within our group."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _all_reduce_sum(self, t: Tensor, inplace: bool = False) -> Tensor:
        out = t if inplace else t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def _all_reduce_max(self, t: Tensor) -> Tensor:
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out

    def _all_to_all(self, t: Tensor) -> Tensor:
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=self.group)
        return out

    def _all_gather(self, t: Tensor) -> list[Tensor]:
        outs = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(outs, t, group=self.group)
        return outs

    def _gather(self, t: Tensor, root: int) -> list[Tensor] | None:
        if self.rank == root:
            outs = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.gather(t, gather_list=outs, dst=self._group_rank(root), group=self.group)
            return outs
        dist.gather(t, gather_list=None, dst=self._group_rank(root), group=self.group)
        return None

    def _broadcast(self, t: Tensor, root: int) -> Tensor:
        out = t.clone() if self.rank == root else t
        dist.broadcast(out, src=self._group_rank(root), group=self.group)
        return out
