"""Check `gradcomp plan`'s predicted step against `gradcomp race`'s measured median step, method by method.

    python scripts/plan_vs_race.py --out runs/pvr/convnet-100mbit --link 100mbit --model convnet
    python scripts/plan_vs_race.py --out runs/pvr/transformer-1gbit --link 1gbit --model transformer \\
        --dataset pystdlib --race-args "--optimizer sgd --lr 0.1 --target-loss 3"
    python scripts/plan_vs_race.py --compare R/race.json P.json        # only the table, from two files

Runs (unless OUT/race.json exists) ``gradcomp race`` with 4 emulated hosts, 40 steps (``--steps``) and the
methods below, then ``gradcomp plan`` for the same model, hosts and link, given three things the race measured
in the same run so that the two differ only in what the plan predicts (compression and communication):

- ``--compute-ms``: the race's compute-only step (forward, backward, optimizer; every worker at once);
- ``--latency``: the race's per-message latency on the link (a one-float all-reduce, per ring message);
- ``--colocated 4``: the race's hosts share this machine's cores, so the plan races each method on 4 local
  processes joined by an unshaped network (``plan.measure_local``) for its compression and its wait in collectives;

and one the race sets: ``--burst``, the token-bucket burst of its emulated links (``netns.TBF_BURST``).

Prints a markdown table (predicted, measured, error, within 20 %) and writes OUT/plan.json and OUT/table.md.
The race's ``torch-fp32`` is matched with the plan's ``none`` (the same messages), ``torch-fp16`` with ``fp16``;
every other method by its label. A step-time check: the race's methods share one optimizer (``--race-args``),
whatever its accuracy; Signum and DGC, which own momentum, need ``--optimizer sgd`` on the Transformer.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

from gradcomp.experiments.race.netns import TBF_BURST
from gradcomp.experiments.race.race import DEFAULT_METHODS

# the race's default set (torch's PowerSGD hook planned as itself: plan.measure_torch_powersgd)
METHODS = list(DEFAULT_METHODS)
PLANNED_AS = {"torch-fp32": "none", "torch-fp16": "fp16"}


def compare(race: dict, plan: dict) -> list[tuple[str, float, float, float]]:
    predicted = {row["label"]: row["step_s"] for row in plan["rows"]}
    for baseline, name in PLANNED_AS.items():
        if name in predicted:
            predicted.setdefault(baseline, predicted[name])
    rows = []
    for m in race["methods"]:
        if m.get("error") or predicted.get(m["label"]) is None:
            continue
        p, r = predicted[m["label"]], m["median_step_s"]
        rows.append((m["label"], p, r, (p - r) / r))
    return rows


def table(race: dict, plan: dict) -> str:
    lines = ["| method | predicted step (ms) | measured median step (ms) | error | within 20 % |",
             "|---|---:|---:|---:|---|"]
    for label, p, r, err in compare(race, plan):
        lines.append(f"| {label} | {1000 * p:.1f} | {1000 * r:.1f} | {100 * err:+.1f} % "
                     f"| {'yes' if abs(err) <= 0.2 else 'no'} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    gradcomp = [args.python, "-m", "gradcomp.cli"]
    os.makedirs(args.out, exist_ok=True)
    race_json = os.path.join(args.out, "race.json")
    model = ["--model", args.model] + (["--dataset", args.dataset] if args.dataset else [])
    extra = shlex.split(args.race_args)
    if not os.path.exists(race_json):
        cmd = [*gradcomp, "race", "--link", args.link, "--hosts", str(args.hosts), "--steps", str(args.steps),
               "--eval-every", str(args.steps), *model, *extra, "--out", args.out, "--quiet"]
        for m in args.methods:
            cmd += ["--method", m]
        print("$", " ".join(cmd[2:]), file=sys.stderr, flush=True)
        code = subprocess.run(cmd).returncode
        if code:
            return code
    with open(race_json) as f:
        race = json.load(f)
    compute = [m["compute_only_step_s"] for m in race["methods"] if m.get("compute_only_step_s")]
    compute_ms = 1e3 * sorted(compute)[len(compute) // 2]
    latency = race["summary"].get("message_latency_s") or 0.0
    planned = [PLANNED_AS.get(m, m) for m in args.methods]
    plan_json = os.path.join(args.out, "plan.json")
    cmd = [*gradcomp, "plan", *model, "--workers", str(args.hosts), "--link", args.link,
           "--latency", f"{1e6 * latency:.1f}us", "--burst", TBF_BURST, "--compute-ms", f"{compute_ms:.2f}",
           "--colocated", str(args.hosts), "--json", plan_json, "--methods", *planned]
    if "--batch-size" in extra:
        cmd += ["--batch-size", extra[extra.index("--batch-size") + 1]]
    print("$", " ".join(cmd[2:]), file=sys.stderr, flush=True)
    code = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
    if code:
        return code
    with open(plan_json) as f:
        plan = json.load(f)
    text = (f"{args.model}, {args.hosts} hosts, {args.link}: compute-only step {compute_ms:.1f} ms, latency "
            f"{1e6 * latency:.0f} us per message (both measured by the race), link burst {TBF_BURST}\n\n"
            f"{table(race, plan)}\n")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", nargs=2, metavar=("RACE_JSON", "PLAN_JSON"), help="only print the table")
    p.add_argument("--out", help="directory for the race's and the plan's files (a finished race is reused)")
    p.add_argument("--link", default="100mbit")
    p.add_argument("--model", default="convnet")
    p.add_argument("--dataset", default=None)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--race-args", default="", help="more gradcomp race options, one string")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    if args.compare:
        with open(args.compare[0]) as f, open(args.compare[1]) as g:
            print(table(json.load(f), json.load(g)))
        return 0
    if not args.out:
        p.error("give --out DIR (or --compare RACE_JSON PLAN_JSON)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
