"""What `gradcomp race` writes: the table (race.md), the plot (race.png), race.json, and the machine and code
version it records.

The race (race.py) measures; this module only formats its records and summary.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from typing import Any

from gradcomp.experiments.run.report import write_atomic

MEMORY_FLAG = 4.0  # flag a method that needs more than this many gradient sizes beyond plain DDP
EXTRA_MEMORY = ("extra_memory_vs_ddp_grads", "extra_cuda_vs_ddp_grads")  # host resident set; CUDA allocated


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _secs(value: float | None) -> str:
    """Seconds with three significant digits (0.0123, 1.23, 123), or – for None."""
    if value is None:
        return "–"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def render_table(records: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    target = summary["effective_target"]
    lower = summary.get("lower_is_better", False)
    spec = ".4f" if lower else ".2f"  # the final value: bits per byte, or an accuracy in %
    head = (
        f"| method | steps to {f'{target:.4f} bits/byte' if lower else f'{100 * target:.2f} %'} | time to target (s) "
        "| × fp32 ideal | fp32 DDP time ÷ this | median step (s) | × fp32 DDP step | compute-only step (s) "
        f"| {'final val. bits/byte' if lower else 'final acc (%)'} | wire MB/step/host "
        "| peak RSS max / median without file-backed (MiB) | extra vs DDP (× grad) |"
    )
    on_cuda = any(r.get("cuda_peak_bytes") is not None for r in records)
    if on_cuda:
        head += " CUDA peak allocated (MiB) | CUDA extra vs DDP (× grad) |"
    columns = 13 if on_cuda else 11
    lines = [head, "|" + "---|" + "---:|" * columns]
    for r in records:
        accuracy = r.get("final_accuracy")
        if r.get("error"):
            lines.append(f"| {r['label']} | failed: {r['error']} |" + " |" * (columns - 1))
            continue
        flag = {key: " ⚠" if (r.get(key) or 0) > MEMORY_FLAG else "" for key in EXTRA_MEMORY}
        mb = r["wire_tx_bytes_per_step"]
        line = (
            f"| {r['label']} | {_fmt(r['steps_to_target'], 'd')} | {_secs(r['time_to_target_s'])} "
            f"| {_fmt(r['vs_fp32_ideal'], '.2f')} | {_fmt(r['vs_fp32_time'], '.2f')} "
            f"| {_secs(r['median_step_s'])} | {_fmt(r['step_vs_fp32'], '.2f')} "
            f"| {_secs(r['compute_only_step_s'])} "
            f"| {_fmt(None if accuracy is None else (accuracy if lower else 100 * accuracy), spec)} "
            f"| {_fmt(mb and mb / 1e6, '.3f')} "
            f"| {max(r['peak_rss_bytes']) / 2**20:.0f} / {statistics.median(r['peak_anon_bytes']) / 2**20:.0f} "
            f"| {_fmt(r['extra_memory_vs_ddp_grads'], '+.1f')}{flag['extra_memory_vs_ddp_grads']} |"
        )
        if on_cuda:
            cuda = r.get("cuda_peak_bytes")
            line += (
                f" {_fmt(cuda and cuda / 2**20, '.0f')} "
                f"| {_fmt(r.get('extra_cuda_vs_ddp_grads'), '+.1f')}{flag['extra_cuda_vs_ddp_grads']} |"
            )
        lines.append(line)
    out = "\n".join(lines) + "\n"
    allocators = sorted({a for r in records for a in r.get("allocator") or []})
    if allocators:
        out += f"\nHost allocator in the workers: {'; '.join(allocators)}\n"
    if summary["fp32_ideal_s"]:
        out += (f"\nfp32 with free communication (fp32 DDP's steps to target × its compute-only step): "
                f"{_secs(summary['fp32_ideal_s'])} s\n")
    if summary.get("message_latency_s"):
        out += (f"\nA message's fixed cost on this link: an all-reduce of one float took "
                f"{1e3 * summary['tiny_allreduce_s']:.2f} ms (median), {1e6 * summary['message_latency_s']:.0f} us "
                "per message of its ring (`gradcomp plan --latency`)\n")
    for note in summary["notes"]:
        out += f"\nNote: {note}\n"
    if summary["targets"]:
        judged = summary.get("targets_judged_on") or "a 100 Mbit/s link"
        out += f"\nTargets at 100 Mbit/s, judged on this race ({judged}):\n"
        out += "\n| goal | met | measured |\n|---|---|---|\n"
        for t in summary["targets"]:
            met = {True: "yes", False: "no", None: "–"}[t["met"]]
            out += f"| {t['goal']} | {met} | {t['detail']} |\n"
    return out


def render_plot(records: list[dict[str, Any]], summary: dict[str, Any], path: str, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lower = summary.get("lower_is_better", False)
    scale = 1 if lower else 100
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in records:
        if r.get("error") or not r["curve"]:
            continue
        ax.plot([s for _, s, _ in r["curve"]], [scale * a for _, _, a in r["curve"]], marker=".", label=r["label"])
    ax.axhline(scale * summary["effective_target"], color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("training wall-clock seconds (evaluation excluded)")
    ax.set_ylabel("validation loss (bits per byte)" if lower else "test accuracy (%)")
    if not lower:
        lo = min((100 * a for r in records if not r.get("error") for _, _, a in r["curve"]), default=90)
        ax.set_ylim(max(lo - 1, 100 * summary["effective_target"] - 10), 100)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no curve when every method failed
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(out_dir: str, result: dict[str, Any], title: str, log=print, plot: bool = True) -> None:
    """race.md, race.png (with matplotlib and ``plot``; otherwise an earlier race's plot there is removed) and
    race.json (written last, replaced whole)."""
    write_atomic(os.path.join(out_dir, "race.md"), result["table"])
    path = os.path.join(out_dir, "race.png")
    if plot and render_plot(result["methods"], result["summary"], path, title):
        result["plot"] = path
    else:
        if os.path.exists(path):  # an earlier race's plot would sit beside this race's table
            os.remove(path)
        if plot:
            log("gradcomp race: matplotlib is not installed: no plot (pip install 'gradcomp[plots]')")
    write_atomic(os.path.join(out_dir, "race.json"), json.dumps(result, indent=1))


def code_version() -> dict[str, Any] | None:
    """The git commit of the gradcomp source that the workers import, and its modified files, if it is a checkout."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the gradcomp package
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", here, "status", "--porcelain", "--", "."], capture_output=True,
                                text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "modified": [line[3:] for line in status.stdout.splitlines()]}


def machine() -> dict[str, Any]:
    import torch

    from gradcomp.experiments.run.report import cpu_model

    return {
        "cpu": cpu_model(), "cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
        "torch": torch.__version__, "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
