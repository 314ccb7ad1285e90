"""Variable-size buffers over equal-size collectives: size exchange, padding, unpadding."""

from __future__ import annotations

import torch
from torch import Tensor

from gradcomp.schemes.requests import AllGather, Broadcast, Rounds
from gradcomp.transport.base import CONTROL


def exchange_sizes(buffer: Tensor) -> Rounds:
    """Every worker's buffer length in bytes (one int64 per worker, booked as control traffic)."""
    mine = torch.tensor([buffer.numel()], dtype=torch.int64, device=buffer.device)
    gathered = yield AllGather(mine, kind=CONTROL)
    return [int(s) for s in torch.cat(gathered).tolist()]


def pad_to(buffer: Tensor, size: int) -> Tensor:
    if buffer.numel() == size:
        return buffer
    padded = torch.zeros(size, dtype=torch.uint8, device=buffer.device)
    padded[: buffer.numel()] = buffer
    return padded


def broadcast_buffer(buffer: Tensor | None, root: int, device: torch.device) -> Rounds:
    """The root's uint8 buffer on every worker: its length first (one int64, control traffic), then the bytes.

    The root passes its buffer, every other worker None.
    """
    if buffer is not None:
        length = torch.tensor([buffer.numel()], dtype=torch.int64, device=device)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=device)
    length = yield Broadcast(length, root, kind=CONTROL)
    if buffer is None:
        buffer = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    return (yield Broadcast(buffer, root))
