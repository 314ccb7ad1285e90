"""The text report of a ``gradcomp bench`` result: the table, the targets met and missed, the comparison with top-k."""

from __future__ import annotations

from typing import Any

from gradcomp.experiments.bench.targets import TARGET_INPUTS, TARGET_SIZE, targets_apply_to
from gradcomp.experiments.bench.timing import MAX_WARMUP_ROUNDS, median


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == float("inf"):
        return "inf"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _num(v: float | None, spec: str) -> str:
    """``format(v, spec)``, or "-" for a cell that does not apply to the row (None)."""
    return "-" if v is None else format(v, spec)


def format_table(result: dict[str, Any]) -> str:
    """The aligned text table of a :func:`run_bench` result, one row per compressor x setting x input."""
    header = ["input", "compressor", "params", "bits/elem", "ratio", "c+e GB/s", "xmemcpy", "xbeside", "d+d GB/s",
              "xmemcpy", "pos bits/kept", "min bits/kept", "xcast", "xcast+sum", "target", "met"]
    body = []
    for r in result["rows"]:
        body.append(
            [
                r["input"],
                r["compressor"],
                r["setting"] + ("" if r["verified"] else " (unverified)"),
                _num(r["bits_per_element"], ".4g"),
                _num(r["ratio_vs_fp32"], ".3g"),
                _fmt(r["compress_encode_gbps"]),
                _num(r["compress_encode_vs_memcpy"], ".3g"),
                _num(r.get("compress_encode_vs_memcpy_beside"), ".3g"),
                _fmt(r["decode_decompress_gbps"]),
                _num(r["decode_decompress_vs_memcpy"], ".3g"),
                "-" if r.get("position_bits_per_kept") is None else f"{r['position_bits_per_kept']:.3f}",
                "-" if r.get("entropy_bits_per_kept") is None else f"{r['entropy_bits_per_kept']:.3f}",
                _num(r.get("compress_encode_vs_cast"), ".3g"),
                _num(r.get("compress_encode_vs_cast_checksum"), ".3g"),
                "-" if r.get("target") is None else (
                    f"<={r['target']:.3g}xcast+sum" if r.get("target_kind") == "cast" else f">={r['target']:.3g}xbeside"
                ),
                {True: "met", False: "MISSED"}.get(r.get("target_met"), "-"),
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(header)]
    left = {0, 1, 2}

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), "  ".join("-" * w for w in widths)]
    previous = None
    for r, cells in zip(result["rows"], body):
        if previous is not None and r["input"] != previous:
            out.append("")
        previous = r["input"]
        out.append(line(cells))
    return "\n".join(out)


