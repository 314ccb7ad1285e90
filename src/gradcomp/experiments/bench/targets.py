"""The bench targets: the figures are data (bench_targets.json beside this module, explained in
docs/bench_targets.md): GRACE's fractions of memcpy, the factor over them, the single-pass and top-k family
fractions, and the cast target of fp16 and bf16 (against a cast plus the wire's checksum of its bytes). Rows of other compressors, of compositions (topk+cnat), of the
model input and sketched SGD's halves have no target."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

TARGETS_FILE = Path(__file__).with_name("bench_targets.json")


def load_targets(path: str | os.PathLike[str] = TARGETS_FILE) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


TARGETS = load_targets()
GRACE_FACTOR = float(TARGETS["grace_factor"])
SINGLE_PASS_TARGET = float(TARGETS["single_pass"]["fraction"])
TOPK_FAMILY_TARGET = float(TARGETS["topk_family"]["fraction"])
SINGLE_PASS = frozenset(TARGETS["single_pass"]["compressors"])
TOPK_FAMILY = frozenset(TARGETS["topk_family"]["compressors"])
# name -> (GRACE's fraction of memcpy, the parameters it was measured at; None: every setting of the row)
GRACE_FRACTIONS: dict[str, tuple[float, dict[str, Any] | None]] = {
    name: (float(g["fraction"]), g["params"]) for name, g in TARGETS["grace_fractions"].items()
}
# compress + encode <= this many times (a cast of the same tensor + the wire's checksum of the cast's bytes)
CAST_TIMES = float(TARGETS["casts"]["times"])
CAST_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, d) for name, d in TARGETS["casts"]["compressors"].items()}
TARGET_INPUTS = tuple(TARGETS["inputs"])
TARGET_SIZE = int(TARGETS["size"])  # at other sizes the copy (and the compressors) run from cache: no comparison


def row_target(row: dict[str, Any]) -> tuple[float, str] | None:
    """(target, how it was derived) for a bench row, or None. For fp16 / bf16 (:data:`CAST_DTYPES`) the target
    is the most compress+encode may take as a multiple of a cast plus the wire's checksum of the cast's bytes (a
    checksummed message of the cast cannot do less); for the others, the least compress+encode must reach as a
    fraction of a memory copy (:func:`target_kind` says which)."""
    name, params = row["compressor"], row.get("params") or {}
    if row["input"] not in TARGET_INPUTS or row.get("numel") != TARGET_SIZE or "part" in row:
        return None
    if name in CAST_DTYPES:
        to = str(CAST_DTYPES[name]).removeprefix("torch.")
        return CAST_TIMES, f"<= {CAST_TIMES:g} x (a cast to {to} + the wire's checksum of its bytes)"
    found: list[tuple[float, str]] = []
    grace = GRACE_FRACTIONS.get(name)
    if grace is not None and (grace[1] is None or all(params.get(k) == v for k, v in grace[1].items())):
        found.append((GRACE_FACTOR * grace[0], f"{GRACE_FACTOR:g} x GRACE {grace[0]:g}"))
    if name in SINGLE_PASS:
        found.append((SINGLE_PASS_TARGET, "single-pass"))
    if name in TOPK_FAMILY:
        found.append((TOPK_FAMILY_TARGET, "top-k family"))
    if not found:
        return None
    return max(v for v, _ in found), "; ".join(f"{why}: {v:.3g}" for v, why in found)


def targets_apply_to(meta: dict[str, Any]) -> bool:
    """The targets were set on the CPU (GRACE's figures: one thread); a GPU's memcpy is another reference."""
    return str(meta.get("device", "cpu")).startswith("cpu")


def target_kind(row: dict[str, Any]) -> str:
    """``cast`` (compress+encode as a multiple of a cast plus its checksum, at most the target) or ``memcpy`` (as
    a fraction of the copy timed beside the row, at least the target)."""
    return "cast" if row["compressor"] in CAST_DTYPES else "memcpy"


def apply_targets(result: dict[str, Any]) -> dict[str, Any]:
    """Adds to every row ``target``, ``target_basis``, ``target_kind``, ``target_value`` (the measured figure it
    is judged on: ``compress_encode_vs_cast_checksum`` or ``compress_encode_vs_memcpy_beside``), ``target_met`` (judged
    against the reference timed beside the row) and ``target_met_batched`` (a memcpy-fraction target against the
    batched ``memcpy`` row instead: the earlier reference, for comparison), None where they do not apply, and
    ``meta["targets"]`` = {"met": [...], "missed": [...], "missed_batched": [...]} (short row descriptions);
    returns ``result``."""
    met, missed, missed_batched = [], [], []
    on_cpu = targets_apply_to(result["meta"])
    for r in result["rows"]:
        found = row_target(r) if on_cpu else None
        r["target"], r["target_basis"] = (None, None) if found is None else found
        r["target_kind"] = None if found is None else target_kind(r)
        r["target_value"] = r["target_met"] = r["target_met_batched"] = None
        if found is None:
            continue
        if r["target_kind"] == "cast":
            value = r.get("compress_encode_vs_cast_checksum")
            ok = None if value is None else bool(value <= r["target"])
            unit = " x (cast + checksum)"
        else:
            value = r.get("compress_encode_vs_memcpy_beside")
            ok = None if value is None else bool(value >= r["target"])
            unit = " of the copy beside"
            batched = r.get("compress_encode_vs_memcpy")
            if batched is not None:
                r["target_met_batched"] = bool(batched >= r["target"])
                if not r["target_met_batched"]:
                    missed_batched.append(f"{r['compressor']} [{r['setting']}] {batched:.3g} vs {r['target']:.3g}")
        r["target_value"], r["target_met"] = value, ok
        if ok is None:
            continue
        what = f"{r['compressor']} [{r['setting']}] {value:.3g}{unit} vs {r['target']:.3g} ({r['target_basis']})"
        (met if ok else missed).append(what)
    result["meta"]["targets"] = {"met": met, "missed": missed, "missed_batched": missed_batched}
    return result
