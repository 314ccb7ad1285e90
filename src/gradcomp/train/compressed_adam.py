"""What 1-bit Adam and 0/1 Adam share: an AdamW that does its own exchange through GradientAggregators.

Compressing the gradient before Adam breaks Adam's per-coordinate normalisation (error feedback turns a
coordinate's gradient into rare bursts of accumulated, stale gradient, scaled by a second moment made for another
signal; docs/adam.md has what was measured). The optimizers
built on this class compress something else, the momentum under a frozen variance, so they are optimizers
that exchange, not compressors: ``step()`` replaces ``aggregator.step()`` + ``optimizer.step()``.

    optimizer = gradcomp.OneBitAdam(model, lr=1e-3, freeze_step=100)   # torch.distributed initialised
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()         # exchanges (dense, or compressed) and updates; every replica the same

Every exchange goes through a :class:`GradientAggregator` over the one transport: the bytes are counted by the
transport, messages are the wire's CRC'd containers, and a non-finite value on any worker raises the same
NonFiniteGradientError on every worker at the same step with nothing changed (this optimizer's moments are
written only after the exchange returns). The 1-bit exchange is the ``sharded`` topology with ``efsignsgd``
both ways: each worker compresses its vector to signs and one scale ‖x‖₁/d per shard of each tensor with its
own error-feedback residual, sends shard j to worker j, which averages its W shards, compresses the average
again with its own (server) residual and all-gathers it back: the scheme of DeepSpeed's compressed all-reduce,
with every worker the server of 1/W of every tensor. Where it differs: DeepSpeed's workers send one scale for
the whole (padded) tensor, here one per shard (W scales per tensor, 32·W bits, so a shard's scale fits its own
entries); and DeepSpeed skips compression with one worker, while here one worker still compresses both ways
(the same code path at every W; a single-worker run is lossy, as a W-worker one is).

The scale ‖x‖₁/d minimises ‖x − s·sign(x)‖₂ over s; DeepSpeed uses ‖x‖₂/√d, which keeps the vector's norm and
overshoots the best fit; the paper's analysis holds for any compressor with bounded error.

Arithmetic of the dense steps is torch's AdamW (``foreach=False``) to the last bit, bias corrections included:
the warm-up *is* AdamW, so a run that never freezes equals ``torch.optim.AdamW`` over an fp32 all-reduce.
Decoupled weight decay ``p ← p·(1 − lr·wd)`` is applied on every step in both phases.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from gradcomp.errors import ConfigError
from gradcomp.registry import make
from gradcomp.train.aggregator import GradientAggregator
from gradcomp.transport.base import Transport


def _named(params) -> list[tuple[str, nn.Parameter]]:
    if isinstance(params, nn.parallel.DistributedDataParallel):
        raise ConfigError(
            "this optimizer exchanges the gradients itself: give it the unwrapped model, not a "
            "DistributedDataParallel one (whose backward would all-reduce them a second time)"
        )
    if isinstance(params, nn.Module):
        named = list(params.named_parameters())
    else:
        named = [item if isinstance(item, tuple) else (f"param{i}", item) for i, item in enumerate(params)]
    for name, p in named:
        if not isinstance(p, torch.Tensor):
            raise ConfigError(f"{name}: expected a parameter tensor, got {type(p).__name__} (param groups as dicts "
                              "are not supported: give the model or one list of parameters)")
    named = [(n, p) for n, p in named if p.requires_grad]
    if not named:
        raise ConfigError("no parameters that require gradients")
    return named


def check_adam_numbers(lr: float, betas, eps: float, weight_decay: float) -> None:
    """ConfigError for numbers torch's Adam would refuse or that would make the run NaN."""
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ConfigError(f"lr must be a finite number > 0, got {lr!r}")
    b1, b2 = betas
    if not all(math.isfinite(b) and 0 <= b < 1 for b in (b1, b2)):
        raise ConfigError(f"betas must be in [0, 1), got {b1}, {b2}")
    if not (math.isfinite(eps) and eps > 0):
        raise ConfigError(f"eps must be > 0, got {eps}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ConfigError(f"weight_decay must be >= 0, got {weight_decay}")


# what the "dense" exchange may use instead of fp32: unbiased or near-lossless quantisers without state, whose
# averaged gradient Adam can normalise as it does fp32's (a biased or error-fed compressor is what breaks Adam)
DENSE_COMPRESSORS = ("none", "fp16", "bf16", "cnat", "natural_dithering")


def _dense_aggregator(named, name: str, transport) -> GradientAggregator:
    """The warm-up's exchange: fp32 (``none``), fp16 and bf16 all-reduced; C_nat and natural dithering, whose codes
    do not sum, sharded both ways (each worker averages its shard of the W messages and sends it back compressed
    again), so that down as up costs the quantiser's bits, not W - 1 all-gathered messages."""
    if name not in DENSE_COMPRESSORS:
        raise ConfigError(f"the warm-up's compressor must be one of {', '.join(DENSE_COMPRESSORS)} (unbiased or "
                          f"near-lossless, so AdamW's moments see the true gradient's statistics), got {name!r}")
    if name in ("cnat", "natural_dithering"):
        return GradientAggregator(named, make(name), transport, topology="sharded", server_compressor=make(name))
    return GradientAggregator(named, make(name), transport)


def check_step_count(value, option: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{option} must be a whole number >= {minimum}, got {value!r}")
    return value


class ExchangingAdam(torch.optim.Optimizer):
    """An AdamW whose ``step()`` does the gradient exchange: a dense fp32 aggregator and 1-bit ones.

    Subclasses write ``step()`` from :meth:`_adamw_dense`, :meth:`_onebit` and :meth:`_apply`, and list their own
    scalar state in ``_counters`` (saved and checked by ``state_dict`` / ``load_state_dict``).
    """

    _counters: tuple[str, ...] = ("t",)
    _settings: tuple[str, ...] = ()  # counters that are the constructor's settings: a state must agree on them
    _tensors: tuple[str, ...] = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, transport: Transport | None = None, *, lr: float, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, onebit: Iterable[str] = ("momentum",),
                 dense_compressor: str = "none"):
        check_adam_numbers(lr, betas, eps, weight_decay)
        self.named = _named(params)
        super().__init__([p for _, p in self.named], dict(lr=lr, betas=tuple(betas), eps=eps,
                                                          weight_decay=weight_decay))
        if transport is None:
            from gradcomp.transport.dist import DistTransport

            transport = DistTransport()
        self.transport = transport
        self.t = 0  # steps taken
        self._dense = _dense_aggregator(self.named, dense_compressor, transport)
        self._compressed = {  # one 1-bit exchange (with its own residuals) per kind of vector sent
            kind: GradientAggregator(self.named, make("efsignsgd"), transport, topology="sharded",
                                     server_compressor=make("efsignsgd", error_feedback=True))
            for kind in onebit
        }
        self._time_offset = 0.0
        self._frozen_cache: tuple | None = None  # _frozen's
        for _, p in self.named:
            self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        """Exchange this worker's gradients and update (the subclass's ``_step``); no closure: call backward()."""
        if closure is not None:
            raise ConfigError(f"{type(self).__name__}.step takes no closure: call backward() first")
        t = self.t + 1
        self._step(self._gradients(), t)
        self.t = t

    def _step(self, grads: list[Tensor], t: int) -> None:
        raise NotImplementedError

    # -- the pieces of a step ---------------------------------------------------------------------------------

    def _hyper(self) -> tuple[float, float, float, float, float]:
        group = self.param_groups[0]
        b1, b2 = group["betas"]
        return group["lr"], b1, b2, group["eps"], group["weight_decay"]

    def _gradients(self) -> list[Tensor]:
        return self._dense.current_gradients()

    def _params(self) -> list[nn.Parameter]:
        return [p for _, p in self.named]

    def _moments(self, name: str) -> list[Tensor]:
        return [self.state[p][name] for p in self._params()]

    def _adamw_dense(self, grads: list[Tensor], step: int, update_variance: bool = True) -> None:
        """One AdamW step, torch's arithmetic, with ``grads`` the workers' average (``step`` 1-based for the bias
        corrections; ``update_variance`` False leaves the second moment as it is)."""
        lr, b1, b2, eps, wd = self._hyper()
        for p, g in zip(self._params(), grads):
            m, v = self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]
            m.lerp_(g, 1 - b1)
            if update_variance:
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
        self._apply(step, self._variance_updates(step))

    def _variance_updates(self, step: int) -> int:
        """How many gradients the second moment has averaged (its bias correction's exponent)."""
        return step

    def _denominators(self, variance_updates: int) -> list[Tensor]:
        _, _, b2, eps, _ = self._hyper()
        root = math.sqrt(1 - b2 ** variance_updates)
        return [(v.sqrt() / root).add_(eps) for v in self._moments("exp_avg_sq")]

    def _apply(self, step: int, variance_updates: int, denominators: list[Tensor] | None = None,
               masks: list[Tensor] | None = None) -> None:
        """p ← p·(1 − lr·wd) − lr·m̂ / (√v̂ + eps), torch's AdamW order; with ``masks``, m̂ only where they are
        True (:meth:`_masks`)."""
        lr, b1, _, _, wd = self._hyper()
        if denominators is None:
            denominators = self._denominators(variance_updates)
        step_size = lr / (1 - b1 ** step)
        masks = masks if masks is not None else [None] * len(denominators)
        for p, m, denom, mask in zip(self._params(), self._moments("exp_avg"), denominators, masks):
            p.mul_(1 - lr * wd)
            p.addcdiv_(m if mask is None else m * mask, denom, value=-step_size)

    def _masks(self) -> list[Tensor]:
        """Where the second moment is not 0. A coordinate whose gradient has been exactly 0 so far (an embedding
        row of a token not seen yet) has v = 0; a 1-bit message gives every coordinate of a shard ± its scale, and
        that divided by √0 + eps would move it by about lr / eps. Compressed vectors and updates are masked with
        this, so such a coordinate stays where it is while its variance is 0 (weight decay aside) (DeepSpeed asks the user for such a
        mask, ``exp_avg_mask``, for padded embedding rows; here it is found)."""
        return [v > 0 for v in self._moments("exp_avg_sq")]

    def _frozen(self, variance_updates: int) -> tuple[list[Tensor], list[Tensor]]:
        """The frozen variance's denominators and masks, computed once (and again after a load)."""
        if self._frozen_cache is None:
            self._frozen_cache = (self._denominators(variance_updates), self._masks())
        return self._frozen_cache

    def _onebit(self, kind: str, vectors: list[Tensor]) -> list[Tensor]:
        """The 1-bit compressed all-reduce of ``vectors`` (one per parameter): every worker gets the same."""
        averaged = self._compressed[kind].aggregate(vectors)
        assert averaged is not None  # no scaler, nonfinite="raise": a bad step raises on every worker
        return averaged

    def _dense_average(self, grads: list[Tensor]) -> list[Tensor]:
        averaged = self._dense.aggregate(grads)
        assert averaged is not None
        return averaged

    # -- what the runner and a user read ----------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Local steps taken since the replicas were last the same (0: they are)."""
        return 0

    def finish(self) -> None:
        """Make the replicas the same at the end of training (a method with local steps syncs them)."""

    def _aggregators(self) -> list[GradientAggregator]:
        return [self._dense, *self._compressed.values()]

    @property
    def compress_s(self) -> float:
        return self._time_offset + sum(a.exchange.compress_s for a in self._aggregators())

    @compress_s.setter
    def compress_s(self, value: float) -> None:  # a resumed run's clock
        self._time_offset += value - self.compress_s

    @property
    def communicate_s(self) -> float:
        return self.transport.counter.seconds  # every exchange's collectives, on the one transport

    # -- state --------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Moments, the counters, extra per-parameter tensors, and every aggregator's residuals: all a bit-exact
        resume needs (the learning rate is the caller's schedule's)."""
        per_param = {name: [self.state[p][name].clone() for p in self._params()]
                     for name in self._tensors if all(name in self.state[p] for p in self._params())}
        return {
            "method": type(self).__name__,
            "counters": {key: getattr(self, key) for key in self._counters},
            "tensors": per_param,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "exchanges": {"dense": self._dense.state_dict(),
                          **{kind: a.state_dict() for kind, a in self._compressed.items()}},
        }

    def load_state_dict(self, state: dict) -> None:
        """ConfigError, and nothing loaded, for a state of another method, model or shape."""
        if not isinstance(state, dict) or state.get("method") != type(self).__name__:
            got = state.get("method") if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"{type(self).__name__}: the state was saved by {got!r}")
        if set(state.get("counters", {})) != set(self._counters):
            raise ConfigError(f"{type(self).__name__}: the state's counters are {sorted(state.get('counters', {}))}, "
                              f"expected {sorted(self._counters)}")
        for key in self._settings:
            if state["counters"][key] != getattr(self, key):
                raise ConfigError(f"{type(self).__name__}: the state was saved with {key}={state['counters'][key]!r}, "
                                  f"this optimizer has {key}={getattr(self, key)!r}")
        for key, value in state["counters"].items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
            if not (number or (key == "_poisoned" and isinstance(value, bool))):
                raise ConfigError(f"{type(self).__name__}: the state's {key} is {value!r}")
        params = self._params()
        missing = [name for name in ("exp_avg", "exp_avg_sq") if name not in state["tensors"]]
        if missing:
            raise ConfigError(f"{type(self).__name__}: the state holds no {', '.join(missing)}")
        for name, tensors in state["tensors"].items():
            if name not in self._tensors or len(tensors) != len(params) or any(
                    t.shape != p.shape or t.dtype != p.dtype for t, p in zip(tensors, params)):
                raise ConfigError(f"{type(self).__name__}: the state's {name} does not fit this model's parameters")
        exchanges = state["exchanges"]
        if set(exchanges) != {"dense", *self._compressed}:
            raise ConfigError(f"{type(self).__name__}: the state's exchanges are {sorted(exchanges)}")
        pairs = [("dense", self._dense), *self._compressed.items()]
        before = [a.state_dict() for _, a in pairs]
        try:
            for name, aggregator in pairs:  # each refuses another model or method
                aggregator.load_state_dict(exchanges[name])
        except Exception:  # one refused: the ones loaded before it are put back
            for (_, aggregator), saved in zip(pairs, before):
                aggregator.load_state_dict(saved)
            raise
        for name, tensors in state["tensors"].items():
            for p, t in zip(params, tensors):
                self.state[p][name] = t.detach().to(p.device).clone()
        for key, value in state["counters"].items():
            setattr(self, key, value)
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        self._after_load()
        # (the cached frozen denominators and masks are recomputed from the loaded variance, bit for bit)

    def _after_load(self) -> None:
        """Recompute what is derived from the loaded state (the frozen denominators and masks)."""
        self._frozen_cache = None
