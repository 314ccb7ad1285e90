"""`gradcomp curves`: test-accuracy curves of finished runs, as a markdown table and a plot.

Input: result files written by ``gradcomp train --eval-every N --json RUN.json`` (optionally ``RUN.json=label``).
Output: for every run the steps at which it first reached each ``--targets`` accuracy, the accuracy curve as a
markdown table (one column per run, rows at the recorded steps), and with ``--out`` a plot of test accuracy
against steps or against the upstream bits each worker had sent by then (``--x bits``; bits grow linearly with
the steps of a fixed-size message, so the measured total is spread evenly over the steps).

A language model's run (``--model transformer``) is read by its validation loss in bits per byte instead, where
lower is better: ``--target-loss`` gives the losses to reach (first recorded step at or below each). A result of
``train --seeds`` holds every seed's run: its curve is the mean over the seeds at each recorded step, the plot
draws mean ± sample standard deviation as a band, and the table gives mean ± std.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from gradcomp.errors import ConfigError, GradcompError


def load_run(spec: str) -> tuple[str, dict[str, Any]]:
    """``path`` or ``path=label`` → (label, result); the label defaults to the run's compressor description."""
    path, _, label = spec.partition("=")
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read run result {path!r}: {exc}") from None
    if not isinstance(result, dict):  # valid JSON, but a list or a number is no result
        raise ConfigError(f"{path}: not a result of gradcomp train (a JSON {type(result).__name__}, not an object)")
    if not result.get("accuracy_curve"):
        raise ConfigError(f"{path}: no accuracy curve recorded (train with --eval-every N)")
    if not isinstance(result.get("steps"), int):
        raise ConfigError(f"{path}: not a result of gradcomp train (no steps)")
    if not label:
        params = ", ".join(f"{k}={v}" for k, v in (result.get("params") or {}).items())
        label = result.get("compressor", path) + (f"({params})" if params else "")
        label += (" + EF" if result.get("error_feedback") else "") + f", {result.get('granularity', 'layer')}"
        label += f", lr {result.get('lr')}, momentum {result.get('momentum')}"
    return label, result


def first_reaching(curve: list[list[float]], target: float, lower_is_better: bool = False) -> int | None:
    """The first recorded step whose value reaches ``target``: an accuracy at least it (a fraction), or with
    ``lower_is_better`` a loss at most it; None if none does."""
    if lower_is_better:
        return next((int(step) for step, value in curve if value <= target), None)
    return next((int(step) for step, value in curve if value >= target), None)


def is_text(result: dict[str, Any]) -> bool:
    """A language model's run: its curve is the validation loss (bits per byte)."""
    return result.get("val_bits_per_byte") is not None


