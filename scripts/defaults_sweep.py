"""Does every method + feedback pair that `gradcomp train` accepts train at its defaults? (issue 52)

Enumerates each built-in method with each feedback setting the CLI accepts for it (its default, and
``--feedback none|residual|momentum_correction|momentum_masking`` where that is a different setting), asking
``TrainConfig.validate`` what is accepted, and runs each on the docs' MNIST command (MNIST, SmallCNN, 4 workers,
batch 32, SGD lr 0.05 momentum 0.9, no ``--param``) on the simulated cluster, one run at a time under ``nice``:

1. a screen of ``--steps 150`` for every pair (the known divergences show before step 100);
2. the full epoch for every pair whose screen diverged or ended below ``--full-below`` (and for the methods whose
   compression starts after step 150: LGC).

The combinations that ``gradcomp.experiments.run.defaults`` refuses are run too (the sweep is what measures
them): its runs set ``GRADCOMP_ALLOW_UNTRAINED_DEFAULTS=1``. Results are appended to ``OUT/results.jsonl``, one
row per run; a row already there is not run again. The table goes to stdout (and ``OUT/table.md``).

    nice -n 10 .venv/bin/python scripts/defaults_sweep.py                  # screen + full epochs, then the table
    .venv/bin/python scripts/defaults_sweep.py --list                      # the pairs, nothing run
    .venv/bin/python scripts/defaults_sweep.py --table-only
    .venv/bin/python scripts/defaults_sweep.py --only signsgd,randomblock --stage screen
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

FEEDBACKS = ("none", "residual", "momentum_correction", "momentum_masking")
SCREEN_STEPS = 150
PHASED = ("lgc",)  # methods whose compressed phase starts after the screen's steps (LGC: dense 100 + top-k 200)


def pairs() -> list[tuple[str, str, list[str]]]:
    """(method, effective feedback, the CLI flags that ask for it) for every pair `gradcomp train` accepts."""
    from gradcomp.experiments.run.defaults import accepted_pairs

    return accepted_pairs()


def run_one(name: str, flags: list[str], steps: int | None, out: Path) -> dict:
    stage = f"steps{steps}" if steps else "epoch"
    tag = "_".join([name, *(f for f in flags if not f.startswith("--"))]) or name
    path = out / f"{tag}.{stage}.json"
    command = ["gradcomp", "train", "--no-progress", "--simulate", "--compressor", name, *flags,
               *(["--steps", str(steps)] if steps else []), "--json", str(path)]
    env = {**os.environ, "GRADCOMP_ALLOW_UNTRAINED_DEFAULTS": "1"}
    bin_dir = Path(sys.executable).parent
    start = time.time()
    proc = subprocess.run(["nice", "-n", "10", str(bin_dir / command[0]), *command[1:]], env=env,
                          capture_output=True, text=True, check=False)
    wall = time.time() - start
    row = {"command": " ".join(command[:-2]), "rc": proc.returncode, "wall_s": round(wall, 1)}
    at = re.search(r"non-finite \(NaN or Inf\) gradient at exchange (\d+)", proc.stderr)
    if at:
        row["nan_step"] = int(at.group(1))
    elif proc.returncode == 0:
        result = json.loads(path.read_text())
        row["test_accuracy"] = result["test_accuracy"]
        row["steps"] = result["steps"]
    else:
        row["error"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"
    return row


def read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def key(row: dict) -> tuple:
    return row["method"], row["feedback"], row["stage"]


def outcome(row: dict | None) -> str:
    if row is None:
        return "–"
    if "nan_step" in row:
        return f"NaN at step {row['nan_step']}"
    if "test_accuracy" in row:
        return f"{100 * row['test_accuracy']:.2f} %"
    return f"error: {row.get('error', '?')}"


def table(rows: list[dict]) -> str:
    by = {key(r): r for r in rows}
    seen = []
    for r in rows:
        if (r["method"], r["feedback"]) not in seen:
            seen.append((r["method"], r["feedback"]))
    lines = ["| method | feedback | flags | step 150 | one epoch (468 steps) |", "|---|---|---|---|---|"]
    for method, feedback in seen:
        screen, full = by.get((method, feedback, "screen")), by.get((method, feedback, "epoch"))
        flags = (screen or full)["flags"]
        lines.append(f"| `{method}` | {feedback}{' (default)' if not flags else ''} | "
                     f"`{' '.join(flags) or '—'}` | {outcome(screen)} | {outcome(full)} |")
    return "\n".join(lines)


def bad(row: dict, below: float) -> bool:
    return "test_accuracy" not in row or row["test_accuracy"] < below


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/defaults_sweep")
    p.add_argument("--only", default="", help="comma-separated method names")
    p.add_argument("--stage", choices=("screen", "epoch", "both"), default="both")
    p.add_argument("--full-below", type=float, default=0.955,
                   help="run the full epoch where the screen ended below this accuracy (fp32: 0.9673 at step 150)")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--list", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    if args.list:
        for name, feedback, flags in pairs():
            print(f"{name:18s} {feedback:20s} {' '.join(flags)}")
        return 0
    if not args.table_only:
        only = {s for s in args.only.split(",") if s}
        todo = [t for t in pairs() if not only or t[0] in only]
        stages = ("screen", "epoch") if args.stage == "both" else (args.stage,)
        for stage in stages:
            for name, feedback, flags in todo:
                done = {key(r): r for r in read(results)}
                if (name, feedback, stage) in done:
                    continue
                if stage == "epoch" and args.stage == "both" and name not in PHASED:
                    screen = done.get((name, feedback, "screen"))
                    if screen is not None and not bad(screen, args.full_below):
                        continue
                row = run_one(name, flags, SCREEN_STEPS if stage == "screen" else None, out)
                row = {"method": name, "feedback": feedback, "flags": flags, "stage": stage, **row}
                with open(results, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{name} {feedback} {stage}: {outcome(row)} ({row['wall_s']} s)", file=sys.stderr, flush=True)
    text = table(read(results))
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
