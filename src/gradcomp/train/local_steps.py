"""Communication delay (local SGD): n local optimizer steps, then exchange the accumulated weight update.

The "communication delay" of Sattler et al.'s SBC (and federated averaging / local SGD when uncompressed):

    at a sync point every worker holds W_i and the shared anchor W (the model after the last sync)
    ΔW_i = W_i − W                          the update accumulated over the last n local steps
    W    ← W + mean_i D(C(ΔW_i))            every worker applies the same decompressed average
    W_i  ← W

The compressor (with its residual, if error feedback is on) sees ΔW_i instead of a gradient. With n = 1
and plain SGD, ΔW_i = −lr·g_i, so exchanging updates is per-step gradient compression up to the factor
−lr; the only difference is the rounding in measuring ΔW_i as (W − lr·g_i) − W (a test shows the two
trajectories agree to 1e-6 with lr a power of two). Optimizer state (momentum) stays local between syncs,
as in local SGD.

The outer optimizer (DiLoCo: Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen,
"DiLoCo: Distributed Low-Communication Training of Language Models", 2023). With ``outer_optimizer="nesterov"``
the averaged update is a pseudo-gradient g = −mean_i D(C(ΔW_i)), and the anchor takes an SGD step with Nesterov
momentum on it, as torch's ``SGD(nesterov=True)`` computes it:

    b ← μ·b + g          W ← W − η·(g + μ·b)

DiLoCo's values are η = 0.7, μ = 0.9 with H = 500 inner AdamW steps on C4; the inner optimizer's state stays on
each worker (never exchanged, never reset). ``outer_optimizer="sgd"`` with η = 1 and μ = 0 is W ← W + mean_i
ΔW_i, the plain averaging above, computed as before (no outer state); other η / μ give SGD with heavy-ball
momentum. The compressor compresses the pseudo-gradient, as Streaming DiLoCo quantises it to 4 bits; with error
feedback its residual carries what one sync did not send into the next. Choice where DiLoCo is silent: the
outer momentum buffer starts at zero and is saved with the anchors (``state_dict``).

The aggregate is applied to the anchor as it is, with no learning rate (plain averaging): it must be an update. A majority vote
(signsgd, signum: ``scale_free``) aggregates to ±1 per coordinate whatever the workers sent, which would move
every weight by 1.0 at each sync; such a method, as the workers' or as the server's compressor, is refused with
ConfigError (``check_compressors``). Methods that send a scale (efsignsgd, onebit) keep the update's magnitude.
"""

from __future__ import annotations

import math

import torch

from gradcomp.errors import ConfigError
from gradcomp.train.aggregator import GradientAggregator


def check_compressors(compressor: object, server_compressor: object | None = None) -> None:
    """Refuse, with ConfigError, a worker or server compressor whose aggregate is a direction without a size
    (``scale_free``: the majority vote of signsgd and signum): local steps apply the aggregate as the update."""
    for role, method in (("compressor", compressor), ("server compressor", server_compressor)):
        if getattr(method, "scale_free", False):
            raise ConfigError(
                f"local steps apply the aggregated weight update as it is, but the {role} {method.name!r} aggregates "
                "by majority vote to ±1 per coordinate, with no learning rate: every weight would move by 1.0 at "
                "each sync. Use a method that keeps the update's size (efsignsgd, onebit, ...) or exchange "
                "gradients every step (no local steps)"
            )


