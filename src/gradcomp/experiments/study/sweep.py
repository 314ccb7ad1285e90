"""`gradcomp sweep`: a grid of schemes × densities × granularity × memory × seeds, resumable.

Memory is ``off``, ``on`` (plain error feedback) or one of DGC's momentum policies (``momentum_correction``,
``momentum_masking``; ``gradcomp.feedback``), which take the optimizer's momentum: their cells run the
optimizer without momentum and the policy with ``--momentum``.

Every cell is one `gradcomp train` run — on the simulated cluster by default (same protocol code and bit
counts as real workers, see docs/architecture.md), on real worker processes with ``--real``. Each finished
cell is appended as one JSON line to ``OUT/results.jsonl``, with the settings every cell shares (model, data,
steps, optimizer, workers, ``--bandwidth``, ``--real``, ...); a cell whose key is already there is not run
again, so an interrupted sweep resumes where it stopped, and a larger grid with the same settings (more
schemes, densities or seeds) extends it. A run with other settings into the same ``OUT`` is refused before any
cell runs, naming the settings that differ: its cells are another experiment (give a new ``--out``). Unless
``--no-baseline``, the grid also holds one uncompressed (fp32) cell per seed, the reference of the table and
plots. ``OUT/table.md`` and the plots are rendered from that file after every cell:

- ``accuracy_vs_bits.png``: test accuracy against upstream bits per worker (log scale), one marker per scheme;
- ``time_split.png``: each scheme's mean time split into compute, compression and communication; with
  ``--bandwidth`` a second bar per scheme prices the communication with the latency-bandwidth model.

The threshold scheme has no density parameter; its cells pick τ so that it keeps the cell's density of the
initial model's first gradient (the (1 − p)-quantile of |g| of worker 0's first batch) — written into the
cell's parameters. Plots need matplotlib (`pip install matplotlib`); without it only the table is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import math
import os
import re
import sys
from collections import defaultdict
from typing import Any

import torch

from gradcomp.errors import ConfigError, NonFiniteGradientError
from gradcomp.experiments.run.launch import WorkerFailedError, launch
from gradcomp.experiments.run.models import build_model
from gradcomp.experiments.run.runner import Batches, TrainConfig, compute_gradients, run_simulated

SCHEMES = ("topk", "randomk", "randomblock", "threshold")
BASELINE = "none"  # uncompressed fp32 allreduce: one cell per seed, the reference every table and plot shows


MEMORY = ("off", "on", "momentum_correction", "momentum_masking")  # on = plain error feedback (residual)


def memory_of(cell: dict[str, Any]) -> str:
    """The cell's memory: off, on (residual), or a momentum policy (cells of older sweeps have no ``feedback``)."""
    return cell.get("feedback") or ("on" if cell["error_feedback"] else "off")


def cell_key(cell: dict[str, Any]) -> str:
    keys = ("scheme", "density", "granularity", "error_feedback", "seed")
    keys += ("feedback",) if "feedback" in cell else ()
    return json.dumps({k: cell[k] for k in keys}, sort_keys=True)


def calibrate_threshold(base: TrainConfig, density: float) -> float:
    """τ keeping ``density`` of worker 0's first gradient of the initial model.

    |g| > τ is an elementwise test, so the threshold scheme selects the same entries at both granularities.
    """
    data = base.load_data()
    model = build_model(base.model, data, base.seed)
    xb, yb = Batches(data, base, 0).get(0, torch.device("cpu"))
    compute_gradients(model, xb, yb)
    magnitudes = torch.cat([p.grad.reshape(-1).abs() for p in model.parameters()])
    rank = min(magnitudes.numel(), max(1, round((1.0 - density) * magnitudes.numel())))
    return float(magnitudes.kthvalue(rank).values)


