"""All-to-all of variable-size encoded buffers: worker j receives every worker's buffer for j.

gloo's all_to_all needs W equal chunks, so the lengths are exchanged first (control traffic) unless the caller
knows them, every buffer is padded to the longest, and each received buffer is cut back to its true length. The
padding is booked apart from the payload. Used by the sharded topology (each buffer a container message for one
shard owner) and FSDP's compressed reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradcomp.errors import WireError
from gradcomp.protocols.sizes import check_size, pad_to, received_lengths
from gradcomp.transport.base import CONTROL
from gradcomp.transport.requests import AllToAll, Rounds


def alltoall_buffers(
    rank: int, buffers: Sequence[Tensor], known: Sequence[int] | None = None, limits: Sequence[int] | None = None
) -> Rounds:
    """Send ``buffers[j]`` (uint8, any lengths) to worker j; returns the W buffers received, in rank order.

    A control all-to-all of (length for you, my longest) per destination comes first; every buffer is then
    padded to the longest buffer of all, and the padding is booked apart and cut off again. ``known[j]``: the
    length of every worker's buffer for worker j, when all of them know it in advance (fixed-width messages);
    the control round is then skipped (this worker's buffers are checked against it first). ``limits[j]``: else the
    most bytes a buffer for worker j can have (``wire.format.max_encoded_size``), which bounds the lengths the
    control round brings before anything is allocated for them.
    """
    world = len(buffers)
    device = buffers[0].device
    lengths = [int(b.numel()) for b in buffers]
    if known is None:
        longest_mine = max(lengths)
        sizes = torch.tensor([[n, longest_mine] for n in lengths], dtype=torch.int64, device=device)
        received = yield AllToAll(sizes, kind=CONTROL)
        rows = received.tolist()  # one read for both columns (two, before: one per column)
        what = "the all-to-all's length round"
        incoming = received_lengths([r[0] for r in rows], what, None if limits is None else limits[rank])  # for me
        chunk = max(received_lengths([r[1] for r in rows], what, None if limits is None else max(limits)))  # longest
    else:
        for j, buffer in enumerate(buffers):
            check_size(buffer, known[j], f"worker {rank}'s buffer for worker {j}")
        incoming = [int(known[rank])] * world
        chunk = max(int(n) for n in known)
    pad_up = sum(chunk - n for j, n in enumerate(lengths) if j != rank)
    pad_down = sum(chunk - n for i, n in enumerate(incoming) if i != rank)
    payload = torch.cat([pad_to(b, chunk) for b in buffers])
    got = yield AllToAll(payload, pad_up=pad_up, pad_down=pad_down)
    if got.numel() != world * chunk:  # the longest length came corrupted to some worker, which sent other chunks
        raise WireError(f"the all-to-all brought {got.numel()} bytes where {world} chunks of {chunk} were agreed")
    return [piece[:n] for piece, n in zip(got.reshape(world, chunk).unbind(0), incoming)]
