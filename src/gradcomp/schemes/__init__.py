"""Schemes: methods that own their rounds of communication and their aggregation rule.

See ``schemes.base`` for the interface, ``schemes.requests`` for the collective requests and the blocking
driver, ``schemes.single_round`` for the scheme that carries every single-message compressor.
"""

from gradcomp.schemes.base import Scheme
from gradcomp.schemes.requests import AllGather, AllReduce, AllToAll, Broadcast, Gather, Request, Rounds, drive, execute
from gradcomp.schemes.single_round import TOPOLOGIES, SingleRound

__all__ = [
    "TOPOLOGIES", "AllGather", "AllReduce", "AllToAll", "Broadcast", "Gather", "Request", "Rounds", "Scheme",
    "SingleRound", "drive", "execute",
]
