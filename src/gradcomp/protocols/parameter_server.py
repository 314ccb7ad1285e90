"""Parameter server: gather at a root, aggregate there, broadcast the aggregate.

    1. every worker sends its encoded buffer to the root (sizes first, padded to the largest);
    2. the root's server role calls ``aggregate(buffers)`` → one downstream buffer (the caller decodes,
       averages, and may compress the average again with the server's own compressor and residual);
    3. the root broadcasts the downstream buffer's length, then the buffer; every worker returns it.

The root is also a worker; its uplink is counted like every other worker's (see transport.base).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gradcomp.protocols.sizes import exchange_sizes, pad_to
from gradcomp.transport.base import CONTROL, Transport


def parameter_server(
    transport: Transport,
    buffer: Tensor,
    aggregate: Callable[[list[Tensor]], Tensor],
    root: int = 0,
) -> Tensor:
    sizes = exchange_sizes(transport, buffer)
    largest = max(sizes)
    pad_in = sum(largest - s for s in sizes)
    gathered = transport.gather(pad_to(buffer, largest), root, pad_up=largest - sizes[transport.rank], pad_in=pad_in)
    if transport.rank == root:
        assert gathered is not None
        downstream = aggregate([b[:s] for b, s in zip(gathered, sizes)])
        length = torch.tensor([downstream.numel()], dtype=torch.int64, device=buffer.device)
    else:
        downstream = None
        length = torch.zeros(1, dtype=torch.int64, device=buffer.device)
    length = transport.broadcast(length, root, kind=CONTROL)
    if downstream is None:
        downstream = torch.empty(int(length.item()), dtype=torch.uint8, device=buffer.device)
    return transport.broadcast(downstream, root)
