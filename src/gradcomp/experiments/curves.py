"""`gradcomp curves`: test-accuracy curves of finished runs, as a markdown table and a plot.

Input: result files written by ``gradcomp train --eval-every N --json RUN.json`` (optionally ``RUN.json=label``).
Output: for every run the steps at which it first reached each ``--targets`` accuracy, the accuracy curve as a
markdown table (one column per run, rows at the recorded steps), and with ``--out`` a plot of test accuracy
against steps or against the upstream bits each worker had sent by then (``--x bits``; bits grow linearly with
the steps of a fixed-size message, so the measured total is spread evenly over the steps).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from gradcomp.errors import ConfigError


def load_run(spec: str) -> tuple[str, dict[str, Any]]:
    """``path`` or ``path=label`` → (label, result); the label defaults to the run's compressor description."""
    path, _, label = spec.partition("=")
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read run result {path!r}: {exc}") from None
    if not result.get("accuracy_curve"):
        raise ConfigError(f"{path}: no accuracy curve recorded (train with --eval-every N)")
    if not label:
        params = ", ".join(f"{k}={v}" for k, v in (result.get("params") or {}).items())
        label = result.get("compressor", path) + (f"({params})" if params else "")
        label += (" + EF" if result.get("error_feedback") else "") + f", {result.get('granularity', 'layer')}"
        label += f", lr {result.get('lr')}, momentum {result.get('momentum')}"
    return label, result


def first_reaching(curve: list[list[float]], target: float) -> int | None:
    """The first recorded step whose test accuracy is at least ``target`` (a fraction), or None."""
    return next((int(step) for step, acc in curve if acc >= target), None)


def render_markdown(runs: list[tuple[str, dict[str, Any]]], targets: list[float]) -> str:
    lines = ["| run | steps | final acc. % | " + " | ".join(f"first ≥ {100 * t:g} %" for t in targets) + " |",
             "|" + "---|" * (3 + len(targets))]
    for label, r in runs:
        firsts = [first_reaching(r["accuracy_curve"], t) for t in targets]
        lines.append(f"| {label} | {r['steps']} | {100 * r['test_accuracy']:.2f} | "
                     + " | ".join("–" if s is None else f"step {s}" for s in firsts) + " |")
    steps = sorted({int(s) for _, r in runs for s, _ in r["accuracy_curve"]})
    lines += ["", "| step | " + " | ".join(label for label, _ in runs) + " |", "|" + "---|" * (1 + len(runs))]
    for step in steps:
        row = [dict((int(s), a) for s, a in r["accuracy_curve"]).get(step) for _, r in runs]
        lines.append(f"| {step} | " + " | ".join("" if a is None else f"{100 * a:.2f}" for a in row) + " |")
    return "\n".join(lines) + "\n"


def render_plot(runs: list[tuple[str, dict[str, Any]]], path: str, x: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--out needs matplotlib: pip install 'gradcomp[plots]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, r in runs:
        steps = [s for s, _ in r["accuracy_curve"]]
        xs = steps if x == "steps" else [r["bits_up_per_worker"] * s / r["steps"] for s in steps]
        ax.plot(xs, [100 * a for _, a in r["accuracy_curve"]], marker=".", label=label)
    if x == "bits":
        ax.set_xscale("log")
    ax.set_xlabel("training steps" if x == "steps" else "upstream bits per worker (measured)")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN.json[=LABEL]", help="results of gradcomp train --json")
    p.add_argument("--targets", default="0.97,0.98", help="comma-separated accuracies (fractions) to report")
    p.add_argument("--x", choices=("steps", "bits"), default="steps")
    p.add_argument("--out", default=None, metavar="PNG", help="also plot the curves here (needs matplotlib)")


def main(args: argparse.Namespace) -> int:
    try:
        targets = [float(t) for t in args.targets.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--targets takes comma-separated fractions, got {args.targets!r}") from None
    if any(not 0 < t <= 1 for t in targets):
        raise ConfigError(f"--targets are accuracies in (0, 1], got {targets}")
    if args.out:  # before anything is printed: the table without the plot asked for is no success
        from gradcomp.experiments.report import check_output_file

        check_output_file(args.out, "--out")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--out needs matplotlib: pip install 'gradcomp[plots]'") from None
    runs = [load_run(spec) for spec in args.runs]
    print(render_markdown(runs, targets), end="")
    if args.out:
        render_plot(runs, args.out, args.x)
    return 0
