"""The Transformer race of the methods built for Adam, at 10 and 100 Mbit/s, from one training per method.

Training is deterministic and the link changes only the clock (docs/race.md), so a method's time to a target at
a link is its steps to the target, measured in its 1,000-step training run (docs/workloads/adam1000, 3 seeds
where they finished), times its step time at that link, measured by `gradcomp race` on the shaped link (4 hosts,
network namespaces, `tc tbf`) over whole communication rounds:

- fp32 DDP, torch fp16 and C_nat send the same message every step: the mean of steps 17-32 of a 32-step race;
- 1-bit Adam runs dense, then compressed: its race freezes at step 16, so steps 1-16 time the dense step and
  17-32 the compressed one, and its run of n steps costs min(n, F) dense steps and the rest compressed ones
  (F = its run's freeze step, 150 or 25);
- DiLoCo with H = 32 (H = 8) syncs once per 32 (8) steps: the mean over whole rounds (steps 1-32, syncs
  included).

The target is each seed's fp32 1,000-step validation loss + 0.05 bits/byte; steps to target are resolved to the
runs' evaluations (every 100 steps), so a time here is an upper bound by up to 100 steps. The ideal is fp32's
steps to target × its compute-only step (race's compute-only measurement, same run).

    python scripts/adam_race.py --link 10mbit --out docs/race/adam-10mbit     # as root; about 15 minutes
    python scripts/adam_race.py --link 100mbit --out docs/race/adam-100mbit
    python scripts/adam_race.py --link 10mbit --out docs/race/adam-10mbit --render   # the table only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SEGMENT = 16
FREEZE = 150  # the 1,000-step runs' freeze step (15 %), unless the row says another
# table key → (race method, how its step time is read from the race's clock at steps 16 and 32)
METHODS = {
    "a_fp32": ("torch-fp32", "steady"),
    "a_fp16": ("torch-fp16", "steady"),
    "a_cnat": ("cnat:topology=sharded,server=cnat", "steady"),
    "a_onebit_adam": (f"onebit_adam:freeze_step={SEGMENT}", "two phases"),
    "a_onebit_adam_f25": (f"onebit_adam:freeze_step={SEGMENT}", "two phases, freeze 25"),
    # its warm-up's steps are C_nat's (sharded both ways), timed as steps 1-16 of its race
    "a_onebit_adam_cnat100": (f"onebit_adam:freeze_step={SEGMENT},warmup=cnat", "two phases, freeze 100"),
    "a_diloco32": ("diloco:local_steps=32", "one round"),
    "a_diloco8": ("diloco:local_steps=8", "one round"),
}


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def steps_to_target(curve: list, target: float) -> int | None:
    for step, value in curve:
        if value <= target:
            return int(step)
    return None


def step_seconds(method: dict, how: str):
    """A function n → seconds of the first n steps at this link, from the race's clock at steps 16 and 32."""
    clock = {int(step): seconds for step, seconds, _ in method["curve"]}
    first, both = clock[SEGMENT], clock[2 * SEGMENT]
    if how == "steady":
        per = (both - first) / SEGMENT
        return lambda n: n * per, per
    if how.startswith("two phases"):
        freeze = int(how.rsplit(" ", 1)[1]) if "freeze" in how else FREEZE
        dense, compressed = first / SEGMENT, (both - first) / SEGMENT
        return lambda n: min(n, freeze) * dense + max(0, n - freeze) * compressed, (dense, compressed)
    per = both / (2 * SEGMENT)
    return lambda n: n * per, per


def race(link: str, out: str, python: str) -> None:
    specs = list(dict.fromkeys(spec for spec, _ in METHODS.values()))
    cmd = [python, "-m", "gradcomp.cli", "race", "--model", "transformer", "--hosts", "4", "--link", link,
           "--steps", str(2 * SEGMENT), "--eval-every", str(SEGMENT), "--target-loss", "0.01", "--out", out]
    for spec in specs:
        cmd += ["--method", spec]
    print("adam_race:", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=False)


