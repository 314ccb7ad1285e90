"""Does every method + feedback pair that `gradcomp train` accepts train at its defaults? (issue 52)

Enumerates each built-in method with each feedback setting the CLI accepts for it (its default, and
``--feedback none|residual|momentum_correction|momentum_masking`` where that is a different setting), asking
``TrainConfig.validate`` what is accepted, and runs each on the docs' MNIST command (MNIST, SmallCNN, 4 workers,
batch 32, SGD lr 0.05 momentum 0.9, no ``--param``) on the simulated cluster, one run at a time under ``nice``:

1. a screen of ``--steps 150`` for every pair (the known divergences show before step 100);
2. the full epoch (the closest calls first) for every pair whose screen ended below ``--full-below`` (and for the
   methods whose compression starts after step 150: LGC); a screen that diverged is not run again, since the
   epoch follows the same trajectory to the same NaN;
3. (``--stage remedy``) one epoch of each refusal rule's remedy, the flags its message names.

The combinations that ``gradcomp.experiments.run.defaults`` refuses are run too (the sweep is what measures
them): its runs pass ``--allow-untrained-defaults``. Results are appended to ``OUT/results.jsonl``, one
row per run; a row already there is not run again. The table goes to stdout (and ``OUT/table.md``).

    nice -n 10 .venv/bin/python scripts/defaults_sweep.py --stage all      # screen, epochs, remedies, the tables
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


def run_one(name: str, flags: list[str], steps: int | None, out: Path, seed: int = 0) -> dict:
    stage = f"steps{steps}" if steps else "epoch"
    tag = "_".join([name, *(f for f in flags if not f.startswith("--"))]) or name
    path = out / f"{tag}.{stage}{f'.seed{seed}' if seed else ''}.json"
    command = ["gradcomp", "train", "--no-progress", "--allow-untrained-defaults", "--simulate", "--compressor", name,
               *flags, *(["--steps", str(steps)] if steps else []), *(["--seed", str(seed)] if seed else []),
               "--json", str(path)]
    env = dict(os.environ)
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


def outcome(row: dict | None, screen: dict | None = None) -> str:
    if row is None:
        if screen is not None and "nan_step" in screen:
            return "(diverged in the screen)"
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
                     f"`{' '.join(flags) or '—'}` | {outcome(screen)} | {outcome(full, screen)} |")
    return "\n".join(lines)


def remedy_flags(flags: list[str], remedy: str) -> list[str]:
    """The pair's flags with the remedy's: a ``--feedback`` in the remedy replaces the pair's."""
    extra = remedy.split()
    if "--feedback" in extra and "--feedback" in flags:
        flags = [f for i, f in enumerate(flags) if f != "--feedback" and (i == 0 or flags[i - 1] != "--feedback")]
    return [*flags, *extra]


def run_remedies(out: Path, results: Path) -> None:
    """One epoch of each distinct (method, remedy) of the refusal rules, from the first pair it covers; remedies
    that are several epochs long are the study's runs (docs/papers/random_block_study.md), not re-run here."""
    from gradcomp.experiments.run.defaults import RULES

    for rule in RULES:
        for remedy in rule.remedies:
            if "--epochs" in remedy:
                continue
            feedback = rule.feedbacks[0]
            pair = next((t for t in pairs() if t[0] == rule.method and t[1] == feedback), None)
            if pair is None:
                continue
            flags = remedy_flags(pair[2], remedy)
            done = {(r["method"], tuple(r["flags"])) for r in read(results) if r["stage"] == "remedy"}
            if (rule.method, tuple(flags)) in done:
                continue
            row = run_one(rule.method, flags, None, out)
            row = {"method": rule.method, "feedback": feedback, "flags": flags, "stage": "remedy", **row}
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{rule.method} remedy {' '.join(flags)}: {outcome(row)} ({row['wall_s']} s)", file=sys.stderr,
                  flush=True)


def remedy_table(rows: list[dict]) -> str:
    lines = ["| remedy run (one epoch) | test acc. |", "|---|---|"]
    for r in rows:
        if r["stage"] == "remedy":
            lines.append(f"| `--compressor {r['method']} {' '.join(r['flags'])}` | {outcome(r)} |")
    return "\n".join(lines)


def bad(row: dict, below: float) -> bool:
    return "test_accuracy" not in row or row["test_accuracy"] < below


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/defaults_sweep")
    p.add_argument("--only", default="", help="comma-separated method names")
    p.add_argument("--stage", choices=("screen", "epoch", "both", "remedy", "all"), default="both",
                   help="both: screen, then epochs; remedy: one epoch of each refusal's remedy (where it is one "
                        "epoch long); all: the three")
    p.add_argument("--full-below", type=float, default=0.92,
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
        stages = {"both": ("screen", "epoch"), "all": ("screen", "epoch"), "remedy": ()}.get(args.stage, (args.stage,))
        for stage in stages:
            if stage == "epoch":  # the closest calls first, the screens at chance last
                screens = {key(r)[:2]: r for r in read(results) if r["stage"] == "screen"}
                todo.sort(key=lambda t: -screens.get(t[:2], {}).get("test_accuracy", 1.0))
            for name, feedback, flags in todo:
                done = {key(r): r for r in read(results)}
                if (name, feedback, stage) in done:
                    continue
                screen = done.get((name, feedback, "screen"))
                if stage == "epoch" and screen is not None and "nan_step" in screen:
                    continue  # the epoch is the same trajectory: NaN at the same step
                if stage == "epoch" and args.stage in ("both", "all") and name not in PHASED:
                    if screen is not None and not bad(screen, args.full_below):
                        continue
                row = run_one(name, flags, SCREEN_STEPS if stage == "screen" else None, out)
                row = {"method": name, "feedback": feedback, "flags": flags, "stage": stage, **row}
                with open(results, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{name} {feedback} {stage}: {outcome(row)} ({row['wall_s']} s)", file=sys.stderr, flush=True)
    if args.stage in ("remedy", "all") and not args.table_only:
        run_remedies(out, results)
    text = table(read(results)) + "\n\n" + remedy_table(read(results))
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
