"""GradientExchange: one worker's exchange of one step, carried out by a scheme over a transport.

One object per worker. ``exchange(slots, tensors, step)`` checks the tensors, runs the scheme's rounds on the
transport with the blocking driver, and returns, on every worker, the same list of aggregated dense float32
tensors. The scheme follows from the method and the topology:

- a method that owns its rounds (a ``Scheme`` such as ``powersgd``) is its own scheme;
- any other compressor travels through ``SingleRound`` (``allreduce`` for summable messages, ``allgather``
  for the rest, or ``ps``, a parameter server that may compress downstream with ``server_compressor``) or,
  with ``topology="sharded"``, through ``Sharded`` (every worker serves 1/W of every slot).

Before anything is sent, each tensor is checked: floating point, the slot's size, finite (NaN / Inf raise
NonFiniteGradientError naming the slot).

Time is split honestly: ``communicate_s`` is the time inside collectives (the transport's clock), and
``compress_s`` is everything else this object does (compress, encode, decode, decompress, aggregate); a
simulated worker's waits for the other workers' turns count as neither.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Compressor, Slot
from gradcomp.compressors.state import plain_name
from gradcomp.errors import ConfigError, NonFiniteGradientError, WireError
from gradcomp.finite import finite_flags
from gradcomp.schemes.base import Scheme
from gradcomp.schemes.single_round import TOPOLOGIES as SINGLE_ROUND_TOPOLOGIES
from gradcomp.schemes.single_round import SingleRound
from gradcomp.transport.base import CONTROL, Transport
from gradcomp.transport.requests import (
    AllGather,
    AllReduce,
    AllToAll,
    Broadcast,
    Gather,
    Request,
    Rounds,
    drive,
    execute,
)
from gradcomp.wire.bits import host_path
from gradcomp.wire.container import decode, encode
from gradcomp.wire.device import DeviceChecks
from gradcomp.wire.format import Codec, FieldSpec, encoded_size
from gradcomp.wire.refusals import ABANDON_MARK, Refusals, StepAbandoned, defer_verdict, refusing_later, take_verdict

TOPOLOGIES = (*SINGLE_ROUND_TOPOLOGIES, "sharded")


def build_scheme(
    method: Compressor | Scheme,
    *,
    topology: str = "auto",
    server_compressor: Compressor | None = None,
    root: int = 0,
    min_compression_rate: float | None = None,
) -> Scheme:
    """The scheme that carries ``method`` with this topology (not yet bound to a worker)."""
    if topology not in TOPOLOGIES:
        raise ConfigError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    if isinstance(method, Scheme):
        if server_compressor is not None:
            raise ConfigError(f"{method.name!r} owns its rounds: it takes no server compressor")
        if topology != "auto":
            if topology not in method.topologies:
                runs_over = f" (it runs over {', '.join(method.topologies)})" if method.topologies else ""
                raise ConfigError(f"{method.name!r} owns its rounds: it takes no topology {topology!r}{runs_over}")
            method.use_topology(topology, root)
        return method
    if not isinstance(method, Compressor):
        raise ConfigError(f"expected a compressor or a scheme (gradcomp.make(...)), got {type(method).__name__}")
    if topology == "sharded":
        from gradcomp.schemes.sharded import Sharded

        return Sharded(method, server_compressor=server_compressor)
    return SingleRound(
        method, topology, server_compressor=server_compressor, root=root, min_compression_rate=min_compression_rate
    )


def check_gradients(names: Sequence[str], tensors: Sequence[Tensor], exchange: int | None = None) -> None:
    """Raise before any communication if a tensor is not floating point or holds NaN / Inf.

    ``exchange`` is the 0-based index of this exchange (the training step when gradients are exchanged every
    step); it goes into the message and the error's ``step``.
    """
    for name, t in zip(names, tensors):
        if not t.is_floating_point():
            raise ConfigError(f"{name}: gradcomp compresses floating-point tensors, got dtype {t.dtype}")
    if not tensors:
        return
    finite = finite_flags(tensors)
    if not all(finite):
        bad = [name for name, ok in zip(names, finite) if not ok]
        where = f" at exchange {exchange}" if exchange is not None else ""
        raise NonFiniteGradientError(
            f"non-finite (NaN or Inf) gradient{where} in {', '.join(bad)}; nothing was sent", step=exchange
        )


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


def warn_float64(named: Sequence[tuple[str, Tensor]], where: str, stacklevel: int = 3) -> bool:
    """Warn once, naming them, when parameters are float64: every method compresses float32 values.

    Their gradients are rounded to float32 before compression (and the result written back as float64), so
    even ``none`` is not exact for them, and the bits are counted against fp32's 32 per entry, not 64.
    Returns whether it warned.
    """
    wide = [name for name, p in named if p.dtype == torch.float64]
    if wide:
        shown = ", ".join(wide[:5]) + (f" and {len(wide) - 5} more" if len(wide) > 5 else "")
        warnings.warn(
            f"{where}: {len(wide)} float64 parameter(s) ({shown}): gradcomp compresses float32 values, so their "
            "gradients are rounded to float32 first (even with 'none'), and bits are counted against fp32",
            stacklevel=stacklevel,
        )
    return bool(wide)


class GradientExchange:
    def __init__(
        self,
        method: Compressor | Scheme,
        transport: Transport,
        *,
        topology: str = "auto",
        server_compressor: Compressor | None = None,
        root: int = 0,
        min_compression_rate: float | None = None,
    ):
        self.scheme = build_scheme(
            method,
            topology=topology,
            server_compressor=server_compressor,
            root=root,
            min_compression_rate=min_compression_rate,
        )
        self.scheme.bind(transport.rank, transport.world_size)
        self.method = method
        self.transport = transport
        self.compress_s = 0.0
        self.refused: NonFiniteGradientError | None = None  # this worker's compressor refused its last exchange
        self._checked: set[tuple[Slot, ...]] = set()  # slot lists whose limits check_slots passed (DDP: per bucket)

    @property
    def topology(self) -> str:
        return getattr(self.scheme, "topology", self.scheme.name)

    @property
    def compressor(self) -> Compressor | Scheme:
        """The method each worker applies (a compressor, or a scheme that owns its rounds)."""
        return self.method

    @property
    def server_compressor(self) -> Compressor | None:
        """The server's compressor (topology ``ps`` or ``sharded``), with its own residual."""
        return getattr(self.scheme, "server_compressor", None)

    @property
    def owns_momentum(self) -> bool:
        return bool(getattr(self.method, "owns_momentum", False))

    @property
    def communicate_s(self) -> float:
        return self.transport.counter.seconds

    def check(self, slots: Sequence[Slot], tensors: Sequence[Tensor], validate: bool = True) -> None:
        if len(slots) != len(tensors):
            raise ConfigError(f"{len(slots)} slots but {len(tensors)} tensors")
        for slot, t in zip(slots, tensors):
            if t.numel() != slot.numel:
                raise ConfigError(f"{slot.name}: tensor has {t.numel()} elements, slot says {slot.numel}")
        key = tuple(slots)
        if key not in self._checked:
            self.scheme.check_slots(slots)  # k larger than a tensor, a server compressor's limits: before sending
            self._checked.add(key)
        if validate:
            check_gradients([s.name for s in slots], tensors)

    def check_same_slots(self, slots: Sequence[Slot], owner: str) -> None:
        """ConfigError on every worker, before any gradient is sent, unless every worker has the same ``slots``
        (names and sizes, in order); the message names the first difference. Otherwise the first exchange would
        hand collectives of different sizes to the transport (gloo aborts the process on one rank, the others
        report a lost worker). Costs one all-gather of two int64 (a digest of the slot list and its length), and
        a second one of the lists only when they differ, each a container message (its bytes a BITS field of
        width 8, so that a list corrupted on its way raises WireError, as any message does, instead of an error
        of the JSON parser or a wrong difference): call it once per run. Booked as set-up traffic
        (``counter.up_setup`` / ``down_setup``) and nowhere else, so the step counts stay the exchanges' own and
        a resumed run's steps count what an uninterrupted run's do."""
        transport = self.transport
        if transport.world_size == 1:
            return
        listed = json.dumps([[slot.name, slot.numel] for slot in slots]).encode()
        digest = int.from_bytes(hashlib.sha256(listed).digest()[:8], "little", signed=True)
        mine = torch.tensor([digest, len(listed)], dtype=torch.int64, device=transport.device)
        gathered = [g.tolist() for g in _setup_all_gather(transport, mine)]
        if all(g == gathered[0] for g in gathered):
            return
        def spec(length: int) -> list[FieldSpec]:
            return [FieldSpec(Codec.BITS, count=length, width=8)]

        mine_listed = torch.frombuffer(bytearray(listed), dtype=torch.uint8).to(transport.device)
        message = encode([mine_listed], spec(len(listed)))
        sizes = [encoded_size(spec(length)) for _, length in gathered]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=transport.device)
        padded[: message.numel()] = message
        lists = [
            [tuple(s) for s in json.loads(bytes(decode(t[:size], spec(length))[0].tolist()).decode())]
            for t, size, (_, length) in zip(_setup_all_gather(transport, padded), sizes, gathered)
        ]
        raise ConfigError(
            f"{owner}: the workers' parameters differ ({first_difference(lists)}); every worker must "
            "pass the same parameters, in the same order, with the same sizes. Nothing was sent"
        )

    def exchange(
        self,
        slots: Sequence[Slot],
        tensors: Sequence[Tensor],
        step: int,
        *,
        validate: bool = True,
        finite: bool | Tensor | None = None,
        handed_on: bool = False,
        verdicts: list[Tensor] | None = None,
        refusals: Refusals | None = None,
    ) -> list[Tensor] | None:
        """The aggregate over workers of the decompressed messages; ``validate=False`` if the caller checked.

        ``finite``: this worker's verdict on its tensors (the caller checked them). The workers then agree, on
        the step's first message (``drive_agreeing``), whether every worker's were finite; if any was not, every
        worker returns None at the same point and sends nothing more. The scheme's state has then moved (it
        compressed before the verdict came): restore it from a ``snapshot()`` taken before. A worker whose own
        tensors are not finite compresses zeros in their place (only the message's shape matters), so no NaN
        reaches a compressor. ``finite`` may also be a one-element bool tensor on the device (``finite_flag``: no
        host read to make it); where the scheme allows it (``Scheme.defers_verdict``: fixed sizes) and the first
        message can carry it on the device path, the verdict is then read once, with the wire's checks, after the
        rounds (``drive_agreeing``): a non-finite step runs its rounds to the end, on its own tensors, and is
        abandoned there, on every worker, before anything of it is applied. A scheme whose sizes vary gets a bad
        worker's tensors as zeros (``torch.where`` on the device) and reads the verdict at its first message: with
        the sizes when that message is a size exchange (one read for both). Without ``finite``, non-finite tensors
        raise NonFiniteGradientError here, on this worker only, before anything is sent (``validate``).

        ``handed_on``: the caller hands the result on, NaN and all, to something that checks it (a GradScaler, or the
        user's own check under the DDP hook's ``nonfinite="propagate"``) and keeps no count of skipped steps. Where
        the verdict is deferred and the scheme's result carries it (``Scheme.verdict_in_result``: a stateless
        all-reduce), nothing is read: a bad step's result holds a NaN on every worker, and ``scaler.step`` (or the
        user's check) skips it on every worker from its own read.

        ``verdicts``: a list to which a deferred verdict that no read of the wire has taken by the end of the rounds
        (an all-reduce-only scheme's) is appended, as a device flag (True: abandon), instead of being read here.
        The caller must then read it before anything of the step is applied and, if it is True, restore the state
        from its snapshot on every worker: the DDP hook reads a backward pass's flags once, at its last bucket.

        ``refusals``: a received message that fails its checks is noted there, and the rounds go on to their end
        (``wire.refusals.refusing_later``), for the caller to ``settle`` at the end of the step or pass, on every
        worker at once; None: WireError here, on the receiving worker only.
        """
        self.check(slots, tensors, validate and finite is None)
        started, blocked_before = time.perf_counter(), self._blocked_seconds()
        self.refused = None
        with refusing_later(refusals):
            result = self._run(slots, tensors, step, finite, handed_on, verdicts)
        blocked = self._blocked_seconds() - blocked_before
        self.compress_s += time.perf_counter() - started - blocked
        return result

    def _run(
        self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int, finite: bool | Tensor | None,
        handed_on: bool, verdicts: list[Tensor] | None,
    ) -> list[Tensor] | None:
        """``exchange``'s rounds, driven."""
        if finite is None:
            result = drive(self.transport, self.scheme.run(slots, tensors, step))
        else:
            on_device = isinstance(finite, Tensor) and bool(tensors) and not host_path(tensors[0])
            defer = on_device and self.scheme.defers_verdict(slots)
            if isinstance(finite, Tensor) and not on_device:
                finite = bool(finite)  # the host path: the verdict is read at the first message
            if defer:  # this worker's tensors go in as they are (a non-finite step is abandoned before anything
                inputs = tensors  # of it is applied, and the device path's compressors read nothing back)
            elif on_device:  # sizes may vary: a bad worker's tensors become zeros on the device, nothing read
                inputs = [torch.where(finite.reshape(()), t, 0) for t in tensors]
            else:
                inputs = tensors if finite else [torch.zeros_like(t) for t in tensors]
            read = not (defer and handed_on and self.scheme.verdict_in_result(slots))
            read = verdicts if read and defer else read
            served = defer and self.scheme.passes_verdict_on(slots)
            started_sending: list[bool] = []
            rounds = _watched(self.scheme.run(slots, inputs, step), started_sending)
            try:
                agreed, result = drive_agreeing(
                    self.transport, rounds, finite, after_rounds=defer, read=read, served=served
                )
            except StepAbandoned:  # an all-gather's aggregate a message made non-finite: the same on every worker
                agreed, result = False, None
            except NonFiniteGradientError as refused:
                # The host path's compressors refuse a finite input whose compression is not finite (QSGD's
                # 2-norm above float32's range, EF-signSGD's g + residual overflowing), on this worker only. Raised
                # before its first message, it would leave the others waiting in that collective until the time-out:
                # this worker's verdict becomes "not finite" instead, on zeros, so every worker abandons the step.
                if started_sending or finite is not True:
                    raise
                self.refused = refused
                zeros = [torch.zeros_like(t) for t in tensors]
                agreed, result = drive_agreeing(
                    self.transport, self.scheme.run(slots, zeros, step), False, after_rounds=defer, read=read
                )
            if not agreed:
                result = None
        return result

    def refusal(self) -> list[str]:
        """For the error of a step abandoned because this worker's compressor refused its finite gradients
        (``refused``): what to name on this worker, or nothing."""
        return [] if self.refused is None else [refusal_note(self.refused)]

    def _blocked_seconds(self) -> float:
        return self.transport.counter.seconds + self.transport.idle_seconds()

    # -- a step undone: the state before it ----------------------------------------------------------------------

    def snapshot(self) -> dict:
        """The scheme's state as it is now (``state_dict()``, which copies every tensor): one copy of the
        residuals, momenta, ... per call, nothing for stateless methods. ``restore`` puts it back exactly."""
        return self.scheme.state_dict()

    def restore(self, snapshot: dict) -> None:
        self.scheme.load_state_dict(snapshot)

    def restore_where(self, snapshot: dict, bad: Tensor) -> bool:
        """``restore(snapshot)`` if the device flag ``bad`` (a bool tensor of one element) is True, else nothing,
        without reading it (``Scheme.restore_where``); False, and nothing changed, when the state's layout moved
        since the snapshot."""
        return self.scheme.restore_where(snapshot, bad.reshape(()))

    # -- checkpointing ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return self.scheme.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheme.load_state_dict(state)

    def identity(self, slots: Sequence[Slot]) -> dict:
        """What a saved state belongs to, recorded by its owner's ``state_dict()``: the method (its repr, with its
        parameters), the slots (name and size of each, and their shapes: a (32, 20) weight's PowerSGD factors do not
        fit a (64, 10) one), and the worker (its rank and the world size): residuals are one worker's own, so rank 0's
        state loaded on every rank would feed rank 0's residuals to all."""
        return {
            "method": repr(self.scheme),
            "slots": [[slot.name, slot.numel] for slot in slots],
            "shapes": [None if slot.shape is None else list(slot.shape) for slot in slots],
            "rank": self.transport.rank,
            "world_size": self.transport.world_size,
        }

    def check_saved(self, state: object, required: Sequence[str], slots: Sequence[Slot], owner: str) -> None:
        """ConfigError unless ``state`` is what ``owner.state_dict()`` returns (a dict with the ``required`` keys),
        saved by this method for these ``slots``, by this rank in a world of this size: loaded otherwise, its
        residuals would be ignored (another slot's key), fed to another method, or be another worker's. States
        saved before identities were recorded carry none (before ranks were recorded: no ``rank`` and
        ``world_size``) and are loaded as they are, unchecked in what they lack."""
        check_state(state, required, owner)
        mine = self.identity(slots)
        if "rank" in state or "world_size" in state:
            theirs_at = (state.get("rank"), state.get("world_size"))
            if theirs_at != (mine["rank"], mine["world_size"]):
                raise ConfigError(
                    f"{owner}.load_state_dict: this state was saved by rank {theirs_at[0]} of {theirs_at[1]}; this "
                    f"is rank {mine['rank']} of {mine['world_size']}: residuals are one worker's own, so save and "
                    "load one state per rank (to load it anyway, delete its 'rank' and 'world_size' keys)"
                )
        if "method" in state and state["method"] != mine["method"]:
            raise ConfigError(
                f"{owner}.load_state_dict: the state was saved by {state['method']}, but this {owner} runs "
                f"{mine['method']}"
            )
        if "slots" in state:
            # (a state saved under a compiled model's names: see compressors.state.plain_name)
            theirs = [(plain_name(s[0]), *s[1:]) for s in state["slots"]]
            ours = [(plain_name(s[0]), *s[1:]) for s in mine["slots"]]
            if theirs != ours:
                pairs = zip(theirs, ours)
                differ = [f"{a[0]} ({a[1]} entries) there, {b[0]} ({b[1]}) here" for a, b in pairs if a != b]
                if len(theirs) != len(ours):
                    differ.append(f"{len(theirs)} slots there, {len(ours)} here")
                raise ConfigError(
                    f"{owner}.load_state_dict: the state was saved for other parameters: {'; '.join(differ[:3])}"
                    + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
                )
        if "shapes" in state and state["shapes"] != mine["shapes"]:  # (states saved before shapes were recorded have none)
            differ = [
                f"{slot.name} {tuple(a) if a else a} there, {tuple(b) if b else b} here"
                for slot, a, b in zip(slots, state["shapes"], mine["shapes"]) if a != b
            ]
            raise ConfigError(
                f"{owner}.load_state_dict: the state was saved for parameters of other shapes: {'; '.join(differ[:3])}"
                + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
            )


