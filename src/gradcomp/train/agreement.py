"""How the workers agree on a step: that every worker's gradients were finite, and that no worker refused a message.

Every worker must make the same decision at the same point of a step, or the replicas part (one applies the step,
another does not) or a worker waits at a collective the others never reach. Two agreements do that, both riding on
traffic the step sends anyway wherever they can:

- **finiteness, at the step's first message** (:func:`drive_agreeing`): a worker whose gradients are not finite marks
  its first message (a NaN value, or ``NF_MARK`` in a byte message's first two bytes) without changing its size, and
  every worker reads the marks with what it receives; if any worker's were not finite, every worker abandons the
  rounds there. On the device path the verdict is a device flag read with the step's first read
  (``_drive_deferred``); where no message can carry a mark, one more small all-reduce carries the flags.
- **refusals, at the step's end** (:func:`settle`): a worker whose received message fails its checks runs the step to
  its end on stand-ins (``wire.refusals.refusing_later``), and the workers then all-reduce one float32 flag; every
  worker raises WireError together, and nothing of the step is applied.

:func:`agreed_non_finite` is the error every worker raises for a step abandoned as not finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from gradcomp.errors import NonFiniteGradientError, WireError
from gradcomp.transport.base import CONTROL, Transport
from gradcomp.transport.requests import AllGather, AllReduce, AllToAll, Broadcast, Gather, Request, Rounds, execute
from gradcomp.wire.bits import host_path
from gradcomp.wire.device import DeviceChecks
from gradcomp.wire.refusals import ABANDON_MARK, Refusals, StepAbandoned, defer_verdict, refusing_later, take_verdict

__all__ = [
    "settle", "drive_agreeing", "watched", "agreed_non_finite", "any_abandons", "locally_bad", "refusal_note", "NF_MARK",
    "AGGREGATOR_REMEDY",
]


def refusal_note(refused: NonFiniteGradientError) -> str:
    """What a worker whose compressor refused its finite gradients names in the agreed error."""
    return f"the compression of its finite gradients ({refused})"


def any_abandons(verdicts: Sequence[Tensor]) -> Tensor:
    """Deferred verdicts (one-element bool tensors on the device, True: abandon, ``exchange(verdicts=...)``) as one
    bool tensor of shape (), True when any is; nothing read."""
    return torch.stack([f.reshape(()) for f in verdicts]).any()


AGGREGATOR_REMEDY = (
    "to skip such steps and train on, pass scaler=your_grad_scaler (fp16 autocast) or nonfinite=\"propagate\" (the "
    "NaN reaches every worker's gradients for your own check), or catch gradcomp.NonFiniteGradientError around "
    "step() and skip the optimizer step"
)


def agreed_non_finite(step: int, here: Sequence[str] = (), remedy: str = AGGREGATOR_REMEDY) -> NonFiniteGradientError:
    """The error every worker raises, at the same exchange, when the workers agreed that some worker's gradients
    were not finite; ``here``: this worker's non-finite tensors, if any (only their own worker names them);
    ``remedy``: what to do instead, for the caller's API."""
    mine = f"; on this worker in {', '.join(here)}" if here else ""
    return NonFiniteGradientError(
        f"non-finite (NaN or Inf) gradient at exchange {step} on at least one worker: every worker stops at this "
        f"exchange and nothing of it was applied (no residual or momentum changed). {remedy[0].upper()}"
        f"{remedy[1:]}{mine}",
        step=step,
    )