class LocalUpdateExchange:
    """Call ``after_local_step()`` after every ``optimizer.step()``; it syncs every ``local_steps`` calls. Weights
    loaded into the model after this is built: call ``reset_anchor()`` on every worker before the next local step."""

    def __init__(self, aggregator: GradientAggregator, local_steps: int, *, outer_optimizer: str = "sgd",
                 outer_lr: float = 1.0, outer_momentum: float = 0.0):
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ConfigError(f"local_steps must be an integer >= 1, got {local_steps!r}")
        if outer_optimizer not in ("sgd", "nesterov"):
            raise ConfigError(f"outer_optimizer must be sgd or nesterov, got {outer_optimizer!r}")
        if not (isinstance(outer_lr, (int, float)) and math.isfinite(outer_lr) and outer_lr > 0):
            raise ConfigError(f"outer_lr must be a finite number > 0, got {outer_lr!r}")
        if not (isinstance(outer_momentum, (int, float)) and math.isfinite(outer_momentum)
                and 0 <= outer_momentum < 1):
            raise ConfigError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        self.outer_optimizer, self.outer_lr, self.outer_momentum = outer_optimizer, float(outer_lr), float(outer_momentum)
        # plain averaging keeps its arithmetic (and its bits) and has no outer state
        self.plain = (outer_optimizer, self.outer_lr, self.outer_momentum) == ("sgd", 1.0, 0.0)
        check_compressors(aggregator.exchange.compressor, aggregator.exchange.server_compressor)
        if getattr(aggregator, "scaler", None) is not None:  # it would unscale weight updates, which are not scaled
            raise ConfigError("LocalUpdateExchange exchanges weight updates: give it an aggregator without a scaler")
        if getattr(aggregator, "propagate", False):  # a bad sync's NaN would be added to every worker's parameters
            raise ConfigError(
                "LocalUpdateExchange adds the averaged update to the parameters itself: give it an aggregator with "
                "nonfinite='raise' (the default), not 'propagate'"
            )
        self.aggregator = aggregator
        self.local_steps = local_steps
        self.params = [p for _, p in aggregator.named]
        self.anchor = [p.detach().clone() for p in self.params]
        self.pending = 0
        self.syncs = 0
        self.outer_buffer = None if self.plain else [torch.zeros_like(a) for a in self.anchor]

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """Take the parameters as they are now as the point the next local steps are measured from. The anchors are
        the parameters when the exchange was built (or at the last sync): weights loaded into the model after that
        (a pretrained checkpoint, a model-only resume, a broadcast from rank 0) would otherwise count as the first
        local update and be averaged and compressed away, mostly reverted. Call it on every worker, with the same
        parameters on every worker, before the first local step after loading (ConfigError with steps pending)."""
        if self.pending:
            raise ConfigError(
                f"LocalUpdateExchange.reset_anchor: {self.pending} local steps are pending since the last sync; call "
                "it right after loading the weights, before any local step (or call sync() first)"
            )
        for p, a in zip(self.params, self.anchor):
            a.copy_(p.detach())

    @torch.no_grad()
    def after_local_step(self) -> bool:
        """Count one local step; at the n-th, exchange the update and return True."""
        self.pending += 1
        if self.pending < self.local_steps:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """Exchange the update accumulated since the last sync (also for fewer than n pending steps)."""
        if self.pending == 0:
            return
        updates = [p.detach() - a for p, a in zip(self.params, self.anchor)]
        averaged = self.aggregator.aggregate(updates)
        if self.plain:
            for a, u in zip(self.anchor, averaged):
                a.add_(u.to(a.dtype))
        else:
            mu, nesterov = self.outer_momentum, self.outer_optimizer == "nesterov"
            for a, u, b in zip(self.anchor, averaged, self.outer_buffer):
                g = -u.to(a.dtype)  # the pseudo-gradient
                b.mul_(mu).add_(g)
                a.add_(g.add(b, alpha=mu) if nesterov else b, alpha=-self.outer_lr)
        for p, a in zip(self.params, self.anchor):
            p.copy_(a)
        self.pending = 0
        self.syncs += 1

    def state_dict(self) -> dict:
        state = {
            "anchor": [a.clone() for a in self.anchor],
            "pending": self.pending,
            "syncs": self.syncs,
            "aggregator": self.aggregator.state_dict(),
        }
        if not self.plain:
            state["outer"] = {"optimizer": self.outer_optimizer, "lr": self.outer_lr, "momentum": self.outer_momentum,
                              "buffer": [b.clone() for b in self.outer_buffer]}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s state. Everything is checked first (the anchors' number, shapes and dtypes
        against this model's parameters, the counters, then the aggregator's own state, which refuses another
        model or method); a refused state leaves the exchange as it was."""
        expected = {"anchor", "pending", "syncs", "aggregator"} | (set() if self.plain else {"outer"})
        if not isinstance(state, dict) or set(state) != expected:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            outer = "" if self.plain else " and the outer optimizer's (outer)"
            raise ConfigError(f"LocalUpdateExchange state must hold anchor, pending, syncs and aggregator{outer}, "
                              f"got {keys}")
        buffer = None
        if not self.plain:
            outer = state["outer"]
            saved = (outer.get("optimizer"), outer.get("lr"), outer.get("momentum"))
            if saved != (self.outer_optimizer, self.outer_lr, self.outer_momentum):
                raise ConfigError(f"LocalUpdateExchange state: saved with outer optimizer {saved}, this exchange has "
                                  f"{(self.outer_optimizer, self.outer_lr, self.outer_momentum)}")
            buffer = outer.get("buffer")
            if not isinstance(buffer, (list, tuple)) or len(buffer) != len(self.params) or any(
                    not isinstance(b, torch.Tensor) or b.shape != p.shape for b, p in zip(buffer, self.params)):
                raise ConfigError("LocalUpdateExchange state: the outer momentum does not fit this model")
        anchor = state["anchor"]
        if not isinstance(anchor, (list, tuple)) or len(anchor) != len(self.params):
            count = len(anchor) if isinstance(anchor, (list, tuple)) else type(anchor).__name__
            raise ConfigError(f"LocalUpdateExchange state: {count} anchors for {len(self.params)} parameters")
        for name, a, p in zip(self.aggregator.names, anchor, self.params):
            if not isinstance(a, torch.Tensor) or a.shape != p.shape or a.dtype != p.dtype:
                got = f"{tuple(a.shape)} {a.dtype}" if isinstance(a, torch.Tensor) else type(a).__name__
                raise ConfigError(
                    f"LocalUpdateExchange state: the anchor of {name} is {got}, the parameter is {tuple(p.shape)} "
                    f"{p.dtype}"
                )
        counters = {key: state[key] for key in ("pending", "syncs")}
        for key, value in counters.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"LocalUpdateExchange state: {key} must be an integer >= 0, got {value!r}")
        self.aggregator.load_state_dict(state["aggregator"])  # raises before anything below is replaced
        self.anchor = [a.detach().to(p.device).clone() for a, p in zip(anchor, self.params)]
        if buffer is not None:
            self.outer_buffer = [b.detach().to(p.device, p.dtype).clone() for b, p in zip(buffer, self.params)]
        self.pending, self.syncs = counters["pending"], counters["syncs"]
