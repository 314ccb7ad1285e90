"""Schemes: methods that own their rounds of communication and their aggregation rule.

See ``schemes.base`` for the interface and ``schemes.single_round`` for the scheme that carries every
single-message compressor. The collective requests a scheme yields, and the blocking driver ``drive``, live
with the transport (``gradcomp.transport.requests``).
"""

from gradcomp.schemes.base import Scheme
from gradcomp.schemes.single_round import TOPOLOGIES, SingleRound

__all__ = ["TOPOLOGIES", "Scheme", "SingleRound"]