def render(link: str, out: str, table: str) -> str:
    raced = {m["spec"]: m for m in json.load(open(os.path.join(out, "race.json")))["methods"]}
    rows = [r for r in read_rows(table) if "result" in r]
    fp32 = {r["seed"]: r["result"] for r in rows if r["key"] == "a_fp32"}
    ideal_step = raced[METHODS["a_fp32"][0]]["compute_only_step_s"]
    lines = [f"### {link}: time to fp32's 1,000-step loss + 0.05 (4 hosts, Transformer, AdamW)", "",
             f"Ideal (fp32's steps to target × its compute-only step, {ideal_step:.3f} s): see the last column. "
             "Step times from `race.json` in this folder; steps to target from docs/workloads/adam1000.", "",
             "| method | step time at the link (s) | steps to target per seed | time to target (s) per seed | "
             "mean ± std | × ideal | fp32 DDP time ÷ this |", "|---|---|---|---|---|---|---|"]
    results = {}
    for key, (spec, how) in METHODS.items():
        method = raced.get(spec)
        if method is None or method.get("error") or not method.get("curve"):
            lines.append(f"| {spec} | (race failed or not run) | | | | | |")
            continue
        seconds, per = step_seconds(method, how)
        per_text = f"{per:.3f}" if not isinstance(per, tuple) else f"dense {per[0]:.3f}, compressed {per[1]:.3f}"
        runs = sorted((r for r in rows if r["key"] == key), key=lambda r: r["seed"])
        if not runs:  # its step time is measured, its steps to target are not
            lines.append(f"| {spec} | {per_text} | (no 1,000-step run: {key}) | – | – | – | – |")
            continue
        steps, times, ideals = [], [], []
        for r in runs:
            if r["seed"] not in fp32:
                continue
            target = fp32[r["seed"]]["val_bits_per_byte"] + 0.05
            n = steps_to_target(r["result"]["val_loss_curve"], target)
            fp32_n = steps_to_target(fp32[r["seed"]]["val_loss_curve"], target)
            steps.append(n)
            times.append(None if n is None else seconds(n))
            ideals.append(fp32_n * ideal_step)
        results[key] = times
        reached = [t for t in times if t is not None]
        mean = statistics.mean(reached) if reached else None
        spread = f"{mean:.0f} ± {statistics.stdev(reached):.0f}" if len(reached) > 1 else (
            f"{mean:.0f} (1 seed)" if mean is not None else "never")
        vs_ideal = (f"{statistics.mean(t / i for t, i in zip(times, ideals) if t is not None):.2f}"
                    if reached else "–")
        lines.append(f"| {spec} | {per_text} | {', '.join('never' if s is None else str(s) for s in steps)} | "
                     f"{', '.join('–' if t is None else f'{t:.0f}' for t in times)} | {spread} | {vs_ideal} | "
                     "{vs_fp32_" + key + "} |")
    base = results.get("a_fp32") or []
    text = "\n".join(lines)
    for key, times in results.items():
        pairs = [b / t for b, t in zip(base, times) if b is not None and t is not None]
        ratio = (f"{statistics.mean(pairs):.2f}" + (f" ± {statistics.stdev(pairs):.2f}" if len(pairs) > 1 else ""))\
            if pairs else "–"
        text = text.replace("{vs_fp32_" + key + "}", ratio)
    with open(os.path.join(out, "adam-race.md"), "w") as f:
        f.write(text + "\n")
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="10mbit")
    p.add_argument("--out", required=True)
    p.add_argument("--table", default="docs/workloads/adam1000/results.jsonl")
    p.add_argument("--render", action="store_true", help="only the table, from OUT/race.json")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args()
    if not args.render:
        race(args.link, args.out, args.python)
    print(render(args.link, args.out, args.table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
