"""Compare `gradcomp plan`'s predicted step with `gradcomp race`'s measured median step, method by method.

    gradcomp race --link 100mbit --hosts 4 --steps 40 --eval-every 40 --model convnet --method torch-fp32 ... --out R
    gradcomp plan --model convnet --workers 4 --link 100mbit --compute-ms C --methods none ... --json P.json
    python scripts/plan_vs_race.py R/race.json P.json

The race's ``torch-fp32`` is matched with the plan's ``none`` (the same messages); every other method by its
label. ``C`` should be the race's compute-only step (its table prints it), so that the two differ only in what
the plan predicts: compression and communication. Prints a markdown table: predicted, measured, error.
"""

from __future__ import annotations

import json
import sys


def compare(race: dict, plan: dict) -> list[tuple[str, float, float, float]]:
    predicted = {row["label"]: row["step_s"] for row in plan["rows"]}
    predicted.setdefault("torch-fp32", predicted.get("none"))
    rows = []
    for m in race["methods"]:
        if m.get("error") or m["label"] not in predicted or predicted[m["label"]] is None:
            continue
        p, r = predicted[m["label"]], m["median_step_s"]
        rows.append((m["label"], p, r, (p - r) / r))
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        race = json.load(f)
    with open(argv[1]) as f:
        plan = json.load(f)
    print("| method | predicted step (ms) | measured median step (ms) | error | within 20 % |")
    print("|---|---:|---:|---:|---|")
    for label, p, r, err in compare(race, plan):
        print(f"| {label} | {1000 * p:.1f} | {1000 * r:.1f} | {100 * err:+.1f} % | {'yes' if abs(err) <= 0.2 else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
