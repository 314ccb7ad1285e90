"""Bytes per step of the methods that own several rounds, to compare one commit of gradcomp with another.

Simulated cluster of 4 workers, ``GradientAggregator``, the synthetic dataset's MLP (a slot per parameter
tensor), batch 16, 8 steps; for each method the bytes worker 0 sent up and received down at every step (the steps
differ where a method changes stage: LGC's dense, top-k and autoencoder steps). Written to run on old checkouts
too (the experiments package moved to sub-packages), so that the bytes of two commits can be set side by side:

    .venv/bin/python scripts/multiround_bytes.py                      # this checkout
    git worktree add /tmp/gc-old a703d48                              # another commit
    PYTHONPATH=/tmp/gc-old/src .venv/bin/python scripts/multiround_bytes.py

docs/architecture.md ("Bytes of the multi-round methods") holds the table of a703d48 against today's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gradcomp

try:
    from gradcomp.experiments.run.data import load_dataset, shard_indices
    from gradcomp.experiments.run.models import build_model
except ImportError:  # before the experiments package was split
    from gradcomp.experiments.data import load_dataset, shard_indices
    from gradcomp.experiments.models import build_model

# label, method, its parameters, topology
CASES = (
    ("sketch, ps, 2 rounds", "sketch", {"density": 0.05, "min_size": 100}, "ps"),
    ("sketch, ps, 1 round", "sketch", {"density": 0.05, "min_size": 100, "rounds": 1}, "ps"),
    ("sketch, allreduce", "sketch", {"density": 0.05, "min_size": 100}, "auto"),
    ("local_topk", "local_topk", {"density": 0.05, "min_size": 100}, "auto"),
    ("true_topk", "true_topk", {"density": 0.05, "min_size": 100}, "auto"),
    ("lgc, ring", "lgc", {"dense_steps": 2, "topk_steps": 2, "density": 0.05}, "auto"),
    ("lgc, ps", "lgc", {"variant": "ps", "dense_steps": 2, "topk_steps": 2, "density": 0.05}, "auto"),
    ("terngrad_shared", "terngrad_shared", {}, "auto"),
    ("powersgd", "powersgd", {}, "auto"),
)
STEPS = 8
WORLD = 4


def per_step_bytes(transport, name: str, params: dict, topology: str) -> list[tuple[int, int]]:
    torch.manual_seed(0)
    data = load_dataset("synthetic")
    model = build_model("mlp", data, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    aggregator = gradcomp.GradientAggregator(model, gradcomp.make(name, **params), transport, topology=topology)
    rows = shard_indices(data.num_train, transport.rank, transport.world_size, epoch=0, seed=0)
    steps = []
    for step in range(STEPS):
        up, down = transport.counter.bytes_up, transport.counter.bytes_down
        batch = rows[(step * 16) % (len(rows) - 16) :][:16]
        optimizer.zero_grad()
        F.cross_entropy(model(data.train_x[batch]), data.train_y[batch]).backward()
        aggregator.step()
        optimizer.step()
        steps.append((transport.counter.bytes_up - up, transport.counter.bytes_down - down))
    return steps


def main() -> None:
    torch.set_num_threads(1)
    print(f"gradcomp from {gradcomp.__file__}")
    print("| method | bytes up, down per step (worker 0), steps 1-8 |")
    print("|---|---|")
    for label, name, params, topology in CASES:
        with gradcomp.SimulatedCluster(WORLD, timeout=120) as cluster:
            steps = cluster.run(lambda t: per_step_bytes(t, name, params, topology))[0]
        shown = ", ".join(f"{u}/{d}" for u, d in steps)
        print(f"| {label} | {shown} |")


if __name__ == "__main__":
    main()