def check_state(state: object, required: Sequence[str], owner: str) -> None:
    """ConfigError unless ``state`` is a dict with the ``required`` keys (what ``owner.state_dict()`` returns)."""
    if not isinstance(state, dict) or any(key not in state for key in required):
        got = f"keys {sorted(map(str, state))}" if isinstance(state, dict) else type(state).__name__
        raise ConfigError(
            f"{owner}.load_state_dict expects what its state_dict() returns (keys {', '.join(required)}), got {got}"
        )


def _setup_all_gather(transport: Transport, t: Tensor) -> list[Tensor]:
    """``transport.all_gather(t)`` booked as set-up traffic only (the step counts, calls and seconds unchanged)."""
    before = transport.counter.snapshot()
    try:
        return transport.all_gather(t, kind=CONTROL)
    finally:
        for f in fields(before):
            setattr(transport.counter, f.name, getattr(before, f.name))
        transport.counter.book_setup(up=t.nbytes, down=(transport.world_size - 1) * t.nbytes)


def first_difference(lists: Sequence[Sequence[tuple[str, int]]]) -> str:
    """The first slot in which a worker's list (name, size) differs from rank 0's, in words."""

    def at(slots: Sequence[tuple[str, int]], i: int) -> str:
        return f"{slots[i][0]} ({slots[i][1]} entries)" if i < len(slots) else "nothing"

    ref = lists[0]
    for rank, other in enumerate(lists[1:], start=1):
        if list(other) != list(ref):
            i = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
            return (
                f"slot {i} is {at(ref, i)} on rank 0 but {at(other, i)} on rank {rank}; rank 0 has {len(ref)} "
                f"slots, rank {rank} {len(other)}"
            )
    return "the same slots, a different digest"


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


def _watched(rounds: Rounds, started: list[bool]) -> Rounds:
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
