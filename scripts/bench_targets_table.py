"""Every targeted row of a `gradcomp bench --json` file as a markdown table (docs/bench_targets.md).

    python scripts/bench_targets_table.py benchmarks/bench-synthetic-10M.json

One line per row that has a target: the compressor and its settings, the reference it is judged against (the
copy timed beside the row, ``xbeside``, or a cast plus the wire's checksum of its bytes timed beside it,
``xcast+sum``), compress+encode and the
reference in ms (medians), the measured ratio, the target and met / MISSED; then the count, and the run's
metadata (load average, threads, batched copy) in one line. Reads only the JSON: the judgement is the bench's own
(``target_met``), the table adds nothing to it.
"""

from __future__ import annotations

import argparse
import json


def rows_table(result: dict) -> str:
    lines = ["| compressor | settings | reference (timed beside the row) | compress+encode (ms) | reference (ms) "
             "| measured | target | met |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    met = total = 0
    for r in result["rows"]:
        if r.get("target") is None:
            continue
        cast = r.get("target_kind") == "cast"
        ref_s = r.get("cast_checksum_beside_s") if cast else r.get("memcpy_beside_s")
        value = r.get("target_value")
        ok = r.get("target_met")
        total += 1
        met += bool(ok)
        setting = str(r.get("setting", "")).replace("|", "\\|")
        lines.append(
            f"| {r['compressor']} | {setting} | {'cast + checksum (xcast+sum)' if cast else 'copy (xbeside)'} "
            f"| {1000 * r['compress_encode_s']:.2f} | {'–' if ref_s is None else f'{1000 * ref_s:.2f}'} "
            f"| {'–' if value is None else f'{value:.3g}'} "
            f"| {'≤' if cast else '≥'} {r['target']:.3g} "
            f"| {'met' if ok else ('MISSED' if ok is False else '–')} |")
    lines.append("")
    lines.append(f"{met} of {total} targeted rows met.")
    return "\n".join(lines)


def meta_line(result: dict) -> str:
    m = result["meta"]
    gbps = m.get("memcpy_gbps", {}).get("synthetic")
    parts = [f"torch {m.get('torch')}", f"threads {m.get('threads')}", f"{m.get('cpus')} CPUs",
             f"load average before {m.get('loadavg_before')}, after {m.get('loadavg_after')}",
             f"{m.get('repeats')} repeats ({m.get('statistic')})"]
    if gbps:
        parts.append(f"batched memcpy {gbps:.1f} GB/s")
    if m.get("seconds"):
        parts.append(f"{m['seconds']:.0f} s")
    return "; ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="a gradcomp bench --json file")
    args = p.parse_args()
    with open(args.json) as f:
        result = json.load(f)
    print(meta_line(result))
    print()
    print(rows_table(result))


if __name__ == "__main__":
    main()