def settle(
    transport: Transport, refusals: Refusals, device: torch.device, checks: DeviceChecks | None = None,
    verdicts: Sequence[Tensor] = (), step: int | None = None,
) -> bool:
    """The end of a step (or of a DDP / FSDP backward pass) whose received messages were checked with their
    refusals kept for it (``wire.refusals.refusing_later``): every worker learns there, at the same step, whether
    any worker refused a message.

    A message that fails its checks (a corruption on the way) is seen only by the worker that received it. Raised
    there at once, it would leave that worker out of the rounds the others go on with: they would wait at their next
    collective until the time-out, or, in a step that had no more, apply it while the receiver did not, and the
    replicas would part. So each worker runs the step to its end (the refused message decoded as harmless
    stand-ins), and then, if the step used the wire at all (``refusals.used``, the same on every worker), the
    workers all-reduce one float32 flag, "I refused a message" (4 bytes, booked as control). On the device path
    the flag is computed where the checks are (``DeviceChecks.fault_flag``) and its sum is read in the one
    transfer that reads the checks and the ``verdicts`` (``read_after``): no read more than before.

    A flag held in ``checks`` that abandons the step (``DeviceChecks.abandon``, ``hold_for_the_pass``) may be this
    worker's alone (an FSDP rank's aggregate of its own shard), and so is ``refusals.abandoned`` (a server's or a
    shard owner's aggregate that a message made non-finite: ``wire.refusals.abandon_later``): either rides in the
    same all-reduced value, so every worker abandons the step with it.

    Returns True when the verdicts say the step is abandoned as not finite (the same on every worker; refusals do
    not matter then, nothing of the step is applied). Raises WireError on every worker when some worker refused a
    message, naming the fault on the worker that refused it; the caller then puts its state back as it was before the
    step (nothing of the step may be applied). Else False.
    """
    checks = checks if checks is not None else DeviceChecks()
    extra, verdicts = [], list(verdicts)
    world = transport.world_size
    if refusals.used and world > 1:
        if refusals.messages:
            mine = torch.ones((), dtype=torch.bool, device=device)
        else:
            mine = checks.fault_flag(device) if checks.pending else torch.zeros((), dtype=torch.bool, device=device)
        # The same 4 bytes also carry an "abandon" flag that only this worker may hold (a server's or an FSDP
        # owner's aggregate that is not finite): refused + (W + 1) * abandon, summed exactly in float32 (W < 4000).
        here = torch.ones((), dtype=torch.bool, device=device) if refusals.abandoned else checks.abandon_flag(device)
        value = mine.to(torch.float32) + (world + 1) * here.to(torch.float32)
        total = transport.all_reduce_sum(value.reshape(1), kind=CONTROL).reshape(())
        extra = [torch.remainder(total, world + 1) > 0]
        verdicts.append(total >= world + 1)
    elif refusals.abandoned:
        verdicts.append(torch.ones((), dtype=torch.bool, device=device))
    with refusing_later(refusals):
        abandoned, seen = checks.read_after(verdicts, extra)
    if abandoned:
        return True
    at = f" at exchange {step}" if step is not None else ""
    if refusals.messages:
        raise WireError(
            f"{refusals.messages[0]} (a message this worker received{at}): every worker stops at this step and "
            "nothing of it was applied"
        )
    if seen and seen[0]:
        raise WireError(
            f"another worker refused a message it received{at} (it failed its checks: a corruption on the way): "
            "every worker stops at this step and nothing of it was applied"
        )
    return False


def locally_bad(groups: Sequence[tuple[Sequence[str], Tensor]]) -> list[str]:
    """Which of this worker's groups of tensors (their names, and a one-element bool device flag, True: finite; on the
    host path the verdict itself, a bool) were not finite, named "one of <names>": what a pass abandoned at its end
    can say once its gradients are averages (one read, on a failure only)."""
    if not groups:
        return []
    flags = [flag for _, flag in groups]
    values = flags if isinstance(flags[0], bool) else torch.stack([f.reshape(()) for f in flags]).tolist()
    return [f"one of {', '.join(names) or '(unnamed)'}" for (names, _), ok in zip(groups, values) if not ok]


# -- agreeing that a step is finite, on the step's first message ---------------------------------------------------

NF_MARK = tuple(ABANDON_MARK)  # bytes 0-1 of a byte message from a worker whose gradients are not finite (b"NF")


