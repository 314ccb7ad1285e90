"""Allreduce for summable messages: one collective, the same sum on every worker."""

from __future__ import annotations

from torch import Tensor

from gradcomp.transport.base import Transport


def allreduce_sum(transport: Transport, flat: Tensor) -> Tensor:
    """Sum ``flat`` (one contiguous 1-D tensor of message fields) over all workers."""
    return transport.all_reduce_sum(flat.reshape(-1))
