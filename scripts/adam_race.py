"""The Transformer race of the methods built for Adam, at a link, from the 1,000-step trainings of the adam1000 table.

Training is deterministic and the link changes only the clock (docs/race.md, "Several links from one training"),
so a method's time to a target at a link is estimated exactly as `gradcomp race --link A,B` does for its later
links (gradcomp.experiments.race.links): its steps to the target come from its 1,000-step training run
(docs/workloads/adam1000, every seed that finished), and its step times from a window of its steps timed by
`gradcomp race` on the shaped link (4 hosts, network namespaces, `tc tbf`): every step up to where its step
pattern is steady (1-bit Adam's freeze step) and 50 steady steps after it in whole rounds (DiLoCo: rounds of H).
Steps the window covers count with their own times, the rest at the window's steady mean.

The target is each seed's fp32 1,000-step validation loss + 0.05 bits/byte; steps to target are resolved to the
runs' evaluations (every 100 steps), so a time here is an upper bound by up to 100 steps. The ideal is fp32's
steps to target × its compute-only step (the race's compute-only measurement, same run).

    python scripts/adam_race.py --link 10mbit --out docs/race/adam-10mbit      # as root; about 25 minutes
    python scripts/adam_race.py --link 100mbit --out docs/race/adam-100mbit    # about 10 minutes
    python scripts/adam_race.py --link 10mbit --out docs/race/adam-10mbit --render   # the table only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from gradcomp.experiments.race import command, links, race
from gradcomp.experiments.run.report import make_output_dir

# table key → the race method that runs the same training (None: timed only, no 1,000-step run)
METHODS = {
    "a_fp32": "torch-fp32",
    "a_fp16": "torch-fp16",
    "a_cnat": "cnat:ddp=off",  # the table's run: gradcomp train's aggregator, the same training
    "a_cnat_sharded": "cnat:topology=sharded,server=cnat,ddp=off",
    "torch_powersgd": "torch-powersgd",
    "a_onebit_adam_cnat100": "onebit_adam:freeze_step=100,warmup=cnat",
    "a_onebit_adam_cnat50": "onebit_adam:freeze_step=50,warmup=cnat",
    "a_zero_one_adam_cnat100_h4": ("zero_one_adam:freeze_step=100,var_update_scaler=1000,warmup=cnat,"
                                   "local_step_clipper=4"),
    "a_zero_one_adam_cnat100_h2": ("zero_one_adam:freeze_step=100,var_update_scaler=1000,warmup=cnat,"
                                   "local_step_clipper=2"),
    "a_diloco32": "diloco:local_steps=32",
}
BASELINES = ("a_fp16", "a_cnat", "a_cnat_sharded", "torch_powersgd")  # the "best of C_nat, torch fp16 and torch PowerSGD"


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def steps_to_target(curve: list, target: float) -> int | None:
    for step, value in curve:
        if value <= target:
            return int(step)
    return None


def options(link: str, out: str, keys: list[str]) -> tuple[race.Options, list]:
    """The race's options, parsed as `gradcomp race --model transformer --hosts 4 --steps 1000` parses them (the
    table's runs are `gradcomp train --model transformer --steps 1000`: the same defaults), and each method's window."""
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    argv = ["--model", "transformer", "--hosts", "4", "--link", link, "--steps", "1000", "--target-loss", "0.01",
            "--out", out]
    for key in keys:
        argv += ["--method", METHODS[key]]
    opts, _, _ = command.options_from_args(p.parse_args(argv))
    configs, _ = race.plan(opts, log=lambda text: None)
    return links.timing_options(opts, configs, links.DEFAULT_WINDOW, link), configs


def run(link: str, out: str, keys: list[str]) -> None:
    timing, _ = options(link, out, keys)
    make_output_dir(out, "--out", "; nothing was started")
    print("adam_race: windows", timing.method_steps, flush=True)
    race.race(timing, log=lambda text: print(text, file=sys.stderr, flush=True))


def render(link: str, out: str, table: str, keys: list[str], also: list[str] = ()) -> str:
    raced: dict = {}
    for where in (*also, out):  # a later race's record of a method wins; `out` last
        with open(os.path.join(where, links.link_dir(link), "race.json")) as f:  # where the timing race writes
            raced.update({m["spec"]: m for m in json.load(f)["methods"]})
    timing, configs = options(link, out, keys)
    rows = [r for r in read_rows(table) if "result" in r]
    fp32 = {r["seed"]: r["result"] for r in rows if r["key"] == "a_fp32"}
    ideal_step = raced[METHODS["a_fp32"]]["compute_only_step_s"]
    lines = [f"### {link}: time to fp32's 1,000-step loss + 0.05 (4 hosts, Transformer, AdamW)", "",
             f"Steps to target from docs/workloads/adam1000 (per seed); step times from a window of each method's "
             f"steps timed at {link} (`{links.link_dir(link)}/race.json` here"
             + (f", and in {', '.join(also)} for the methods that race did not time" if also else "")
             + f"); ideal = fp32's steps to target × its compute-only step ({ideal_step:.3f} s).", "",
             "| method | window timed (steps) | mean step in the window's steady part (s) | steps to target per seed "
             "| time to target (s) per seed | mean ± std | × ideal | fp32 DDP time ÷ this |",
             "|---|---|---|---|---|---|---|---|"]
    results: dict[str, list] = {}
    for (key, spec), method, cfg in zip(((k, METHODS[k]) for k in keys), timing.methods, configs):
        rec = raced.get(spec)
        if rec is None or rec.get("error") or not rec.get("step_end_s"):
            lines.append(f"| {spec} | (race failed or not run) | | | | | | |")
            continue
        ends = rec["step_end_s"]
        start, h = links.steady_from(method, cfg), links.round_length(cfg)
        steady = links.steady_mean(ends, start, h)
        runs = sorted((r for r in rows if r["key"] == key), key=lambda r: r["seed"])
        if not runs:
            lines.append(f"| {spec} | {len(ends)} | {steady:.3f} | (no 1,000-step run) | – | – | – | – |")
            continue
        steps, times, ideals = [], [], []
        for r in runs:
            if r["seed"] not in fp32:
                continue
            target = fp32[r["seed"]]["val_bits_per_byte"] + 0.05
            n = steps_to_target(r["result"]["val_loss_curve"], target)
            steps.append(n)
            times.append(None if n is None else links.predict(ends, n, start, h))
            ideals.append(steps_to_target(fp32[r["seed"]]["val_loss_curve"], target) * ideal_step)
        results[key] = times
        reached = [t for t in times if t is not None]
        mean = statistics.mean(reached) if reached else None
        spread = f"{mean:.0f} ± {statistics.stdev(reached):.0f}" if len(reached) > 1 else (
            f"{mean:.0f} (1 seed)" if mean is not None else "never")
        vs_ideal = (f"{statistics.mean(t / i for t, i in zip(times, ideals) if t is not None):.2f}"
                    if reached else "–")
        lines.append(f"| {spec} | {len(ends)} | {steady:.3f} | "
                     f"{', '.join('never' if s is None else str(s) for s in steps)} | "
                     f"{', '.join('–' if t is None else f'{t:.0f}' for t in times)} | {spread} | {vs_ideal} | "
                     "{vs_fp32_" + key + "} |")
    base = results.get("a_fp32") or []
    text = "\n".join(lines)
    for key, times in results.items():
        pairs = [b / t for b, t in zip(base, times) if b is not None and t is not None]
        ratio = (f"{statistics.mean(pairs):.2f}" + (f" ± {statistics.stdev(pairs):.2f}" if len(pairs) > 1 else ""))\
            if pairs else "–"
        text = text.replace("{vs_fp32_" + key + "}", ratio)
    best = min((statistics.mean(t) for k, t in results.items() if k in BASELINES and t and None not in t),
               default=None)
    for key, ours in results.items():
        if best and key not in BASELINES and key != "a_fp32" and ours and None not in ours:
            text += (f"\n\n{METHODS[key]} against the best of {', '.join(BASELINES)} that reached the target on "
                     f"every seed: {best / statistics.mean(ours):.2f}x sooner (means over the seeds each has).")
    with open(os.path.join(out, "adam-race.md"), "w") as f:
        f.write(text + "\n")
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="10mbit")
    p.add_argument("--out", required=True)
    p.add_argument("--table", default="docs/workloads/adam1000/results.jsonl")
    p.add_argument("--keys", default=",".join(METHODS), help="table keys to race (default: all)")
    p.add_argument("--render", action="store_true", help="only the table, from OUT/link-LINK/race.json")
    p.add_argument("--also", action="append", default=[], metavar="DIR",
                   help="with --render: another timing race's OUT (same link), for methods OUT's race lacks")
    args = p.parse_args()
    keys = [k.strip() for k in args.keys.split(",") if k.strip()]
    unknown = [k for k in keys if k not in METHODS]
    if unknown or "a_fp32" not in keys:
        p.error(f"--keys: unknown {unknown}; known {list(METHODS)}; a_fp32 is needed (the reference)")
    if not args.render:
        run(args.link, args.out, keys)
    print(render(args.link, args.out, args.table, keys, args.also))
    return 0


if __name__ == "__main__":
    sys.exit(main())
