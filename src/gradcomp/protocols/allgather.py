"""Allgather of variable-size encoded buffers.

gloo's all_gather needs equal sizes, so the workers first exchange their lengths (control traffic), pad to the
largest, gather, and cut each buffer back to its true length. The padding each worker sent and received is
booked apart from the payload.
"""

from __future__ import annotations

from torch import Tensor

from gradcomp.protocols.sizes import exchange_sizes, pad_to
from gradcomp.schemes.requests import AllGather, Rounds


def allgather_buffers(rank: int, buffer: Tensor) -> Rounds:
    """Every worker's uint8 buffer, in rank order, without padding (``rank``: this worker's)."""
    sizes = yield from exchange_sizes(buffer)
    largest = max(sizes)
    pad_up = largest - sizes[rank]
    pad_down = sum(largest - s for r, s in enumerate(sizes) if r != rank)
    gathered = yield AllGather(pad_to(buffer, largest), pad_up=pad_up, pad_down=pad_down)
    return [b[:s] for b, s in zip(gathered, sizes)]