def versus_topk(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every other sparsifier's compress+encode time as a fraction of top-k's at the same density and input.

    Top-k with fixed-width positions is the reference (its default); rows without a ``density`` parameter
    (threshold) have no same-density top-k row and are left out, as are the two halves of ``sketch``, which are
    not one compress+encode.
    """
    reference = {
        (r["input"], r["params"].get("density")): r
        for r in result["rows"]
        if r["compressor"] == "topk" and r["params"].get("positions", "fixed") == "fixed"
    }
    out = []
    for r in result["rows"]:
        density = r["params"].get("density")
        ref = reference.get((r["input"], density))
        if r["compressor"] in ("topk", "memcpy") or "part" in r or density is None or ref is None:
            continue
        out.append(
            {
                "input": r["input"],
                "compressor": r["compressor"],
                "setting": r["setting"],
                "density": density,
                "fraction": r["compress_encode_s"] / ref["compress_encode_s"],
                "compress_fraction": r["compress_s"] / ref["compress_s"],
            }
        )
    return out


def cast_lines(result: dict[str, Any]) -> list[str]:
    """Per fp16 / bf16 row with a reference timed beside it: its parts against the cast and the checksum."""
    out = []
    for r in result["rows"]:
        if not r.get("cast_checksum_beside_s"):
            continue
        ref = r["cast_checksum_beside_s"]
        out.append(
            f"{r['input']} {r['compressor']}: cast {1e3 * r['cast_beside_s']:.3g} ms + checksum "
            f"{1e3 * r['checksum_beside_s']:.3g} ms beside the row (median of the sums {1e3 * ref:.3g} ms); "
            f"compress {1e3 * r['compress_s']:.3g} + encode {1e3 * r['encode_s']:.3g} = "
            f"{r['compress_encode_vs_cast_checksum']:.3g} x, encode + decode {1e3 * r['encode_decode_s']:.3g} ms = "
            f"{r['encode_decode_vs_cast_checksum']:.3g} x, decode + decompress "
            f"{r['decode_decompress_vs_cast_checksum']:.3g} x"
        )
    return out


def format_report(result: dict[str, Any]) -> str:
    """The text ``gradcomp bench`` prints for a :func:`run_bench` result: the run and its inputs, the table, the
    targets met and missed, the fp16 / bf16 references, the copies timed beside the rows, the comparison with
    top-k and the run's seconds."""
    meta = result["meta"]
    lines = _preamble(result)
    lines.append("")
    lines.append(format_table(result))
    for note in meta["skipped"]:
        lines.append(f"skipped: {note}")
    lines += _target_lines(result)
    lines += cast_lines(result)
    lines += _copy_lines(result)
    compared = versus_topk(result)
    if compared:
        lines += ["", "time as a fraction of top-k's at the same density (same input, same run):"]
        for c in compared:
            lines.append(
                f"  {c['input']:9s}  {c['compressor']:12s} {c['setting']:28s} compress+encode "
                f"{100 * c['fraction']:6.2f} %   compress alone {100 * c['compress_fraction']:6.2f} %"
            )
    lines.append("")
    lines.append(f"total {meta['seconds']:.1f} s")
    return "\n".join(lines)


def _preamble(result: dict[str, Any]) -> list[str]:
    """The lines above the table: the run (torch, device, repeats, load, allocator), each input with its copy
    rate, and what the columns mean."""
    meta = result["meta"]
    lines = [
        f"gradcomp bench: torch {meta['torch']}, device {meta['device']}, {meta['threads']} threads, "
        f"median of {meta['repeats']} repeats after warm-up rounds until one takes no page fault "
        f"(1 to {MAX_WARMUP_ROUNDS})",
    ]
    load = meta.get("loadavg_before")
    if load is not None:
        lines[0] += f"; load average {load[0]:g} before, {meta['loadavg_after'][0]:g} after, {meta['cpus']} CPUs"
        if max(load[0], meta["loadavg_after"][0]) > (meta["cpus"] or 1):
            lines.append(
                "  warning: the machine was busy (load average above the CPU count): timings are noisy, "
                "prefer the xmemcpy fractions and rerun on a quiet machine"
            )
    if meta.get("allocator"):
        lines.append(f"  host allocator: {meta['allocator']}")
    for name, info in meta["inputs"].items():
        lines.append(
            f"  input {name}: {info['numel']:,} elements, {info['description']}; "
            f"memcpy {meta['memcpy_gbps'][name]:.3g} GB/s"
        )
    lines.append(
        "  bits/elem = 8 * encoded bytes / numel (headers included); ratio = 32 / bits; GB/s of fp32 input "
        "(4 * numel bytes / median time); xmemcpy = fraction of the memcpy rate on the same input; "
        "xbeside = the same against one copy of the input timed beside each repeat (median); xcast = "
        "compress+encode time as a multiple of a bare cast of the input timed beside each repeat (fp16, bf16); "
        "xcast+sum = the same against that cast plus the wire's checksum of its bytes, timed beside it"
    )
    if any(r.get("method") == "sketch" for r in result["rows"]):
        lines.append(
            "  sketch (sketch) / sketch (unsketch): one worker's round 1 of sketched SGD on the input as one slot, "
            "sizes from SketchedSGD.plan(): count-sketching it into a preallocated r x c table (c+e columns), "
            "then estimating all d coordinates and selecting the P*k largest (d+d columns); GB/s of the d-float "
            "input; the hash tables are built once per slot, outside the timed region; bits/elem = the r x c fp32 "
            "table (32*r*c/d, no headers; round 2's P*k values not counted)"
        )
    return lines


def _target_lines(result: dict[str, Any]) -> list[str]:
    """The targets' verdict: why none were checked (not the CPU, not the targets' synthetic size), or the rows
    that met and missed theirs, and the memcpy-fraction targets judged against the batched memcpy row."""
    meta = result["meta"]
    targets = meta.get("targets")
    if not targets_apply_to(meta):
        return ["", f"targets: none checked (they are set for the CPU; this ran on {meta['device']})"]
    if "synthetic" in meta["inputs"] and meta["inputs"]["synthetic"]["numel"] != TARGET_SIZE:
        return ["", f"targets: none checked (they are set for the synthetic input at --size {TARGET_SIZE})"]
    if not (targets and (targets["met"] or targets["missed"])):
        return []
    total = len(targets["met"]) + len(targets["missed"])
    lines = [
        "",
        f"targets ({'/'.join(TARGET_INPUTS)} input; each row against references timed beside it: compress+"
        f"encode as a fraction of the copy (xbeside), fp16 / bf16 as a multiple of a cast plus its checksum "
        f"(xcast+sum)): "
        f"{len(targets['met'])} of {total} rows met"
        + (f"; MISSED by {len(targets['missed'])}:" if targets["missed"] else ""),
    ]
    lines += [f"  met     {m}" for m in targets["met"]]
    lines += [f"  MISSED  {m}" for m in targets["missed"]]
    batched_missed = targets.get("missed_batched") or []
    judged = [r for r in result["rows"] if r.get("target_met_batched") is not None]
    if judged:
        lines.append(
            f"against the batched memcpy row instead (xmemcpy, the earlier reference): "
            f"{sum(r['target_met_batched'] for r in judged)} of {len(judged)} memcpy-fraction targets met"
            + (f"; missed by {len(batched_missed)}: " + ", ".join(batched_missed) if batched_missed else "")
        )
    return lines


def _copy_lines(result: dict[str, Any]) -> list[str]:
    """Per input, the range of the copies timed beside its rows against the memcpy row's batched copies; and the
    rows still taking page faults after their warm-up."""
    lines = []
    for name in result["meta"]["inputs"]:
        rows = [r for r in result["rows"] if r["input"] == name]
        copies = [r["memcpy_beside_s"] for r in rows if r.get("memcpy_beside_s")]
        batched = [r["compress_encode_s"] for r in rows if r["compressor"] == "memcpy"]
        if copies and batched:
            lines.append(
                f"input {name}: copies timed beside the rows {1e3 * min(copies):.3g} to {1e3 * max(copies):.3g} ms "
                f"(median {1e3 * median(copies):.3g}); the memcpy row's batched copies {1e3 * batched[0]:.3g} ms"
            )
    faulting = [r for r in result["rows"] if r.get("minor_faults_per_repeat")]
    if faulting:
        lines.append(
            "still taking page faults after the warm-up (median per repeat): "
            + ", ".join(f"{r['compressor']} [{r['setting']}] {r['minor_faults_per_repeat']:g}" for r in faulting)
        )
    return lines
