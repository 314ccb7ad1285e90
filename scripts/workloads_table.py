"""The workloads tables: every method family on the Transformer (and the MNIST default job), 3 seeds each.

Runs one `gradcomp train` per (row, seed) — 4 gloo workers, equal steps (the model's defaults) — and appends
each result as one JSON line to OUT/results.jsonl as soon as it finishes, so an interrupted script keeps what
it has and a second start skips the (row, seed) pairs already there. Order: the fp32 reference for all seeds
first, then every row for seed 0, then seed 1, then seed 2, so that whatever finishes is the most useful part.
Then ``--render`` writes OUT/table.md (mean ± sample std over the seeds that finished, and the per-seed values).

    nice -n 10 python scripts/workloads_table.py --out runs/workloads            # run (resumes)
    python scripts/workloads_table.py --out runs/workloads --render               # the tables only

Methods that apply momentum themselves (DGC's momentum correction, sketched SGD, Signum) refuse AdamW (the
Transformer's optimizer), so on the Transformer they run with SGD + momentum 0.9 at ``SGD_LR`` (not tuned),
beside an fp32 reference with the same SGD; their rows say so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SEEDS = (0, 1, 2)
SGD_LR = "0.1"  # the Transformer with SGD + momentum 0.9, for the methods that own momentum (not tuned)

# (key, label, arguments): the best documented configuration of each family (docs/all_methods.md)
TRANSFORMER_ROWS = [
    ("fp32", "uncompressed fp32 allreduce (AdamW)", ["--compressor", "none"]),
    ("topk_ef", "top-k 1 %, error feedback", ["--compressor", "topk", "--param", "density=0.01", "--error-feedback"]),
    ("powersgd", "PowerSGD rank 2", ["--compressor", "powersgd", "--param", "rank=2"]),
    ("topk10_ef", "top-k 10 %, error feedback (how much of top-k's loss is its sparsity)",
     ["--compressor", "topk", "--param", "density=0.1", "--error-feedback"]),
    ("efsignsgd", "EF-signSGD (sign family without worker momentum)", ["--compressor", "efsignsgd"]),
    ("sbc", "SBC 1 %, 4 local steps", ["--compressor", "sbc", "--param", "density=0.01", "--local-steps", "4"]),
    ("sbc_nolocal", "SBC 1 %, no local steps (AdamW normalises the compressed gradient, as for top-k)",
     ["--compressor", "sbc", "--param", "density=0.01"]),
    ("localsgd", "local SGD (local AdamW), 16 local steps", ["--compressor", "none", "--local-steps", "16"]),
    ("randomk_ef", "random-k 1 %, error feedback", ["--compressor", "randomk", "--param", "density=0.01",
                                                    "--error-feedback"]),
    ("randomblock_ef", "random-block 1 %, error feedback", ["--compressor", "randomblock", "--param",
                                                            "density=0.01", "--error-feedback"]),
    ("cnat", "natural compression (C_nat)", ["--compressor", "cnat"]),
    ("qsgd", "QSGD", ["--compressor", "qsgd"]),
    ("natural_dithering", "natural dithering", ["--compressor", "natural_dithering"]),
    ("terngrad", "TernGrad", ["--compressor", "terngrad"]),
    ("lgc", "LGC ring, 20 dense + 100 top-k steps, 0.1 %", ["--compressor", "lgc", "--param", "dense_steps=20",
                                                            "--param", "topk_steps=100"]),
    ("fp32_sgd", f"uncompressed fp32 allreduce (SGD lr {SGD_LR}, momentum 0.9)",
     ["--compressor", "none", "--optimizer", "sgd", "--lr", SGD_LR]),
    ("topk_ef_sgd", f"top-k 1 %, error feedback (SGD lr {SGD_LR}, momentum 0.9)",
     ["--compressor", "topk", "--param", "density=0.01", "--error-feedback", "--optimizer", "sgd", "--lr", SGD_LR]),
    ("dgc", f"DGC 0.1 %, clipping 0.5 (SGD lr {SGD_LR})", ["--compressor", "dgc", "--param", "clip=0.5",
                                                           "--optimizer", "sgd", "--lr", SGD_LR]),
    ("signum", "Signum, majority vote (SGD lr 1e-3)", ["--compressor", "signum", "--optimizer", "sgd", "--lr",
                                                        "0.001"]),
    ("sketch", f"sketched SGD, x4 setting (SGD lr {SGD_LR})",
     ["--compressor", "sketch", "--param", "density=0.01", "--param", "rows=1", "--param", "cols_per_k=18",
      "--param", "candidates=4", "--optimizer", "sgd", "--lr", SGD_LR]),
]
# the Transformer at 1,000 steps under AdamW: the methods built for Adam (1-bit Adam, 0/1 Adam, DiLoCo's outer
# Nesterov step) beside the best gradient compressors with a dense warm-up and the fp32 / fp16 references
ADAM_BASE = ["--model", "transformer", "--steps", "1000", "--eval-every", "100"]
ADAM_ROWS = [
    ("a_fp32", "uncompressed fp32 allreduce (AdamW)", ["--compressor", "none"]),
    ("a_onebit_adam", "1-bit Adam, freeze step 150", ["--optimizer", "onebit_adam"]),
    ("a_onebit_adam_f25", "1-bit Adam, freeze step 25 (≥ 16x overall)", ["--optimizer", "onebit_adam",
                                                                         "--freeze-step", "25"]),
    ("a_onebit_adam_cnat100", "1-bit Adam, freeze step 100, C_nat warm-up sharded both ways (≥ 16x overall)",
     ["--optimizer", "onebit_adam", "--freeze-step", "100", "--warmup-compressor", "cnat"]),
    # the same before the warm-up's C_nat went sharded both ways (it was all-gathered: W - 1 messages down); the
    # command no longer runs it, its result is kept
    ("a_onebit_adam_cnat100_gathered", "1-bit Adam, freeze step 100, C_nat warm-up all-gathered (down: 3 messages "
     "of 9 bits)", ["--optimizer", "onebit_adam", "--freeze-step", "100", "--warmup-compressor", "cnat"]),
    ("a_diloco32", "DiLoCo H=32, outer Nesterov 0.7 / 0.9, fp32 pseudo-gradients",
     ["--compressor", "none", "--local-steps", "32", "--outer-optimizer", "nesterov"]),
    ("a_diloco8", "DiLoCo H=8, outer Nesterov 0.7 / 0.9, fp32 pseudo-gradients",
     ["--compressor", "none", "--local-steps", "8", "--outer-optimizer", "nesterov"]),
    ("a_cnat", "natural compression (C_nat)", ["--compressor", "cnat"]),
    ("a_cnat_sharded", "natural compression (C_nat), sharded both ways (server C_nat)",
     ["--compressor", "cnat", "--topology", "sharded", "--server-compressor", "cnat"]),
    ("a_fp16", "fp16", ["--compressor", "fp16"]),
    ("a_zero_one_adam", "0/1 Adam", ["--optimizer", "zero_one_adam"]),
    ("a_zero_one_adam_dense52", "0/1 Adam, the variance stage dense (52 steps, then frozen; no 1-bit gradient steps)",
     ["--optimizer", "zero_one_adam", "--freeze-step", "52", "--var-update-scaler", "1000"]),
    ("a_zero_one_adam_cnat100", "0/1 Adam, variance stage = 1-bit Adam's warm-up (100 C_nat steps), then local steps",
     ["--optimizer", "zero_one_adam", "--freeze-step", "100", "--var-update-scaler", "1000", "--warmup-compressor",
      "cnat"]),
    ("a_zero_one_adam_cnat100_h4", "0/1 Adam as above, at most 4 local steps between syncs",
     ["--optimizer", "zero_one_adam", "--freeze-step", "100", "--var-update-scaler", "1000", "--warmup-compressor",
      "cnat", "--local-step-clipper", "4"]),
    ("a_zero_one_adam_cnat100_h2", "0/1 Adam as above, at most 2 local steps between syncs",
     ["--optimizer", "zero_one_adam", "--freeze-step", "100", "--var-update-scaler", "1000", "--warmup-compressor",
      "cnat", "--local-step-clipper", "2"]),
    ("a_onebit_adam_cnat50", "1-bit Adam, freeze step 50, C_nat warm-up sharded both ways",
     ["--optimizer", "onebit_adam", "--freeze-step", "50", "--warmup-compressor", "cnat"]),
    ("a_diloco32_4bit", "DiLoCo H=32, outer Nesterov, 4-bit pseudo-gradients (random dithering, 7 levels)",
     ["--compressor", "random_dithering", "--param", "levels=7", "--local-steps", "32", "--outer-optimizer",
      "nesterov"]),
    ("a_diloco8_4bit", "DiLoCo H=8, outer Nesterov, 4-bit pseudo-gradients (random dithering, 7 levels)",
     ["--compressor", "random_dithering", "--param", "levels=7", "--local-steps", "8", "--outer-optimizer",
      "nesterov"]),
    ("a_localsgd16", "local AdamW, 16 local steps, plain averaging", ["--compressor", "none", "--local-steps", "16"]),
    ("a_powersgd_dense", "PowerSGD rank 2, 100 dense steps", ["--compressor", "powersgd", "--param", "rank=2",
                                                              "--dense-steps", "100"]),
    ("a_topk_ef_dense", "top-k 1 %, error feedback, 100 dense steps",
     ["--compressor", "topk", "--param", "density=0.01", "--error-feedback", "--dense-steps", "100"]),
    ("a_sbc", "SBC 1 %, 4 local steps", ["--compressor", "sbc", "--param", "density=0.01", "--local-steps", "4"]),
]
# the fair-lr grid of the 1,000-step table: every row again at these multiples of AdamW's default lr (2e-3)
LR_GRID = (0.5, 2.0, 4.0)
ADAM_LR = 2e-3


def grid_rows(rows: list) -> list:
    """Each row at the grid's other learning rates (keys KEY@xM), for --lr-grid."""
    return [(f"{key}@x{m:g}", f"{label} (lr x{m:g})", [*args, "--lr", repr(ADAM_LR * m)])
            for key, label, args in rows for m in LR_GRID]


