"""Per-worker test gradients and their rank-order mean, shared by the exchange and topology tests."""

from __future__ import annotations

import torch


def worker_gradients(rank: int, step: int, sizes, stride: int) -> list[torch.Tensor]:
    """Gaussian tensors of ``sizes``, scaled by 1 + rank, seeded by ``stride * rank + step``."""
    g = torch.Generator().manual_seed(stride * rank + step)
    return [torch.randn(n, generator=g) * (1 + rank) for n in sizes]


def rank_order_mean(per_worker: list[torch.Tensor]) -> torch.Tensor:
    """The mean summed in rank order, as the simulated cluster and the gathered protocols sum."""
    total = torch.zeros_like(per_worker[0], dtype=torch.float32)
    for t in per_worker:
        total += t
    return total / len(per_worker)
