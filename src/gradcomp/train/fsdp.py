"""FSDP2's gradient reduce-scatter, compressed with a gradcomp compressor.

    model = ...; fully_shard(block) for each block; fully_shard(model)          # torch.distributed.fsdp
    state = gradcomp.compress_fsdp(model, gradcomp.make("topk", density=0.01, error_feedback=True))
    ...; loss.backward(); optimizer.step()                                         # as with plain FSDP2

What FSDP2 does without it. After a module's backward, FSDP2 copies the unsharded gradients of the module's
parameters into one flat buffer of W equal rows (``foreach_reduce_scatter_copy_in``): row j holds, for every
parameter in turn, its dim-0 chunk j (dim 0 padded up to a multiple of W; the padding rows are zeros), i.e.
exactly what rank j keeps of that parameter. A reduce-scatter then leaves on rank j the average of every
rank's row j, which FSDP2 views as the sharded ``.grad`` of each parameter. ``FSDPModule.
set_custom_reduce_scatter`` replaces that collective by an object called as ``comm(output_tensor=...,
input_tensor=..., group=..., op=...)``, synchronously, on the autograd thread, once per FSDP module and
backward, in the same order on every rank.

What this module puts there (``_CompressedReduceScatter``), on rank r for each call:

1. Slots. Every parameter's chunk j is a slot of its own, ``Slot(f"{name}/shard{j}", index·W + j, n)``, where
   ``name`` / ``index`` are the parameter's in ``model.named_parameters()`` and n its chunk's real entries
   (the padding is not compressed: an empty chunk sends nothing). Names and indices are the same on every
   rank and distinct per (parameter, chunk), so shared randomness (random-k positions) is shared by the
   ranks that send chunk j and differs between chunks, as in the sharded topology (schemes/sharded.py).
2. Compress. Rank r compresses its chunk j of every parameter with the compressor (its error-feedback
   residual for that slot, when it has one) and encodes them into ONE wire buffer for rank j.
3. All-to-all. The W buffers travel by one all-to-all (``alltoall_buffers``: sizes fixed by the specs need
   no size round; otherwise a control all-to-all first, padding booked apart), through a ``DistTransport``
   on a process group of its own, so every byte is booked by the transport's ``ByteCounter`` from the
   buffers handed to the process group, as everywhere in gradcomp.
4. Aggregate. Rank r decodes the W buffers it received in rank order and aggregates them by the
   compressor's rule (``aggregate_buffers``: the mean; the majority vote for signSGD / Signum), and writes
   the result into the output shard (zeros in the padding). This is the first half of the sharded
   topology; the second half (sending aggregates back) is not needed: FSDP keeps the gradient sharded, the
   optimizer updates the shard, and the next forward all-gathers parameters, not gradients.

Error-feedback memory. In a compressed reduce-scatter the compression error arises on the *sender*: rank r
loses ``chunk_j - C(chunk_j)`` when it sends its chunk j to rank j, and only rank r knows it (rank j
receives the compressed message only). So the residual that error feedback re-injects must live with the
sender, one per chunk it sends: on every rank, the residuals cover the whole unsharded gradient of the
model, W times the local shard's gradient (the figure is measured in docs/fsdp.md). Keeping it "for the
local shard only" would need the compression to act after the reduction (on the owner), and then nothing
before the reduction is compressed: that is an fp32 reduce-scatter. Methods without a residual (fp16,
bf16, C_nat, QSGD and dithering: unbiased or nearly exact) keep no state at all; biased ones (the sign
family, top-k, threshold, SBC/STC) need their residual and so a full gradient's memory per rank. Under
FSDP that is one unsharded gradient (in fp32) more per rank than plain FSDP keeps; the model's
parameters, gradients and optimizer states stay sharded.

Other choices:

- ``op``: FSDP2 asks for the average (``ReduceOp.AVG``) in fp32 and bf16; with fp16 gradient reduction
  (``MixedPrecisionPolicy(reduce_dtype=float16)``) or ``set_force_sum_reduction_for_comms`` it asks for a sum
  after dividing the input by a pre-factor and divides the output by a post-factor itself: the output is then
  W times the aggregate. A custom divide factor (``set_gradient_divide_factor``: NCCL's PREMUL_SUM) is
  refused. The compressors read float32: chunks of another dtype are widened exactly, and the result is
  written back in the output's dtype.
- Unused parameters: ``compress_fsdp`` turns on ``set_reduce_scatter_unused_params(True)`` so that every
  parameter that requires a gradient is in every reduce-scatter (zeros when unused), which keeps the layout
  of the flat buffer fixed and known; as with ``GradientAggregator``, an unused parameter then receives the
  aggregate (its residual, the other ranks' gradients) instead of ``None``.
- Step: each FSDP module counts its own reduce-scatters; the count seeds shared randomness and is saved.
- Freezing: every FSDP module with parameters gets a compressed reduce-scatter, also one frozen whole when
  ``compress_fsdp`` is called. FSDP2 lays its flat buffer out anew, at each backward, by the parameters that
  require gradients; a module's reduce-scatter compares that set with its own layout's at every call and, changed,
  lays itself out again (``_CompressedReduceScatter.lay_out``) before anything is sent. A parameter keeps its slots
  (numbered by its place in the model), so its residual waits while it is frozen and is sent once it trains
  again; the module's step count goes on, so shared randomness never repeats. The state's identity lists the
  slots of the parameters that train when it is saved.
- Sharding: only FSDP2's default dim-0 sharding (``Shard(0)``) is carried; a ``shard_placement_fn`` that
  shards another dim is refused at registration (FSDP reorders such gradients before the copy-in).
- NaN / Inf in a gradient on any rank, with ``nonfinite="raise"``: every rank raises the same
  ``NonFiniteGradientError`` from ``backward``, in the same backward pass, and no rank's state changes (by default,
  ``"propagate"``, the pass is skipped instead: see the end of this item). The ranks learn it from the calls' own
  messages, without a round of their own (``drive_agreeing``: a bad rank marks its buffers, which every rank receives a chunk of). The
  state keeps one journal for the whole pass (``FSDPCompressionState.pass_begins``; FSDP calls every module's
  reduce-scatter once per pass, in the same order on every rank), so a bad pass puts back every slot its calls
  changed, the finite calls before the bad one included, and every call's step count. A message that is itself not
  finite makes one rank's aggregate of its own shard non-finite, which no other rank sees: that rank holds an
  "abandon" flag, which the pass's end agreement (``train.agreement.settle``) carries to every rank, and every rank
  raises there. Catch the error, call FSDP2's
  ``reset_iter_state()`` on the root module (its recovery after an exception in backward) and ``zero_grad()``, and
  go on: the run is then the run without that step, bit for bit (tests/test_fsdp.py). The price: the journal's copy
  of every slot's state the pass changed, held until the pass ends (with error feedback, all the residuals).
  On the host path (and for sizes that vary) each call reads its verdict at once: a bad rank compresses zeros in its
  rows' place and the error is raised at the bad call. On the device path, for messages of fixed sizes, a call reads
  nothing: its rank's verdict stays a device flag put on its buffers by ``torch.where``, and the agreed verdict and
  the decoded messages' checks are held for the pass (``wire.device.hold_for_the_pass``). The pass's first call
  queues ``pass_ends`` with the autograd engine, which runs after FSDP2's own end-of-backward callback (queued
  before it, and where FSDP reduce-scatters the root module's own parameters): one read for the whole pass. A
  message that failed its checks (on either path) is noted and the pass goes on (``wire.refusals.refusing_later``);
  at its end the ranks agree on it (``train.agreement.settle``: one 4-byte all-reduce, read with the pass's checks)
  and every rank raises WireError, the pass undone.
  With ``scaler=`` (fp16 mixed precision) or ``nonfinite="propagate"`` (the default) nothing raises: the backward
  pass is skipped
  on every rank instead, its state put back. At a bad call read at once, that call's output is filled with NaN and
  nothing is sent for the pass's later calls (their outputs NaN too); at the pass's end, the ``.grad`` of every
  parameter the pass's calls served is filled with NaN. Either way the scaler's check (or the user's) skips the step
  on every rank. Under a scaler the rows are divided by its scale before compression, in float32 (residuals in
  unscaled units; an fp16 gradient divided in fp16 would underflow), and the aggregate multiplied back. A pass is
  one backward pass of the autograd engine (its graph task), so a module that sat the forward pass out, or a
  backward that failed half way, does not blur two passes; a call made outside a backward pass is a pass of its own.
- Methods that own their rounds (PowerSGD, sketched SGD, LGC, ...) are refused: their rounds assume every
  rank ends with the whole aggregate, which a reduce-scatter does not give.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradcomp.compressors.base import Compressor, Slot, bind_worker
from gradcomp.compressors.state import Journal, journal, plain_name
from gradcomp.errors import ConfigError, NonFiniteGradientError, WireError
from gradcomp.finite import all_finite, check_nonfinite, check_scaler, finite_flag, loss_scale
from gradcomp.protocols import alltoall_buffers
from gradcomp.schemes.single_round import aggregate_buffers, encode_slots, fixed_buffer_size
from gradcomp.train.agreement import agreed_non_finite, drive_agreeing, locally_bad, refusal_note, settle
from gradcomp.train.exchange import check_gradients, check_state
from gradcomp.transport.dist import DistTransport
from gradcomp.wire.bits import host_path
from gradcomp.wire.device import DeviceChecks, holding_for_the_pass
from gradcomp.wire.format import max_encoded_size
from gradcomp.wire.refusals import Refusals, StepAbandoned, refusing_later

try:  # torch >= 2.6 (FSDP2's custom collectives: 2.8)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - an older torch
    FSDPModule = None  # type: ignore[assignment,misc]
    ReduceScatter = object  # type: ignore[assignment,misc]

# what a NonFiniteGradientError of compress_fsdp says to do instead
FSDP_REMEDY = (
    "to skip such steps and train on as FSDP does, leave nonfinite= at its default (\"propagate\") and let your "
    "GradScaler or check skip the step, or pass scaler=your_grad_scaler. Having caught this error, call "
    "reset_iter_state() on the root FSDP module and zero_grad() before the next step"
)


@dataclass(frozen=True)
class _Piece:
    """One parameter's place in a row of FSDP's flat reduce-scatter buffer."""

    name: str
    offset: int  # where its chunk starts in every row
    padded: int  # entries of its chunk in a row (dim 0 padded to a multiple of W)
    slots: tuple[Slot | None, ...]  # chunk j as a slot (its first n entries are real), None when empty


def _group_of(module: Any) -> Any:
    """The FSDP module's one parameter group (FSDP2 internals; None when it manages no parameter)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise ConfigError(
            "compress_fsdp: an FSDP module with several parameter groups (a per-parameter mesh from "
            "shard_placement_fn) is not supported: FSDP2's custom reduce-scatter is one per module"
        )
    return groups[0] if groups else None


