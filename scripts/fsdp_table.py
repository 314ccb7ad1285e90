"""The FSDP table of docs/fsdp.md: FSDP2 on gloo with FSDP's own reduce-scatter and with gradcomp's
compressed one, per method and seed: bytes per step, final test accuracy, median step time, residual bytes.

    python scripts/fsdp_table.py --workers 2 --steps 300 --seeds 0,1,2 --out runs/fsdp.jsonl

Every (method, seed) is one run of ``run_fsdp_worker`` (the loop of ``gradcomp train --fsdp``) in W gloo
processes started once per seed; the baseline ``fsdp`` is the same loop without ``compress_fsdp``. One JSON
line per run is appended to ``--out`` (a finished run is skipped when the script is started again); the
markdown table is printed at the end.

Step time, paired and interleaved (``--rounds R``): every seed runs the methods R times in the same W processes,
in the given order on even rounds and reversed on odd ones, so that no method always runs first (the first run of
a process pays for warm-up) or always last; each method's step is divided by FSDP's own in the same round, and
the table gives the median of those ratios and their range:

    python scripts/fsdp_table.py --steps 60 --seeds 300 --rounds 4 --out runs/fsdp_timing.jsonl \
        --methods "fsdp,none,cnat,topk 0.01 + EF,efsignsgd lr 0.4 m 0"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.multiprocessing as mp

from gradcomp.experiments.run.launch import join_group, rendezvous_store
from gradcomp.experiments.run.runner import TrainConfig

METHODS = {  # name: (compressor, params, error feedback, lr[, momentum]); lr 0.05, momentum 0.9 = the default job's
    "fsdp": (None, {}, None, 0.05),
    "none": ("none", {}, None, 0.05),
    "fp16": ("fp16", {}, None, 0.05),
    "bf16": ("bf16", {}, None, 0.05),
    "cnat": ("cnat", {}, None, 0.05),
    "qsgd": ("qsgd", {}, None, 0.05),
    "natural_dithering": ("natural_dithering", {}, None, 0.05),
    "efsignsgd": ("efsignsgd", {}, None, 0.05),
    "onebit": ("onebit", {}, None, 0.05),
    "topk 0.01 + EF": ("topk", {"density": 0.01}, True, 0.05),
    # the sign family's settings of docs/methods/sign.md (at lr 0.05 with momentum 0.9 both diverge, as without FSDP)
    "efsignsgd lr 0.4 m 0": ("efsignsgd", {}, None, 0.4, 0.0),
    "onebit lr 0.4 m 0": ("onebit", {}, None, 0.4, 0.0),
}


def _worker(rank: int, world: int, port: int, jobs: list, out: str) -> None:
    torch.set_num_threads(1)
    join_group("gloo", port, rank, world, timeout_s=300)
    from gradcomp.experiments.run.fsdp_run import run_fsdp_worker
    from gradcomp.transport.dist import DistTransport

    transport = DistTransport()
    for label, cfg, round_ in jobs:
        stats = run_fsdp_worker(cfg, transport, torch.device("cpu"), compress=METHODS[label][0] is not None)
        if rank == 0:
            counter = stats["counter"]
            row = {
                "method": label, "seed": cfg.seed, "round": round_, "workers": world, "steps": stats["steps"],
                "accuracy": stats["test_accuracy"], "median_step_s": stats["median_step_s"],
                "bytes_up_per_step": (counter["up_payload"] + counter["up_control"]) / stats["steps"],
                "bytes_down_per_step": (counter["down_payload"] + counter["down_control"]) / stats["steps"],
                "padding_per_step": (counter["up_padding"] + counter["down_padding"]) / stats["steps"],
                "residual_bytes": stats["fsdp_residual_bytes"],
                "parameters": stats["num_parameters"],
            }
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated labels of METHODS")
    ap.add_argument("--out", default="runs/fsdp.jsonl")
    ap.add_argument("--rounds", type=int, default=1, help="run the methods this many times per seed, the order "
                    "reversed every other round (paired step-time ratios to fsdp)")
    args = ap.parse_args()
    methods = args.methods.split(",")
    done = set()
    if os.path.exists(args.out):
        with open(args.out) as f:
            done = {(r["method"], r["seed"], r.get("round", 0)) for r in map(json.loads, f)}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for seed in (int(s) for s in args.seeds.split(",")):
        jobs = []
        for round_, label in ((r, m) for r in range(args.rounds) for m in (methods if r % 2 == 0 else methods[::-1])):
            if (label, seed, round_) in done:
                continue
            name, params, ef, lr, *rest = METHODS[label]
            momentum = rest[0] if rest else 0.9
            cfg = TrainConfig(compressor=name or "none", params=dict(params), error_feedback=ef, lr=lr, seed=seed,
                              momentum=momentum,
                              workers=args.workers, steps=args.steps, progress=False, fsdp=True)
            jobs.append((label, cfg, round_))
        if not jobs:
            continue
        store = rendezvous_store(args.workers, timeout_s=300)
        mp.start_processes(_worker, args=(args.workers, store.port, jobs, args.out), nprocs=args.workers,
                           start_method="spawn")
    with open(args.out) as f:
        rows = [json.loads(line) for line in f]
    base = [r["median_step_s"] for r in rows if r["method"] == "fsdp"]
    print("| method | up / step (KiB) | down / step (KiB) | residual (KiB) | test acc. (per seed) | mean ± std | "
          "median step (ms) | × FSDP's |")
    print("|---|---|---|---|---|---|---|---|")
    for label in methods:
        mine = sorted((r for r in rows if r["method"] == label), key=lambda r: r["seed"])
        if not mine:
            continue
        acc = [100 * r["accuracy"] for r in mine]
        spread = f"{statistics.mean(acc):.2f} ± {statistics.stdev(acc):.2f}" if len(acc) > 1 else f"{acc[0]:.2f}"
        step = statistics.median(r["median_step_s"] for r in mine)
        versus = f"{step / statistics.median(base):.2f}" if base else "–"
        up = statistics.mean(r["bytes_up_per_step"] for r in mine) / 1024
        down = statistics.mean(r["bytes_down_per_step"] for r in mine) / 1024
        print(f"| {label} | {up:.1f} | {down:.1f} | {mine[0]['residual_bytes'] / 1024:.1f} | "
              f"{', '.join(f'{a:.2f}' for a in acc)} | {spread} | {1000 * step:.1f} | {versus} |")
    fsdp = {(r["seed"], r.get("round", 0)): r["median_step_s"] for r in rows if r["method"] == "fsdp"}
    if args.rounds > 1 and fsdp:
        print("\n| method | step ÷ FSDP's in the same round: median | min – max | rounds |\n|---|---|---|---|")
        for label in methods:
            ratios = sorted(r["median_step_s"] / fsdp[(r["seed"], r.get("round", 0))] for r in rows
                            if r["method"] == label and (r["seed"], r.get("round", 0)) in fsdp)
            if ratios:
                print(f"| {label} | {statistics.median(ratios):.2f} | {ratios[0]:.2f} – {ratios[-1]:.2f} "
                      f"| {len(ratios)} |")


if __name__ == "__main__":
    main()
