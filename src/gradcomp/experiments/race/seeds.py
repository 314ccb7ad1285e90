"""`gradcomp race --seeds S,S,...`: one race per seed, and every method's time to target over the seeds; and the
same for several links (``--link A,B``, race/links.py)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from gradcomp.errors import ConfigError
from gradcomp.experiments.race import links as by_link
from gradcomp.experiments.race.race import Interrupted, Options, make_network, plan, race
from gradcomp.experiments.run.report import make_output_dir, write_atomic


def race_links_seeds(opts: Options, links: list[str], seeds: list[int], log) -> int:
    """``--link A,B``: per seed (into OUT/seed-S with several seeds), one training at A, timing windows at the rest."""
    if opts.window < 1:
        raise ConfigError(f"--link-window must be >= 1, got {opts.window}")
    if opts.out and len(seeds) > 1:
        make_output_dir(opts.out, "--out", "; nothing was started")
    for seed in seeds:
        one = dataclasses.replace(opts, seed=seed, out=os.path.join(opts.out, f"seed-{seed}")
                                  if opts.out and len(seeds) > 1 else opts.out)
        try:
            result = race_links(one, links, log, show=print)
        except (KeyboardInterrupt, Interrupted):
            log(f"gradcomp race: interrupted during seed {seed}")
            return 130
        if any(entry.get("error") for row in result["methods"] for entry in row["links"].values()):
            return 1
    return 0


def race_seeds(opts: Options, seeds: list[int], log) -> int:
    """One race per seed (into OUT/seed-S), then every method's time to target and final value over the seeds."""
    plan(opts, log)  # every method checked once, before the first race starts
    if opts.out:
        make_output_dir(opts.out, "--out", "; nothing was started")
    results = []
    for seed in seeds:
        log(f"gradcomp race: seed {seed} ({len(results) + 1}/{len(seeds)})")
        one = dataclasses.replace(opts, seed=seed, out=os.path.join(opts.out, f"seed-{seed}") if opts.out else None)
        try:
            results.append(race(one, log))
        except (KeyboardInterrupt, Interrupted):
            log(f"gradcomp race: interrupted during seed {seed}; the seeds before it are in {opts.out}")
            return 130
    combined = seeds_summary(results, seeds)
    print(combined["table"])
    if opts.out:
        write_atomic(os.path.join(opts.out, "race-seeds.md"), combined["table"])
        write_atomic(os.path.join(opts.out, "race-seeds.json"), json.dumps(combined, indent=1))
    failed = [r["label"] for res in results for r in res["methods"] if r.get("error")]
    return 1 if failed else 0


def seeds_summary(results: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Per method: time to target and final value for every seed, and their mean ± sample std (over the seeds
    that reached the target; the others are counted)."""
    from gradcomp.experiments.run.report import mean_std

    lower = results[0]["summary"].get("lower_is_better", False)
    labels = [r["label"] for r in results[0]["methods"]]
    rows = []
    for label in labels:
        per = [next((r for r in res["methods"] if r["label"] == label), None) for res in results]
        times = [None if r is None or r.get("error") else r.get("time_to_target_s") for r in per]
        finals = [None if r is None or r.get("error") else r.get("final_accuracy") for r in per]
        reached = [t for t in times if t is not None]
        done = [f for f in finals if f is not None]
        rows.append({"label": label, "seeds": seeds, "time_to_target_s": times, "final": finals,
                     "time_mean_std": mean_std(reached) if reached else None,
                     "final_mean_std": mean_std(done) if done else None})
    scale, spec = (1, ".4f") if lower else (100, ".2f")
    unit = "bits/byte" if lower else "%"
    lines = [f"| method | time to target (s): mean ± std | per seed (s) | final {unit}: mean ± std | per seed |",
             "|---|---|---|---|---|"]
    for row in rows:
        tm = row["time_mean_std"]
        fm = row["final_mean_std"]
        reached = sum(t is not None for t in row["time_to_target_s"])
        lines.append(
            f"| {row['label']} | " + (f"{tm[0]:.3g} ± {tm[1]:.2g} ({reached} of {len(seeds)} reached)" if tm else "–")
            + " | " + ", ".join("–" if t is None else f"{t:.3g}" for t in row["time_to_target_s"])
            + " | " + (f"{format(scale * fm[0], spec)} ± {format(scale * fm[1], spec)}" if fm else "–")
            + " | " + ", ".join("–" if f is None else format(scale * f, spec) for f in row["final"]) + " |")
    table = (f"Over seeds {', '.join(map(str, seeds))} (sample std; each race's own table is in seed-S/race.md; "
             "targets per race as each race's summary says):\n\n" + "\n".join(lines) + "\n")
    return {"seeds": seeds, "lower_is_better": lower, "methods": rows, "table": table,
            "effective_targets": [res["summary"]["effective_target"] for res in results]}


def race_links(opts, links: list[str], log=print, show=None) -> dict[str, Any]:
    """The full race at links[0], a timing race at every other link, and the combined table."""
    if len(links) < 2:
        raise ConfigError("race_links needs two links or more")
    if opts.window < 1:
        raise ConfigError(f"--link-window must be >= 1, got {opts.window}")
    configs, _ = plan(dataclasses.replace(opts, link=links[0]), log)
    for link in links:  # every link checked (and the namespaces' tools for a shaped one) before anything starts
        make_network(dataclasses.replace(opts, link=link), log)  # a link this machine cannot have: refused now
    if opts.out:
        make_output_dir(opts.out, "--out", "; nothing was started")
    log(f"gradcomp race: one training per method at {links[0]}; at {', '.join(links[1:])} a window of each "
        f"method's steps is timed and its time to target estimated from it (docs/race.md, several links)")
    first = dataclasses.replace(opts, link=links[0],
                                out=os.path.join(opts.out, by_link.link_dir(links[0])) if opts.out else None)
    results = [race(first, log)]
    for link in links[1:]:
        log(f"gradcomp race: timing windows at {link}")
        results.append(race(by_link.timing_options(opts, configs, opts.window, link), log))
    combined = by_link.combine(opts, links, results, configs)
    if show is not None:
        show(combined["table"])
    if opts.out:
        write_atomic(os.path.join(opts.out, "race-links.md"), combined["table"])
        write_atomic(os.path.join(opts.out, "race-links.json"), json.dumps(combined, indent=1))
    return combined
