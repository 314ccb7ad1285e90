"""`gradcomp race --link A,B,...`: one training, timed at several link rates.

Training is deterministic: on every link a method takes the same steps, computes the same losses and sends the
same bytes; only the clock differs. So the race trains every method once, in full, at the first link A (the
race that ``--link A`` alone runs, with its evaluations), and at every other link B times only a **window** of
each method's steps. A method's time to the target at B is then

    T_B = (its own step times at B, step by step, for the steps the window covers)
        + (the steps to the target beyond the window) × (its mean step at B over the window's steady part)

with the steps to the target taken from the training at A. The window of a method is every step up to where its
step pattern becomes steady (``steady_from``: the end of a dense warm-up, 1-bit Adam's freeze step, DGC's
sparsity warm-up, LGC's dense and top-k stages, torch PowerSGD's ``start_iter``) and ``--link-window`` steps
after it, rounded up to whole communication rounds: a method with H local steps communicates once in H steps,
so its steady mean is taken over whole rounds of H. 0/1 Adam is steady from the first whole round after its local-step
interval reaches its cap (``local_step_clipper``: rounds of that many steps); where the run ends before that, it is
timed over all its steps at every link.

The full training at A is the check of the estimate: the same formula applied to A's own first window steps is
reported beside the time A measured (``check`` in the output: their ratio). Nothing here is a network model:
every number is a measured step time; what is extrapolated is only the number of steady steps.

Outputs: OUT/link-A/ is the full race (race.md / race.json), OUT/link-B/ the timing race at B (its race.json has
the window's step times; it evaluates only at the window's end, so its own table says nothing of the target), and OUT/race-links.md /
race-links.json the time to target at every link, with the ratios to fp32 DDP and to fp32's communication-free
ideal at that link (fp32's steps to the target × the compute-only step measured at that link).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from gradcomp.errors import ConfigError
from gradcomp.experiments.race import netns
from gradcomp.experiments.race.method import Method
from gradcomp.train import zero_one_adam

DEFAULT_WINDOW = 50  # steady steps timed at every link after the first (rounded up to whole rounds)


def parse_links(text: str) -> list[str]:
    """``"10mbit,100mbit"`` → ["10mbit", "100mbit"]; ConfigError for an empty item, a bad rate or a repeat."""
    links = [item.strip() for item in str(text).split(",")]
    if any(not item for item in links):
        raise ConfigError(f"--link takes rates separated by commas (e.g. 10mbit,100mbit), got {text!r}")
    rates = [netns.link_rate(item) for item in links]
    if len(set(rates)) != len(rates):
        raise ConfigError(f"--link names the same rate twice: {text!r}")
    return links


def _zero_one_round(cfg) -> tuple[int, int] | None:
    """0/1 Adam's (first steady step, round length): where its local-step interval has reached its cap."""
    kinds = zero_one_adam.schedule(int(cfg.resolved_freeze_step()), int(cfg.steps), int(cfg.var_update_scaler),
                                   int(cfg.local_step_scaler), int(cfg.local_step_clipper))
    return zero_one_adam.steady_round(kinds)


def round_length(cfg) -> int:
    """Steps per communication round: H with local steps (local SGD, DiLoCo, SBC's local steps; 0/1 Adam's capped
    interval once reached), else 1."""
    if cfg.optimizer == "zero_one_adam":
        steady = _zero_one_round(cfg)
        return steady[1] if steady else 1
    return int(cfg.local_steps) if cfg.local_steps else 1


