"""Why top-k with error feedback fails under AdamW: Adam's second moment and step size around the switch.

The 1,000-step table (docs/adam.md) has top-k 1 % with error feedback after 100 dense steps: the loss *rises*
once top-k takes over. The explanation offered is Adam's normalisation: with error feedback a coordinate's
residual arrives in rare bursts, each about 1/density times the gradient; the second moment v sees the bursts
squared, so √v̂ grows and the step m̂ / (√v̂ + eps) of every coordinate that is not bursting shrinks, while the
bursting ones take steps of Adam's full size in the direction of a stale, accumulated gradient.

This script measures that, on the workload of the table (the Transformer, 4 simulated workers, AdamW lr 2e-3 with
the 1,000-step run's warm-up and cosine, seed 0), for fp32 and for top-k 1 % EF after ``--dense`` dense steps,
from the same initialisation and data, and prints, every ``--every`` steps around the switch, on worker 0:

- ``sqrt_v``: the median and the 99th percentile over all coordinates of √v̂ (v̂ = Adam's bias-corrected second
  moment): the median is the typical coordinate's, the 99th percentile the bursting few's;
- ``step_rms``: the root mean square of Adam's normalised step m̂ / (√v̂ + eps) (before the lr);
- ``moved``: the fraction of coordinates whose averaged gradient this step is not zero;
- ``loss``: worker 0's training loss.

    python scripts/adam_topk_variance.py --steps 140 --dense 100 > docs/adam/topk-variance.md   # about 5 min

The arithmetic is gradcomp train's (GradientAggregator with ``dense_steps``, torch's AdamW, the runner's batches
and lr schedule); what it adds is reading the optimizer's state.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import gradcomp
from gradcomp.experiments.run.models import build_model
from gradcomp.experiments.run.runner import Batches, compute_gradients, set_lr
from gradcomp.experiments.study import pilot


def adam_stats(optimizer: torch.optim.AdamW, averaged: list[torch.Tensor]) -> tuple[float, float, float, float]:
    group = optimizer.param_groups[0]
    b1, b2 = group["betas"]
    eps = group["eps"]
    roots, steps, moved, total = [], [], 0, 0
    for p, g in zip(group["params"], averaged):
        state = optimizer.state[p]
        t = float(state["step"])
        v_hat = state["exp_avg_sq"] / (1 - b2 ** t)
        m_hat = state["exp_avg"] / (1 - b1 ** t)
        roots.append(v_hat.sqrt().reshape(-1))
        steps.append((m_hat / (v_hat.sqrt() + eps)).reshape(-1))
        moved += int((g != 0).sum())
        total += g.numel()
    root = torch.cat(roots)
    step = torch.cat(steps)
    high = float(root.kthvalue(max(1, int(0.99 * root.numel()))).values)
    return float(root.median()), high, float(step.pow(2).mean().sqrt()), moved / total


def train(method: str, args) -> list[tuple]:
    cfg = pilot.base_config("transformer", "pystdlib", None, None, 4, args.steps, args.seed, run_steps=args.run)
    data = cfg.load_data()
    cluster = gradcomp.SimulatedCluster(4)
    compressor_args = {"none": ("none", {}), "topk": ("topk", {"density": args.density, "error_feedback": True})}

    def work(transport):
        model = build_model(cfg.model, data, cfg.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                      weight_decay=cfg.weight_decay, foreach=False)
        name, kwargs = compressor_args[method]
        aggregator = gradcomp.GradientAggregator(model, gradcomp.make(name, **kwargs), transport,
                                                 dense_steps=args.dense if method == "topk" else 0)
        batches = Batches(data, cfg, transport.rank)
        rows = []
        for step in range(args.steps):
            xb, yb = batches.get(step, torch.device("cpu"))
            set_lr(optimizer, cfg.lr_at(step, cfg.schedule_steps or args.steps))
            loss = compute_gradients(model, xb, yb)
            aggregator.step()
            averaged = [p.grad.detach().clone() for p in model.parameters()]
            optimizer.step()
            if transport.rank == 0 and (step + 1) % args.every == 0:
                rows.append((step + 1, loss, *adam_stats(optimizer, averaged)))
        return rows

    return cluster.run(work)[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=140)
    p.add_argument("--dense", type=int, default=100, help="dense steps before top-k (its --dense-steps)")
    p.add_argument("--run", type=int, default=1000, help="the run whose lr schedule these steps follow")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    fp32, topk = train("none", args), train("topk", args)
    print(f"Transformer, 4 simulated workers, seed {args.seed}, AdamW at the {args.run}-step run's schedule; top-k "
          f"{100 * args.density:g} % with error feedback after {args.dense} dense steps. Worker 0, every "
          f"{args.every} steps.\n")
    print("| step | loss fp32 / top-k | median √v̂ fp32 / top-k | 99th percentile √v̂ fp32 / top-k "
          "| step rms fp32 / top-k | top-k: coordinates moved |")
    print("|---|---|---|---|---|---|")
    for a, b in zip(fp32, topk):
        print(f"| {a[0]} | {a[1]:.3f} / {b[1]:.3f} | {a[2]:.2e} / {b[2]:.2e} | {a[3]:.2e} / {b[3]:.2e} | "
              f"{a[4]:.3f} / {b[4]:.3f} | {100 * b[5]:.1f} % |")
    after = [(b[2] / a[2], b[3] / a[3], b[4] / a[4]) for a, b in zip(fp32, topk) if a[0] > args.dense]
    if after:
        print(f"\nAfter the switch (the rows after step {args.dense}; medians of top-k / fp32): median √v̂ "
              f"{statistics.median(r[0] for r in after):.2f}x, 99th percentile √v̂ "
              f"{statistics.median(r[1] for r in after):.2f}x, step rms {statistics.median(r[2] for r in after):.2f}x.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
