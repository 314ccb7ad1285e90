"""An independent reference for random sparsification with error feedback.

This loop does not use gradcomp's compressors, error feedback, aggregator or transport: W logical workers
share one replica (data-parallel replicas stay identical, so one copy suffices), each computes its gradient
on its own shard's batch, keeps its own residual, and the "allreduce" is a plain sum of the W sparse
messages. Only the data loader, the model and the batch order are gradcomp's, so a run here and
`gradcomp train --simulate` with the same settings see the same batches.

    python scripts/reference_ef_random.py --scheme randomk --density 0.1 --lr 0.05 --momentum 0.9 --steps 300

Selection: random-k draws k positions without replacement (torch.randperm from a generator seeded by the
step), random-block a wrapping block of k coordinates at a uniformly drawn start. Values are not rescaled
(the biased variant that error feedback expects).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from gradcomp.experiments.run.data import load_dataset
from gradcomp.experiments.run.models import build_model
from gradcomp.experiments.run.runner import Batches, TrainConfig, evaluate


def select(scheme: str, d: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if scheme == "randomk":
        return torch.randperm(d, generator=gen)[:k]
    start = int(torch.randint(d, (1,), generator=gen))
    return (start + torch.arange(k)) % d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheme", choices=("randomk", "randomblock", "none"), default="randomk")
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--memory", choices=("on", "off"), default="on")
    p.add_argument("--granularity", choices=("layer", "model"), default="layer")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=468)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-every", type=int, default=25)
    p.add_argument("--sparse-tensors", default=None, metavar="I,J",
                   help="layer granularity: sparsify only these parameter tensors (0-based), send the rest dense")
    args = p.parse_args()
    torch.set_num_threads(1)

    cfg = TrainConfig(workers=args.workers, seed=args.seed, steps=args.steps)
    data = load_dataset("mnist")
    model = build_model("cnn", data, args.seed)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)
    batches = [Batches(data, cfg, w) for w in range(args.workers)]
    sizes = [q.numel() for q in params] if args.granularity == "layer" else [sum(q.numel() for q in params)]
    residual = [[torch.zeros(n) for n in sizes] for _ in range(args.workers)]
    gen = torch.Generator().manual_seed(1234 + args.seed)
    if args.sparse_tensors is None:
        sparse = set(range(len(sizes)))
    else:
        sparse = {int(i) for i in args.sparse_tensors.split(",")}
        print("sparsified:", ", ".join(n for i, (n, _) in enumerate(model.named_parameters()) if i in sparse))

    for step in range(args.steps):
        chosen = [select(args.scheme, n, max(1, math.ceil(args.density * n)), gen) if t in sparse else torch.arange(n)
                  for t, n in enumerate(sizes)]
        total = [torch.zeros(n) for n in sizes]
        losses = []
        for w in range(args.workers):
            xb, yb = batches[w].get(step, torch.device("cpu"))
            model.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            losses.append(loss.item())
            flat = torch.cat([q.grad.reshape(-1) for q in params]) / args.workers
            pieces = flat.split(sizes)
            for t, (g, idx) in enumerate(zip(pieces, chosen)):
                wanted = g + residual[w][t] if args.memory == "on" else g.clone()
                if args.scheme == "none":
                    total[t] += wanted
                    continue
                total[t][idx] += wanted[idx]
                if args.memory == "on":
                    wanted[idx] = 0.0
                    residual[w][t] = wanted
        flat_total = torch.cat(total)
        offset = 0
        for q in params:
            q.grad = flat_total[offset : offset + q.numel()].view_as(q).clone()
            offset += q.numel()
        opt.step()
        mean_loss = sum(losses) / len(losses)
        if step % args.print_every == 0 or step == args.steps - 1 or not math.isfinite(mean_loss):
            r = sum(float(r.norm()) ** 2 for rs in residual for r in rs) ** 0.5
            print(f"step {step:4d} loss {mean_loss:8.4f} |residual| {r:10.4f}", flush=True)
        if not math.isfinite(mean_loss):
            break
    print(f"test accuracy {100 * evaluate(model, data.test_x, data.test_y):.2f} %")


if __name__ == "__main__":
    main()
