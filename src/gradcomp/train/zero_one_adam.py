"""0/1 Adam: adaptive variance freezing, 1-bit steps, and 1-bit synchronisation after growing runs of local steps.

Lu, Li, Zhang, De Sa, He, "Maximizing Communication Efficiency for Large-scale Training via 0/1 Adam",
ICLR 2023 (DeepSpeed's ``ZeroOneAdam``).

Algorithm, on every worker, at step t (1-based):

- **Variance stage** (t ≤ ``var_freeze_step``). The variance is updated only at the steps of T_v, whose gaps
  grow: every step for the first κ updates (``var_update_scaler``), then every 2nd step for κ more, every 4th,
  ... At a step of T_v the gradients are averaged dense (fp32 all-reduce) and both moments are updated. At
  every other step the gradients go through the 1-bit compressed all-reduce (worker and server error feedback,
  ``ExchangingAdam``) and only the momentum is updated, from that average. Every step then applies
  p ← p·(1 − lr·wd) − lr·m̂ / (√v̂ + eps) with the latest v. After ``var_freeze_step`` v never changes again.
- **Local stage** (t > ``var_freeze_step``). Each worker updates its momentum with its own gradient and applies
  the update locally; every H steps (the set T_u) the workers synchronise: the change since the last sync,
  multiplied back by the frozen √v̂ + eps (into momentum units, where the 1-bit compressor's error is
  bounded), goes through the 1-bit compressed all-reduce; every worker's parameters become the last sync's plus
  the averaged change divided by √v̂ + eps, and the momentum becomes the averaged change divided by the sum of
  the learning rates of those steps. H starts at 1 and doubles every ``local_step_scaler`` steps, to at most
  ``local_step_clipper``.

Choices where the paper is silent or DeepSpeed differs:

- T_u. The paper ties the sync gaps to the learning-rate schedule; DeepSpeed doubles them every
  ``local_step_scaler`` steps (default 32,678, for runs of hundreds of thousands of steps). Here the same
  doubling rule with default 50 steps (``gradcomp train``), so that on a 1,000-step run H reaches its cap of 16
  about 200 steps after the freeze (docs/adam.md).
- ``var_freeze_step``: DeepSpeed advises the end of the learning-rate warm-up; ``gradcomp train`` takes 15 % of
  the run's steps when none is given (the same default as 1-bit Adam's freeze step, so that the two compare at
  the same warm-up). With κ = 16, 52 of the first 150 steps of a run are then dense.
- Bias corrections as torch's AdamW (DeepSpeed has none): m̂ = m / (1 − β1^t), and v̂ = v / (1 − β2^n) with n the
  number of variance updates so far (v has averaged n squared gradients, not t).
- The replicas are made equal at every sync from a kept copy of the parameters at the last sync (not by
  subtracting the local change again, which leaves rounding that differs between workers); ``finish()``
  synchronises a last, shorter run of local steps. A sync comes after ``H`` local steps since the last one
  (DeepSpeed syncs at global steps that are multiples of H, so a run can be cut short when H doubles).
- Weight decay is decoupled in the local stage too: the kept copy decays with the weights, so the change sent
  (and the momentum made from it) holds the momentum steps alone. DeepSpeed folds ``wd·p`` into the change, and
  so into the momentum, where it adds up over syncs (about 1/(1 − β1) times the decay).
- A non-finite gradient during a run of local steps cannot be told to the others before the run's sync (local
  steps send nothing): the worker leaves that step's update out, and its sync message is made non-finite, so
  that every worker raises NonFiniteGradientError at the sync, with the moments, parameters and residuals as
  before the sync step (the worker's bad step stays left out; a caller that catches the error can go on).
- A coordinate whose variance is 0 (its gradient exactly 0 at every variance update: an embedding row of a byte
  not seen) is not moved by 1-bit vectors or local steps while it is: divided by eps they would move it by about
  lr / eps (``ExchangingAdam._masks``).
- ``warmup_compressor`` (not in the paper, default ``"none"``: fp32), as 1-bit Adam's: what the variance stage's
  dense steps (those of T_v) send: fp16, bf16, C_nat or natural dithering (``DENSE_COMPRESSORS``). With
  ``var_update_scaler`` at least ``var_freeze_step`` every step of the variance stage is such a step, and the
  stage is 1-bit Adam's warm-up: no 1-bit gradient steps, whose error feedback Adam's moments see as bursts.
- The residuals of the variance stage's 1-bit gradient exchange and of the local stage's 1-bit sync are apart
  (two exchanges): they compress different quantities.
"""

