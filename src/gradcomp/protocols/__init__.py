"""Protocols: reusable rounds that move and combine message buffers, written as generators of requests.

- ``allreduce_sum``: summable messages (plain elementwise sum of the fields).
- ``allgather_buffers``: every worker gets every worker's encoded buffer (sizes differ: exchange sizes, pad to
  the largest, cut the padding off again; padding is booked apart from payload).
- ``alltoall_buffers``: every worker sends one buffer to each worker (the same sizes, padding and booking).
- ``parameter_server``: one rank gathers the buffers, aggregates them (and may compress the aggregate
  downstream) with a callable it is given, and broadcasts the result.

Schemes compose them with ``yield from``. Protocols know buffers and sizes, never compressors: what to do
with the buffers is the caller's business.
"""

from gradcomp.protocols.allgather import allgather_buffers
from gradcomp.protocols.alltoall import alltoall_buffers
from gradcomp.protocols.allreduce import allreduce_sum
from gradcomp.protocols.parameter_server import parameter_server
from gradcomp.protocols.sizes import broadcast_buffer, exchange_sizes, pad_to

__all__ = ["allgather_buffers", "alltoall_buffers", "allreduce_sum", "broadcast_buffer", "exchange_sizes", "pad_to", "parameter_server"]
