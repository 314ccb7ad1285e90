"""A DistributedDataParallel communication hook built on gradcomp's compressors and protocols.

    state = gradcomp.register_ddp_hook(ddp_model, gradcomp.make("topk", density=0.01, error_feedback=True))

Each DDP bucket is one slot (``bucket<index>``): it is compressed, exchanged with the compressor's protocol
over DDP's own process group (gloo or NCCL), and the hook returns an already-completed Future holding the
average. Unlike torch's PowerSGD hook this works on gloo with any number of buckets: every bucket's exchange
is a complete, blocking round of collectives, issued in the same bucket order on every rank.

The step counter (which seeds shared randomness) advances after the last bucket of each backward pass.
Residuals are keyed by bucket index and size, so DDP's bucket rebuild after the first iteration starts fresh
residuals for the rebuilt buckets instead of mixing sizes. A NaN / Inf gradient raises
NonFiniteGradientError naming the parameters before anything is sent.

(No ``from __future__ import annotations`` here: DDP inspects the hook's annotations at registration and
wants the real ``dist.GradBucket`` / ``torch.futures.Future`` objects, not strings.)
"""

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradcomp.compressors.base import Compressor, Slot
from gradcomp.train.exchange import GradientExchange, check_gradients
from gradcomp.transport.dist import DistTransport


class CompressionHookState:
    def __init__(
        self,
        compressor: Compressor,
        process_group: dist.ProcessGroup | None = None,
        *,
        topology: str = "auto",
        server_compressor: Compressor | None = None,
        param_names: dict[int, str] | None = None,
    ):
        self.exchange = GradientExchange(
            compressor, DistTransport(process_group), topology=topology, server_compressor=server_compressor
        )
        self.param_names = param_names or {}
        self.step = 0
        self.bucket_sizes: dict[int, int] = {}  # bucket index → elements, as of the latest backward pass

    @property
    def transport(self) -> DistTransport:
        return self.exchange.transport  # type: ignore[return-value]

    def check(self, bucket: dist.GradBucket) -> None:
        params = bucket.parameters()
        names = [self.param_names.get(id(p), f"bucket{bucket.index()}[{i}]") for i, p in enumerate(params)]
        check_gradients(names, bucket.gradients())

    def state_dict(self) -> dict:
        return {"step": self.step, "exchange": self.exchange.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.exchange.load_state_dict(state["exchange"])


def compression_hook(state: "CompressionHookState", bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    buffer = bucket.buffer()
    state.check(bucket)
    slot = Slot(f"bucket{bucket.index()}", bucket.index(), buffer.numel())
    state.bucket_sizes[bucket.index()] = buffer.numel()
    (average,) = state.exchange.exchange([slot], [buffer], state.step, validate=False)
    if bucket.is_last():
        state.step += 1
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(average.to(buffer.dtype))
    return future


def register_ddp_hook(
    model: nn.parallel.DistributedDataParallel,
    compressor: Compressor,
    *,
    topology: str = "auto",
    server_compressor: Compressor | None = None,
) -> CompressionHookState:
    """Register gradcomp's hook on a DDP model; returns the state (checkpoint it with ``state_dict()``)."""
    names = {id(p): name for name, p in model.module.named_parameters()}
    state = CompressionHookState(
        compressor,
        model.process_group,
        topology=topology,
        server_compressor=server_compressor,
        param_names=names,
    )
    model.register_comm_hook(state, compression_hook)
    return state
