"""GradientAggregator: the call between ``loss.backward()`` and ``optimizer.step()``.

    aggregator = gradcomp.GradientAggregator(model, gradcomp.make("topk", density=0.01, error_feedback=True))
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        aggregator.step()          # every .grad now holds the compressed, aggregated average over workers
        optimizer.step()

Granularity ``layer`` compresses every parameter on its own (one slot each, still one collective per step);
``model`` flattens all gradients into one vector and compresses that (global top-k, one random block, ...).
Non-finite gradients: the workers agree, on the step's first message, whether every worker's gradients were finite
(``GradientExchange.exchange(finite=...)``). If any worker's were not, every worker raises the same
NonFiniteGradientError at the same step, and the method's state (residuals, momentum) is restored to what it was
before the step (``snapshot`` / ``restore``: one copy of the state per step, none for stateless methods). With a
``torch.amp.GradScaler`` (``scaler=``) the step is skipped instead: every worker's gradients are set to NaN so that
``scaler.step`` skips it and ``scaler.update`` lowers the scale on every worker. Gradients are unscaled before
they are compressed (residuals and momentum stay in unscaled units, whatever the scale does) and the average is
scaled back, so that ``scaler.unscale_`` / ``scaler.step`` see what they expect (exact: the scale is a power of 2).
``nonfinite="propagate"`` hands a bad step's NaN on without reading whether it is bad: ``step()`` returns None,
every worker's gradients of a bad step are NaN (the same on every worker) for the scaler's check (or your own), the
state is put back, and on a GPU the methods that only all-reduce (none, fp16, bf16, random-k, random block,
PowerSGD, sketched SGD, true top-k) read nothing from the device in a step; ``skipped`` is not counted then.

A message that fails its checks on one worker (a corruption on the way, seen only by its receiver) does not stop
that worker at once: the step's rounds run to their end (``wire.refusals.refusing_later``), then the workers agree
on it (``train.agreement.settle``: one 4-byte all-reduce; on the device path read with the step's checks) and every
worker raises WireError at that step, the state put back as for a non-finite step.

A parameter without a gradient on this step contributes zeros, so all workers always send the same slots;
``step()`` says what it receives. At the first exchange the workers check, with one small all-gather, that they
all have the same parameters (names and sizes, in order): ConfigError on every worker, naming the first
difference, before any gradient is sent.
"""

from __future__ import annotations

import time

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from gradcomp.compressors.base import Compressor, Slot
from gradcomp.compressors.state import plain_name
from gradcomp.errors import ConfigError
from gradcomp.finite import check_nonfinite, check_scaler, finite_flag, finite_flags, loss_scale
from gradcomp.train.agreement import agreed_non_finite, any_abandons, settle
from gradcomp.train.exchange import GradientExchange, warn_float64
from gradcomp.transport.base import Transport
from gradcomp.wire.bits import host_path
from gradcomp.wire.device import DeviceChecks, holding_for_the_pass
from gradcomp.wire.refusals import Refusals

GRANULARITIES = ("layer", "model")


def _named_parameters(params) -> list[tuple[str, nn.Parameter]]:
    """Every parameter given, named, frozen ones included."""
    if isinstance(params, nn.Module):  # (a compiled model's names without torch.compile's "_orig_mod.")
        return [(plain_name(name), p) for name, p in params.named_parameters()]
    named = []
    for i, item in enumerate(params):
        named.append((plain_name(item[0]), item[1]) if isinstance(item, tuple) else (f"param{i}", item))
    return named


