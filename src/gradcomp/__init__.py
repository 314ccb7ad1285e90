"""gradcomp: communication-efficient distributed deep learning over torch.distributed.

    import gradcomp
    compressor = gradcomp.make("topk", density=0.01, error_feedback=True)
    aggregator = gradcomp.GradientAggregator(model, compressor)   # after init_process_group
    ...; loss.backward(); aggregator.step(); optimizer.step()
"""

from gradcomp.allocator import keep_freed_memory
from gradcomp.compressors import Compressor, Slot
from gradcomp.errors import (
    CommunicationError,
    ConfigError,
    GradcompError,
    NonFiniteGradientError,
    WireError,
    WorkerLostError,
)
from gradcomp.feedback import ErrorFeedback
from gradcomp.registry import available, make, register
from gradcomp.train import (
    CompressionHookState,
    GradientAggregator,
    GradientExchange,
    LocalUpdateExchange,
    OneBitAdam,
    ZeroOneAdam,
    compression_hook,
    register_ddp_hook,
)
from gradcomp.transport import ByteCounter, DistTransport, SimulatedCluster, Transport

__version__ = "0.1.0"


def __getattr__(name: str):
    # FSDP2 support is imported on first use: torch.distributed.fsdp takes about a second to import
    if name in ("compress_fsdp", "FSDPCompressionState"):
        from gradcomp.train import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module 'gradcomp' has no attribute {name!r}")


__all__ = [
    "ByteCounter", "CommunicationError", "CompressionHookState", "Compressor", "ConfigError", "DistTransport",
    "ErrorFeedback", "FSDPCompressionState",
    "GradcompError", "GradientAggregator", "GradientExchange", "LocalUpdateExchange", "NonFiniteGradientError",
    "OneBitAdam", "ZeroOneAdam",
    "SimulatedCluster", "Slot", "Transport", "WireError", "WorkerLostError", "available", "compress_fsdp",
    "compression_hook",
    "keep_freed_memory", "make", "register", "register_ddp_hook",
]