def steady_from(method: Method, cfg) -> int | None:
    """The step from which a method's steps repeat one pattern (every round alike); None when they never do."""
    if cfg.optimizer == "zero_one_adam":  # steady once its interval is capped (its variance is frozen by then)
        steady = _zero_one_round(cfg)
        return steady[0] if steady else None
    start = int(cfg.dense_steps or 0)
    if cfg.optimizer == "onebit_adam":
        start = max(start, int(cfg.resolved_freeze_step()))
    if method.baseline == "torch-powersgd":
        start = max(start, int(method.params.get("start_iter", 2)))
    if method.is_gradcomp and cfg.compressor in ("lgc", "dgc"):
        from gradcomp.registry import make

        compressor = make(cfg.compressor, **cfg.params)
        stages = (compressor.dense_steps + compressor.topk_steps if cfg.compressor == "lgc"
                  else 4 * compressor.warmup_steps)  # DGC: four stages of warmup_steps exchanges each
        start += stages  # after --dense-steps, if any: the later of the two readings, so the window is long enough
    return start


def window_steps(method: Method, cfg, window: int) -> int:
    """How many steps a method is timed for at the links after the first: at least up to where it is steady and
    ``window`` steps after that, in whole rounds; all of its steps when it never becomes steady."""
    total = int(cfg.steps)
    start = steady_from(method, cfg)
    if start is None:
        return total
    h = round_length(cfg)
    steady = math.ceil(max(window, h) / h) * h
    begin = math.ceil(start / h) * h  # the first whole round after the pattern settles
    return min(total, begin + steady)


def predict(step_end_s: list[float], steps_to_target: int, steady: int | None, round_steps: int = 1) -> float:
    """Seconds to ``steps_to_target`` steps from a window of step end times (seconds since the first step began).

    Steps the window covers count with their own times; the rest at the window's mean step over whole rounds
    from ``steady`` (the window's last whole rounds after it). A window that covers the target needs no estimate.
    """
    n = len(step_end_s)
    if steps_to_target <= 0:
        return 0.0
    if steps_to_target <= n:
        return float(step_end_s[steps_to_target - 1])
    if steady is None:
        raise ValueError("a method that never becomes steady is timed over all its steps, not extrapolated")
    return float(step_end_s[n - 1] + (steps_to_target - n) * steady_mean(step_end_s, steady, round_steps))


def steady_mean(step_end_s: list[float], steady: int, round_steps: int = 1) -> float:
    """The window's mean step over its whole rounds from the first round boundary at or after ``steady``."""
    n = len(step_end_s)
    begin = math.ceil(steady / round_steps) * round_steps
    rounds = (n - begin) // round_steps
    if rounds < 1:
        raise ValueError(f"the window ({n} steps) holds no whole round of {round_steps} after step {steady}")
    stop = begin + rounds * round_steps
    start_s = step_end_s[begin - 1] if begin else 0.0
    return (step_end_s[stop - 1] - start_s) / (stop - begin)


def timing_options(opts, configs: list[Any], window: int, link: str):
    """The race at ``link`` that times each method's window: no evaluation, each method's own number of steps."""
    steps = {m.label: window_steps(m, cfg, window) for m, cfg in zip(opts.methods, configs)}
    return dataclasses.replace(opts, link=link, eval_every=0, method_steps=steps,
                               out=os.path.join(opts.out, link_dir(link)) if opts.out else None)


def link_dir(link: str) -> str:
    return "link-" + link.strip().lower()


