"""How many times a training step may make the host wait for a GPU, per method: the budget tests enforce.

One steady-state step of a small model (three parameter tensors, four slots after DDP's bucketing: a 64x40 and a
10x64 weight and two biases) at world size 1, counted on the CPU by tests/test_sync_count.py as described there;
"aggregator" is ``GradientAggregator.step()``, "ddp" the backward pass with gradcomp's DDP hook (on the autograd
thread and the hook's communication thread). Counts grow with the number of slots where a method synchronises
per slot (the notes say where). docs/gpu.md shows the same numbers in a table that tests/test_sync_count.py checks
against this module.

``FIXED_SIZE`` are the methods whose messages have a size known from the configuration alone; the aim for them
is zero. What each count is made of is in ``NOTES``; ``BEFORE`` is the same count at a703d48, before the device
checksum and the device decode (measured the same way, except that a703d48 could not route CPU tensors through its
device code, so its CPU-only branches were counted where a GPU would have run others: random-k's numpy rounds
count fewer there than the torch rounds a GPU runs).
"""

from __future__ import annotations

FIXED_SIZE = (
    "none", "fp16", "bf16", "topk", "randomk", "randomblock", "powersgd", "signsgd", "signum", "efsignsgd",
    "onebit", "cnat", "qsgd", "terngrad", "terngrad_shared", "natural_dithering", "random_dithering", "sketch",
    "local_topk", "true_topk",
)  # fmt: skip

_FINITE = (
    "1 finiteness check of this worker's gradients (finite.finite_flags, on the DDP hook's communication thread) and "
    "1 read of the agreed verdict that rode on the step's first message (exchange._marked)"
)
_READ = (
    "1 read of every decoded message's checks (header, checksum, section heads, padding, positions) together with "
    "the finiteness of the aggregate sums (wire.container.DeviceChecks, once per exchange whatever the world size)"
)
_SIZES = (
    "1 size exchange (sizes.exchange_sizes); per message received: 1 transfer of the whole message to the host (its "
    "section headers and checksum: the layout depends on the data); 1 read of every message's data checks (padding, "
    "positions, Golomb code structure) together with the finiteness of the aggregate sums (wire.container."
    "DeviceChecks, once per exchange whatever the world size)"
)
_GOLOMB_LENGTHS = "1 read of the message's Golomb stream lengths, all slots at once (wire.container._golomb_lengths)"
_NONZERO = "accumulation.largest: nonzero on the selection mask (2 per selection)"
_PADDING = "sign._check_packed: the padding bits of the last sign byte (per slot with a partial byte)"

