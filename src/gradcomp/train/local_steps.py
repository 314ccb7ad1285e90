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
"""

from __future__ import annotations

import torch

from gradcomp.errors import ConfigError
from gradcomp.train.aggregator import GradientAggregator


class LocalUpdateExchange:
    """Call ``after_local_step()`` after every ``optimizer.step()``; it syncs every ``local_steps`` calls."""

    def __init__(self, aggregator: GradientAggregator, local_steps: int):
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ConfigError(f"local_steps must be an integer >= 1, got {local_steps!r}")
        self.aggregator = aggregator
        self.local_steps = local_steps
        self.params = [p for _, p in aggregator.named]
        self.anchor = [p.detach().clone() for p in self.params]
        self.pending = 0
        self.syncs = 0

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
        for p, a, u in zip(self.params, self.anchor, averaged):
            a.add_(u.to(a.dtype))
            p.copy_(a)
        self.pending = 0
        self.syncs += 1

    def state_dict(self) -> dict:
        return {
            "anchor": [a.clone() for a in self.anchor],
            "pending": self.pending,
            "syncs": self.syncs,
            "aggregator": self.aggregator.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.anchor = [a.clone() for a in state["anchor"]]
        self.pending, self.syncs = int(state["pending"]), int(state["syncs"])
        self.aggregator.load_state_dict(state["aggregator"])
