"""Transports: a torch.distributed process group, or a simulated cluster of W workers in one process.

``requests`` holds the vocabulary of the layers above: the collective requests a scheme or protocol yields
(``AllReduce``, ``AllGather``, ``AllToAll``, ``Gather``, ``Broadcast``) and the blocking driver ``drive`` that
hands them to a ``Transport`` one by one.
"""

from gradcomp.errors import WorkerLostError
from gradcomp.transport.base import CONTROL, PAYLOAD, ByteCounter, Transport
from gradcomp.transport.dist import DistTransport
from gradcomp.transport.requests import (
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Gather,
    Request,
    Rounds,
    drive,
    execute,
)
from gradcomp.transport.sim import SimTransport, SimulatedCluster

__all__ = [
    "CONTROL", "PAYLOAD", "AllGather", "AllReduce", "AllToAll", "Broadcast", "ByteCounter", "DistTransport",
    "Gather", "Request", "Rounds", "SimTransport", "SimulatedCluster", "Transport", "WorkerLostError", "drive",
    "execute",
]
