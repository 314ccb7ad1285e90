"""One table of every method gradcomp has, on the same model and budget (docs/all_methods.md).

Each row is one `gradcomp train` run of the default job (MNIST, SmallCNN, 4 gloo workers, batch 32 per
worker, SGD lr 0.05 momentum 0.9 unless the method owns its momentum, one epoch) with `--bandwidth 1Gbit`,
so the run also prices its measured collectives with the latency-bandwidth model (ring allreduce, 50 µs
latency). A run whose JSON exists in the output folder is not run again.

    python scripts/all_methods.py                   # runs what is missing, then writes docs/all_methods.md
    python scripts/all_methods.py --table-only      # rebuild the table from runs/all/*.json
    python scripts/all_methods.py --only topk,dgc   # a subset of the rows
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

# (row name, what it is, gradcomp train arguments)
ROWS: list[tuple[str, str, str]] = [
    ("fp32", "uncompressed fp32 allreduce", "--compressor none"),
    ("fp16", "fp16 casting", "--compressor fp16"),
    ("bf16", "bf16 casting", "--compressor bf16"),
    ("fedavg16", "federated averaging / local SGD, 16 local steps", "--compressor none --local-steps 16"),
    ("topk", "top-k 1 %, error feedback", "--compressor topk --param density=0.01 --error-feedback"),
    ("topk_masking", "top-k 1 %, momentum masking",
     "--compressor topk --param density=0.01 --feedback momentum_masking"),
    ("randomk", "random-k 1 %, no memory", "--compressor randomk --param density=0.01"),
    ("randomblock", "random-block 1 %, no memory", "--compressor randomblock --param density=0.01"),
    ("threshold", "threshold 1e-3, error feedback", "--compressor threshold --error-feedback"),
    ("sbc", "SBC 1 %, 4 local steps", "--compressor sbc --param density=0.01 --local-steps 4"),
    ("stc", "STC 1 %", "--compressor stc --param density=0.01"),
    ("cnat", "natural compression", "--compressor cnat"),
    ("natural_dithering", "natural dithering", "--compressor natural_dithering"),
    ("random_dithering", "random (standard) dithering", "--compressor random_dithering"),
    ("qsgd", "QSGD", "--compressor qsgd"),
    ("qsgd_elias", "QSGD, Elias-coded levels", "--compressor qsgd --param coding=elias"),
    ("terngrad", "TernGrad", "--compressor terngrad"),
    ("terngrad_shared", "TernGrad, shared scaler (max-allreduce first)", "--compressor terngrad_shared"),
    (
        "terngrad_shared_int8",
        "TernGrad, shared scaler, int8 sums allreduced",
        "--compressor terngrad_shared --param exchange=allreduce",
    ),
    ("signsgd", "signSGD, majority vote, lr 1e-3", "--compressor signsgd --lr 0.001 --momentum 0"),
    ("signum", "Signum, majority vote, lr 1e-3", "--compressor signum --lr 0.001"),
    ("efsignsgd", "EF-signSGD, lr 0.4", "--compressor efsignsgd --lr 0.4 --momentum 0"),
    ("onebit", "1-bit SGD, lr 0.4", "--compressor onebit --lr 0.4 --momentum 0"),
    ("powersgd", "PowerSGD rank 2", "--compressor powersgd --param rank=2"),
    ("dgc", "DGC 0.1 %, local clipping 0.5", "--compressor dgc --param clip=0.5"),
    ("sketch_x4", "sketched SGD, x4 setting",
     "--compressor sketch --param density=0.01 --param rows=1 --param cols_per_k=18 --param candidates=4"),
    (
        "lgc_ring",
        "LGC ring, 20 dense + 100 top-k steps, 0.1 %",
        "--compressor lgc --param dense_steps=20 --param topk_steps=100",
    ),
    (
        "lgc_ps",
        "LGC parameter server, 20 dense + 100 top-k steps, 0.1 %",
        "--compressor lgc --param variant=ps --param dense_steps=20 --param topk_steps=100",
    ),
    ("local_topk", "local top-k 1 % (sketched SGD's baseline)", "--compressor local_topk --param density=0.01"),
    ("true_topk", "true top-k 1 % (oracle: dense allreduce)", "--compressor true_topk --param density=0.01"),
]


def run(name: str, args: str, out: Path) -> None:
    path = out / f"{name}.json"
    if path.exists():
        return
    command = ["gradcomp", "train", "--no-progress", "--allow-untrained-defaults", "--bandwidth", "1Gbit", "--json",
               str(path), *shlex.split(args)]
    print("$", " ".join(command), file=sys.stderr, flush=True)
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)


def table(out: Path) -> str:
    lines = [
        "| method | test acc. | bits up / worker | bits down / worker | × fewer up / down | compute / compress / "
        "communicate s | modelled comm. at 1 Gbit/s (s) | "
        "command (`gradcomp train --no-progress --bandwidth 1Gbit` …) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, what, args in ROWS:
        path = out / f"{name}.json"
        if not path.exists():
            log = out / f"{name}.log"
            status = "failed: " + log.read_text().strip().splitlines()[-1][:90] if log.exists() else "not run"
            lines.append(f"| {what} | {status} | | | | | | `{args}` |")
            continue
        r = json.loads(path.read_text())
        lines.append(
            f"| {what} | {100 * r['test_accuracy']:.2f} % | {r['bits_up_per_worker'] / 1e6:,.1f} Mbit | "
            f"{r['bits_down_per_worker'] / 1e6:,.1f} Mbit | {r['compression_ratio_up']:,.1f} / "
            f"{r['compression_ratio_down']:,.1f} | {r['compute_s']:.1f} / {r['compress_s']:.1f} / "
            f"{r['communicate_s']:.1f} | {r.get('modelled_communicate_s', float('nan')):.3g} | `{args}` |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/all")
    parser.add_argument("--doc", default="docs/all_methods.md")
    parser.add_argument("--only", default=None, help="comma-separated row names")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = set(args.only.split(",")) if args.only else None
    if not args.table_only:
        for name, _, row_args in ROWS:
            if wanted is None or name in wanted:
                run(name, row_args, out)
    doc = Path(args.doc)
    text = doc.read_text() if doc.exists() else "# Every method on the default job\n\nTABLE\n"
    start, end = "<!-- table -->\n", "<!-- /table -->\n"
    block = start + table(out) + end
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.replace("TABLE\n", block)
    doc.write_text(text)
    print(table(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