from __future__ import annotations

import torch

from gradcomp.finite import finite_flags
from gradcomp.train.compressed_adam import ExchangingAdam, check_step_count
from gradcomp.transport.base import Transport


class ZeroOneAdam(ExchangingAdam):
    _counters = ("t", "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper",
                 "var_interval", "var_counter", "var_updates", "local_interval", "local_counter", "_pending", "lrs",
                 "syncs", "_poisoned")
    _settings = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")
    _tensors = ("exp_avg", "exp_avg_sq", "anchor")

    def __init__(self, params, transport: Transport | None = None, *, var_freeze_step: int, lr: float = 1e-3,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, var_update_scaler: int = 16,
                 local_step_scaler: int = 50, local_step_clipper: int = 16, warmup_compressor: str = "none"):
        self.var_freeze_step = check_step_count(var_freeze_step, "var_freeze_step")
        self.var_update_scaler = check_step_count(var_update_scaler, "var_update_scaler")
        self.local_step_scaler = check_step_count(local_step_scaler, "local_step_scaler")
        self.local_step_clipper = check_step_count(local_step_clipper, "local_step_clipper")
        self.warmup_compressor = warmup_compressor
        super().__init__(params, transport, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         onebit=("gradient", "update"), dense_compressor=warmup_compressor)
        self.var_interval, self.var_counter, self.var_updates = 1, 0, 0
        self.local_interval, self.local_counter, self._pending, self.lrs, self.syncs = 1, 0, 0, 0.0, 0
        self._poisoned = False  # a local step's gradient was not finite since the last sync

    def _variance_updates(self, step: int) -> int:
        return self.var_updates

    @property
    def pending(self) -> int:
        return self._pending

    def _step(self, grads, t: int) -> None:
        if t <= self.var_freeze_step:
            self._variance_stage(grads, t)
        else:
            self._local_stage(grads, t)

    def _variance_stage(self, grads, t: int) -> None:
        _, b1, _, _, _ = self._hyper()
        variance_step = t % self.var_interval == 0
        if variance_step:
            averaged = self._dense_average(grads)
        else:  # (0 where the variance is still 0: ExchangingAdam._masks)
            averaged = [a * mask for a, mask in zip(self._onebit("gradient", grads), self._masks())]
        if variance_step:
            self.var_updates += 1
        self._adamw_dense(averaged, t, update_variance=variance_step)
        if variance_step:
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:
                self.var_counter, self.var_interval = 0, 2 * self.var_interval
        if t == self.var_freeze_step:  # the point the first local steps are measured from
            for p in self._params():
                self.state[p]["anchor"] = p.detach().clone()

    def _local_stage(self, grads, t: int) -> None:
        lr, b1, _, _, wd = self._hyper()
        syncing = self._pending + 1 == self.local_interval
        before = self._local_snapshot() if syncing else None
        if all(finite_flags(grads)):
            for m, g in zip(self._moments("exp_avg"), grads):
                m.lerp_(g, 1 - b1)
            self._apply(t, self.var_updates, *self._frozen(self.var_updates))
            if wd:  # the anchor decays as the weights do, so that the change synced is the momentum steps' alone
                for a in self._moments("anchor"):
                    a.mul_(1 - lr * wd)
        else:  # not applied here; every worker learns of it at the sync, which no worker then applies
            self._poisoned = True
        self.lrs += lr
        self._pending += 1
        self.local_counter += 1
        if syncing:
            try:
                self._sync(t)
            except Exception:
                self._restore_local(before)
                raise
        if self.local_counter == self.local_step_scaler:
            self.local_counter = 0
            self.local_interval = min(self.local_step_clipper, 2 * self.local_interval)

    def _sync(self, t: int) -> None:
        _, b1, _, _, _ = self._hyper()
        denominators, masks = self._frozen(self.var_updates)
        anchors = self._moments("anchor")
        change = [(p.detach() - a) * d for p, a, d in zip(self._params(), anchors, denominators)]
        if self._poisoned:  # a local gradient was not finite: the sync's finiteness check raises on every worker
            self._poisoned = False
            first = next(i for i, c in enumerate(change) if c.numel())
            change[first] = torch.full_like(change[first], float("nan"))
        averaged = self._onebit("update", change)  # every worker the same, or an error on every worker
        correction = 1 - b1 ** t
        for p, a, d, m, u, mask in zip(self._params(), anchors, denominators, self._moments("exp_avg"), averaged,
                                       masks):
            m.copy_(u).mul_(-correction / self.lrs).mul_(mask)
            a.add_(u * mask / d)
            p.copy_(a)
        self._pending, self.lrs = 0, 0.0
        self.syncs += 1

    def _local_snapshot(self) -> tuple:
        return ([m.clone() for m in self._moments("exp_avg")], [p.detach().clone() for p in self._params()],
                self.lrs, self._pending, self.local_counter)

    def _restore_local(self, snapshot: tuple) -> None:
        moments, params, self.lrs, self._pending, self.local_counter = snapshot
        for m, saved in zip(self._moments("exp_avg"), moments):
            m.copy_(saved)
        for p, saved in zip(self._params(), params):
            p.copy_(saved)

    @torch.no_grad()
    def finish(self) -> None:
        """Synchronise the local steps taken since the last sync (the replicas are then the same)."""
        if self._pending:
            self._sync(self.t)


