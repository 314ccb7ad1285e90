"""Collective requests: what a scheme asks the transport to do, one round at a time.

A scheme's ``run`` is a generator: it yields one of these, a driver hands it to the transport, and the result
is sent back into the generator. The scheme never touches a process group, so every round is byte-counted by
the transport and runs unchanged on the simulated cluster.

=============  ===========================================================  ==========================
request        what it does                                                  the generator receives
=============  ===========================================================  ==========================
AllReduce      elementwise ``sum`` or ``max`` over workers                   the reduced tensor
AllGather      every worker's tensor (equal shapes)                          list, in rank order
AllToAll       W equal chunks, chunk j to worker j                           W chunks, chunk i from i
Gather         every worker's tensor at ``root`` (equal shapes)              list at root, else None
Broadcast      ``root``'s tensor on every worker                             the tensor
=============  ===========================================================  ==========================

``kind`` books the bytes as payload or control (size exchanges); ``pad_*`` is padding inside the tensor,
booked apart. ``Broadcast(peer=True)``: the root is a worker sending to its peers (booked as its upload),
not the parameter server's downlink (booked as server output). ``AllReduce(inplace=True)`` lets the
transport overwrite the tensor it was given (the scheme made it and will not read it again), which saves a
copy of every reduced buffer. ``AllGather(read=True)`` (a size exchange): the generator receives every worker's
values as one flat list of Python numbers, read from the device in one transfer, so that the driver can read the
workers' finiteness marks in the same transfer (``train.agreement.drive_agreeing``); with ``also`` (this worker's
values to read as well, not sent) it receives ``(gathered values, also's values)``, still one transfer.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor

from gradcomp.transport.base import PAYLOAD, Transport


@dataclass
class AllReduce:
    tensor: Tensor
    op: str = "sum"  # "sum" or "max"
    kind: str = PAYLOAD
    inplace: bool = False


@dataclass
class AllGather:
    tensor: Tensor
    kind: str = PAYLOAD
    pad_up: int = 0
    pad_down: int = 0
    read: bool = False  # answer with the gathered values on the host (one flat list), not tensors
    also: Tensor | None = None  # with read: this worker's int64 values read in the same transfer (not sent)


@dataclass
class AllToAll:
    tensor: Tensor
    kind: str = PAYLOAD
    pad_up: int = 0
    pad_down: int = 0


@dataclass
class Gather:
    tensor: Tensor
    root: int
    kind: str = PAYLOAD
    pad_up: int = 0
    pad_in: int = 0


@dataclass
class Broadcast:
    tensor: Tensor
    root: int
    kind: str = PAYLOAD
    peer: bool = False  # the root is a worker sending to its peers, not the parameter server (booked as such)


Request = Union[AllReduce, AllGather, AllToAll, Gather, Broadcast]  # noqa: UP007 (a runtime alias; Python 3.10)
# A scheme's rounds: yields requests, receives their results, returns the aggregated tensors.
Rounds = Generator[Request, Any, Any]


def execute(transport: Transport, request: Request) -> Any:
    """Carry out one request on ``transport`` (blocking) and return its result."""
    if isinstance(request, AllReduce):
        if request.op == "sum":
            return transport.all_reduce_sum(request.tensor, request.kind, inplace=request.inplace)
        if request.op == "max":
            return transport.all_reduce_max(request.tensor, request.kind)
        raise ValueError(f"unknown all-reduce op {request.op!r}")
    if isinstance(request, AllGather):
        gathered = transport.all_gather(request.tensor, request.kind, request.pad_up, request.pad_down)
        if not request.read:
            return gathered
        if request.also is None:
            return torch.cat(gathered).tolist()
        values = torch.cat([*gathered, request.also.reshape(-1)]).tolist()
        n = sum(g.numel() for g in gathered)
        return values[:n], values[n:]
    if isinstance(request, AllToAll):
        return transport.all_to_all(request.tensor, request.kind, request.pad_up, request.pad_down)
    if isinstance(request, Gather):
        return transport.gather(request.tensor, request.root, request.kind, request.pad_up, request.pad_in)
    if isinstance(request, Broadcast):
        return transport.broadcast(request.tensor, request.root, request.kind, peer=request.peer)
    raise TypeError(f"a scheme yielded {type(request).__name__}, which is not a collective request")


def drive(transport: Transport, rounds: Rounds) -> Any:
    """The blocking driver: run a scheme's rounds to the end on ``transport``; returns what the scheme returns."""
    try:
        request = next(rounds)
        while True:
            request = rounds.send(execute(transport, request))
    except StopIteration as done:
        return done.value