def curve_band(result: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(step, mean, std) of the run's metric curve: accuracy, or bits per byte for a language model. A ``--seeds``
    result is averaged over its seeds at the steps every seed recorded (std: sample, 0 for one seed)."""
    from gradcomp.experiments.run.report import mean_std

    key = "val_loss_curve" if is_text(result) else "accuracy_curve"
    runs = result.get("runs") or [result]
    by_step = [dict((int(s), v) for s, v in r[key]) for r in runs]
    steps = sorted(set.intersection(*(set(d) for d in by_step)))
    return [(step, *mean_std([d[step] for d in by_step])) for step in steps]


def _value(text: bool, mean: float, std: float, seeds: int) -> str:
    spec, scale = (".4f", 1) if text else (".2f", 100)
    out = format(scale * mean, spec)
    return out + (f" ± {format(scale * std, spec)}" if seeds > 1 else "")


def render_markdown(runs: list[tuple[str, dict[str, Any]]], targets: list[float]) -> str:
    """Steps to each target and the curve table. Accuracy runs, or (all of them) language-model runs in bits/byte."""
    text = is_text(runs[0][1])
    if text:
        head = "| run | steps | seeds | final val. bits/byte | " + " | ".join(f"first ≤ {t:g} bits/byte" for t in targets)
    else:
        head = "| run | steps | seeds | final acc. % | " + " | ".join(f"first ≥ {100 * t:g} %" for t in targets)
    lines = [head + " |", "|" + "---|" * (4 + len(targets))]
    bands = {label: curve_band(r) for label, r in runs}
    for label, r in runs:
        seeds = len(r.get("runs") or [r])
        curve = [(s, m) for s, m, _ in bands[label]]
        firsts = [first_reaching(curve, t, lower_is_better=text) for t in targets]
        key = "val_bits_per_byte" if text else "test_accuracy"
        finals = [x[key] for x in (r.get("runs") or [r])]
        from gradcomp.experiments.run.report import mean_std

        lines.append(f"| {label} | {r['steps']} | {seeds} | {_value(text, *mean_std(finals), seeds)} | "
                     + " | ".join("–" if s is None else f"step {s}" for s in firsts) + " |")
    steps = sorted({s for band in bands.values() for s, _, _ in band})
    lines += ["", "| step | " + " | ".join(label for label, _ in runs) + " |", "|" + "---|" * (1 + len(runs))]
    for step in steps:
        row = []
        for label, r in runs:
            hit = next(((m, sd) for s, m, sd in bands[label] if s == step), None)
            row.append("" if hit is None else _value(text, *hit, len(r.get("runs") or [r])))
        lines.append(f"| {step} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def render_plot(runs: list[tuple[str, dict[str, Any]]], path: str, x: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--out needs matplotlib: pip install 'gradcomp[plots]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    text = is_text(runs[0][1])
    scale = 1 if text else 100
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, r in runs:
        band = curve_band(r)
        steps = [s for s, _, _ in band]
        xs = steps if x == "steps" else [r["bits_up_per_worker"] * s / r["steps"] for s in steps]
        means = [scale * m for _, m, _ in band]
        (line,) = ax.plot(xs, means, marker=".", label=label)
        if len(r.get("runs") or [r]) > 1:  # mean ± std over the seeds
            ax.fill_between(xs, [scale * (m - sd) for _, m, sd in band], [scale * (m + sd) for _, m, sd in band],
                            color=line.get_color(), alpha=0.2, linewidth=0)
    if x == "bits":
        ax.set_xscale("log")
    ax.set_xlabel("training steps" if x == "steps" else "upstream bits per worker (measured)")
    ax.set_ylabel("validation loss (bits per byte)" if text else "test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:  # checked before, but permission bits do not tell everything (root, /proc, a full disk)
        raise GradcompError(f"--out {path}: cannot write the plot ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)


def check_plot_file(path: str) -> None:
    """ConfigError now, before the table is printed, if ``--out`` could not take the plot: a folder that is
    missing or not writable, or a name whose suffix is no image format matplotlib writes (``--out run.json``
    would be refused only after the table, and could overwrite a result if it were not)."""
    import os

    from gradcomp.experiments.run.report import check_output_file

    check_output_file(path, "--out")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ConfigError("--out needs matplotlib: pip install 'gradcomp[plots]'") from None
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise ConfigError(f"--out {path}: matplotlib cannot write a .{suffix} plot; give a name ending in one of "
                          f".{', .'.join(sorted(formats))} (e.g. curves.png)")
    existed = os.path.exists(path)
    try:  # by doing it: as root, os.access says yes to anything (e.g. /proc), and a mount may be read-only
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise ConfigError(f"--out {path}: cannot be written ({exc.strerror or exc})") from None
    if not existed:
        os.unlink(path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN.json[=LABEL]", help="results of gradcomp train --json")
    p.add_argument("--targets", default="0.97,0.98", help="comma-separated accuracies (fractions) to report")
    p.add_argument("--target-loss", default="3.0,2.5", metavar="BITS",
                   help="language-model runs: comma-separated validation losses (bits per byte) to reach")
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
        check_plot_file(args.out)
    runs = [load_run(spec) for spec in args.runs]
    kinds = {is_text(r) for _, r in runs}
    if len(kinds) > 1:
        raise ConfigError("curves compares runs of one kind: language-model runs (bits/byte) and classifier runs "
                          "(accuracy) cannot share a table")
    if kinds == {True}:
        try:
            targets = [float(t) for t in args.target_loss.split(",") if t.strip()]
        except ValueError:
            raise ConfigError(f"--target-loss takes comma-separated bits per byte, got {args.target_loss!r}") from None
        if any(not (t > 0 and t < float("inf")) for t in targets):
            raise ConfigError(f"--target-loss values are losses in bits per byte, > 0; got {targets}")
        missing = [label for label, r in runs if not all(x.get("val_loss_curve") for x in (r.get("runs") or [r]))]
        if missing:
            raise ConfigError(f"{', '.join(missing)}: no validation-loss curve recorded (train with --eval-every N)")
    print(render_markdown(runs, targets), end="")
    if args.out:
        render_plot(runs, args.out, args.x)
    return 0
