"""What the ranks' agreement on refused messages costs a step: with it, and without it, in the same run.

    PYTHONPATH=src python benchmarks/refusal_agreement.py                        # 2 gloo ranks, top-k 1 %
    PYTHONPATH=src python benchmarks/refusal_agreement.py --workers 4 --method signum --steps 200

Every step of a method whose messages are containers ends with one all-reduce of a 4-byte flag, "I refused a
message" (``train.agreement.settle``; docs/wire.md, "A message refused on one rank"). This times
iterations of a loop that draws SmallCNN's gradients (about 0.2M parameters, random normal: a stand-in for
backward, about a millisecond) and calls ``GradientAggregator.step()``, on gloo over 127.0.0.1 (a whole iteration:
the agreement makes the ranks wait for each other at the step's end, which without it they do at the next step's
first collective, so timing ``step()`` alone would charge it for a wait that moved), in blocks of ``--block`` steps that alternate between the agreement as shipped
and the agreement switched off (the step's count of container messages held at zero, so ``settle`` sends
nothing), and reports the median step of each and their ratio, per rank. Switched off, a corrupted message
leaves the other ranks behind, as before 2026-11-28: only for this measurement.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

import gradcomp
from gradcomp.experiments.run.launch import join_group, rendezvous_store
from gradcomp.experiments.run.models import SmallCNN
from gradcomp.train import aggregator as aggregator_module
from gradcomp.wire.refusals import Refusals


class _Unagreed(Refusals):
    """Refusals whose count of container messages stays zero: ``settle`` then sends no flag."""

    used = property(lambda self: 0, lambda self, value: None)


def _worker(rank: int, args, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    join_group("gloo", port, rank, args.workers, timeout_s=60)
    model = SmallCNN()
    params = {"density": 0.01} if args.method == "topk" else {}
    aggregator = gradcomp.GradientAggregator(model, gradcomp.make(args.method, **params))
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {"with": [], "without": []}
    for block in range(2 * args.blocks + 1):
        mode = "with" if block % 2 else "without"
        aggregator_module.Refusals = Refusals if mode == "with" else _Unagreed
        for _ in range(args.block):
            started = time.perf_counter()
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            aggregator.step()
            if block:  # (the first block warms up)
                times[mode].append(time.perf_counter() - started)
    aggregator_module.Refusals = Refusals
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump({mode: statistics.median(t) for mode, t in times.items()} | {
            "control_bytes_up": aggregator.transport.counter.up_control}, f)
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--method", default="topk")
    parser.add_argument("--blocks", type=int, default=10, help="blocks of each kind, alternating")
    parser.add_argument("--block", type=int, default=20, help="steps per block")
    args = parser.parse_args()
    store = rendezvous_store(args.workers, timeout_s=60)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(args, store.port, out_dir), nprocs=args.workers, start_method="spawn")
        results = []
        for rank in range(args.workers):
            with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    steps = args.blocks * args.block
    print(f"{args.workers} gloo ranks on 127.0.0.1, {args.method}, SmallCNN's gradients, {steps} steps of each kind "
          f"in alternating blocks of {args.block}, torch {torch.__version__}, one thread per rank")
    print("rank  median iteration, with the agreement  without  ratio")
    for rank, r in enumerate(results):
        print(f"{rank:>4}  {1e3 * r['with']:>32.3f} ms  {1e3 * r['without']:>6.3f} ms  {r['with'] / r['without']:.3f}")
    print(f"control bytes sent by rank 0 in all: {results[0]['control_bytes_up']}")


if __name__ == "__main__":
    main()