def _can_mark(t: Tensor, chunks: int = 1) -> bool:
    if not t.numel() or t.numel() % chunks:
        return False
    return t.is_floating_point() or t.dtype == torch.int64 or (t.dtype == torch.uint8 and t.numel() // chunks >= 2)


def _mark(t: Tensor, chunks: int = 1, value: float = float("nan")) -> Tensor:
    """A copy of ``t`` that says "not finite" without changing its size (``_can_mark(t, chunks)`` holds).

    float: ``value`` (NaN; +Inf for a maximum) in the first entry of each chunk, which a sum, a maximum, a gather
    or a broadcast keeps non-finite; int64 (sizes and counts, never negative): every entry n becomes −1 − n;
    uint8 (containers, which start with b"GC"): the first two bytes of each chunk become b"NF". ``chunks``: an
    all-to-all's W chunks (each receiver gets one).
    """
    if t.dtype == torch.int64:
        return -1 - t
    out = t.clone().view(chunks, -1)
    if t.is_floating_point():
        out[:, 0] = value
    else:
        out[:, 0], out[:, 1] = NF_MARK
    return out.view_as(t)


def _mark_flags(received: list[Tensor] | Tensor, chunks: int = 1) -> Tensor:
    """For each received tensor (or chunk of one), whether its sender marked it: a bool tensor, nothing read.
    Only what a mark changes is looked at (a float's first entry, a container's first two bytes), not copied
    whole: with W gathered messages a copy of all of them cost more than decoding them (a simulated cluster of 256)."""
    parts = received if isinstance(received, list) else [received]
    rows = [r.reshape(chunks, -1) for r in parts]
    if rows[0].is_floating_point():
        return ~torch.isfinite(torch.cat([r[:, 0] for r in rows]))
    if rows[0].dtype == torch.int64:  # sizes and counts: every entry of a marked one is negative
        return torch.cat([(r < 0).any(dim=1) for r in rows])
    heads = torch.cat([r[:, :2] for r in rows])
    return (heads[:, 0] == NF_MARK[0]) & (heads[:, 1] == NF_MARK[1])


def _marked(received: list[Tensor] | Tensor, chunks: int = 1) -> list[bool]:
    """For each received tensor (or chunk of one), whether its sender marked it (one host read for all)."""
    return [bool(f) for f in _mark_flags(received, chunks).tolist()]


def _reads(request: Request) -> bool:
    """Whether the request's answer is its values read to the host (a size exchange, ``AllGather(read=True)``)."""
    return isinstance(request, AllGather) and request.read


def _marked_values(values: Sequence[float] | tuple[Sequence[float], Sequence[float]]) -> list[bool]:
    """For each gathered value of a size exchange read to the host (``AllGather(read=True)``'s answer: the values, or
    the values and this worker's ``also``), whether its sender marked it (negative: −1 − n)."""
    if isinstance(values, tuple):
        values = values[0]
    return [v < 0 for v in values]


def _mark_unless(t: Tensor, finite: Tensor, chunks: int, value: float, inplace: bool = False) -> Tensor:
    """``_mark(t, ...)`` where the device flag ``finite`` is False, ``t`` itself where it is True (a copy, or ``t``
    rewritten if ``inplace``: an all-reduce's buffer that is the scheme's to give): decided on the device, only the
    entries a mark changes rewritten (``torch.where``), nothing read back."""
    if t.dtype == torch.int64:  # sizes and counts: every entry n becomes −1 − n
        return torch.where(finite, t, -1 - t)
    out = (t if inplace else t.clone()).view(chunks, -1)
    # (Python scalars, not a tensor made from a list: a copy from pageable host memory would wait for the device)
    marks = [value] if t.is_floating_point() else list(NF_MARK)
    for i, mark in enumerate(marks):
        out[:, i] = torch.where(finite, out[:, i], mark)
    return out.view_as(t)


def _flag_round(transport: Transport, rounds: Rounds, request: Request, bad: bool) -> tuple[bool, Any]:
    """The fallback: one all-reduce of a float32 flag (4 bytes, control), then ``request`` and the rest."""
    flag = torch.tensor([1.0 if bad else 0.0], device=request.tensor.device)
    if float(transport.all_reduce_sum(flag, kind=CONTROL)[0]) != 0.0:
        rounds.close()
        return False, None
    return True, _continue(transport, rounds, execute(transport, request))


def drive_agreeing(
    transport: Transport, rounds: Rounds, finite: bool | Tensor, *, after_rounds: bool = True,
    read: bool | list[Tensor] | None = True, served: bool = False,
) -> tuple[bool, Any]:
    """Run a scheme's rounds like ``drive``, with this worker's finiteness riding on the step's first message.

    Returns ``(True, the scheme's result)`` when every worker's gradients were finite, else ``(False, None)``
    on every worker, at the same request: the rounds are abandoned there, so nothing more is sent. ``_mark``
    says how a message says "not finite" without changing its size. A summed or gathered first message (an
    all-reduce, an all-gather, an all-to-all) tells every worker at once; a parameter server's gather tells the
    root, whose next broadcast (the downstream message, or its length) tells the others. Broadcasts that come
    first (a leader's message: LGC's positions) carry only their root's data and are passed on until a message
    to which every worker contributes. A message that cannot carry it (an integer all-reduce, an empty tensor;
    a step of broadcasts only) is preceded (followed) by one all-reduce of a float32 flag (4 bytes, booked as
    control). Reading the flags is one host read of a few values.

    ``finite`` a one-element bool tensor (``GradientExchange.exchange``'s deferred verdict): where the first such
    message is a float all-reduce or a gather of every worker's message, on the device path, the mark is put on
    by ``torch.where`` and the agreed verdict is not read there but handed to the wire's next device read
    (``wire.refusals.defer_verdict``: one byte more in that transfer, StepAbandoned if bad), or read after the
    last round if no such read came (not with ``after_rounds=False``: the scheme's sizes vary). A first message
    that is a size exchange (``AllGather(read=True)``, int64) carries the device flag as its mark (every length n
    becomes −1 − n, ``torch.where``), and the verdict is read with the lengths, in the one transfer the size
    exchange makes anyway. Elsewhere ``finite`` is read at once and all goes as above. ``read=False`` (a deferred
    verdict that the result carries, for a GradScaler to read): the verdict left after the rounds is not read; a
    list: it is appended there, for the caller to read later (``GradientExchange.exchange(verdicts=...)``); None:
    read, as True. ``served`` (``Scheme.passes_verdict_on``): a first message that is a parameter server's gather
    carries the device flag too; the root reads the verdict with its checks of what it gathered, and passes a bad
    one on in its broadcast (``wire.refusals.AbandonedHere``), which every worker reads at its step's end.
    """
    if isinstance(finite, Tensor):
        return _drive_deferred(transport, rounds, finite, after_rounds, read, served)
    world = transport.world_size
    try:
        request = next(rounds)
    except StopIteration as done:  # nothing to send (no slots): the same on every worker
        return True, done.value
    request, ended = _past_broadcasts(transport, rounds, request, finite)
    if ended is not None:
        return ended
    try:
        chunks = world if isinstance(request, AllToAll) else 1
        t = request.tensor
        carries = _can_mark(t, chunks) and (
            isinstance(request, (AllGather, AllToAll, Gather))
            or (isinstance(request, AllReduce) and t.is_floating_point())
        )
        if not carries:
            return _flag_round(transport, rounds, request, not finite)
        if not finite:
            maximum = isinstance(request, AllReduce) and request.op == "max"
            request = replace(request, tensor=_mark(t, chunks, float("inf") if maximum else float("nan")))
            if isinstance(request, AllReduce):
                request.inplace = True  # the marked copy is ours to overwrite
        received = execute(transport, request)
        if isinstance(request, Gather):
            return _after_gather(transport, rounds, request.root, t, received, finite)
        if any(_marked_values(received) if _reads(request) else _marked(received, chunks)):
            rounds.close()
            return False, None
        return True, _continue(transport, rounds, received)
    except StopIteration as done:
        return True, done.value


def _past_broadcasts(
    transport: Transport, rounds: Rounds, request: Request, finite: bool | Tensor
) -> tuple[Request | None, tuple[bool, Any] | None]:
    """Broadcasts that come first (a leader's message: LGC's positions) carry only their root's data: they are sent
    as they are, and the verdict rides on the next message every worker contributes to. Returns ``(that request,
    None)``, or ``(None, (agreed, result))`` for a step of broadcasts only, agreed by one all-reduce of a float32
    flag after them (read once; ``finite`` a bool or a device flag)."""
    while isinstance(request, Broadcast):
        try:
            request = rounds.send(execute(transport, request))
        except StopIteration as done:
            device = request.tensor.device
            if isinstance(finite, Tensor):
                bad = (~finite.reshape(1)).to(device=device, dtype=torch.float32)
            else:
                bad = torch.tensor([0.0 if finite else 1.0], device=device)
            agreed = float(transport.all_reduce_sum(bad, kind=CONTROL)[0]) == 0.0
            return None, (agreed, done.value if agreed else None)
    return request, None


def _drive_deferred(
    transport: Transport, rounds: Rounds, finite: Tensor, after_rounds: bool, read: bool | list[Tensor] | None = True,
    served: bool = False,
) -> tuple[bool, Any]:
    """``drive_agreeing`` with a device flag: the verdict read with the sizes, after the rounds, or at once (or,
    after the rounds, not at all: ``read=False``; handed to the caller: ``read`` a list). ``served``: a first
    gather to a parameter server carries it too (the root's to read and pass on)."""
    try:
        request = next(rounds)
    except StopIteration as done:
        return True, done.value
    request, ended = _past_broadcasts(transport, rounds, request, finite)
    if ended is not None:
        return ended
    chunks = transport.world_size if isinstance(request, AllToAll) else 1
    t = request.tensor
    flag = finite.reshape(()).to(device=t.device)
    if _reads(request) and t.dtype == torch.int64 and t.numel():  # a size exchange: the mark is −1 − n
        values = execute(transport, replace(request, tensor=_mark_unless(t, flag, 1, 0.0)))
        if any(_marked_values(values)):
            rounds.close()
            return False, None
        return True, _continue(transport, rounds, values)
    gather = isinstance(request, Gather) and served and after_rounds
    if not (
        isinstance(request, (AllGather, AllToAll)) or (isinstance(request, AllReduce) and t.is_floating_point())
        or gather
    ) or not _can_mark(t, chunks) or host_path(t):
        return _agree_now(transport, rounds, request, bool(finite))
    value = float("inf") if isinstance(request, AllReduce) and request.op == "max" else float("nan")
    inplace = isinstance(request, AllReduce) and request.inplace  # (no copy of a dense all-reduce's buffer)
    request = replace(request, tensor=_mark_unless(t, flag, chunks, value, inplace))
    if isinstance(request, AllReduce):
        request.inplace = True  # the marked copy is ours to overwrite
    received = execute(transport, request)
    if not after_rounds:  # sizes vary: the verdict is read here, in one read of the marks
        if any(_marked(received, chunks)):
            rounds.close()
            return False, None
        return True, _continue(transport, rounds, received)
    if gather:  # the root reads the verdict with its checks (and passes it on); the others learn it from the root
        defer_verdict(_mark_flags(received).any() if received is not None else torch.zeros((), dtype=torch.bool,
                                                                                            device=t.device))
    else:
        defer_verdict(_mark_flags(received, chunks).any())
    try:
        result = _continue(transport, rounds, received)
    except StepAbandoned:  # a device read found the verdict bad: every worker abandons the step at that read
        rounds.close()
        return False, None
    finally:
        pending = take_verdict()
        defer_verdict(None)
    if pending is not None and read is not False:  # no read of the wire took it
        if isinstance(read, list):
            read.append(pending)  # the caller's to read, before anything of the step is applied
        elif bool(pending):  # the one read of the step
            return False, None
    return True, result


def watched(rounds: Rounds, started: list[bool]) -> Rounds:
    """``rounds``, noting in ``started`` once its first request is made (a single-round scheme has compressed by
    then): an error before it is raised before anything of the step was sent."""
    try:
        request = next(rounds)
    except StopIteration as done:
        return done.value
    started.append(True)
    sent = yield request
    return (yield from _rest(rounds, sent))


def _agree_now(transport: Transport, rounds: Rounds, request: Request, finite: bool) -> tuple[bool, Any]:
    """``drive_agreeing`` from its first request ``request`` on, with the verdict known on this worker."""

    def again() -> Rounds:
        sent = yield request
        return (yield from _rest(rounds, sent))

    return drive_agreeing(transport, again(), finite)


def _rest(rounds: Rounds, sent: Any) -> Rounds:
    """The rounds from the answer ``sent`` to the request they last yielded on (``yield from`` after a send);
    closing this generator closes ``rounds``."""
    try:
        request = rounds.send(sent)
        while True:
            request = rounds.send((yield request))
    except StopIteration as done:
        return done.value
    finally:
        rounds.close()


def _after_gather(
    transport: Transport, rounds: Rounds, root: int, mine: Tensor, received: list[Tensor] | None, finite: bool
) -> tuple[bool, Any]:
    """A parameter server's gather: the root knows; its next broadcast, marked or not, tells every worker."""
    root_saw_bad = False
    if received is not None:  # the root serves with its own unmarked message in place of a marked one
        flags = _marked(received)
        root_saw_bad = any(flags)
        received = [mine if bad else r for r, bad in zip(received, flags)]
    request = rounds.send(received)
    if not (isinstance(request, Broadcast) and request.root == root and _can_mark(request.tensor)):
        return _flag_round(transport, rounds, request, root_saw_bad or not finite)
    if root_saw_bad and transport.rank == root:
        request = replace(request, tensor=_mark(request.tensor))
    received = execute(transport, request)
    if _marked(received)[0]:
        rounds.close()
        return False, None
    return True, _continue(transport, rounds, received)


def _continue(transport: Transport, rounds: Rounds, result: Any) -> Any:
    """``drive`` from the point where ``result`` is the answer to the request the rounds last yielded."""
    try:
        request = rounds.send(result)
        while True:
            request = rounds.send(execute(transport, request))
    except StopIteration as done:
        return done.value
