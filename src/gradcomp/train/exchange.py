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
from dataclasses import fields

import torch
from torch import Tensor

from gradcomp.compressors.base import Compressor, Slot
from gradcomp.compressors.state import plain_name
from gradcomp.errors import ConfigError, NonFiniteGradientError
from gradcomp.finite import finite_flags
from gradcomp.schemes.base import Scheme
from gradcomp.schemes.single_round import TOPOLOGIES as SINGLE_ROUND_TOPOLOGIES
from gradcomp.schemes.single_round import SingleRound
from gradcomp.train.agreement import drive_agreeing, refusal_note, watched
from gradcomp.transport.base import CONTROL, Transport
from gradcomp.transport.requests import (
    drive,
)
from gradcomp.wire.bits import host_path
from gradcomp.wire.container import decode, encode
from gradcomp.wire.format import Codec, FieldSpec, encoded_size
from gradcomp.wire.refusals import Refusals, StepAbandoned, refusing_later

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
            rounds = watched(self.scheme.run(slots, inputs, step), started_sending)
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