def cell_config(base: TrainConfig, cell: dict[str, Any], calibrate: bool = True) -> TrainConfig:
    """The cell's training configuration (``calibrate=False``: a placeholder threshold, for checking only)."""
    scheme, density = cell["scheme"], cell["density"]
    if scheme == BASELINE:
        params = {}
    elif scheme == "threshold":
        params = {"threshold": calibrate_threshold(base, density) if calibrate else 1.0}
    else:
        params = {"density": density}
    cfg = dataclasses.replace(
        base, compressor=scheme, params=params, granularity=cell["granularity"],
        error_feedback=cell["error_feedback"], seed=cell["seed"], progress=False,
    )
    if "feedback" in cell:  # a momentum policy: it takes the optimizer's momentum (set to 0)
        cfg = dataclasses.replace(cfg, error_feedback=None, feedback=cell["feedback"])
        cfg.hand_momentum_to_method()
    return cfg


def run_cell(base: TrainConfig, cell: dict[str, Any], real: bool) -> dict[str, Any]:
    """One cell's row. A run whose gradient turns NaN/Inf is a result too: it is recorded as diverged."""
    cfg = cell_config(base, cell)
    try:
        if real:
            result = launch(cfg)
        else:
            cfg.validate()
            result = run_simulated(cfg)
    except NonFiniteGradientError as exc:
        result = {"diverged": True, "diverged_at_step": exc.step, "error": str(exc)}
    except WorkerFailedError as exc:
        if "NonFiniteGradientError" not in str(exc):  # a real worker's NaN arrives as the launcher's error text
            raise
        at = re.search(r"at exchange (\d+)", str(exc))
        result = {"diverged": True, "diverged_at_step": int(at.group(1)) if at else None, "error": str(exc)}
    assert result is not None
    return {**cell, "params": cfg.params, "result": result}


# TrainConfig fields that are not settings of the sweep: the cell's own (its key and what follows from it), and
# how a run is carried out without changing its result
_NOT_SETTINGS = ("compressor", "params", "error_feedback", "feedback", "feedback_momentum", "granularity", "seed",
                 "weight_decay_in_gradient", "progress", "timeout_s", "save_path", "checkpoint_dir",
                 "checkpoint_every", "checkpoint_keep", "resume_dir", "resume_if_present")
_OPTION = {"data_root": "--data", "betas": "--beta1/--beta2", "real": "--real"}  # the rest: --steps for steps


def sweep_settings(base: TrainConfig, real: bool) -> dict[str, Any]:
    """What every cell of this invocation shares (model, data, steps, optimizer, workers, ...), as stored in
    each row: a cell run with other settings is another experiment, and must not be taken as done."""
    settings = {k: v for k, v in dataclasses.asdict(base).items() if k not in _NOT_SETTINGS}
    if settings.get("data_root") is not None:  # one folder however it is written (~/x, ./x, /home/u/x)
        settings["data_root"] = os.path.abspath(os.path.expanduser(settings["data_root"]))
    return json.loads(json.dumps({**settings, "real": real}))  # as read back from results.jsonl (tuples → lists)


def check_settings(rows: list[dict[str, Any]], settings: dict[str, Any], out: str) -> None:
    """ConfigError, before any cell runs, if a row of ``OUT/results.jsonl`` was run with other settings: resuming
    would take it as done, and the table would mix the two. Rows of sweeps older than stored settings pass."""
    for row in rows:
        stored = row.get("settings")
        if stored is None:
            continue
        differ = sorted(k for k in set(stored) | set(settings) if k in stored and k in settings
                        and stored[k] != settings[k])
        if differ:
            what = "; ".join(f"{_OPTION.get(k, '--' + k.replace('_', '-'))} {stored[k]!r} there, {settings[k]!r} now"
                             for k in differ)
            raise ConfigError(
                f"--out {out} holds cells run with other settings ({what}; first such cell: {cell_key(row)}): "
                "they would be taken as done. Give a new --out for these settings, or the same settings to "
                "resume or extend that sweep"
            )


def diverged(row: dict[str, Any]) -> bool:
    return bool(row["result"].get("diverged"))


