"""Per-worker communication vs number of workers: sketched SGD, local top-k, true top-k and fp32 allreduce.

For the docs on sketched SGD (Ivkin et al., NeurIPS 2019): with the same model and the same k, how many bits
does one worker send (up) and receive (down) per step when W = 4, 16, 64, 256 workers train together?

- ``sketch``: one allreduce of the count sketches, one allreduce of the P·k candidates' exact values: the
  tensors a worker hands the transport do not depend on W, so its bits are flat in W.
- ``local_topk``: every worker's k (int32 position, float32 value) pairs are allgathered: a worker receives
  the W − 1 other workers' messages, so its bits down grow as (W − 1).
- ``true_topk``: the oracle top-k of the summed accumulation; it allreduces the dense vector, so its bits
  are those of fp32 (flat, no saving).
- ``none``: uncompressed fp32 allreduce, the reference.

Every run is real data-parallel training on gradcomp's simulated cluster (``gradcomp train --simulate``: W
in-process workers, each with its own replica, running the same loop and the same protocol code as a gloo
run); the bits are the transport's own counters (``gradcomp.transport.base``: an allreduce of t counts
t.nbytes up and t.nbytes down per worker, an allgather t.nbytes up and (W − 1)·t.nbytes down), never a
formula. The counters are also read after every step (through the runner's per-step progress hook), which
checks that every step moves the same number of bits and that the totals hold nothing outside the steps.

The same k for the three top-k methods: ``density`` (default 0.01 per layer; layers under ``min_size``
= 1000 coordinates travel dense) or ``k`` from ``--param``, which also carries the sketch's own settings
(``cols_per_k``, ``candidates``, ``rows``, ...; the resolved values are written to the JSON). Byte counts per
step are what this measures, so large W runs fewer steps (``--max-worker-steps``, W·steps at most, 5 steps
at least): 256 simulated workers take turns on the CPU. The test accuracy of each run is recorded too, but
it is *not* a tuned comparison: the per-worker batch is fixed, so the global batch grows with W, the
learning rate is the same for all W, and large W trains for fewer steps.

    nice -n 19 .venv/bin/python scripts/sketch_scaling.py            # W = 4,16,64,256, all four methods
    nice -n 19 .venv/bin/python scripts/sketch_scaling.py --param cols_per_k=4 --param candidates=1 \\
        --out runs/sketch_scaling/cols4_cand1 --plot runs/sketch_scaling/cols4_cand1/sketch_scaling.png
    .venv/bin/python scripts/sketch_scaling.py --workers 2,4 --steps 2 --dataset digits --model mlp --plot none

Writes ``OUT/W<W>_<method>.json`` (the runner's result dict plus the resolved parameters and the per-step
check) and ``OUT/summary.json``, prints a Markdown table and saves the plot (matplotlib, Agg backend; skipped
with a note when matplotlib is missing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

from gradcomp.experiments.run import runner
from gradcomp.experiments.run.launch import launch
from gradcomp.experiments.run.runner import TrainConfig
from gradcomp.registry import parse_param_strings

METHODS = ("sketch", "local_topk", "true_topk", "none")
TOPK_METHODS = ("sketch", "local_topk", "true_topk")
# parameters of the shared worker state (k, momentum + accumulation, dense small layers) that every top-k
# method gets from --param, so that the three select the same k from the same kind of state
SHARED_KEYS = ("k", "density", "momentum", "min_size")
DEFAULT_PLOT = "docs/methods/img/sketch_scaling.png"
NOT_TUNED = (
    "Accuracy is NOT a tuned comparison: the per-worker batch is fixed (global batch = W x batch grows "
    "with W), the learning rate is the same for every W, and large W runs fewer steps."
)


def method_params(method: str, sketch_params: dict[str, Any]) -> dict[str, Any]:
    """The parameters one method runs with: sketch gets all of ``sketch_params``, the baselines the shared k."""
    if method == "none":
        return {}
    given = dict(sketch_params)
    if "k" not in given and "density" not in given:
        given["density"] = 0.01
    if method == "sketch":
        return given
    return {key: value for key, value in given.items() if key in SHARED_KEYS}


def steps_for(workers: int, steps: int, max_worker_steps: int, min_steps: int = 5) -> int:
    """Steps for a run of ``workers``: ``steps``, cut so that workers·steps <= max_worker_steps (0: no cut)."""
    if max_worker_steps <= 0:
        return steps
    return min(steps, max(min_steps, max_worker_steps // workers))


def _record_steps():
    """A stand-in for the runner's progress bar that keeps every worker's counters after each step."""
    sink: list[list[tuple[int, int]]] = []

    class StepRecorder(runner.Progress):
        def __init__(self, total: int, enabled: bool, label: str, initial: int = 0):
            super().__init__(total, False, label, initial)
            self.cumulative: list[tuple[int, int]] = []
            sink.append(self.cumulative)

        def update(self, loss, counter) -> None:
            self.cumulative.append((counter.bytes_up, counter.bytes_down))

    return StepRecorder, sink


def per_step_check(result: dict[str, Any], cumulative: list[list[tuple[int, int]]]) -> dict[str, Any]:
    """From every worker's counters after each step: the bits each step moved, and whether they are constant."""
    steps = result["steps"]
    up, down = set(), set()
    for worker in cumulative:
        before = (0, 0)
        for after in worker:
            up.add(8 * (after[0] - before[0]))
            down.add(8 * (after[1] - before[1]))
            before = after
    totals = sorted((8 * w[-1][0], 8 * w[-1][1]) for w in cumulative if w)
    counted = sorted(zip(result["bits_up_by_worker"], result["bits_down_by_worker"]))
    return {
        "workers_recorded": len(cumulative),
        "steps_recorded": sorted({len(w) for w in cumulative}),
        "bits_up_per_step_seen": sorted(up),  # over all workers and steps
        "bits_down_per_step_seen": sorted(down),
        "constant": len(up) == 1 and len(down) == 1 and all(len(w) == steps for w in cumulative),
        "totals_match": totals == counted,  # nothing counted outside the training steps
    }