def combine(opts, links: list[str], results: list[dict[str, Any]], configs: list[Any]) -> dict[str, Any]:
    """Time to target at every link, from the full race at links[0] and the timing races at the others."""
    full = results[0]
    rows = []
    for method, cfg in zip(opts.methods, configs):
        first = next(r for r in full["methods"] if r["label"] == method.label)
        start = steady_from(method, cfg)
        h = round_length(cfg)
        row: dict[str, Any] = {"label": method.label, "steps_to_target": first.get("steps_to_target"),
                               "steady_from": start, "round_steps": h, "window_steps": window_steps(method, cfg,
                                                                                                       opts.window),
                               "final": first.get("final_accuracy"), "links": {}}
        s = first.get("steps_to_target")
        for link, result in zip(links, results):
            rec = next(r for r in result["methods"] if r["label"] == method.label)
            if rec.get("error"):
                row["links"][link] = {"error": rec["error"]}
                continue
            entry: dict[str, Any] = {"median_step_s": rec["median_step_s"],
                                     "compute_only_step_s": rec["compute_only_step_s"]}
            ends = rec.get("step_end_s") or []
            if link == links[0]:
                entry["time_to_target_s"] = rec.get("time_to_target_s")
                if s is not None and ends:
                    window = ends[:row["window_steps"]]
                    entry["estimate_s"] = predict(window, s, start, h)
                    measured = rec.get("time_to_target_s")
                    entry["check"] = entry["estimate_s"] / measured if measured else None
            else:
                entry["window_steps_timed"] = len(ends)
                entry["time_to_target_s"] = predict(ends, s, start, h) if s is not None and ends else None
                entry["estimated"] = s is not None and s > len(ends)
            row["links"][link] = entry
        rows.append(row)
    ref = next((row for row, m in zip(rows, opts.methods) if m.name == "torch-fp32"), None)
    for link in links:
        ideal = None
        if ref is not None and ref["steps_to_target"] is not None:
            compute = (ref["links"].get(link) or {}).get("compute_only_step_s")
            ideal = ref["steps_to_target"] * compute if compute else None
        fp32 = (ref["links"].get(link) or {}).get("time_to_target_s") if ref else None
        for row in rows:
            entry = row["links"].get(link) or {}
            t = entry.get("time_to_target_s")
            entry["vs_fp32_time"] = fp32 / t if fp32 and t else None
            entry["vs_fp32_ideal"] = t / ideal if t and ideal else None
    out = {"command": "gradcomp race --link " + ",".join(links), "links": links, "window": opts.window,
           "target": full["summary"]["effective_target"], "lower_is_better": full["summary"]["lower_is_better"],
           "methods": rows}
    out["table"] = render(out)
    return out


def _secs(value) -> str:
    if value is None:
        return "–"
    return f"{value:,.0f} s" if value >= 100 else f"{value:.1f} s" if value >= 10 else f"{value:.3g} s"


def _ratio(value) -> str:
    return "–" if value is None else f"{value:.2f}x"


def render(combined: dict[str, Any]) -> str:
    links = combined["links"]
    lower = combined["lower_is_better"]
    target = combined["target"]
    what = f"{target:.4f} bits/byte" if lower else f"{100 * target:.2f} %"
    lines = [
        f"Time to {what}, at every link, from one training at {links[0]} (its full race in {link_dir(links[0])}/) and "
        f"a window of each method's steps timed at " + ", ".join(links[1:]) + f" ({combined['window']} steady steps "
        "after its warm-up, in whole rounds; steps beyond the window at the window's mean step). "
        f"Check: at {links[0]}, the same estimate from its first window steps against the time measured there.",
        "",
        "| method | steps to target | window (steps) | " + " | ".join(
            f"{link}: time | × sooner than fp32 DDP | × the ideal" for link in links) + f" | check at {links[0]} |",
        "|---|---|---|" + "---|---|---|" * len(links) + "---|",
    ]
    for row in combined["methods"]:
        cells = [row["label"], "not reached" if row["steps_to_target"] is None else str(row["steps_to_target"]),
                 str(row["window_steps"]) if row["steady_from"] is not None else f"all ({row['window_steps']})"]
        for link in links:
            entry = row["links"].get(link) or {}
            if entry.get("error"):
                cells += ["failed", "–", "–"]
                continue
            mark = " (est.)" if entry.get("estimated") else ""
            cells += [_secs(entry.get("time_to_target_s")) + mark, _ratio(entry.get("vs_fp32_time")),
                      _ratio(entry.get("vs_fp32_ideal"))]
        check = (row["links"].get(links[0]) or {}).get("check")
        cells.append("–" if check is None else f"{check:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"