class _CompressedReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP2's ``ReduceScatter`` for one FSDP module: compress per destination, all-to-all, aggregate."""

    def __init__(self, state: FSDPCompressionState, key: str, group: Any = None, index_of: dict | None = None):
        self.state = state
        self.key = key
        self.group = group  # FSDP2's parameter group of the module
        self.index_of = index_of or {}  # id(parameter) -> (its index, its name) in model.named_parameters()
        self.watched: list[Tensor] = []  # every sharded parameter of the module, and whether each required gradients
        self.trainable: list[bool] = []  # when the module was last laid out
        self.names: list[str] = []
        self.step = 0
        self.layouts = 0  # how many times the module was laid out (1 + the changes of which parameters train)
        if group is not None:
            self.lay_out()

    def lay_out(self) -> None:
        """The module's place in FSDP's flat buffer, by the parameters that require gradients now: the pieces, the
        slots each rank serves and the buffers' sizes. Made at ``compress_fsdp`` and again at the first call after
        a parameter of the module was frozen or unfrozen (FSDP2 lays its buffer out by the same rule at each
        backward). Slots are numbered by the parameters' places in the model, so a parameter keeps its slot, its
        residual and its shared randomness across layouts; the step count goes on. ConfigError (on every rank
        alike: the layout depends only on the model) before anything is sent."""
        world, compressor = self.state.world_size, self.state.compressor
        pieces, params, offset = [], [], 0
        for fp in self.group.fsdp_params:
            if not fp.sharded_param.requires_grad:
                continue
            if fp.fsdp_placement.dim != 0:
                raise ConfigError(
                    f"compress_fsdp: a parameter is sharded on dim {fp.fsdp_placement.dim}; only dim-0 sharding "
                    "(FSDP2's default) is carried"
                )
            found = self.index_of.get(id(fp.sharded_param))
            if found is None:
                raise ConfigError("compress_fsdp: an FSDP parameter is not among model.named_parameters()")
            index, name = found
            if len(fp._orig_size) == 0:
                raise ConfigError(f"compress_fsdp: {name} is a 0-dimensional parameter, which FSDP cannot shard")
            padded = int(fp.padded_sharded_param_size.numel())
            padded_rows = int(fp.padded_sharded_param_size[0])
            rest = padded // padded_rows if padded_rows else 0  # entries per row of dim 0
            slots = _chunk_slots(name, index, int(fp._orig_size[0]), padded_rows, rest, world)
            for slot in slots:
                if slot is not None:
                    compressor.specs(slot)  # ConfigError (k larger than a chunk, ...) before anything is sent
            pieces.append(_Piece(name, offset, padded, tuple(slots)))
            params.append(fp.sharded_param)
            offset += padded
        self.watched = [fp.sharded_param for fp in self.group.fsdp_params]
        self.trainable = [p.requires_grad for p in self.watched]
        self.names = [self.index_of.get(id(p), (0, "(a parameter)"))[1] for p in self.watched]
        self.set_pieces(pieces, params)
        self.layouts += 1

    def set_pieces(self, pieces: list[_Piece], params: Sequence[Tensor] = ()) -> None:
        """The pieces, and what follows from them: a row's size, the slots each rank serves, the buffers' sizes."""
        world, state = self.state.world_size, self.state
        self.pieces = pieces
        self.params = list(params)  # the sharded parameters (their .grad: NaN when a skipped pass is found bad)
        self.row = sum(p.padded for p in pieces)
        # the slots rank j serves: (piece, slot) for every non-empty chunk j
        self.owned: list[list[tuple[_Piece, Slot]]] = [
            [(p, p.slots[j]) for p in pieces if p.slots[j] is not None] for j in range(world)
        ]
        sizes = []
        for owned in self.owned:
            size = fixed_buffer_size(state.compressor, [s for _, s in owned]) if owned else 0
            sizes.append(size)
        self.known: list[int] | None = None if any(s is None for s in sizes) else sizes  # type: ignore[misc]
        # else the most bytes a buffer for rank j can have: bounds the lengths the all-to-all's length round brings
        self.limits = None if self.known is not None else [
            max_encoded_size([spec for _, s in owned for spec in state.compressor.specs(s)]) if owned else 0
            for owned in self.owned
        ]

    def _messages(self, rows: Tensor, step: int, scale: Tensor | None = None) -> list[Tensor]:
        """This rank's wire buffer for every rank j: its chunk j of every parameter, compressed and encoded;
        ``scale``: the loss scale the chunks are divided by first, in float32 (an fp16 gradient divided in fp16
        would lose its small entries to underflow, which the scale is there to prevent)."""
        compressor, up = self.state.compressor, []
        for j, owned in enumerate(self.owned):
            if not owned:
                up.append(torch.empty(0, dtype=torch.uint8, device=rows.device))
                continue
            messages = []
            for piece, slot in owned:
                chunk = rows[j, piece.offset : piece.offset + slot.numel].to(torch.float32)
                messages.append(compressor.compress(chunk if scale is None else chunk / scale, slot, step))
            up.append(encode_slots(compressor, [s for _, s in owned], messages))
        return up

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Any = None, op: Any = None, async_op: bool = False
    ) -> None:
        state = self.state
        factor = self._factor(op)
        rows, names = self._rows(output_tensor, input_tensor)
        record = state.pass_begins(self)
        if state.pass_bad:  # an earlier call of this backward pass was not finite on some rank: so is this one
            output_tensor.fill_(float("nan"))  # on every rank, with nothing sent
            state.call_ends()
            return None
        scale = loss_scale(state.scaler)  # error feedback sees unscaled gradients (_messages)
        # fixed sizes on the device path: this rank's verdict stays a device flag, rides on the all-to-all and waits,
        # with the decoded messages' checks, for the pass's one read at its end (state.pass_ends); else it is read here
        defer = self.known is not None and not host_path(input_tensor)
        finite: bool | Tensor = finite_flag([input_tensor]) if defer else all_finite(input_tensor)
        step = self.step
        started = time.perf_counter()
        blocked_before = state.transport.counter.seconds
        mine = self.owned[state.rank]
        with torch.no_grad():
            up, refused, finite = self._compress(record, rows, defer, finite, step, scale)
            held = isinstance(finite, Tensor)  # (a refusal made it a bool: read at once)
            state.pass_device = input_tensor.device
            # Every call counts as a use of the wire on every rank, so that every rank makes the pass's end agreement
            # (settle): a rank that owns no row of the pass's modules decodes nothing, and counted only its decodes, it
            # skipped the agreement's all-reduce while the others waited in it until the time-out.
            state.pass_refusals.used += 1
            with holding_for_the_pass(state.pass_checks if held else None), refusing_later(state.pass_refusals):
                agreed, aggregates = drive_agreeing(
                    state.transport, self._rounds(up, mine, step, input_tensor.device), finite, after_rounds=defer,
                    read=state.pass_flags if held else True,
                )
            if not agreed:  # some rank's gradients were not finite: every rank is here, at this call
                self._not_agreed(output_tensor, rows, names, finite, refused, step)
                return None
            if held:  # this rank's flag, to name its parameters if the pass's read finds it bad
                state.pass_mine.append((self, finite))
            self._write_back(output_tensor, mine, aggregates, factor, scale)
        state.compress_s += time.perf_counter() - started - (state.transport.counter.seconds - blocked_before)
        self.step += 1
        state.calls += 1
        state.call_ends()
        return None

    def _factor(self, op: Any) -> float:
        """What the average is multiplied by for FSDP's ``op``: 1 for its average, W for its sum of inputs it divided
        by a pre-factor; ConfigError, with nothing sent, for any other reduction, or a sum of a majority vote."""
        state = self.state
        if op == dist.ReduceOp.AVG:
            return 1.0
        if op == dist.ReduceOp.SUM:
            if getattr(state.compressor, "scale_free", False):
                raise ConfigError(
                    f"compress_fsdp: {state.compressor.name!r} aggregates by majority vote to ±1, but FSDP asked for a "
                    "sum of inputs it divided by a pre-factor (fp16 gradient reduction, or "
                    "set_force_sum_reduction_for_comms) and divides the result by a post-factor itself: the vote "
                    "would come out as ±pre-factor. Reduce in float32 or bfloat16 "
                    "(MixedPrecisionPolicy(reduce_dtype=...)). Nothing was sent"
                )
            return float(state.world_size)
        raise ConfigError(
            f"compress_fsdp: FSDP asked for a reduce-scatter with {op!r}; only its average (and its sum with "
            "pre/post division) are carried: do not call set_gradient_divide_factor on a compressed model"
        )

    def _rows(self, output_tensor: Tensor, input_tensor: Tensor) -> tuple[Tensor, list[str]]:
        """FSDP's input as W rows (row j: rank j's chunk of every parameter) and the parameters' names, after the
        module is laid out again if which of its parameters train changed. ConfigError, with nothing sent, for
        buffers of other sizes than the layout's, or gradients that are not floating point (the same on every
        rank, so every rank refuses the call here)."""
        world = self.state.world_size
        if [p.requires_grad for p in self.watched] != self.trainable:  # (two of the same size swapped keep the size)
            self.lay_out()  # frozen or unfrozen since the last layout: FSDP's buffer follows the new set, and so do we
        if input_tensor.numel() != world * self.row or output_tensor.numel() != self.row:
            raise ConfigError(
                f"compress_fsdp: FSDP module {self.key!r} handed a reduce-scatter of {input_tensor.numel()} entries "
                f"(output {output_tensor.numel()}), but its parameters that require gradients make "
                f"{world} x {self.row}. Nothing was sent"
            )
        rows = input_tensor.reshape(world, self.row)
        names = [p.name for p in self.pieces]
        if not input_tensor.is_floating_point():  # the same dtype on every rank: every rank refuses it here
            check_gradients(names, [rows[:, p.offset : p.offset + p.padded] for p in self.pieces], self.step)
        return rows, names

    def _compress(
        self, record: Journal, rows: Tensor, defer: bool, finite: bool | Tensor, step: int, scale: Tensor | None
    ) -> tuple[list[Tensor], NonFiniteGradientError | None, bool | Tensor]:
        """This rank's messages for every rank (``_messages``), with each slot's state before the pass changes it
        noted in the pass's ``record``; zeros are compressed where this rank's rows were read not finite. Returns
        the messages, the refusal of rows whose compression was not finite (or None), and this rank's verdict."""
        refused = None
        with journal(record):  # each slot's state before this pass changes it
            try:  # (deferred: the rows as they are; a bad pass is undone before anything of it is applied)
                up = self._messages(rows if defer or finite else torch.zeros_like(rows), step, scale)
            except NonFiniteGradientError as exc:  # finite rows whose compression is not (QSGD's norm, ...):
                refused, finite = exc, False  # refused on this rank only, so it is this rank's verdict
                up = self._messages(torch.zeros_like(rows), step)  # (only the messages' sizes matter then)
        return up, refused, finite

    def _rounds(self, up: list[Tensor], mine: list[tuple[_Piece, Slot]], step: int, device: torch.device):
        """The call's rounds (for ``drive_agreeing``): the all-to-all of the messages ``up``, then the decoding of
        what this rank received into the aggregates of the slots it owns, ``mine`` (its checks held for the pass
        when deferred)."""
        state = self.state
        received = yield from alltoall_buffers(state.rank, up, self.known, self.limits)
        slots = [s for _, s in mine]
        if not mine:
            return []
        try:
            return aggregate_buffers(state.compressor, slots, received, step, device, final=True)
        except StepAbandoned:  # (read at once) a message made this rank's aggregate of its own shard not
            # finite: the others cannot see it; every rank learns it at the pass's end (settle), which
            # abandons the pass there. (Deferred, the aggregate's flag is held for that read instead.)
            state.pass_checks.abandon(torch.ones((), dtype=torch.bool, device=device))
            return [torch.full((s.numel,), float("nan"), device=device) for s in slots]

    def _not_agreed(
        self, output_tensor: Tensor, rows: Tensor, names: list[str], finite: bool | Tensor,
        refused: NonFiniteGradientError | None, step: int,
    ) -> None:
        """A call that some rank's gradients made not finite (every rank is here, at this call): the pass undone
        (the state it changed and its calls' step counts put back), then skipped on every rank, NaN in the output
        for the scaler (or the user's check), or, without propagation, the agreed NonFiniteGradientError raised,
        naming this rank's parameters that were not finite and its refusal."""
        state = self.state
        state.pass_abandoned()  # the state this pass changed and its calls' step counts put back
        if state.propagate:  # the pass is skipped on every rank: NaN for the scaler (or the user's check)
            output_tensor.fill_(float("nan"))
            state.call_ends()
            return
        here = [] if bool(finite) else [
            name for name, p in zip(names, self.pieces)
            if not all_finite(rows[:, p.offset : p.offset + p.padded])
        ]
        if refused is not None:
            here.append(refusal_note(refused))
        state.call_ends()
        raise agreed_non_finite(step, here, remedy=FSDP_REMEDY)

    @staticmethod
    def _write_back(
        output_tensor: Tensor, mine: list[tuple[_Piece, Slot]], aggregates: list[Tensor], factor: float,
        scale: Tensor | None,
    ) -> None:
        """The aggregates of this rank's slots written into FSDP's output (zeros elsewhere: padding), times FSDP's
        ``factor`` and back in the scaler's units."""
        output_tensor.zero_()
        if not mine:
            return
        flat = output_tensor.reshape(-1)
        for (piece, slot), aggregate in zip(mine, aggregates):
            if factor != 1.0:
                aggregate = aggregate * factor
            if scale is not None:
                aggregate = aggregate * scale  # back in the scaler's units
            flat[piece.offset : piece.offset + slot.numel].copy_(aggregate)


