"""How fast the simulated cluster compresses, relative to the workers' own forward and backward passes.

For each method, ``gradcomp train --simulate`` runs W workers (default 64) for a few steps of the default job
(SmallCNN, ``--model cnn``, on MNIST, batch 32) and reports, averaged over the workers:

- ``compute_s``: forward + backward + optimizer step (the runner's training clock),
- ``compress_s``: everything the exchange does outside collectives (compress, encode, decode, decompress,
  aggregate), as each worker is charged for it — with all-gather methods every worker decodes W messages,
- ``simulated compress_s``: the part of it the simulation really spent: the cluster decodes and adds up an
  all-gather's W messages once for all workers (``transport.sim.computed_once``) and charges each worker the
  time, so this is compress_s minus the charged time,
- the ratio simulated compress / compute (the target is <= 2), and the run's wall time.

Timings depend on the machine and on what else runs on it: say so when you quote them (the figures in
docs/plan.md were taken on a shared, loaded 2-core machine).

    PYTHONPATH=src python benchmarks/sim_speed.py --workers 64 --steps 3 [--methods topk:density=0.001 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from gradcomp.experiments.run.data import load_dataset
from gradcomp.experiments.run.runner import TrainConfig, run_worker, worker_threads
from gradcomp.registry import parse_param_strings
from gradcomp.transport.sim import SimulatedCluster

METHODS = ("topk:density=0.001", "topk:density=0.01", "qsgd", "signsgd", "powersgd:rank=2", "none")


def parse(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    return name, parse_param_strings([p for p in rest.split(",") if p]) if rest else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="cnn")
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    print(f"{'method':24} {'compute s':>10} {'compress s':>11} {'simulated':>10} {'ratio':>7} {'wall s':>8}   "
          f"(per worker, {args.steps} steps, W={args.workers}, load {os.getloadavg()[0]:.1f})")
    for text in args.methods:
        name, params = parse(text)
        cfg = TrainConfig(compressor=name, params=params, workers=args.workers, steps=args.steps, model=args.model,
                          dataset=args.dataset, simulate=True, progress=False)
        load_dataset(cfg.dataset)
        threads = torch.get_num_threads()
        torch.set_num_threads(worker_threads(cfg.workers))  # as run_simulated does
        started = time.perf_counter()
        try:
            with SimulatedCluster(cfg.workers) as cluster:
                stats = cluster.run(lambda t: run_worker(cfg, t, torch.device("cpu")))
        finally:
            torch.set_num_threads(threads)
        wall = time.perf_counter() - started
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        compute = mean([s["compute_s"] for s in stats])
        compress = mean([s["compress_s"] for s in stats])
        simulated = compress - mean([t.charged_s for t in cluster.transports])
        ratio = simulated / compute
        rows.append({"method": text, "workers": args.workers, "steps": args.steps, "compute_s": compute,
                     "compress_s": compress, "simulated_compress_s": simulated, "ratio": ratio, "wall_s": wall,
                     "loadavg": os.getloadavg()[0], "digest": stats[0]["digest"]})
        print(f"{text:24} {compute:10.3f} {compress:11.3f} {simulated:10.3f} {ratio:7.2f} {wall:8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
