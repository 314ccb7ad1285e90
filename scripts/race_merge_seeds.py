"""Merge races of the same methods run with different seeds into one mean ± std table, and time each method to
fixed validation losses (or accuracies) read off the curves the races recorded.

    python scripts/race_merge_seeds.py docs/race/transformer-100mbit/race.json \\
        docs/race/transformer-100mbit-seeds/seed-1/race.json docs/race/transformer-100mbit-seeds/seed-2/race.json \\
        --seeds 0,1,2 --thresholds 3.6,3.8,4.0 --out docs/race/transformer-100mbit-seeds/race-seeds-0-1-2.md

Only the methods of the last race are kept (a full race of one seed can then join a seeds race of fewer
methods). ``gradcomp race --seeds`` times every seed to that race's effective target: the target, or, where fp32
DDP did not reach it, the best loss fp32 reached in that seed. The fixed-threshold table uses one threshold for
every seed instead (– where a method never reached it), so the two tables answer different questions.
"""

from __future__ import annotations

import argparse
import json
import sys

from gradcomp.experiments.race.race import first_reaching
from gradcomp.experiments.race.seeds import seeds_summary


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("races", nargs="+", help="race.json files, one per seed")
    p.add_argument("--seeds", required=True, help="the seeds of the files, in order, e.g. 0,1,2")
    p.add_argument("--thresholds", default="", help="fixed targets to time every seed to, e.g. 3.6,3.8,4.0")
    p.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    if len(seeds) != len(args.races):
        p.error(f"{len(args.races)} races but {len(seeds)} seeds")
    results = []
    for path in args.races:
        with open(path) as f:
            results.append(json.load(f))
    labels = [m["label"] for m in results[-1]["methods"]]
    for res in results:
        res["methods"] = [m for m in res["methods"] if m["label"] in labels]
    lower = results[0]["summary"].get("lower_is_better", False)
    targets = ", ".join(f"seed {s}: {res['summary']['effective_target']:.4f}" for s, res in zip(seeds, results))
    text = seeds_summary(results, seeds)["table"] + f"\nEffective targets: {targets}.\n"
    if args.thresholds:
        thresholds = [float(t) for t in args.thresholds.split(",")]
        head = " | ".join(f"{t:g}: per seed (s)" for t in thresholds)
        lines = [f"| method | {head} |", "|---|" + "---|" * len(thresholds)]
        for label in labels:
            cells = []
            for t in thresholds:
                times = []
                for res in results:
                    m = next((m for m in res["methods"] if m["label"] == label), None)  # None: not in this race
                    hit = first_reaching(m["curve"], t, lower) if m is not None and not m.get("error") else None
                    times.append("–" if hit is None else f"{hit[1]:.1f}")
                cells.append(", ".join(times))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        text += "\nTime to fixed targets, the same for every seed (seeds " + ", ".join(map(str, seeds)) + "):\n\n"
        text += "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