def schedule(freeze: int, steps: int, kappa: int, scaler: int, clipper: int) -> list[tuple[str, int]]:
    """0/1 Adam's steps 1..steps as :class:`ZeroOneAdam`'s counters make them (``kappa``: var_update_scaler,
    ``scaler`` / ``clipper``: local_step_scaler / local_step_clipper), for planning and timing without training:
    per step its kind and interval, ("variance", k) for a step that updates the variance (a dense exchange),
    ("gradient", k) for a 1-bit exchange of the gradient (k: the variance interval), ("local", H) for a local step
    and ("sync", H) for one that syncs."""
    out = []
    interval, counter = 1, 0
    for t in range(1, freeze + 1):
        if t % interval == 0:
            out.append(("variance", interval))
            counter += 1
            if counter == kappa:
                counter, interval = 0, 2 * interval
        else:
            out.append(("gradient", interval))
    interval, counter, pending = 1, 0, 0
    for _ in range(freeze + 1, steps + 1):
        syncing = pending + 1 == interval
        pending = 0 if syncing else pending + 1
        out.append(("sync" if syncing else "local", interval))
        counter += 1
        if counter == scaler:
            counter, interval = 0, min(clipper, 2 * interval)
    return out


def steady_round(kinds: list[tuple[str, int]]) -> tuple[int, int] | None:
    """(first step, round length H) from which ``schedule``'s steps repeat one round of H − 1 local steps and a
    sync to the run's end, the first step a multiple of H (step indices from 0; H = the interval of the run's last
    steps), or None when there is no such step (the interval changed mid-round, so the rounds start off the
    multiples of H; or the run ends in its variance stage)."""
    if not kinds or kinds[-1][0] not in ("local", "sync"):
        return None
    h = kinds[-1][1]
    first = len(kinds)
    while first > 0 and kinds[first - 1] in (("local", h), ("sync", h)):
        first -= 1
    for i in range(first, len(kinds) - h + 1):
        if i % h == 0 and (i == 0 or kinds[i - 1][0] != "local") and all(
                kinds[j][0] == ("sync" if (j - i) % h == h - 1 else "local") for j in range(i, len(kinds))):
            return i, h
    return None
