"""Variable-size buffers over equal-size collectives: size exchange, padding, unpadding.

A size round costs one collective, i.e. one more wait for every worker, for a few bytes. When every worker
knows every buffer's length in advance (a message of fixed-width fields: its wire layout follows from the
compressor's specs, ``wire.encoded_size``), the protocols take those lengths instead and skip the round;
``known_sizes`` checks this worker's buffer against them before anything is sent.

The lengths a size round brings are plain int64 values, not container messages: framing each of them would
add 30 bytes to every variable-size message's 8. They are checked instead (``received_lengths``) before any
buffer is allocated for them: a length no container message can have (negative, or beyond the header's u32
body length) raises ``WireError`` on the worker that received it. A corrupted length that is still possible
cuts or pads a message, which the message's own checksum and length field then refuse, or, where it changes
the padded size of the next collective on one worker only, leaves the workers' collectives unequal, which the
process group reports (gloo's size check, or its time-out).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gradcomp.errors import WireError
from gradcomp.transport.base import CONTROL
from gradcomp.transport.requests import AllGather, Broadcast, Rounds
from gradcomp.wire import MAX_MESSAGE_BYTES


def exchange_sizes(buffer: Tensor, limit: int | None = None) -> Rounds:
    """Every worker's buffer length in bytes (one int64 per worker, booked as control traffic), read to the host
    in one transfer (``AllGather(read=True)``: a step's verdict on finiteness can ride on it); ``limit``: see
    ``received_lengths``."""
    mine = torch.tensor([buffer.numel()], dtype=torch.int64, device=buffer.device)
    gathered = yield AllGather(mine, kind=CONTROL, read=True)
    return received_lengths(gathered, "the size round", limit)


def received_lengths(values, what: str, limit: int | None = None) -> list[int]:
    """``values`` (message lengths in bytes, one per worker, as a round brought them) as ints, after checking
    that each is a length the messages can have: in [0, ``limit``], the most the receiver's specs allow
    (``wire.format.max_encoded_size``), or, where the caller does not know them, in [0, MAX_MESSAGE_BYTES].
    Raises WireError naming the round and the worker otherwise, before anything is allocated for it (a corrupted
    length would otherwise size the padding and the receive buffers: gigabytes for one flipped bit)."""
    bound = MAX_MESSAGE_BYTES if limit is None else min(int(limit), MAX_MESSAGE_BYTES)
    lengths = [int(v) for v in values]
    for worker, n in enumerate(lengths):
        if not 0 <= n <= bound:
            raise WireError(
                f"{what} brought length {n} for worker {worker}'s message, which no message can have (0 to "
                f"{bound} bytes): a control value corrupted on its way; nothing was allocated for it"
            )
    return lengths


def exchange_lengths(length: Tensor, also: Tensor, layout: Tensor, limit: int | None = None) -> Rounds:
    """The device path's size exchange, before a message is encoded (``wire.format.length_on_device``): this
    worker's length (a one-element int64 tensor on the device, not read) and ``layout``, the message's layout values
    (``wire.format.layout_values``, int64 on the device), sent together (8 bytes each, control traffic), so that
    every receiver decodes every message where it is, none brought to the host for its headers; ``also`` (int64
    values of this worker's own, not sent) read in the same transfer. Returns ``(every worker's length, every
    worker's layout values, also's values)``. The host path's exchange (``exchange_sizes``) sends lengths only: it
    reads a message's headers where the message is. ``limit``: see ``received_lengths``."""
    sent = torch.cat([length.reshape(1), layout.reshape(-1)])
    gathered, mine = yield AllGather(sent, kind=CONTROL, read=True, also=also)
    n = sent.numel()  # (the same on every worker: the specs fix how many layout values a message has)
    rows = [[int(v) for v in gathered[r : r + n]] for r in range(0, len(gathered), n)]
    # (the layout values are checked where they are used: wire.container refuses any a message cannot have)
    lengths = received_lengths([row[0] for row in rows], "the size round", limit)
    return lengths, [row[1:] for row in rows], [int(v) for v in mine]


def buffer_sizes(buffer: Tensor, rank: int, known: Sequence[int] | None = None, limit: int | None = None) -> Rounds:
    """Every worker's buffer length: ``known`` (checked for this worker's, no collective) or a size round (its
    lengths bounded by ``limit``: see ``received_lengths``)."""
    if known is None:
        return (yield from exchange_sizes(buffer, limit))
    return known_sizes(buffer, known, rank)


def known_sizes(buffer: Tensor, sizes: Sequence[int], rank: int) -> list[int]:
    """``sizes`` (every worker's length, known in advance) after checking that this worker's buffer has its own.

    A mismatch means the encoder and the specs disagree: sending would desynchronise the collective, so it
    raises WireError before anything is sent. It is an internal assertion (``wire.encode`` already refuses a
    field whose count differs from its spec's): should it ever fire, it fires on this worker only, and the
    others wait at the collective until the process group's time-out.
    """
    sizes = [int(s) for s in sizes]
    check_size(buffer, sizes[rank], f"worker {rank}'s buffer")
    return sizes


def check_size(buffer: Tensor, size: int, what: str) -> None:
    if buffer.numel() != size:
        raise WireError(
            f"{what} is {buffer.numel()} bytes but its specs fix {size}: the encoder and the specs disagree; "
            "nothing was sent"
        )


def pad_to(buffer: Tensor, size: int) -> Tensor:
    if buffer.numel() == size:
        return buffer
    padded = torch.zeros(size, dtype=torch.uint8, device=buffer.device)
    padded[: buffer.numel()] = buffer
    return padded


def broadcast_buffer(
    buffer: Tensor | None, root: int, device: torch.device, size: int | None = None, peer: bool = False,
    limit: int | None = None,
) -> Rounds:
    """The root's uint8 buffer on every worker: its length first (one int64, control traffic), then the bytes.

    The root passes its buffer, every other worker None. ``size``: the buffer's length when every worker knows
    it in advance; the length round is then skipped (the root's buffer is checked against it first). ``peer``:
    the root is a worker, not the parameter server (``Broadcast.peer``, booked as the root's upload). ``limit``:
    the most bytes the buffer can have (see ``received_lengths``).
    """
    if size is not None:
        if buffer is not None:
            check_size(buffer, size, "the root's downstream buffer")
        length = int(size)
    else:
        if buffer is not None:
            count = torch.tensor([buffer.numel()], dtype=torch.int64, device=device)
        else:
            count = torch.zeros(1, dtype=torch.int64, device=device)
        count = yield Broadcast(count, root, kind=CONTROL, peer=peer)
        # the root knows its own length: only the others read the broadcast one (a wait for the device on a GPU)
        if buffer is not None:
            length = buffer.numel()
        else:
            length = received_lengths([count.item()], "the length broadcast", limit)[0]
    if buffer is None:
        buffer = torch.empty(length, dtype=torch.uint8, device=device)
    return (yield Broadcast(buffer, root, peer=peer))