def run_one(
    method: str,
    workers: int,
    steps: int,
    sketch_params: dict[str, Any],
    *,
    dataset: str = "mnist",
    model: str = "cnn",
    batch_size: int = 32,
    lr: float = 0.05,
    seed: int = 0,
    data_root: str | None = None,
) -> dict[str, Any]:
    """One simulated training run; the runner's result dict with the resolved parameters and per-step check."""
    cfg = TrainConfig(
        compressor=method,
        params=method_params(method, sketch_params),
        workers=workers,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        dataset=dataset,
        data_root=data_root,
        model=model,
        seed=seed,
        simulate=True,
        progress=False,
    )
    momentum_note = cfg.hand_momentum_to_method()  # as `gradcomp train` does: the method owns the momentum
    resolved = cfg.build_compressors()[0].params()
    recorder, cumulative = _record_steps()
    with mock.patch.object(runner, "Progress", recorder):
        result = launch(cfg)
    result["resolved_params"] = resolved
    result["momentum_note"] = momentum_note
    result["per_step"] = per_step_check(result, cumulative)
    return result


def row_of(result: dict[str, Any]) -> dict[str, Any]:
    steps = result["steps"]
    fp32 = result["dense_bits_per_worker"] / steps  # 32 bits per parameter: what an fp32 allreduce hands over
    up = result["bits_up_per_worker"] / steps
    down = result["bits_down_per_worker"] / steps
    payload_up = up - result["control_bits_up"] / steps  # (control: the ranks' agreement on refused messages)
    payload_down = down - result["control_bits_down"] / steps
    return {
        "workers": result["workers"],
        "method": result["compressor"],
        "bits_up_per_worker_per_step": up,
        "bits_down_per_worker_per_step": down,
        "payload_bits_up_per_worker_per_step": payload_up,
        "payload_bits_down_per_worker_per_step": payload_down,
        "fp32_bits_per_worker_per_step": fp32,
        "ratio_up": fp32 / up if up else float("inf"),
        "ratio_down": fp32 / down if down else float("inf"),
        "test_accuracy": result["test_accuracy"],
        "steps": steps,
        "global_batch": result["workers"] * result["batch_size"],
        "wall_time_s": result["wall_time_s"],
        "per_step_constant": result["per_step"]["constant"] and result["per_step"]["totals_match"],
        "params": result["resolved_params"],
    }


