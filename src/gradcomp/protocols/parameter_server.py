"""Parameter server: gather at a root, aggregate there, broadcast the aggregate.

    1. every worker sends its encoded buffer to the root (sizes first, padded to the largest; no size round
       when the caller gives every worker's ``sizes``, known in advance for fixed-width messages);
    2. the root's server role calls ``aggregate(buffers)`` → one downstream buffer (the caller decodes,
       averages, and may compress the average again with the server's own compressor and residual);
    3. the root broadcasts the downstream buffer's length (unless ``downstream_size`` is known in advance), then
       the buffer; every worker returns it.

The root is also a worker; its uplink is counted like every other worker's (see transport.base).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from gradcomp.protocols.sizes import broadcast_buffer, buffer_sizes, pad_to
from gradcomp.transport.requests import Gather, Rounds


def parameter_server(
    rank: int,
    buffer: Tensor,
    aggregate: Callable[[list[Tensor]], Tensor],
    root: int = 0,
    sizes: Sequence[int] | None = None,
    downstream_size: int | None = None,
    limit: int | None = None,
    downstream_limit: int | None = None,
) -> Rounds:
    """``limit`` / ``downstream_limit``: the most bytes a worker's buffer / the downstream buffer can have
    (``wire.format.max_encoded_size``), bounding the lengths their size rounds bring."""
    sizes = yield from buffer_sizes(buffer, rank, sizes, limit)
    largest = max(sizes)
    pad_in = sum(largest - s for s in sizes)
    gathered = yield Gather(pad_to(buffer, largest), root, pad_up=largest - sizes[rank], pad_in=pad_in)
    downstream = None
    if rank == root:
        assert gathered is not None
        downstream = aggregate([b[:s] for b, s in zip(gathered, sizes)])
    return (yield from broadcast_buffer(downstream, root, buffer.device, downstream_size, limit=downstream_limit))