def _unscaled_already(scaler) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` was called for some optimizer since the last ``scaler.update()``."""
    from torch.amp.grad_scaler import OptState

    states = getattr(scaler, "_per_optimizer_states", {})
    return any(state.get("stage") is OptState.UNSCALED for state in states.values())


class GradientAggregator:
    def __init__(
        self,
        params: nn.Module | Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]],
        compressor: Compressor,
        transport: Transport | None = None,
        *,
        granularity: str = "layer",
        topology: str = "auto",
        server_compressor: Compressor | None = None,
        root: int = 0,
        scaler: torch.amp.GradScaler | None = None,
        nonfinite: str = "raise",
        dense_steps: int = 0,
    ):
        if isinstance(dense_steps, bool) or not isinstance(dense_steps, int) or dense_steps < 0:
            raise ConfigError(f"dense_steps must be a whole number >= 0, got {dense_steps!r}")
        if granularity not in GRANULARITIES:
            raise ConfigError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        if isinstance(params, nn.parallel.DistributedDataParallel):
            raise ConfigError(
                "GradientAggregator got a DistributedDataParallel model, whose backward already averages the "
                "gradients: they would be exchanged twice. Use gradcomp.register_ddp_hook(ddp_model, ...) to compress "
                "DDP's exchange, or pass the unwrapped model (ddp_model.module) and drop DistributedDataParallel"
            )
        check_scaler(scaler, "GradientAggregator")
        check_nonfinite(nonfinite, "GradientAggregator")
        self.propagate = nonfinite == "propagate"
        given = _named_parameters(params)
        self.named = [(name, p) for name, p in given if p.requires_grad]
        # parameters frozen now, which get no slot (a frozen backbone costs nothing on the wire); one that requires a
        # gradient later would be trained on each worker's own gradient: step() refuses it (_check_unfrozen)
        self._module = params if isinstance(params, nn.Module) else None
        self._frozen_at_start = [(name, p) for name, p in given if not p.requires_grad]
        self._slotted = {id(p) for _, p in self.named}
        if not self.named:
            raise ConfigError("no parameters that require gradients")
        if transport is None:
            from gradcomp.transport.dist import DistTransport

            transport = DistTransport()
        self.granularity = granularity
        self._warned_float64 = warn_float64(self.named, "GradientAggregator")
        self.names = [name for name, _ in self.named]
        self.slots = self.slots_for(self.named, granularity)
        self.exchange = GradientExchange(
            compressor, transport, topology=topology, server_compressor=server_compressor, root=root
        )
        # the first dense_steps steps go through an uncompressed fp32 all-reduce (torch PowerSGD's start_iter, DGC's
        # and 1-bit Adam's warm-up); the method's state is untouched until its first step
        self.dense_steps = dense_steps
        self._dense = None
        if dense_steps:
            from gradcomp.compressors.dense import NoCompression

            self._dense = GradientExchange(NoCompression(), transport)
        self.scaler = scaler
        self.steps = 0
        self.skipped = 0  # steps skipped because some worker's gradients overflowed (with a scaler)
        self._slots_agreed = False  # every worker's parameters checked against the others' (first exchange)

    @staticmethod
    def slots_for(named: Sequence[tuple[str, nn.Parameter]], granularity: str) -> list[Slot]:
        """One slot per parameter (``layer``) or one for the whole flattened model (``model``)."""
        if granularity == "layer":
            return [Slot(name, i, p.numel(), tuple(p.shape)) for i, (name, p) in enumerate(named)]
        return [Slot("model", 0, sum(p.numel() for _, p in named))]

    @property
    def transport(self) -> Transport:
        return self.exchange.transport

    def current_gradients(self) -> list[Tensor]:
        """Each parameter's ``.grad``; zeros for a parameter without one, or frozen since (``requires_grad`` off)."""
        return [p.grad if p.grad is not None and p.requires_grad else torch.zeros_like(p) for _, p in self.named]

    def aggregate(self, grads: Sequence[Tensor]) -> list[Tensor] | None:
        """The averaged gradients for ``grads`` (one per parameter, in order); advances the step counter.

        If some worker's gradients are not finite: NonFiniteGradientError on every worker (the counter stays), or,
        with a scaler, None on every worker (a skipped step; the counter advances). The state is as before either way.
        With ``nonfinite="propagate"`` nothing is read to decide it: the averages are returned, NaN on every worker
        when the step is bad (the counter advances).
        """
        self._check_gradients(grads)
        # On the host path this worker's verdict is read here (names for the error); on the device path it stays
        # a device flag, read once with the step's other checks (GradientExchange.exchange), and the names are
        # looked for only on a step that failed.
        # (the finiteness check, the state's snapshot and the rescaling are this object's work outside collectives,
        # as the exchange's is: counted in exchange.compress_s, the time split's "compression")
        started = time.perf_counter()
        device_path = bool(grads) and not host_path(grads[0])
        here = [] if device_path else self._not_finite(grads)
        finite = finite_flag(grads) if device_path else not here
        own = time.perf_counter() - started
        if not self._slots_agreed:
            self.exchange.check_same_slots(self.slots_for(self.named, "layer"), "GradientAggregator")
            self._slots_agreed = True
        started = time.perf_counter()
        scale = loss_scale(self.scaler)
        snapshot = self.exchange.snapshot()
        self.exchange.compress_s += own + time.perf_counter() - started
        # on the device path, a verdict that no read took comes back here: read with the checks (held for the step)
        # and the workers' agreement on refused messages (settle), or, propagated, applied unread (_handed_on)
        verdicts: list[Tensor] | None = [] if device_path else None
        checks, refusals = DeviceChecks() if device_path else None, Refusals()
        options = {"validate": False, "finite": finite, "handed_on": self.propagate, "verdicts": verdicts,
                   "refusals": refusals}
        exchange = self._dense if self.steps < self.dense_steps else self.exchange
        compress_before = exchange.compress_s
        try:
            with holding_for_the_pass(checks):
                averaged = self._exchanged(exchange, grads, scale if not here else None, options)
            held = [] if self.propagate or verdicts is None else verdicts
            if averaged is not None and settle(self.transport, refusals, grads[0].device, checks, held, self.steps):
                averaged = None
        except Exception:  # a refused message (every worker), or an error on this one: the state as before the step
            self.exchange.restore(snapshot)
            raise
        finally:
            if exchange is not self.exchange:  # a dense step's work is this aggregator's too
                self.exchange.compress_s += exchange.compress_s - compress_before
        if averaged is not None and self.propagate and verdicts:
            averaged = self._handed_on(averaged, verdicts, snapshot)
        if averaged is None:
            return self._not_applied(grads, here, device_path, snapshot)
        self.steps += 1
        started = time.perf_counter()
        if scale is not None:
            averaged = [a * scale for a in averaged]  # back in the scaler's units (a power of 2: exact)
        averaged = [a.view_as(g) for a, g in zip(averaged, grads)]
        self.exchange.compress_s += time.perf_counter() - started
        return averaged

    def _check_gradients(self, grads: Sequence[Tensor]) -> None:
        """ConfigError, before anything is sent, for gradients the exchange cannot take: another count than the
        parameters', a dtype that is not floating point, a sparse layout, or a scaler whose ``unscale_`` was called
        already (the aggregator unscales, and judges the step's finiteness, itself)."""
        if len(grads) != len(self.named):
            raise ConfigError(f"expected {len(self.named)} gradients, got {len(grads)}")
        for name, g in zip(self.names, grads):
            if not g.is_floating_point():
                raise ConfigError(f"{name}: gradcomp compresses floating-point tensors, got dtype {g.dtype}")
            if g.layout != torch.strided:
                raise ConfigError(
                    f"{name}: a {g.layout} gradient (nn.Embedding(sparse=True)?): gradcomp compresses dense "
                    "tensors; build the module with sparse=False, or leave the parameter out of this aggregator and "
                    "average its gradient yourself. Nothing was sent"
                )
        if self.scaler is not None and _unscaled_already(self.scaler):
            raise ConfigError(
                "GradientAggregator: scaler.unscale_(optimizer) was called before step(): the aggregator unscales "
                "(and judges the step's finiteness on every worker) itself. Call step() right after backward(), then "
                "scaler.unscale_(optimizer) for clipping, then scaler.step(optimizer). Nothing was sent"
            )

    def _not_finite(self, grads: Sequence[Tensor]) -> list[str]:
        """The names of this worker's gradients that hold a NaN or Inf (a host read)."""
        return [name for name, ok in zip(self.names, finite_flags(grads)) if not ok]

    def _exchanged(
        self, exchange: GradientExchange, grads: Sequence[Tensor], scale: Tensor | None, options: dict
    ) -> list[Tensor] | None:
        """The step's exchange of ``grads`` through ``exchange``, divided by ``scale`` first (None: as they are),
        one slot per parameter or, with ``granularity="model"``, one flat slot split back per parameter; None when
        some worker's gradients were not finite."""
        if self.granularity == "layer":
            inputs = [g / scale for g in grads] if scale is not None else grads
            return exchange.exchange(self.slots, inputs, self.steps, **options)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if scale is not None:
            flat.div_(scale)
        out = exchange.exchange(self.slots, [flat], self.steps, **options)
        return None if out is None else list(torch.split(out[0], [g.numel() for g in grads]))

    def _not_applied(
        self, grads: Sequence[Tensor], here: list[str], device_path: bool, snapshot: dict
    ) -> list[Tensor] | None:
        """A step some worker's gradients made not finite (on every worker): the state put back as before it, then
        NonFiniteGradientError naming this worker's bad gradients (``here``; on the device path looked for now) and
        refusals, or, the counter advanced, a skipped step: None with a scaler, NaN on every worker propagated."""
        self.exchange.restore(snapshot)
        if device_path:  # which of this worker's tensors were not finite (reads on a failed step only)
            here = self._not_finite(grads)
        if self.scaler is None and not self.propagate:
            raise agreed_non_finite(self.steps, here + self.exchange.refusal())
        self.steps += 1
        self.skipped += 1
        if self.propagate:  # NaN on every worker, for the scaler's check or the caller's
            return [torch.full_like(g, float("nan")) for g in grads]
        return None

    def _handed_on(self, averaged: list[Tensor], verdicts: list[Tensor], snapshot: dict) -> list[Tensor] | None:
        """The step's agreed verdict left on the device (``verdicts``: True, some worker's gradients were not
        finite) applied without a read: the averages NaN where it says so and the state put back by
        ``torch.where`` (``GradientExchange.restore_where``); None, after one read, when it says so and the state's
        layout moved during the step (a slot's first step), which only the read can undo."""
        bad = any_abandons(verdicts)
        if not self.exchange.restore_where(snapshot, bad):
            return None if bool(bad) else averaged
        return [a.masked_fill(bad, float("nan")) for a in averaged]

    @torch.no_grad()
    def step(self) -> bool | None:
        """Replace every parameter's ``.grad`` with the aggregated average over all workers; returns True, or
        False for a step skipped because some worker's gradients overflowed (with a ``scaler``; every ``.grad``
        is then NaN, so ``scaler.step`` skips it and ``scaler.update`` lowers the scale, on every worker). With
        ``nonfinite="propagate"``: None (not looked at; a bad step's ``.grad`` are NaN on every worker).

        One exchange per call: call it once per iteration, between ``backward()`` and ``optimizer.step()``. A
        second call in the same iteration is not detected; it runs another exchange of the averaged gradients
        (with error feedback, the residuals move again) and advances the step counter.

        A parameter whose ``.grad`` is None on this worker (unused in this forward pass) sends zeros and, unlike
        plain torch, receives the aggregate like every other parameter: its own residual's flush (with error
        feedback) and the other workers' gradients, so with momentum or weight decay it keeps moving. A
        parameter used on another worker must receive the aggregate, and leaving ``.grad`` None where it was
        None on every worker would need the workers to agree on that, which the compressed messages do not
        carry: one more collective every step (torch's DDP with ``find_unused_parameters=True`` all-reduces a
        bitmap for it), a latency paid on every step on slow links, so it is not done.

        A parameter frozen since construction (``requires_grad_(False)``) keeps its slot, sends zeros (so every
        worker still sends the same slots) and its ``.grad`` is left alone: the optimizer does not move it. Its
        residual (error feedback) is not flushed into it: it drains through its slot's messages and that slot's
        aggregate is discarded (with ``granularity="model"`` it competes with the other parameters for the
        selected entries until drained); what is left flows back if it is unfrozen. Freeze it on every worker.
        A parameter frozen when the aggregator was built has no slot (a frozen backbone costs nothing on the wire);
        if it requires a gradient later, step() refuses it (ConfigError, nothing sent): its gradient would never be
        averaged, and each worker would train it apart.
        """
        if not self._warned_float64:  # model.double() after construction
            self._warned_float64 = warn_float64(self.named, "GradientAggregator", stacklevel=4)
        self._check_unfrozen()
        averaged = self.aggregate(self.current_gradients())
        if averaged is None:  # skipped (a scaler, and some worker overflowed): every optimizer must see it
            for _, p in self.named:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
            return False
        for (_, p), a in zip(self.named, averaged):
            if not p.requires_grad:
                continue  # frozen: no gradient, the optimizer leaves it where it is
            if p.grad is None:
                p.grad = a.to(p.dtype).clone()
            else:
                p.grad.copy_(a)
        return None if self.propagate else True

    def _check_unfrozen(self) -> None:
        """ConfigError, before anything is sent, for a parameter that requires a gradient now but has no slot: frozen
        when this aggregator was built (or added to the module since). Its gradient would never be averaged: each
        worker would train it on its own, and the replicas would part without an error."""
        current = self._module.named_parameters() if self._module is not None else self._frozen_at_start
        late = [name for name, p in current if p.requires_grad and id(p) not in self._slotted]
        if late:
            raise ConfigError(
                f"GradientAggregator: {', '.join(late[:5])}{' and more' if len(late) > 5 else ''} require gradients "
                "but have no slot (frozen when this aggregator was built, or added since): their gradients would not "
                "be averaged and the replicas would part. Build the aggregator with every parameter that will train "
                "unfrozen (freezing one later is fine: it then sends zeros), or build a new GradientAggregator now "
                "(its residuals start empty). Nothing was sent"
            )

    def state_dict(self) -> dict:
        return {"steps": self.steps, "exchange": self.exchange.state_dict(), **self.exchange.identity(self.slots)}

    def load_state_dict(self, state: dict) -> None:
        """ConfigError, and nothing loaded, for a state saved by another method, for other parameters, or by
        another rank or world size (residuals are each worker's own: save one state per rank). A state saved
        before ranks were recorded (no ``rank`` and ``world_size`` keys) loads without that check."""
        self.exchange.check_saved(state, ("steps", "exchange"), self.slots, "GradientAggregator")
        self.exchange.load_state_dict(state["exchange"])
        self.steps = int(state["steps"])
