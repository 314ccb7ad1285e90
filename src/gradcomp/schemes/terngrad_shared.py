"""TernGrad with scaler sharing: one scaler, the max over workers, agreed before the ternary round.

Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning", NeurIPS 2017,
section 3 ("scaler sharing"): every worker ternarises its gradient with the *same* s = max over workers of
its own (clipped) max|g|, so that the ternary messages of all workers have one scale and the aggregate is
s·(Σ ternaries)/W. The per-worker variant (each worker its own s, sent with its codes) is the compressor
``terngrad`` (``gradcomp.compressors.natural``); this scheme reuses its clipping and its random draws.

Per exchange, for the slots handed over (one per tensor at layer granularity):

1. Each worker clips its tensor at c·σ (``clip``, 2.5 by default; 0 turns it off) and computes its scaler
   s_i = max|clipped x|; one **max-allreduce** of the W-independent vector (s per slot, float32) gives
   s = max_i s_i on every worker: 32 bits per slot up and down, booked as payload.
2. Each worker sends s·sign(x_j)·b_j with b_j ~ Bernoulli(|x_j| / s) — a probability that is at most 1
   because s is at least this worker's own max. Codes: 2 bits per coordinate (0 = 0, 1 = +s, 2 = −s, as
   ``terngrad``), all slots in ONE wire buffer without a scale field (every worker already holds s),
   **allgathered**; every worker decodes the W buffers in rank order and returns s·(Σ units)/W.

Choices where the paper is silent or describes a parameter server:

- The paper pushes ternary gradients to a parameter server. gradcomp allgathers the 2-bit codes instead
  (the workers' messages are not summable on the wire: a sum of W ternaries needs log2(2W+1) bits), so
  bits down are (W − 1)·2 per coordinate, as for ``terngrad`` over allgather. ``exchange="allreduce"``
  sends the ternaries as int8 and sums them in one allreduce (8 bits per coordinate up and down at any
  W ≤ 127; larger worlds are refused): fewer bits down than the allgather from W = 6 on, 4× more up.
- Clipping is per worker, before the max (the paper clips each worker's gradient).
- Randomness: the same per-worker stream as ``terngrad`` (seeded by run seed, step, slot and worker rank).
- A NaN or Inf entry raises NonFiniteGradientError before the first round on the host path. The device path
  reads nothing back: this worker's scaler is then NaN or ±Inf, sent as +Inf (a NaN may not survive a max on
  every backend), so the shared s is +Inf on every worker and so is every result (0 · Inf is NaN): non-finite
  on every worker, never a finite stand-in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Slot, bind_worker
from gradcomp.compressors.natural import TernGrad
from gradcomp.errors import ConfigError
from gradcomp.schemes.base import Scheme
from gradcomp.protocols import allgather_buffers
from gradcomp.transport.requests import AllReduce, Rounds
from gradcomp.wire import Codec, FieldSpec, decode, encode
from gradcomp.wire.device import DeviceChecks, hold_for_the_pass

EXCHANGES = ("allgather", "allreduce")
_INT8_MAX_WORKERS = 127  # a sum of W values in {-1, 0, 1} fits int8


class TernGradShared(Scheme):
    name = "terngrad_shared"

    def __init__(self, clip: float = 2.5, seed: int = 0, exchange: str = "allgather"):
        self.ternary = TernGrad(clip=clip, seed=seed)  # checks clip and seed
        if exchange not in EXCHANGES:
            raise ConfigError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        self.exchange = exchange
        self.unbiased = self.ternary.unbiased

    def bind(self, rank: int, world_size: int) -> None:
        super().bind(rank, world_size)
        if self.exchange == "allreduce" and world_size > _INT8_MAX_WORKERS:
            raise ConfigError(
                f"terngrad_shared with exchange='allreduce' sums int8 ternaries: at most {_INT8_MAX_WORKERS} "
                f"workers, got {world_size} (use exchange='allgather')"
            )
        bind_worker(self.ternary, rank)

    def params(self) -> dict[str, Any]:
        return {**self.ternary.params(), "exchange": self.exchange}

    def defers_verdict(self, slots: Sequence[Slot]) -> bool:
        return True  # one scaler per slot, then codes of a size the slots fix

    def run(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        if not slots:
            return []
        clipped = [self.ternary.clipped(t, s) for s, t in zip(slots, tensors)]  # host path: raises before sending
        device = tensors[0].device
        mine = torch.stack([peak * top for peak, _, top in clipped]).to(device=device, dtype=torch.float32)
        mine = torch.nan_to_num(mine, nan=float("inf"), posinf=float("inf"), neginf=float("inf"))  # (device path)
        shared = yield AllReduce(mine, op="max")

        units = []
        for slot, (peak, scaled, _), scale in zip(slots, clipped, shared):
            # |clipped x| / s = |scaled|·max|x| / s, at most 1 since s >= this worker's clipped max
            ratio = torch.where(scale > 0, peak / scale, torch.zeros_like(scale))
            prob = (scaled.abs() * ratio).clamp_(max=1.0)
            units.append(self.ternary.ternary_codes(scaled, prob, slot, step))

        if self.exchange == "allreduce":
            signed = torch.cat([(c == 1).to(torch.int8) - (c == 2).to(torch.int8) for c in units])
            summed = yield AllReduce(signed, inplace=True)
            sums = torch.split(summed.to(torch.float32), [s.numel for s in slots])
        else:
            specs = [FieldSpec(Codec.BITS, count=s.numel, width=2) for s in slots]
            message = encode(units, specs)  # its size fixed by the specs: no size round
            gathered = yield from allgather_buffers(self.rank, message, [message.numel()] * self.world_size)
            sums = [torch.zeros(s.numel, dtype=torch.float32, device=device) for s in slots]
            later = DeviceChecks()  # device buffers: every message's checks in one read after the loop (or the pass's)
            for buffer in gathered:  # rank order: the same sums on every worker
                for total, codes in zip(sums, decode(buffer, specs, later)):
                    total += (codes == 1).to(torch.float32) - (codes == 2).to(torch.float32)
            if not hold_for_the_pass(later):
                later.read()
        return [total * (scale / self.world_size) for total, scale in zip(sums, shared)]
