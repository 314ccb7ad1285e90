"""Allreduce for summable messages: one collective, the same sum on every worker."""

from __future__ import annotations

from torch import Tensor

from gradcomp.transport.requests import AllReduce, Rounds


def allreduce_sum(flat: Tensor, inplace: bool = False) -> Rounds:
    """Sum ``flat`` (one contiguous 1-D tensor of message fields) over all workers."""
    return (yield AllReduce(flat.reshape(-1), inplace=inplace))