class FSDPCompressionState:
    """What ``compress_fsdp`` returns: the compressor, the transport (``transport.counter``: bytes), the
    per-module reduce-scatters, and ``state_dict`` / ``load_state_dict`` for the residuals and step counts."""

    def __init__(self, compressor: Compressor, transport: DistTransport, scaler: Any = None, propagate: bool = False):
        self.compressor = compressor
        self.transport = transport
        self.rank, self.world_size = transport.rank, transport.world_size
        self.comms: list[_CompressedReduceScatter] = []
        self.compress_s = 0.0
        self.calls = 0  # compressed reduce-scatters made and applied (an abandoned pass's are taken back)
        self.scaler = scaler
        # a bad pass is skipped (NaN in every rank's gradients), not raised: for the scaler, or the user's own check
        self.propagate = scaler is not None or propagate
        self.skipped = 0  # backward passes skipped so (some rank's gradients were not finite)
        # the backward pass under way: the calls made in it, each one's step count before it, the record of the state
        # its calls changed, and whether it is abandoned; on the device path, what waits for its one read at its end:
        # the deferred verdicts, the decoded messages' checks, and each call's own flag (to name a bad module)
        self._pass_calls: dict[str, int] = {}
        self._pass_record: Journal | None = None
        self._pass_task = -1  # the autograd engine's graph task of the pass (-1: one call outside a backward pass)
        self._pass_calls_before = 0
        self.pass_bad = False
        self.pass_flags: list[Tensor] = []
        self.pass_checks = DeviceChecks()
        self.pass_mine: list[tuple[_CompressedReduceScatter, Tensor]] = []
        self.pass_refusals = Refusals()  # the messages this rank refused in the pass, agreed on at its end (settle)
        self.pass_device = torch.device("cpu")

    def pass_begins(self, comm: _CompressedReduceScatter) -> Journal:
        """A call of a backward pass (FSDP calls the reduce-scatter of every module that took part in the forward
        pass once, in the same order on every rank): the pass's record of the state it changes. A pass is one
        backward pass of the autograd engine (its graph task), whatever modules it calls; a call made outside a
        backward pass is a pass of its own. Its first call asks the engine to end it when the backward ends
        (``pass_ends``: the one read of what the pass deferred, and the record's copies dropped, not kept through the
        optimizer step and the next forward pass); a backward that failed never ends its pass that way, and the next
        one's first call starts afresh. A module applied twice in one forward pass is reduce-scattered once per use
        in the same backward: both calls belong to its pass (its journal and step count from before the first)."""
        task = _graph_task()
        if self._pass_record is None or task == -1 or task != self._pass_task:
            self._pass_calls, self._pass_record, self.pass_bad, self._pass_task = {}, Journal(), False, task
            self.pass_flags, self.pass_checks, self.pass_mine = [], DeviceChecks(), []
            self.pass_refusals = Refusals()
            self._pass_calls_before = self.calls
            if task != -1:
                torch.autograd.Variable._execution_engine.queue_callback(self.pass_ends)
        self._pass_calls.setdefault(comm.key, comm.step)
        return self._pass_record

    def pass_abandoned(self) -> None:
        """Some rank's gradients were not finite in the pass (every rank learns it at the same call, or at the pass's
        end): the state the pass changed and its calls' step counts go back to where the pass began, what it deferred
        is dropped, and its later calls send nothing."""
        self._undo_pass()
        self.pass_bad = True
        if self.propagate:
            self.skipped += 1

    def _undo_pass(self) -> None:
        """The state the pass changed and its calls' step counts put back; what it deferred dropped."""
        self._pass_record.undo()  # type: ignore[union-attr]
        by_key = {c.key: c for c in self.comms}
        for key, step in self._pass_calls.items():
            by_key[key].step = step
        self.calls = self._pass_calls_before
        self.pass_flags, self.pass_checks, self.pass_mine = [], DeviceChecks(), []

    def call_ends(self) -> None:
        """After each call: a call made outside a backward pass ends its pass with it."""
        if self._pass_task == -1:
            self.pass_ends()

    def pass_ends(self) -> None:
        """The end of the backward pass (queued with the autograd engine by its first call; FSDP's own end of the
        backward, queued before it, has set every gradient by then). On the device path its one read: the deferred
        verdicts and every decoded message's checks. A pass found bad is undone as at a bad call; it raises the
        NonFiniteGradientError (named by the pass's first call's step) from ``backward``, or, skipping, fills the
        gradients of every module it called with NaN. A message that failed its checks raises WireError, the pass
        undone too. The next call begins a new pass."""
        try:
            refusals, self.pass_refusals = self.pass_refusals, Refusals()
            if self.pass_bad or self._pass_record is None:  # (an abandoned pass: nothing of it is applied)
                return
            if not (self.pass_flags or self.pass_checks.pending or refusals.used):
                return
            flags, checks, mine = self.pass_flags, self.pass_checks, self.pass_mine
            self.pass_flags, self.pass_checks, self.pass_mine = [], DeviceChecks(), []
            first = next(iter(self._pass_calls.values()))
            called = [c for c in self.comms if c.key in self._pass_calls]
            try:
                bad = settle(self.transport, refusals, self.pass_device, checks, flags, first)
            except WireError:
                self._undo_pass()
                raise
            if not bad:
                return
            self.pass_abandoned()
            if not self.propagate:
                raise agreed_non_finite(first, locally_bad([([p.name for p in c.pieces], f) for c, f in mine]),
                                        remedy=FSDP_REMEDY)
            for comm in called:
                for param in comm.params:
                    if param.grad is not None:  # the pass's gradients, on every rank: the scaler (or user) skips
                        _local(param.grad).fill_(float("nan"))
        finally:
            self._pass_calls, self._pass_record = {}, None

    @property
    def counter(self):
        return self.transport.counter

    def slots(self) -> list[Slot]:
        """Every slot this rank sends, module by module (a state's identity), as the parameters that require
        gradients now lay them out: a module frozen or unfrozen since its last call is laid out again here (it
        sends nothing), so that a state saves, and loads, for the parameters that train when it is called."""
        for comm in self.comms:
            if comm.group is not None and [p.requires_grad for p in comm.watched] != comm.trainable:
                comm.lay_out()
        return [s for comm in self.comms for p in comm.pieces for s in p.slots if s is not None]

    def residual_bytes(self) -> int:
        """Bytes of the tensors this rank keeps between steps (error-feedback residuals, momentum), measured
        from the compressor's state."""
        return _tensor_bytes(self.compressor.state_dict())

    def identity(self) -> dict:
        return {
            "method": repr(self.compressor),
            "slots": [[s.name, s.numel] for s in self.slots()],
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def state_dict(self) -> dict:
        return {
            "steps": {comm.key: comm.step for comm in self.comms},
            "compressor": self.compressor.state_dict(),
            **self.identity(),
        }

    def load_state_dict(self, state: dict) -> None:
        """ConfigError, and nothing loaded, for a state of another rank, method or model."""
        check_state(state, ("steps", "compressor"), "FSDPCompressionState")
        mine = self.identity()
        for key in ("rank", "world_size", "method"):
            if key in state and state[key] != mine[key]:
                raise ConfigError(
                    f"FSDPCompressionState.load_state_dict: the state was saved with {key} {state[key]!r}, this is "
                    f"{mine[key]!r} (residuals are one rank's own: save and load one state per rank)"
                )
        saved = [(plain_name(s[0]), *s[1:]) for s in state.get("slots", ())]  # (compiled blocks' names, as before)
        if "slots" in state and saved != [tuple(s) for s in mine["slots"]]:
            raise ConfigError(
                "FSDPCompressionState.load_state_dict: the state was saved for other parameters, or with other "
                "parameters training (freeze and unfreeze the model as it was when the state was saved, then load)"
            )
        if set(state["steps"]) != {comm.key for comm in self.comms}:
            raise ConfigError(
                f"FSDPCompressionState.load_state_dict: the state has FSDP modules {sorted(state['steps'])}, "
                f"this model {sorted(comm.key for comm in self.comms)}"
            )
        self.compressor.load_state_dict(state["compressor"])
        for comm in self.comms:
            comm.step = int(state["steps"][comm.key])


def _local(t: Tensor) -> Tensor:
    """A sharded gradient's local shard (a DTensor's, in place), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _graph_task() -> int:
    """The autograd engine's id of the backward pass running on this thread, -1 outside one (torch's own accessor,
    private; -1 where a torch lacks it, and every call is then a pass of its own)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else int(current())


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def fsdp_slots(model: nn.Module, world_size: int) -> list[Slot]:
    """The slots ``compress_fsdp`` compresses for a plain ``model`` once sharded over ``world_size`` ranks (dim 0
    cut into W chunks of ceil(rows / W) rows, as FSDP2 pads it): for checks before any process group exists."""
    slots = []
    for index, (name, p) in enumerate(model.named_parameters()):
        if not p.requires_grad or p.dim() == 0:
            continue
        rows = p.shape[0]
        rest = p.numel() // rows if rows else 0
        chunks = _chunk_slots(name, index, rows, -(-rows // world_size), rest, world_size)
        slots.extend(s for s in chunks if s is not None)
    return slots


def _chunk_slots(name: str, index: int, rows: int, per_chunk: int, rest: int, world: int) -> list[Slot | None]:
    """A parameter's W dim-0 chunks as slots (``per_chunk`` rows each, ``rest`` entries a row; the last ones
    short or empty as FSDP pads dim 0), None for an empty chunk: ``Slot(f"{name}/shard{j}", index·W + j, n)``."""
    out: list[Slot | None] = []
    for j in range(world):
        real = max(0, min(rows - j * per_chunk, per_chunk)) * rest
        out.append(Slot(f"{name}/shard{j}", index * world + j, real) if real > 0 else None)
    return out


def check_fsdp_method(method: Any, model: nn.Module, world_size: int) -> None:
    """ConfigError unless ``compress_fsdp`` can carry ``method`` for ``model`` over ``world_size`` ranks."""
    if not isinstance(method, Compressor):
        raise ConfigError(
            f"compress_fsdp carries a single-message compressor (gradcomp.make('topk', ...)), got "
            f"{getattr(method, 'name', '') or type(method).__name__}, which owns its rounds: they assume every rank "
            "ends with the whole aggregate, which a reduce-scatter does not give"
        )
    bind_worker(method, 0)
    for slot in fsdp_slots(model, world_size):
        method.specs(slot)  # k larger than a chunk, ...


def compress_fsdp(
    model: nn.Module,
    compressor: Compressor,
    *,
    process_group: dist.ProcessGroup | None = None,
    scaler: Any = None,
    nonfinite: str = "propagate",
) -> FSDPCompressionState:
    """Compress the gradient reduce-scatter of every FSDP2 module in ``model`` with ``compressor``.

    Call it on every rank, after ``fully_shard`` and before the first backward. Its collectives run on a
    process group of its own (``process_group``, by default a new group over the FSDP mesh's ranks, made with
    ``torch.distributed.new_group``, hence on every rank and in the same order). Returns the state:
    ``state.counter`` (bytes), ``state.state_dict()`` / ``load_state_dict`` (residuals, one per rank).

    ``scaler``: the GradScaler (FSDP2's ``ShardedGradScaler``, or ``torch.amp.GradScaler``) that scales the loss
    under fp16 mixed precision. The gradients are then divided by its scale before they are compressed (residuals
    in unscaled units) and the average multiplied back; a backward pass in which some rank's gradients were not
    finite is skipped instead of raised: every rank's gradients of the pass are NaN (from the bad call on, or, on the
    device path, all of them at the pass's end), so the scaler skips the step and lowers its scale everywhere, and
    the residuals and step counts go back to where the pass began. ``nonfinite``: ``"propagate"`` (default, as
    FSDP's own reduce-scatter: the same skipping without a scaler, the NaN in every rank's gradients for a check of
    your own, e.g. an unchanged GradScaler loop) or ``"raise"`` (every rank raises the same
    NonFiniteGradientError from the same backward pass, its state put back). ConfigError for anything else,
    before anything is registered.
    """
    if FSDPModule is None:  # pragma: no cover
        raise ConfigError("compress_fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6)")
    check_nonfinite(nonfinite, "compress_fsdp")
    check_scaler(scaler, "compress_fsdp")
    if not isinstance(compressor, Compressor):
        check_fsdp_method(compressor, model, 1)  # raises: a method that owns its rounds
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules or not isinstance(model, FSDPModule):
        raise ConfigError(
            "compress_fsdp takes a model wrapped by FSDP2 (torch.distributed.fsdp.fully_shard(model), after its "
            "blocks), got a model that is not an FSDP module"
        )
    named = [(plain_name(name), p) for name, p in model.named_parameters()]  # (torch.compile'd blocks: plain names)
    index_of = {id(p): (i, name) for i, (name, p) in enumerate(named)}
    groups = [(m, _group_of(m)) for m in modules]
    fsdp_group = next((g for _, g in groups if g is not None), None)
    if fsdp_group is None:
        raise ConfigError("compress_fsdp: the FSDP model manages no parameter")
    if process_group is None:
        pg = fsdp_group.mesh_info.shard_process_group
        ranks = dist.get_process_group_ranks(pg)
        unsorted = {"sort_ranks": False} if ranks != sorted(ranks) else {}  # row j goes to FSDP's rank j
        process_group = dist.new_group(ranks, backend=dist.get_backend(pg), **unsorted)
    transport = DistTransport(process_group)
    if transport.rank != fsdp_group.mesh_info.shard_mesh_rank:
        raise ConfigError(
            f"compress_fsdp: this process is rank {transport.rank} of the given process group but rank "
            f"{fsdp_group.mesh_info.shard_mesh_rank} of the FSDP mesh; the two must number the ranks alike"
        )
    world = transport.world_size
    bind_worker(compressor, transport.rank)
    state = FSDPCompressionState(compressor, transport, scaler, propagate=nonfinite == "propagate")
    for module, group in groups:
        if group is None:
            continue
        if group.mesh_info.shard_mesh_size != world:
            raise ConfigError(
                f"compress_fsdp: the FSDP mesh shards over {group.mesh_info.shard_mesh_size} ranks, the process "
                f"group has {world}"
            )
        # Every module with parameters, frozen ones too: a module unfrozen later is compressed from its first call
        # (one left to FSDP's own reduce-scatter would have sent plain gradients, counted by no one).
        # the module's place and its first parameter's owner: the same whichever parameters train at this call
        first = index_of.get(id(group.fsdp_params[0].sharded_param), (0, ""))[1]
        prefix = first.rsplit(".", 1)[0] if "." in first else ""
        key = f"{len(state.comms)}:{prefix}"
        comm = _CompressedReduceScatter(state, key, group, index_of)
        module.set_reduce_scatter_unused_params(True, recurse=False)
        module.set_custom_reduce_scatter(comm)
        state.comms.append(comm)
    return state
