"""Curvature of the loss along a random block versus along random-k coordinates (random-block study).

A coordinate set S that is updated once and then left alone for ~1/p steps (random selection, with or without
memory) moves by a single uncorrected step of size lr_eff * g_S. On a quadratic that step overshoots when
lr_eff * h_S > 2, where h_S = g_S' H g_S / |g_S|^2 is the curvature of the loss along the step. This script
measures h_S with Hessian-vector products for random blocks (contiguous, per layer) and for random-k sets of
the same size, on the model after a few steps of plain SGD:

    python scripts/block_curvature.py --density 0.01 --warmup-steps 100 --trials 20
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

from gradcomp.experiments.run.data import load_dataset
from gradcomp.experiments.run.models import build_model


def rayleigh(model, loss_fn, direction: list[torch.Tensor]) -> float:
    """d' H d / d' d for the loss at the current parameters (one Hessian-vector product)."""
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_fn(), params, create_graph=True)
    dot = sum((g * d).sum() for g, d in zip(grads, direction))
    hv = torch.autograd.grad(dot, params)
    num = sum(float((h * d).sum()) for h, d in zip(hv, direction))
    den = sum(float((d * d).sum()) for d in direction)
    return num / den if den > 0 else float("nan")


def masked(grads: list[torch.Tensor], chooser, only: int | None = None) -> list[torch.Tensor]:
    """The gradient kept on the chosen coordinates of every tensor (or of tensor ``only``), zero elsewhere."""
    out = []
    for i, g in enumerate(grads):
        flat = torch.zeros(g.numel())
        if only is None or i == only:
            idx = chooser(g.numel())
            flat[idx] = g.reshape(-1)[idx]
        out.append(flat.view_as(g))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=100, help="plain SGD steps before measuring")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--batch", type=int, default=512)
    args = p.parse_args()
    torch.manual_seed(0)
    data = load_dataset("mnist")
    model = build_model("cnn", data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(args.warmup_steps):
        rows = torch.randint(data.train_x.shape[0], (128,))
        opt.zero_grad()
        F.cross_entropy(model(data.train_x[rows]), data.train_y[rows]).backward()
        opt.step()
    rows = torch.randint(data.train_x.shape[0], (args.batch,))
    xb, yb = data.train_x[rows], data.train_y[rows]

    def loss_fn():
        return F.cross_entropy(model(xb), yb)

    grads = [g.detach() for g in torch.autograd.grad(loss_fn(), list(model.parameters()))]
    gen = torch.Generator().manual_seed(1)

    def block(d):
        k = max(1, math.ceil(args.density * d))
        return (int(torch.randint(d, (1,), generator=gen)) + torch.arange(k)) % d

    def randomk(d):
        return torch.randperm(d, generator=gen)[: max(1, math.ceil(args.density * d))]

    print(f"after {args.warmup_steps} SGD steps, density {args.density}, {args.trials} draws; "
          f"median (max) of h_S = g_S' H g_S / |g_S|^2")
    print(f"  full gradient: {rayleigh(model, loss_fn, grads):.3f}")
    names = [n for n, _ in model.named_parameters()]
    for only in [None, *range(len(grads))]:
        row = []
        for chooser in (block, randomk):
            hs = [rayleigh(model, loss_fn, masked(grads, chooser, only)) for _ in range(args.trials)]
            hs = [h for h in hs if not math.isnan(h)] or [float("nan")]  # an all-zero selection has no curvature
            row.append(f"{statistics.median(hs):9.3f} ({max(hs):9.3f})")
        where = "all tensors" if only is None else names[only]
        print(f"  {where:20s} block {row[0]}   random-k {row[1]}")


if __name__ == "__main__":
    main()