# the MNIST default job (SmallCNN, one epoch, SGD 0.05 / 0.9): the rows of docs/all_methods.md's head
MNIST_ROWS = [
    ("mnist_fp32", "uncompressed fp32 allreduce", ["--compressor", "none"]),
    ("mnist_topk_ef", "top-k 1 %, error feedback", ["--compressor", "topk", "--param", "density=0.01",
                                                    "--error-feedback"]),
    ("mnist_sbc", "SBC 1 %, 4 local steps", ["--compressor", "sbc", "--param", "density=0.01", "--local-steps", "4"]),
    ("mnist_powersgd", "PowerSGD rank 2", ["--compressor", "powersgd", "--param", "rank=2"]),
    ("mnist_signum", "Signum, majority vote, lr 1e-3", ["--compressor", "signum", "--lr", "0.001"]),
    ("mnist_dgc", "DGC 0.1 %, local clipping 0.5", ["--compressor", "dgc", "--param", "clip=0.5"]),
    ("mnist_qsgd", "QSGD", ["--compressor", "qsgd"]),
    ("mnist_localsgd", "local SGD, 16 local steps", ["--compressor", "none", "--local-steps", "16"]),
]


def plan(lr_grid: bool = True) -> list[tuple[str, str, list[str], int, str]]:
    jobs = []
    adam = ADAM_ROWS + (grid_rows(ADAM_ROWS) if lr_grid else [])
    for table, rows, base in (("transformer", TRANSFORMER_ROWS, ["--model", "transformer", "--eval-every", "50"]),
                              ("mnist", MNIST_ROWS, []), ("adam1000", adam, ADAM_BASE)):
        ref, rest = rows[0], rows[1:]
        jobs += [(table, ref[0], ref[1], base + ref[2], s) for s in SEEDS]
        for seed in SEEDS:
            jobs += [(table, key, label, base + args, seed) for key, label, args in rest]
    return [(t, k, label, args, s) for t, k, label, args, s in jobs]