def read_results(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    cells = []
    if args.baseline:
        cells += [{"scheme": BASELINE, "density": 1.0, "granularity": "layer", "error_feedback": False, "seed": seed}
                  for seed in args.seeds]
    for scheme, density, granularity, memory, seed in itertools.product(
        args.schemes, args.densities, args.granularities, args.memory, args.seeds
    ):
        cell = {"scheme": scheme, "density": density, "granularity": granularity,
                "error_feedback": memory == "on", "seed": seed}
        if memory not in ("on", "off"):
            cell["feedback"] = memory
        cells.append(cell)
    return cells


# plot markers per memory: (memory, marker, legend text)
MARKERS = (("off", "x", "no memory"), ("on", "o", "error feedback"), ("momentum_correction", "^", "momentum corr."),
           ("momentum_masking", "s", "momentum corr. + masking"))


def render_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per (scheme, density, granularity, memory), mean over the seeds that finished.

    Seeds whose run diverged (NaN/Inf gradient) are counted in the accuracy column, never averaged in.
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["scheme"], row["density"], row["granularity"], memory_of(row))].append(row)
    modelled = any("modelled_communicate_s" in row["result"] for rs in groups.values() for row in rs)
    text_model = any(row["result"].get("val_bits_per_byte") is not None for rs in groups.values() for row in rs)
    metric = "val. bits/byte (mean ± std [per seed])" if text_model else "test acc. % (mean ± std [per seed])"
    head = ["scheme", "density", "granularity", "memory", "seeds", metric, "bits up / worker", "× fewer",
            "compute s", "compress s", "communicate s"] + (["modelled comm. s"] if modelled else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(groups.items(), key=lambda kv: (kv[0][0] != BASELINE, kv[0][0], -kv[0][1], kv[0][2],
                                                   MEMORY.index(kv[0][3])))
    for (scheme, density, granularity, memory), group in order:
        rs = [row["result"] for row in group if not diverged(row)]
        lost = [row["result"] for row in group if diverged(row)]
        name = f"{scheme} (fp32)" if scheme == BASELINE else scheme
        cells = [name, f"{density:g}", granularity, memory, str(len(group)),
                 _accuracy_text(rs, lost)]
        if rs:
            cells += [f"{_mean(rs, 'bits_up_per_worker') / 1e6:.2f} Mbit", f"{_mean(rs, 'compression_ratio_up'):.1f}"]
            cells += [f"{_mean(rs, k):.3g}" for k in ("compute_s", "compress_s", "communicate_s")]
            if modelled:  # only when every finished seed was priced (a resumed sweep may mix runs)
                priced = all("modelled_communicate_s" in r for r in rs)
                cells.append(f"{_mean(rs, 'modelled_communicate_s'):.3g}" if priced else "–")
        else:
            cells += ["–"] * (len(head) - len(cells))
        lines.append("| " + " | ".join(cells) + " |")
    if any(scheme == "threshold" for scheme, *_ in groups):
        lines += ["", "Threshold cells: the density is the target τ was calibrated to (the share of the first gradient "
                  "above τ); what they really sent is in the bits columns."]
    return "\n".join(lines) + "\n"


def _mean(results: list[dict], key: str) -> float:
    return sum(r[key] for r in results) / len(results)


def _accuracy_text(finished: list[dict], lost: list[dict]) -> str:
    steps = sorted((r.get("diverged_at_step") for r in lost), key=lambda s: (s is None, s or 0))
    known = any(s is not None for s in steps)
    where = f" at step {', '.join('?' if s is None else str(s) for s in steps)}" if known else ""
    note = f"diverged{where}" if not finished else f"{len(lost)} diverged{where}"
    if not finished:
        return note
    from gradcomp.experiments.run.report import mean_std

    text_model = finished[0].get("val_bits_per_byte") is not None
    values = [r["val_bits_per_byte"] if text_model else 100 * r["test_accuracy"] for r in finished]
    spec = ".4f" if text_model else ".2f"
    mean, std = mean_std(values)
    text = format(mean, spec)
    if len(values) > 1:  # mean ± sample standard deviation, then every seed's value
        text += f" ± {format(std, spec)} [{', '.join(format(v, spec) for v in values)}]"
    return text + (f" ({note})" if lost else "")


def render_plots(rows: list[dict[str, Any]], out_dir: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    by_scheme: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if not diverged(row):
            by_scheme[row["scheme"]].append(row)
    if not by_scheme:
        return []
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    compressed = sorted(k for k in by_scheme if k != BASELINE)
    baseline = [(r["result"]["bits_up_per_worker"], 100 * r["result"]["test_accuracy"])
                for r in by_scheme.get(BASELINE, [])]
    if baseline:
        ax.scatter(*zip(*baseline), marker="*", s=120, color="black", label="uncompressed (fp32)")
    for i, scheme in enumerate(compressed):
        rs = by_scheme[scheme]
        for memory, marker, what in MARKERS:
            pts = [(r["result"]["bits_up_per_worker"], 100 * r["result"]["test_accuracy"]) for r in rs
                   if memory_of(r) == memory]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, color=f"C{i}", label=f"{scheme} ({what})")
    ax.set_xscale("log")
    ax.set_xlabel("upstream bits per worker (measured)")
    ax.set_ylabel("test accuracy (%)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths = [os.path.join(out_dir, "accuracy_vs_bits.png")]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    schemes = ([BASELINE] if baseline else []) + compressed
    names = ["none (fp32)" if s == BASELINE else s for s in schemes]

    def mean_of(part: str) -> list[float]:
        return [sum(r["result"][part] for r in by_scheme[s]) / len(by_scheme[s]) for s in schemes]

    priced = all("modelled_communicate_s" in r["result"] for s in schemes for r in by_scheme[s])
    xs = list(range(len(schemes)))
    width = 0.38 if priced else 0.7
    here = [x - width / 2 for x in xs] if priced else xs
    compute, compress = mean_of("compute_s"), mean_of("compress_s")
    ax.bar(here, compute, width, color="C0", label="compute")
    ax.bar(here, compress, width, bottom=compute, color="C1", label="compression")
    ax.bar(here, mean_of("communicate_s"), width, bottom=[a + b for a, b in zip(compute, compress)], color="C2",
           label="communication (measured here)")
    if priced:  # the same run with its collectives priced by the latency-bandwidth model
        there = [x + width / 2 for x in xs]
        ax.bar(there, compute, width, color="C0", alpha=0.55)
        ax.bar(there, compress, width, bottom=compute, color="C1", alpha=0.55)
        ax.bar(there, mean_of("modelled_communicate_s"), width, bottom=[a + b for a, b in zip(compute, compress)],
               color="C3", alpha=0.8, label="communication (α–β model; right bars)")
    ax.set_xticks(xs, names)
    ax.set_ylabel("seconds per run (mean over cells)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "time_split.png"))
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


def _floats(text: str, option: str) -> list[float]:
    values = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            values.append(float(part))
        except ValueError:
            raise ConfigError(f"{option} takes comma-separated numbers, e.g. 0.1,0.01; got {part.strip()!r}") from None
    if not values:
        raise ConfigError(f"{option} needs at least one value, got {text!r}")
    return values


def check_values(args: argparse.Namespace) -> None:
    """Every value of the grid, before the first cell runs (a bad one found later would leave partial results)."""
    from gradcomp.train.aggregator import GRANULARITIES

    for d in args.densities:
        if not (math.isfinite(d) and 0 < d <= 1):
            raise ConfigError(f"--densities are fractions in (0, 1], got {d:g}")
    for option, values in (("--densities", args.densities), ("--granularities", args.granularities),
                           ("--memory", args.memory), ("--schemes", args.schemes)):
        twice = sorted({v for v in values if values.count(v) > 1}, key=str)
        if twice:
            raise ConfigError(f"{option}: {', '.join(map(str, twice))} given twice; each value runs once")
    bad = [g for g in args.granularities if g not in GRANULARITIES]
    if bad:
        raise ConfigError(f"--granularities takes {', '.join(GRANULARITIES)}; got {', '.join(bad)}")
    if not args.granularities:
        raise ConfigError("--granularities needs at least one of " + ", ".join(GRANULARITIES))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated sparsifiers")
    p.add_argument("--densities", default="0.1,0.01,0.001")
    p.add_argument("--granularities", default="layer,model")
    p.add_argument("--memory", default="on,off",
                   help="comma-separated: off, on (error feedback), momentum_correction, momentum_masking "
                        "(DGC's worker-side momentum; the optimizer's momentum moves into the policy)")
    p.add_argument("--seeds", default="0,1", help="comma-separated, distinct; the table shows mean ± std and each seed")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the uncompressed (fp32) reference cell run once per seed")
    p.add_argument("--out", default="runs/sweep", metavar="DIR")
    p.add_argument("--real", action="store_true", help="spawn real gloo workers instead of the simulated cluster")
    p.add_argument("--workers", type=int, default=4)
    from gradcomp.experiments.run.options import add_training_options

    add_training_options(p)
    p.add_argument("--bandwidth", default=None, metavar="RATE")
    p.add_argument("--latency", default="0", metavar="TIME")


def main(args: argparse.Namespace) -> int:
    args.schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    unknown = sorted(set(args.schemes) - set(SCHEMES))
    if unknown:
        raise ConfigError(f"unknown scheme(s) {unknown}; the sweep knows {list(SCHEMES)}")
    from gradcomp.experiments.run.report import parse_seeds
    from gradcomp.experiments.run.options import resolve_training_defaults

    args.densities = _floats(args.densities, "--densities")
    args.granularities = [g.strip() for g in args.granularities.split(",") if g.strip()]
    args.memory = [m.strip() for m in args.memory.split(",") if m.strip()]
    if set(args.memory) - set(MEMORY):
        raise ConfigError(f"--memory takes a comma-separated list of {', '.join(MEMORY)}; got {args.memory}")
    args.seeds = parse_seeds(args.seeds)
    check_values(args)
    base = TrainConfig(workers=args.workers, **resolve_training_defaults(args), bandwidth=args.bandwidth,
                       latency=args.latency, progress=False)
    for cell in grid(args):  # every cell's configuration, before the first one trains
        checked = cell_config(base, cell, calibrate=False)
        checked.validate()
    from gradcomp.experiments.run.report import make_output_dir

    make_output_dir(args.out, "--out")  # a ConfigError now, not a traceback
    path = os.path.join(args.out, "results.jsonl")
    settings = sweep_settings(base, args.real)
    rows = read_results(path)
    check_settings(rows, settings, args.out)
    done = {cell_key(row) for row in rows}
    cells = grid(args)
    todo = [c for c in cells if cell_key(c) not in done]
    print(f"gradcomp sweep: {len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to run")
    for i, cell in enumerate(todo, start=1):
        row = {**run_cell(base, cell, args.real), "settings": settings}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        r = row["result"]
        if diverged(row):
            print(f"[{i}/{len(todo)}] {cell_key(cell)}: {r['error']}", flush=True)
        else:
            metric = (f"{r['val_bits_per_byte']:.4f} bits/byte" if r.get("val_bits_per_byte") is not None
                      else f"{100 * r['test_accuracy']:.2f} %")
            print(f"[{i}/{len(todo)}] {cell_key(cell)}: {metric}, "
                  f"x{r['compression_ratio_up']:.1f} fewer bits up", flush=True)
        _render(path, args.out)
    if not _render(path, args.out):
        why = ("matplotlib is not installed (pip install matplotlib)" if matplotlib_missing()
               else "no cell finished without diverging")
        print(f"gradcomp sweep: table.md only, no plots: {why}", file=sys.stderr)
    return 0


def matplotlib_missing() -> bool:
    return importlib.util.find_spec("matplotlib") is None


def _render(path: str, out_dir: str) -> list[str]:
    """Writes table.md and, with matplotlib, the plots (the paths of those written)."""
    rows = read_results(path)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(render_table(rows))
    return render_plots(rows, out_dir)