# name: (aggregator, ddp, notes)
_TABLE: dict[str, tuple[int, int, str]] = {
    "none": (2, 2, _FINITE),
    "fp16": (2, 2, _FINITE),
    "bf16": (2, 2, _FINITE),
    "randomblock": (2, 2, _FINITE),
    "topk": (3, 3, f"{_FINITE}; {_READ}"),
    "signsgd": (4, 4, f"{_FINITE}; {_READ}; 1 {_PADDING}"),
    "signum": (4, 4, f"{_FINITE}; {_READ}; 1 {_PADDING}"),
    "powersgd": (4, 4, f"{_FINITE}; 2 zero-column checks of Q (powersgd._prepare_q, one per group)"),
    "local_topk": (6, 6, f"{_FINITE}; {_NONZERO}; 1 read of the gathered container's checks; 1 range check of the "
                   "received coordinates (accumulation.split_indices)"),
    "true_topk": (4, 4, f"{_FINITE}; {_NONZERO}"),
    "sketch": (7, 7, f"{_FINITE}; {_NONZERO} (x2); 1 boolean index (sketch.run)"),
    "terngrad_shared": (7, 7, f"{_FINITE}; 1 read of the decoded message's checks; 4 finiteness checks of max|g| "
                        "(terngrad._clip, per slot)"),
    "cnat": (7, 7, f"{_FINITE}; {_READ}; 4 finiteness checks of the input (natural.cnat_encode, per slot)"),
    "qsgd": (7, 7, f"{_FINITE}; {_READ}; 4 finiteness checks of the norm (per slot)"),
    "natural_dithering": (7, 7, f"{_FINITE}; {_READ}; 4 finiteness checks of the norm (per slot)"),
    "random_dithering": (7, 7, f"{_FINITE}; {_READ}; 4 finiteness checks of the norm (per slot)"),
    "terngrad": (7, 7, f"{_FINITE}; {_READ}; 4 finiteness checks of max|g| (terngrad._clip, per slot)"),
    "efsignsgd": (9, 9, f"{_FINITE}; {_READ}; 4 finiteness checks of g + residual (sign._finite_or_f64, per slot); "
                  f"2 {_PADDING}"),
    "onebit": (9, 9, f"{_FINITE}; {_READ}; 4 finiteness checks of g + residual (sign._finite_or_f64, per slot); "
               f"2 {_PADDING}"),
    "randomk": (18, 18, f"{_FINITE}; sampling k distinct positions (sparse.sample_without_replacement: per slot and "
                "round, 1 count of the distinct draws and 2-3 boolean indexings)"),
    "lgc": (6, 6, f"{_FINITE}; {_NONZERO} (the leader's top-k); 1 read of the Golomb stream's length (the leader "
            "encoding; the other workers read the broadcast length instead, sizes.broadcast_buffer); 1 read of the "
            "decoded positions' checks (one Golomb section of known count: its length follows from the message's, "
            "decoded on the device like a fixed layout)"),
    "sbc": (6, 6, f"{_FINITE}; {_GOLOMB_LENGTHS}; {_SIZES}"),
    "threshold": (6, 6, f"{_FINITE}; 1 read of all the slots' selection counts (sparse.Threshold.compress_slots, once "
                  f"per message); {_SIZES}"),
    "stc": (7, 7, f"{_FINITE}; 1 read of all the slots' counts of nonzero kept entries (sbc.SparseTernary."
            f"compress_slots, once per message); {_GOLOMB_LENGTHS}; {_SIZES}"),
    "dgc": (8, 8, f"{_FINITE}; 1 read of all the slots' counts of candidates above their sampled thresholds and 1 "
            "of keep_largest's two conditions for all the slots with more candidates than k (dgc.DGC.compress_slots, "
            "once per message; a slot with too few candidates lowers its threshold on its own, with reads: rare); "
            f"{_GOLOMB_LENGTHS}; {_SIZES}"),
}  # fmt: skip

BUDGETS: dict[str, dict[str, int]] = {name: {"aggregator": a, "ddp": d} for name, (a, d, _) in _TABLE.items()}
NOTES: dict[str, str] = {name: note for name, (_, _, note) in _TABLE.items()}

BEFORE: dict[str, tuple[int | None, int | None]] = {
    "bf16": (5, 5), "cnat": (29, 29), "dgc": (84, 84), "efsignsgd": (35, 35), "fp16": (5, 5), "lgc": (None, None),
    "local_topk": (3, 3), "natural_dithering": (33, 33), "none": (1, 1), "onebit": (35, 35), "powersgd": (3, 3),
    "qsgd": (25, 25), "random_dithering": (33, 33), "randomblock": (1, 1), "randomk": (9, 9), "sbc": (72, 72),
    "signsgd": (30, 30), "signum": (30, 30), "sketch": (6, 6), "stc": (92, 92), "terngrad": (33, 33),
    "terngrad_shared": (25, 25), "threshold": (54, 54), "topk": (45, 45), "true_topk": (3, 3),
}  # fmt: skip


def markdown_table() -> str:
    """The table of docs/gpu.md (tests/test_sync_count.py checks that the page shows these numbers)."""
    lines = [
        "| method | message size | aggregator step | DDP hook step | at a703d48 (aggregator / DDP) | what they are |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name in sorted(_TABLE, key=lambda n: (n not in FIXED_SIZE, _TABLE[n][0], n)):
        a, d, note = _TABLE[name]
        before = BEFORE.get(name, (None, None))
        was = "–" if before[0] is None else f"{before[0]} / {before[1]}"
        kind = "fixed" if name in FIXED_SIZE else "variable"
        lines.append(f"| `{name}` | {kind} | {a} | {d} | {was} | {note} |")
    return "\n".join(lines)