def read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(out: str, python: str, only: str | None, keys: list[str] | None = None,
        seeds: list[int] | None = None) -> None:
    path = os.path.join(out, "results.jsonl")
    done = {(r["key"], r["seed"]) for r in read(path)}
    jobs = plan(lr_grid=bool(keys) and any("@" in k for k in keys))
    if keys:  # these rows only, in the order given, every seed of one row before the next row
        jobs = sorted((j for j in jobs if j[1] in keys), key=lambda j: (keys.index(j[1]), j[4]))
    for table, key, label, args, seed in jobs:
        if (key, seed) in done or (only and table != only) or (seeds is not None and seed not in seeds):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "result.json")
            cmd = [python, "-m", "gradcomp.cli", "train", "--no-progress", "--seed", str(seed), "--json", result,
                   *args]
            print(f"workloads_table: {table} {key} seed {seed}: {' '.join(cmd[2:])}", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            row = {"table": table, "key": key, "label": label, "seed": seed, "command": " ".join(cmd[3:]),
                   "returncode": proc.returncode}
            if proc.returncode == 0:
                with open(result) as f:
                    row["result"] = json.load(f)
            else:
                row["error"] = (proc.stderr or proc.stdout)[-2000:]
            print(f"  -> rc {proc.returncode}", flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        render(out)


def _ms(values: list[float], signed: bool = False) -> str:
    n = len(values)
    mean = sum(values) / n
    number = f"{mean:+.3f}" if signed else f"{mean:.4g}"
    if n == 1:
        return f"{number} (1 seed)"
    std = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    return f"{number} ± {std:.2g}"


def render(out: str) -> str:
    rows = read(os.path.join(out, "results.jsonl"))
    text = []
    ran = {r["key"] for r in rows}
    adam = ADAM_ROWS + [row for row in grid_rows(ADAM_ROWS) if row[0] in ran]  # grid rows that ran
    for table, spec in (("transformer", TRANSFORMER_ROWS), ("mnist", MNIST_ROWS), ("adam1000", adam)):
        text_model = table != "mnist"
        metric = "val_bits_per_byte" if text_model else "test_accuracy"
        name = "validation bits/byte" if text_model else "test accuracy %"
        scale = 1 if text_model else 100
        ref = [r for r in rows if r["key"] == spec[0][0] and "result" in r]
        dense = ref[0]["result"]["dense_bits_per_worker"] if ref else None
        text += [f"### {table}", "",
                 f"| method | seeds finished | {name}: mean ± std | per seed | − its fp32 reference, same seed: "
                 "mean ± std | Mbit up / worker | Mbit down / worker | × fewer up / down than fp32 |",
                 "|---|---|---|---|---|---|---|---|"]
        for key, label, args in spec:
            # the reference trained with the same optimizer: fp32 SGD for the rows that refuse AdamW
            ref_key = "fp32_sgd" if table == "transformer" and "sgd" in args else spec[0][0]
            reference = {r["seed"]: scale * r["result"][metric] for r in rows if r["key"] == ref_key and "result" in r}
            got = sorted((r for r in rows if r["key"] == key), key=lambda r: r["seed"])
            ok = [r for r in got if "result" in r]
            if not got:
                text.append(f"| {label} | 0 (not run) | – | – | – | – | – | – |")
                continue
            if not ok:
                text.append(f"| {label} | 0 (failed: {got[0]['error'].strip().splitlines()[-1][:80]}) "
                            "| – | – | – | – | – | – |")
                continue
            paired = [scale * r["result"][metric] - reference[r["seed"]] for r in ok if r["seed"] in reference]
            diff = "–" if key == ref_key or not paired else _ms(paired, signed=True)
            values = [scale * r["result"][metric] for r in ok]
            up = ok[0]["result"]["bits_up_per_worker"]
            down = ok[0]["result"]["bits_down_per_worker"]
            ratio = f"{dense / up:.1f} / {dense / down:.1f}" if dense and up and down else "–"
            per = ", ".join(f"s{r['seed']}: {scale * r['result'][metric]:.4g}" for r in ok)
            text.append(f"| {label} | {len(ok)} | {_ms(values)} | {per} | {diff} | {up / 1e6:,.1f} | {down / 1e6:,.1f} "
                        f"| {ratio} |")
        text.append("")
        if text_model:
            done = [r for key, _, _ in spec for r in sorted((r for r in rows if r["key"] == key and "result" in r),
                                                             key=lambda r: r["seed"])]
            steps = [s for s, _ in done[0]["result"].get("val_loss_curve") or []] if done else []
            if steps:
                text += [f"Validation bits per byte at steps {', '.join(map(str, steps))}, every finished run:", "",
                         "| row | seed | " + " | ".join(map(str, steps)) + " |", "|---|---|" + "---|" * len(steps)]
                for r in done:
                    curve = dict((s, v) for s, v in r["result"].get("val_loss_curve") or [])
                    text.append(f"| {r['key']} | {r['seed']} | "
                                + " | ".join(f"{curve[s]:.3f}" if s in curve else "–" for s in steps) + " |")
                text.append("")
    body = "\n".join(text)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(body)
    return body


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/workloads")
    p.add_argument("--render", action="store_true", help="only write OUT/table.md from the results so far")
    p.add_argument("--only", choices=["transformer", "mnist", "adam1000"], default=None)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--docs", default=None, metavar="MD", help="also replace the Transformer block between the "
                   "'<!-- transformer table' and '<!-- /transformer table -->' lines of this page")
    p.add_argument("--keys", default=None, help="comma-separated row keys to run, in this order (e.g. fp32,topk_ef; "
                   "the lr grid's rows are KEY@xM, e.g. a_onebit_adam@x2)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds to run (default: all three)")
    args = p.parse_args()
    keys = [k.strip() for k in args.keys.split(",")] if args.keys else None
    known = {j[1] for j in plan()}
    if keys and set(keys) - known:
        p.error(f"unknown row keys {sorted(set(keys) - known)}; known: {sorted(known)}")
    os.makedirs(args.out, exist_ok=True)
    if not args.render:
        run(args.out, args.python, args.only, keys, [int(x) for x in args.seeds.split(",")] if args.seeds else None)
    body = render(args.out)
    if args.docs:
        update_docs(args.docs, body)
    print(body)
    return 0


def update_docs(path: str, body: str) -> None:
    block = body.split("### transformer", 1)[1].split("### mnist", 1)[0].strip()
    with open(path) as f:
        page = f.read()
    start = page.index("<!-- transformer table")
    start = page.index("\n", start) + 1
    end = page.index("<!-- /transformer table -->")
    with open(path, "w") as f:
        f.write(page[:start] + block + "\n" + page[end:])


if __name__ == "__main__":
    sys.exit(main())