def run_scaling(
    workers: Sequence[int],
    methods: Sequence[str],
    steps: int,
    sketch_params: dict[str, Any],
    *,
    max_worker_steps: int = 0,
    out: Path | None = None,
    log: Callable[[str], None] = lambda text: None,
    **train: Any,
) -> list[dict[str, Any]]:
    """Every (W, method) run; one row each (see ``row_of``). Writes ``out/W<W>_<method>.json`` when ``out``."""
    rows = []
    for w in workers:
        n = steps_for(w, steps, max_worker_steps)
        for method in methods:
            started = time.perf_counter()
            result = run_one(method, w, n, sketch_params, **train)
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                (out / f"W{w}_{method}.json").write_text(json.dumps(result, indent=1))
            row = row_of(result)
            rows.append(row)
            log(
                f"W={w:<4} {method:<11} {n:>4} steps  up {row['bits_up_per_worker_per_step']:>12,.0f}  "
                f"down {row['bits_down_per_worker_per_step']:>12,.0f} bits/step  "
                f"acc {row['test_accuracy']:.4f}  {time.perf_counter() - started:6.1f}s"
            )
    return rows


def problems(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the data contradicts of the expected scaling (empty when everything holds)."""
    found = []
    by = {(r["method"], r["workers"]): r for r in rows}
    ws = sorted({r["workers"] for r in rows})
    for r in rows:
        if not r["per_step_constant"]:
            found.append(f"{r['method']} W={r['workers']}: bits differ between steps (or are counted outside them)")
    for method in ("sketch", "true_topk", "none"):
        seen = {
            (by[method, w]["bits_up_per_worker_per_step"], by[method, w]["bits_down_per_worker_per_step"])
            for w in ws
            if (method, w) in by
        }
        if len(seen) > 1:
            found.append(f"{method}: bits per worker per step change with W: {sorted(seen)}")
    for w in ws:
        if ("local_topk", w) in by:
            r = by["local_topk", w]
            if r["payload_bits_down_per_worker_per_step"] != (w - 1) * r["payload_bits_up_per_worker_per_step"]:
                found.append(f"local_topk W={w}: payload bits down are not (W - 1) x payload bits up")
        if ("true_topk", w) in by and ("none", w) in by:
            a, b = by["true_topk", w], by["none", w]
            for key in ("bits_up_per_worker_per_step", "bits_down_per_worker_per_step"):
                if a[key] != b[key]:
                    found.append(f"W={w}: true_topk {key} {a[key]:,.0f} != none {b[key]:,.0f}")
    return found


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| W | method | bits up / worker / step | bits down / worker / step | fp32 / up | fp32 / down "
        "| test acc. | steps | wall s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        acc = "" if r["test_accuracy"] is None else f"{100 * r['test_accuracy']:.1f} %"
        lines.append(
            f"| {r['workers']} | {r['method']} | {r['bits_up_per_worker_per_step']:,.0f} "
            f"| {r['bits_down_per_worker_per_step']:,.0f} | {r['ratio_up']:.2f}x | {r['ratio_down']:.2f}x "
            f"| {acc} | {r['steps']} | {r['wall_time_s']:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path, title: str) -> str:
    """Save the figure; returns a line saying where, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed in this environment: no plot (pip install matplotlib)"
    style = {  # none and true_topk coincide: none is drawn wide and underneath, true_topk thin on top of it
        "none": ("0.6", "s", 5.0, 1),
        "true_topk": ("tab:green", "^", 1.6, 3),
        "sketch": ("tab:blue", "o", 1.8, 2),
        "local_topk": ("tab:red", "D", 1.8, 2),
    }
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for method in [m for m in METHODS if any(r["method"] == m for r in rows)]:
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["workers"])
        color, marker, width, z = style[method]
        ws = [r["workers"] for r in mine]
        for key, line, what in (
            ("bits_down_per_worker_per_step", "-", "down"),
            ("bits_up_per_worker_per_step", "--", "up"),
        ):
            ys = [r[key] for r in mine]
            ax.plot(ws, ys, line, color=color, marker=marker, lw=width, ms=6, zorder=z, label=f"{method} {what}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ws = sorted({r["workers"] for r in rows})
    ax.set_xticks(ws, [str(w) for w in ws])
    ax.set_xlabel("workers W")
    ax.set_ylabel("bits per worker per step")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2, title="solid: down, dashed: up", title_fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def title_of(dataset: str, model: str, sketch_params: dict[str, Any]) -> str:
    given = method_params("sketch", sketch_params)
    k = f"k = {given['k']} per layer" if "k" in given else f"k = {100 * given['density']:g}% per layer"
    return f"Bits per worker per step vs workers ({dataset.upper()} {model.upper()}, {k})"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=_ints, default=[4, 16, 64, 256], help="comma-separated W (default 4,16,64,256)")
    p.add_argument("--steps", type=int, default=300, help="steps per run (default 300), cut for large W")
    p.add_argument(
        "--max-worker-steps",
        type=int,
        default=2560,
        help="at most W x steps per run, at least 5 steps (default 2560: 300/160/40/10 steps; 0: no cut)",
    )
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated (default {','.join(METHODS)})")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="sketch parameter (default density=0.01); k/density/momentum/min_size also go to the top-k baselines",
    )
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--data", default=None, metavar="DIR", help="MNIST directory (default: the bundled copy)")
    p.add_argument("--model", default="cnn")
    p.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/sketch_scaling", help="directory for the JSON files")
    p.add_argument("--plot", default=DEFAULT_PLOT, help=f"PNG path, or 'none' (default {DEFAULT_PLOT})")
    args = p.parse_args(argv)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    sketch_params = parse_param_strings(args.param)
    out = Path(args.out)
    started = time.perf_counter()
    schedule = {w: steps_for(w, args.steps, args.max_worker_steps) for w in args.workers}
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    log(f"steps per W: {schedule}; methods {methods}; sketch params {method_params('sketch', sketch_params)}")
    rows = run_scaling(
        args.workers,
        methods,
        args.steps,
        sketch_params,
        max_worker_steps=args.max_worker_steps,
        out=out,
        log=log,
        dataset=args.dataset,
        model=args.model,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        data_root=args.data,
    )
    total_s = time.perf_counter() - started
    title = title_of(args.dataset, args.model, sketch_params)
    table = markdown_table(rows)
    found = problems(rows)
    notes = [
        f"{title}; simulated cluster, bits from the transport's counters (allreduce: t.nbytes up and down per "
        "worker; allgather: t.nbytes up, (W - 1) t.nbytes down). fp32 / x: the bits of an fp32 allreduce "
        "(32 bits per parameter) over the method's (above 1: fewer bits than fp32).",
        "Bits per step are measured on every step of every worker: "
        + (
            "identical across steps and workers in every run."
            if all(r["per_step_constant"] for r in rows)
            else "NOT constant in some run, see below."
        ),
        f"Steps per W: {schedule} (W x steps <= {args.max_worker_steps} when positive, at least min(5, --steps); "
        f"per-worker batch {args.batch_size}, lr {args.lr}).",
        NOT_TUNED,
    ]
    sketch_rows = [r for r in rows if r["method"] == "sketch"]
    if sketch_rows:
        notes.append(f"sketch resolved params: {sketch_rows[0]['params']}")
    plot_line = "plot: skipped (--plot none)" if args.plot.lower() == "none" else plot(rows, Path(args.plot), title)
    summary = {
        "title": title,
        "workers": args.workers,
        "methods": methods,
        "steps_per_workers": schedule,
        "sketch_params_given": sketch_params,
        "params_per_method": {m: method_params(m, sketch_params) for m in methods},
        "dataset": args.dataset,
        "model": args.model,
        "batch_size_per_worker": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "rows": rows,
        "problems": found,
        "notes": notes,
        "markdown_table": table,
        "plot": None if args.plot.lower() == "none" else args.plot,
        "total_wall_s": total_s,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"### {title}\n")
    print(table)
    print()
    for note in notes:
        print(f"- {note}")
    print()
    print(
        "Checks: "
        + (
            "sketch, true_topk and none flat in W; local_topk down = (W - 1) x up; true_topk = none."
            if not found
            else "FAILED"
        )
    )
    for problem in found:
        print(f"  - {problem}")
    print(plot_line)
    print(f"JSON: {out}/ (summary.json and one file per run); total {total_s:.0f} s")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
