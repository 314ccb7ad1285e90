"""Bytes per worker per step of allgather, a single-root parameter server and the sharded topology, W = 4..64.

Simulated cluster; every worker's gradient is the real gradient of the MNIST SmallCNN (215,370 parameters,
one slot per parameter tensor, at its initial weights) on its own batch of 32 training images, a fresh batch
each step. For each compressor the ``ps`` and ``sharded`` runs use the same server compressor; ``allgather``
has none. Prints a markdown table: mean over workers and steps of what a worker hands the transport (payload
+ size exchanges, padding apart, transport.base rules), and for ``ps`` what the root's server role receives
and sends (``server_in`` / ``server_out``), the bottleneck that ``sharded`` spreads over all workers:

    .venv/bin/python scripts/sharded_bytes.py                 # W = 4, 16, 64; 3 steps
    .venv/bin/python scripts/sharded_bytes.py --workers 4 16 --steps 2
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import gradcomp
from gradcomp import GradientExchange, SimulatedCluster
from gradcomp.experiments.run.data import load_dataset
from gradcomp.experiments.run.models import build_model
from gradcomp.train.aggregator import GradientAggregator

METHODS = {
    # label: (worker compressor, server compressor for ps and sharded)
    "cnat": (lambda: gradcomp.make("cnat"), lambda: gradcomp.make("cnat")),
    "topk 0.01 + EF": (
        lambda: gradcomp.make("topk", density=0.01, error_feedback=True),
        lambda: gradcomp.make("topk", density=0.01, error_feedback=True),
    ),
}
TOPOLOGIES = ("allgather", "ps", "sharded")


def gradients(world: int, steps: int, batch: int = 32, seed: int = 0):
    """gradients[step][rank]: the CNN's gradient (list of tensors) on a distinct batch; and the slots."""
    data = load_dataset("mnist")
    model = build_model("cnn", data, seed)
    named = list(model.named_parameters())
    slots = GradientAggregator.slots_for(named, "layer")
    order = torch.randperm(data.num_train, generator=torch.Generator().manual_seed(seed))
    out = []
    for step in range(steps):
        per_worker = []
        for rank in range(world):
            start = (step * world + rank) * batch
            idx = order[start : start + batch]
            model.zero_grad()
            F.cross_entropy(model(data.train_x[idx]), data.train_y[idx]).backward()
            per_worker.append([p.grad.detach().clone().reshape(-1) for _, p in named])
        out.append(per_worker)
    return slots, out


def measure(world: int, topology: str, method: str, slots, grads) -> dict:
    make, make_server = METHODS[method]
    steps = len(grads)

    def fn(t):
        ex = GradientExchange(
            make(), t, topology=topology, server_compressor=make_server() if topology != "allgather" else None
        )
        for step in range(steps):
            ex.exchange(slots, grads[step][t.rank], step)
        return t.counter.snapshot()

    with SimulatedCluster(world, timeout=600.0) as cluster:
        counters = cluster.run(fn)
    per = world * steps
    return {
        "up": sum(c.bytes_up for c in counters) / per,
        "down": sum(c.bytes_down for c in counters) / per,
        "padding": sum(c.padding_bytes for c in counters) / per,
        "server_in": sum(c.server_in for c in counters) / steps,
        "server_out": sum(c.server_out for c in counters) / steps,
    }


def kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for world in args.workers:
        slots, grads = gradients(world, args.steps)
        fp32 = 4 * sum(s.numel for s in slots)
        for method in METHODS:
            for topology in TOPOLOGIES:
                m = measure(world, topology, method, slots, grads)
                server = f"{kib(m['server_in'])} / {kib(m['server_out'])}" if topology == "ps" else "–"
                rows.append(
                    f"| {world} | {method} | {topology} | {kib(m['up'])} | {kib(m['down'])} | "
                    f"{fp32 / m['up']:.1f} | {fp32 / m['down']:.1f} | {kib(m['padding'])} | {server} |"
                )
    print(f"SmallCNN, {sum(s.numel for s in slots):,} parameters in {len(slots)} slots; fp32 = {kib(fp32)} KiB; "
          f"mean over workers and {args.steps} steps; KiB = 1024 bytes\n")
    print("| W | method | topology | up / worker (KiB) | down / worker (KiB) | × fewer up | × fewer down | "
          "padding (KiB) | ps root server in / out (KiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
