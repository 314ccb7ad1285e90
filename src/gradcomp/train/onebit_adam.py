"""1-bit Adam: dense AdamW for a warm-up, then the 1-bit, error-compensated momentum under a frozen variance.

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam: Communication Efficient Large-Scale
Training with Adam's Convergence Speed", ICML 2021 (DeepSpeed's ``OnebitAdam``).

Algorithm, on every worker i, at step t (1-based), with W workers:

- **Warm-up** (t ≤ ``freeze_step``): the gradients are averaged by a dense fp32 all-reduce and AdamW updates m
  and v as usual. After step ``freeze_step`` the second moment v is frozen: Adam's variance stabilises early,
  and a fixed v makes the update linear in the momentum, which is what lets the momentum be compressed.
- **Compression stage** (t > ``freeze_step``): the worker updates its momentum with its *local* gradient,
  m_i = β1·m + (1 − β1)·g_i, and the workers' m_i go through the 1-bit compressed all-reduce with worker and
  server error feedback (``ExchangingAdam``: signs and one scale per shard, each worker the server of 1/W of
  every tensor). Every worker's m becomes that same average; then p ← p·(1 − lr·wd) − lr·m̂ / (√v̂ + eps) with
  the frozen v̂.

Choices where the paper is silent or DeepSpeed differs:

- Bias corrections as torch's AdamW (DeepSpeed's 1-bit Adam has none): the warm-up equals ``torch.optim.AdamW``,
  and the frozen v keeps the correction of the step it froze at, 1 − β2^freeze_step.
- Decoupled weight decay on the weights (AdamW), never through the compressed momentum.
- ``freeze_step``: the paper froze after 15-25 % of BERT's steps, and DeepSpeed's tutorials advise about
  15 %. ``gradcomp train --optimizer onebit_adam`` takes 15 % of the run's steps when none is given (150 of
  1,000: by then v has averaged 150 squared gradients, with its bias correction; docs/adam.md). There is no
  default in the API: a step count means nothing without the run's length.
- The residuals start empty at the freeze; the dense warm-up's bytes are counted like every other step's.
- ``warmup_compressor`` (not in the paper, default ``"none"``: fp32): the warm-up's gradients may go through an
  unbiased or near-lossless quantiser instead (fp16, bf16, C_nat, natural dithering; ``DENSE_COMPRESSORS``).
  With the warm-up in fp32 it dominates the bits of a short run (150 dense steps of 1,000 cost 5x the 850
  compressed ones), and on a slow link its time; C_nat sends 9 bits a coordinate, an unbiased estimate whose
  variance Adam's second moment sees as a little more gradient noise, not as the bursts error feedback makes.
- A coordinate whose frozen variance is 0 (its gradient was exactly 0 throughout the warm-up: an embedding row of
  a byte never seen) is not moved after the freeze: the 1-bit message would give it ± its shard's scale, which
  divided by eps is a step of about lr / eps (``ExchangingAdam._masks``).
"""

from __future__ import annotations

import torch

from gradcomp.train.compressed_adam import ExchangingAdam, check_step_count
from gradcomp.transport.base import Transport


class OneBitAdam(ExchangingAdam):
    _counters = ("t", "freeze_step")
    _settings = ("freeze_step",)

    def __init__(self, params, transport: Transport | None = None, *, freeze_step: int, lr: float = 1e-3,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 warmup_compressor: str = "none"):
        self.freeze_step = check_step_count(freeze_step, "freeze_step")
        self.warmup_compressor = warmup_compressor
        super().__init__(params, transport, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         onebit=("momentum",), dense_compressor=warmup_compressor)

    @property
    def frozen(self) -> bool:
        return self.t >= self.freeze_step

    def _step(self, grads, t: int) -> None:
        if t <= self.freeze_step:
            self._adamw_dense(self._dense_average(grads), t)
        else:
            _, b1, _, _, _ = self._hyper()
            local = [m.lerp(g, 1 - b1) for m, g in zip(self._moments("exp_avg"), grads)]
            averaged = self._onebit("momentum", local)  # raises on every worker, nothing changed, if not finite
            denominators, masks = self._frozen(self.freeze_step)
            for m, a, mask in zip(self._moments("exp_avg"), averaged, masks):
                torch.mul(a, mask, out=m)  # (0 where the frozen variance is 0: ExchangingAdam._masks)
            self._apply(t, self.freeze_step, denominators)
