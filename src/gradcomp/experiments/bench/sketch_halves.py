"""Sketched SGD's round 1, timed in its two local halves (sketch; estimate and select), with its checks against
slower references and its two bench rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Slot
from gradcomp.compressors.countsketch import CountSketch
from gradcomp.errors import ConfigError
from gradcomp.experiments.bench.timing import BenchError, Timer, gbps, median
from gradcomp.schemes.accumulation import largest
from gradcomp.schemes.sketch import SketchedSGD, SlotPlan


def sketch_plan(scheme: SketchedSGD, numel: int, what: str) -> SlotPlan:
    """The plan sketched SGD makes for the input as one slot; ConfigError (naming the input) if it cannot work."""
    try:
        return scheme.plan(Slot(name="bench", index=0, numel=numel))
    except ConfigError as exc:
        raise ConfigError(f"sketch on {what}: {exc}") from None


def selection_size(scheme: SketchedSGD, plan: SlotPlan) -> int:
    """How many estimates round 1 selects: the P·k candidates, or the k sent with ``rounds=1``."""
    return plan.candidates if scheme.rounds == 2 else plan.k


def verify_sketch(cs: CountSketch, x: Tensor, table: Tensor, chosen: Tensor, take: int, what: str) -> None:
    """Check a count sketch, its estimates and the selection against slower references; BenchError if broken."""
    d, r, c = cs.numel, cs.rows, cs.cols
    xd = x.reshape(-1).to(torch.float64)
    positions = cs.positions.view(r, d)
    for j in range(r):  # the table, row by row: a float64 bincount of the same hashes
        buckets = positions[j].to(torch.int64) - j * c
        ref = torch.bincount(buckets, weights=cs.signs[j].to(torch.float64) * xd, minlength=c)
        scale = torch.bincount(buckets, weights=xd.abs(), minlength=c)
        count = torch.bincount(buckets, minlength=c).to(torch.float64)
        err = (table[j * c : (j + 1) * c].to(torch.float64) - ref).abs()
        # fp32 summation of n terms in any order is within (n - 1)·2^-24·Σ|terms| of the exact sum
        if not bool((err <= count * 2.0**-23 * scale + 1e-30).all()):
            raise BenchError(
                f"{what}: row {j} of the count sketch differs from a float64 bincount of the same hashes (max "
                f"|diff| {float(err.max()):.3g}); not timing it"
            )
    estimates = cs.estimate(table)
    per_row = table[cs.positions.to(torch.int64)].view(r, d) * cs.signs
    expected = per_row.median(dim=0).values if r > 1 else per_row[0]
    if estimates.shape != (d,) or not torch.equal(estimates, expected):
        raise BenchError(f"{what}: the estimates are not the median over rows of the signed buckets; not timing it")
    magnitude = estimates.abs()
    picked = torch.zeros(d, dtype=torch.bool, device=estimates.device)
    picked[chosen] = True
    if chosen.numel() != take or int(picked.sum()) != take:
        raise BenchError(f"{what}: selected {chosen.numel()} coordinates ({int(picked.sum())} distinct), not {take}")
    if take < d and float(magnitude[picked].min()) < float(magnitude[~picked].max()):
        raise BenchError(f"{what}: the selection missed a larger estimate than one it took; not timing it")


def bench_sketch(
    scheme: SketchedSGD, plan: SlotPlan, x: Tensor, repeats: int, timer: Timer, what: str
) -> dict[str, Any]:
    """Time one worker's round 1 of sketched SGD on ``x`` as one slot: sketching, then unsketching.

    Sketching is ``CountSketch.sketch`` into a preallocated table; unsketching is ``estimate`` of that table and
    the selection of the ``selection_size`` largest estimates. The hash tables are built here, before the
    timed loop (training builds them once per slot and caches them). Verified on the warm-up (``verify_sketch``).
    """
    numel = x.numel()
    cs = CountSketch(numel, scheme.rows, plan.cols, scheme.seed, 0, x.device)  # as SketchedSGD builds them
    take = selection_size(scheme, plan)
    table = torch.empty(cs.size, dtype=torch.float32, device=x.device)
    x_ref = x.clone()
    parts: dict[str, list[float]] = {"sketch": [], "unsketch": []}
    for i in range(repeats + 1):  # i == 0 is the warm-up
        t0 = timer.now()
        cs.sketch(x, out=table)
        t1 = timer.now()
        chosen = largest(cs.estimate(table), take)
        t2 = timer.now()
        if i == 0:
            verify_sketch(cs, x, table, chosen, take, what)
            continue
        if chosen.numel() != take:
            raise BenchError(f"{what}: selected {chosen.numel()} coordinates, not {take}")
        parts["sketch"].append(t1 - t0)
        parts["unsketch"].append(t2 - t1)
    if not torch.equal(x, x_ref):
        raise BenchError(f"{what}: sketching modified its input tensor")
    return {"sketch_s": median(parts["sketch"]), "unsketch_s": median(parts["unsketch"]), "selected": take}


def sketch_rows(
    scheme: SketchedSGD,
    plan: SlotPlan,
    m: dict[str, Any],
    input_name: str,
    numel: int,
    memcpy_gbps: float,
    label: str,
) -> list[dict[str, Any]]:
    """The ``sketch (sketch)`` and ``sketch (unsketch)`` rows: each half's time in its own column pair, the other
    pair (and the unsketch row's bits) None, as non-applicable cells."""
    size = scheme.rows * plan.cols
    shape = f"{scheme.rows}x{plan.cols} table, k={plan.k}"
    common = {
        "input": input_name,
        "numel": numel,
        "method": "sketch",
        "params": scheme.params(),
        "plan": {
            "rows": scheme.rows,
            "cols": plan.cols,
            "k": plan.k,
            "candidates": plan.candidates,
            "selected": m["selected"],
            "table_floats": size,
        },
        "encode_s": None,
        "decode_s": None,
        "verified": True,
        "position_bits_per_kept": None,
        "entropy_bits_per_kept": None,
        "hash_tables": "built once per slot, outside the timed region",
    }
    none_side = {
        f"{side}{suffix}": None
        for side in ("compress_encode", "decode_decompress")
        for suffix in ("_s", "_gbps", "_vs_memcpy")
    }
    sketch_gbps = gbps(numel, m["sketch_s"])
    unsketch_gbps = gbps(numel, m["unsketch_s"])
    return [
        {
            **common,
            **none_side,
            "compressor": "sketch (sketch)",
            "part": "sketch",
            "setting": f"{label}: {shape}, tables prebuilt",
            "encoded_bytes": 4 * size,
            "bits_per_element": 32.0 * size / numel,
            "ratio_vs_fp32": numel / size,
            "compress_encode_s": m["sketch_s"],
            "compress_s": m["sketch_s"],
            "decompress_s": None,
            "compress_encode_gbps": sketch_gbps,
            "compress_encode_vs_memcpy": sketch_gbps / memcpy_gbps,
        },
        {
            **common,
            **none_side,
            "compressor": "sketch (unsketch)",
            "part": "unsketch",
            "setting": f"{label}: {shape}, estimate + top {m['selected']}, tables prebuilt",
            "encoded_bytes": None,
            "bits_per_element": None,
            "ratio_vs_fp32": None,
            "compress_s": None,
            "decode_decompress_s": m["unsketch_s"],
            "decompress_s": m["unsketch_s"],
            "decode_decompress_gbps": unsketch_gbps,
            "decode_decompress_vs_memcpy": unsketch_gbps / memcpy_gbps,
        },
    ]
