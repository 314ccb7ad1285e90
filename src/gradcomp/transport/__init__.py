"""Transports: a torch.distributed process group, or a simulated cluster of W workers in one process."""

from gradcomp.errors import WorkerLostError
from gradcomp.transport.base import CONTROL, PAYLOAD, ByteCounter, Transport
from gradcomp.transport.dist import DistTransport
from gradcomp.transport.sim import SimTransport, SimulatedCluster

__all__ = [
    "CONTROL", "PAYLOAD", "ByteCounter", "DistTransport", "SimTransport", "SimulatedCluster", "Transport",
    "WorkerLostError",
]
