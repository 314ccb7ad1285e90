"""Allgather of variable-size encoded buffers.

gloo's all_gather needs equal sizes, so the workers first exchange their lengths (control traffic), pad to the
largest, gather, and cut each buffer back to its true length. The padding each worker sent and received is
booked apart from the payload. When the caller knows every worker's length in advance (``sizes``: fixed-width
messages) the length round is skipped: one collective instead of two.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from gradcomp.protocols.sizes import buffer_sizes, pad_to
from gradcomp.transport.requests import AllGather, Rounds


def allgather_buffers(
    rank: int, buffer: Tensor, sizes: Sequence[int] | None = None, limit: int | None = None
) -> Rounds:
    """Every worker's uint8 buffer, in rank order, without padding (``rank``: this worker's).

    ``sizes``: every worker's buffer length when all of them know it in advance (checked for this worker's);
    ``limit``: else the most bytes any worker's buffer can have (``wire.format.max_encoded_size``), which bounds
    the lengths the size round brings before anything is allocated for them.
    """
    sizes = yield from buffer_sizes(buffer, rank, sizes, limit)
    largest = max(sizes)
    pad_up = largest - sizes[rank]
    pad_down = sum(largest - s for r, s in enumerate(sizes) if r != rank)
    gathered = yield AllGather(pad_to(buffer, largest), pad_up=pad_up, pad_down=pad_down)
    return [b[:s] for b, s in zip(gathered, sizes)]
