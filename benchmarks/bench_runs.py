"""Run ``gradcomp bench`` several times, each in a fresh process, and summarise the targets across the runs.

One bench run's fractions of memcpy move by 10-20 % between runs on a shared machine, mostly with the speed of
the reference copy, so a row within that distance of its target is met in one run and missed in the next.
This script gives every targeted row's median, lowest and highest fraction over ``--runs`` runs, against both
references the bench measures (the batched ``memcpy`` row, ``xmemcpy``; and the copy timed beside each row,
``xbeside``), and how many rows meet their targets at the median of the runs. It also prints the references'
own spread: the batched copy's time per run, and the median copy beside the rows per run.

Usage (one thread, the targets' input, about 20 s a run on the project's 2-core CPU machine)::

    python benchmarks/bench_runs.py --runs 5 --out runs/bench-runs   # JSON of every run plus summary.md

``--bench-args`` replaces the arguments given to each ``gradcomp bench`` (default: ``--threads 1 --no-model``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

DEFAULT_BENCH_ARGS = "--threads 1 --no-model"


def run_once(bench_args: list[str], json_path: Path) -> dict:
    """One ``gradcomp bench`` in a fresh process (the command line's own allocator setting applies)."""
    command = [sys.executable, "-c", "from gradcomp.cli import run; run()", "bench", *bench_args, "--quiet"]
    command += ["--json", str(json_path)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"gradcomp bench failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return json.loads(json_path.read_text())


TARGET_INPUT = "synthetic"  # the bench's targets apply to this input only


def summarise(runs: list[dict]) -> str:
    """A markdown summary of several bench results over the same rows (the targets' input only)."""
    per_run = []
    for i, run in enumerate(runs, 1):
        rows = [r for r in run["rows"] if r["input"] == TARGET_INPUT]
        if not any(r["compressor"] == "memcpy" for r in rows):
            raise SystemExit(f"run {i} has no {TARGET_INPUT} input: the targets apply to it alone")
        if not any(r.get("memcpy_beside_s") for r in rows):
            raise SystemExit(f"run {i} has no copies timed beside its rows (a bench from before they existed?)")
        per_run.append(rows)
    keys = [(r["compressor"], r["setting"]) for r in per_run[0]]
    for i, rows in enumerate(per_run[1:], 2):
        if [(r["compressor"], r["setting"]) for r in rows] != keys:
            raise SystemExit(f"run {i} does not have the rows of run 1 in the same order")
    lines = [f"{len(runs)} runs of `gradcomp bench`; fractions of memcpy for compress+encode.", ""]
    batched = [next(r for r in rows if r["compressor"] == "memcpy")["compress_encode_s"] for rows in per_run]
    beside = [statistics.median(r["memcpy_beside_s"] for r in rows if r.get("memcpy_beside_s")) for rows in per_run]
    numel = per_run[0][0]["numel"]
    lines.append(f"Reference copies of the {4 * numel / 1e6:g} MB input, ms per run:")
    lines.append("")
    lines.append("| run | batched copies (the memcpy row) | median copy beside the rows |")
    lines.append("|---:|---:|---:|")
    for i, (a, b) in enumerate(zip(batched, beside), 1):
        lines.append(f"| {i} | {1e3 * a:.2f} | {1e3 * b:.2f} |")
    lines.append("")
    targeted = [i for i, r in enumerate(per_run[0]) if r.get("target") is not None]
    if not targeted:
        lines.append("No row has a target (they apply to the synthetic input at the default --size, on the CPU).")
        return "\n".join(lines)
    header = "| row | target | xmemcpy median (min-max) | met | xbeside median (min-max) | met |"
    lines += [header, "|---|---:|---:|---|---:|---|"]
    met = {"xmemcpy": 0, "xbeside": 0}
    for index in targeted:
        row = per_run[0][index]
        same = [rows[index] for rows in per_run]
        label = f"{row['compressor']} [{row['setting']}]".replace("|", "\\|")  # a table cell: escape the pipes
        cells = [label, f"{row['target']:.3g}"]
        # fp16 / bf16: at most `target` x (a cast + the wire's checksum of its bytes), timed beside the row; they have
        # no batched reference, so both columns give that figure
        cast = row.get("target_kind") == "cast"
        for key, name in (("compress_encode_vs_memcpy", "xmemcpy"), ("compress_encode_vs_memcpy_beside", "xbeside")):
            if cast:
                key = "compress_encode_vs_cast_checksum"
            values = [r[key] for r in same]
            median = statistics.median(values)
            ok = median <= row["target"] if cast else median >= row["target"]
            met[name] += ok
            cells += [f"{median:.3g} ({min(values):.3g}-{max(values):.3g})", "met" if ok else "**missed**"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"At the median of the runs: {met['xmemcpy']} of {len(targeted)} met against the batched copy, "
        f"{met['xbeside']} of {len(targeted)} against the copy beside each row.",
    ]
    casts = [i for i in targeted if per_run[0][i].get("target_kind") == "cast"]
    if casts:
        lines += ["", "fp16 / bf16 against a cast + the wire's checksum of its bytes (timed beside each repeat), "
                  "median (min-max) over the runs:", "",
                  "| row | compress+encode | encode+decode | decode+decompress | cast (ms) | checksum (ms) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for index in casts:
            same = [rows[index] for rows in per_run]
            cells = [f"{same[0]['compressor']} [{same[0]['setting']}]"]
            for key, scale in (("compress_encode_vs_cast_checksum", 1), ("encode_decode_vs_cast_checksum", 1),
                               ("decode_decompress_vs_cast_checksum", 1), ("cast_beside_s", 1e3),
                               ("checksum_beside_s", 1e3)):
                values = [scale * r[key] for r in same if r.get(key) is not None]
                cells.append(f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})" if values else "-")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="bench runs, each in a fresh process (default 5)")
    parser.add_argument("--out", type=Path, required=True, help="folder for run-N.json and summary.md")
    parser.add_argument("--bench-args", default=DEFAULT_BENCH_ARGS, help=f"default: {DEFAULT_BENCH_ARGS!r}")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(1, args.runs + 1):
        runs.append(run_once(shlex.split(args.bench_args), args.out / f"run-{i}.json"))
        print(f"run {i} of {args.runs} done", file=sys.stderr)
    summary = summarise(runs)
    (args.out / "summary.md").write_text(summary + "\n")
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
