"""How many times a training step may make the host wait for a GPU, per method: the budget tests enforce.

One steady-state step of a small model (three parameter tensors, four slots after DDP's bucketing: a 64x40 and a
10x64 weight and two biases) at world size 1, counted on the CPU by tests/test_sync_count.py as described there;
"aggregator" is ``GradientAggregator.step()``, "ddp" the backward pass with gradcomp's DDP hook (on the autograd
thread and the hook's communication thread). Counts grow with the number of slots where a method synchronises
per slot (the notes say where). docs/gpu.md shows the same numbers in a table that tests/test_sync_count.py checks
against this module.

``FIXED_SIZE`` are the methods whose messages have a size known from the configuration alone: one read per
exchange each for the aggregator (per step), one per backward pass for the DDP hook (at its last bucket, whatever
the number of buckets: every bucket's verdict and checks wait on the device until then), the workers' finiteness
verdict (with the wire's checks where there are any), which decides, before anything of the step is applied,
whether the step stands (docs/gpu.md says why it is not zero). What each count
is made of is in ``NOTES``; the budgets are the measured counts exactly (tests/test_sync_count.py fails on a count
above or below its budget); ``BEFORE`` is the same count at a703d48, before the device
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

# The stateless all-reduces, whose sum carries a bad worker's NaN to every worker (Scheme.verdict_in_result): the
# exchange takes no verdict of theirs at all when the result is handed on to a GradScaler or the user's check
VERDICT_IN_RESULT = ("bf16", "fp16", "none", "randomblock", "randomk")

# The methods whose one read is the verdict after the last round (all-reduces only: no message decoded by the wire).
# Under a GradScaler or nonfinite="propagate" the DDP hook reads nothing of theirs (0 instead of their "ddp" budget
# below), nor does GradientAggregator(nonfinite="propagate") (0 instead of "aggregator"): the stateless ones need no
# verdict, the others' (PowerSGD, sketched SGD, true top-k) is applied on the device, NaN in every result and the
# state put back where it says so (comm_thread._CommThread._pass_handed_on, GradientAggregator._handed_on), except in
# a step in which a slot's state first appears, which reads it once
READS_NOTHING_HANDED_ON = ("bf16", "fp16", "none", "powersgd", "randomblock", "randomk", "sketch", "true_topk")

_VERDICT = (
    "1 read, after the last round, of the workers' agreed finiteness verdict, a device flag that rode on the step's "
    "first message (agreement._drive_deferred); the DDP hook reads it once per backward pass, at its last bucket, "
    "whatever the number of buckets"
)
_PASS = (
    "; the DDP hook holds every bucket's checks and verdict on the device and reads them once per backward pass, "
    "at its last bucket, whatever the number of buckets (wire.device.hold_for_the_pass)"
)
_WITH_CHECKS = (
    "1 read of the agreed finiteness verdict (a device flag that rode on the step's first message) in the same "
    "transfer as every decoded message's checks (header, checksum, section heads, padding, positions, the sign "
    "bitmaps' padding bits), and the finiteness of the aggregate sums (wire.device.DeviceChecks, once per "
    f"exchange whatever the world size){_PASS}"
)
_SIZES = (
    "1 size exchange, which carries every message's layout values (its free sections' counts and its Golomb "
    "streams' lengths: wire.format.layout_values, sizes.exchange_lengths) and the workers' finiteness verdict as "
    "well (a bad worker's values n travel as -1 - n, marked on the device: agreement._drive_deferred); every "
    "received message is then decoded on the device, its layout known, nothing of it brought to the host; 1 read "
    "of every message's checks (header, checksum, section heads against the layout values, padding, positions, "
    "Golomb code structure) together with the finiteness of the aggregate sums (wire.device.DeviceChecks, once "
    "per exchange whatever the world size; the DDP hook holds this last read for the backward pass and makes it "
    "once, at its last bucket, with the other buckets': wire.device.hold_for_the_pass)"
)
_STREAMS = (
    "; the size exchange's read brings this worker's Golomb stream lengths too, computed on the device before "
    "encoding (wire.format.length_on_device), so that encoding reads nothing"
)

_DIRECT = (
    "the DDP hook all-reduces the bucket (or its cast) itself and its communication thread reads the pass's reduced "
    "first entries at the last bucket (a callback would run on the autograd thread under NCCL); with a scaler, 0"
)

# name: (aggregator, ddp, notes)
_TABLE: dict[str, tuple[int, int, str]] = {
    "none": (1, 1, f"{_VERDICT}; {_DIRECT}"),
    "fp16": (1, 1, f"{_VERDICT}; {_DIRECT}"),
    "bf16": (1, 1, f"{_VERDICT}; {_DIRECT}"),
    "randomblock": (1, 1, _VERDICT),
    "randomk": (1, 1, f"{_VERDICT}; the k positions are sampled with sizes known in advance "
                "(sparse._first_distinct_fixed)"),
    "powersgd": (1, 1, f"{_VERDICT}; a zero column of Q is refilled by torch.where, not looked for"),
    "true_topk": (1, 1, f"{_VERDICT}; the selection is fixed-size (accumulation._largest_on_device)"),
    "sketch": (1, 1, f"{_VERDICT}; fixed-size selections, what was sent masked rather than indexed"),
    "topk": (1, 1, _WITH_CHECKS),
    "signsgd": (1, 1, _WITH_CHECKS),
    "signum": (1, 1, _WITH_CHECKS),
    "efsignsgd": (1, 1, f"{_WITH_CHECKS}; a non-finite g + residual travels in the message (no check of its own)"),
    "onebit": (1, 1, f"{_WITH_CHECKS}; a non-finite g + residual travels in the message (no check of its own)"),
    "cnat": (1, 1, f"{_WITH_CHECKS}; a NaN / Inf input travels as exponent code 255 (no check of its own)"),
    "qsgd": (1, 1, f"{_WITH_CHECKS}; a non-finite norm travels in the message (no check of its own)"),
    "natural_dithering": (1, 1, f"{_WITH_CHECKS}; a non-finite norm travels in the message (no check of its own)"),
    "random_dithering": (1, 1, f"{_WITH_CHECKS}; a non-finite norm travels in the message (no check of its own)"),
    "terngrad": (1, 1, f"{_WITH_CHECKS}; a non-finite max|g| travels as the scale (no check of its own)"),
    "terngrad_shared": (1, 1, "1 read of the agreed verdict with the decoded messages' checks; a non-finite scaler "
                        f"goes into the max-allreduce as +Inf (no check of its own){_PASS}"),
    "local_topk": (1, 1, "1 read of the agreed verdict with the gathered messages' checks and the range check of "
                   f"their coordinates (accumulation.split_indices, handed to DeviceChecks){_PASS}"),
    "lgc": (2, 2, "1 size read: the Golomb stream's length of the leader's positions (the leader encoding; the "
            "other workers read the broadcast length instead, sizes.broadcast_buffer); 1 read of the agreed verdict, "
            "marked on the device on the first message every worker contributes to (the leader's broadcasts pass "
            "first: agreement._drive_deferred, LGC.defers_verdict) in the same transfer as every decoded message's "
            "checks (the positions' Golomb section of known count, decoded on the device like a fixed layout, "
            f"clamped into the slot until then: lgc._decoded){_PASS}"),
    "sbc": (2, 2, f"{_SIZES}{_STREAMS}"),
    "threshold": (2, 2, f"{_SIZES}; the size exchange's read brings this worker's selection counts too: the slots' "
                  "masks |x| > threshold are counted on the device and compacted once the counts are read "
                  "(compressors.base.SizedSelection: Threshold.select_sized, ErrorFeedback.select_sized)"),
    "stc": (2, 2, f"{_SIZES}; the size exchange's read brings this worker's counts of nonzero kept entries and its "
            "Golomb streams' lengths too, both computed on the device from the top-k and its nonzero mask (the Rice "
            "parameter follows from k, not from the count: sbc.SparseTernary.select_sized)"),
    "dgc": (2, 2, f"{_SIZES}; the size exchange's read brings this worker's counts of nonzero entries among each "
            "slot's k largest |v| and its Golomb streams' lengths too (torch.topk over the slot on the device path "
            "instead of the sampled threshold, whose candidates' count would be read; the Rice parameter of each "
            "count computed on the device: dgc.DGC.select_sized, wire.golomb.rice_parameter_on_device); with clip, "
            "compress_slots reads the norm and the counts (not counted here)"),
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


# Topologies: reads per worker and step of a fixed-size method (C_nat, top-k, none: the same counts) under
# GradientAggregator on the simulated cluster, whatever W; (the parameter server's root or shard owner, each other
# worker), (the same at 2782a3e), what they are. tests/test_sync_count.py counts them at W = 2 and 3.
TOPOLOGIES: dict[str, tuple[tuple[int, int], tuple[int, int], str]] = {
    "allgather": ((1, 1), (1, 1), "the budget above: the verdict with every message's checks, once per step"),
    "sharded": ((2, 2), (5, 5), "1 read at each shard owner of the W buffers it received, their checks with the "
                "agreed verdict (which rode on the all-to-all: Sharded.defers_verdict), before it compresses its "
                "aggregate again (a message that fails its checks, or a sum that overflowed, must be known before "
                "anything is sent on); 1 read, at the step's end, of the owners' downstream buffers' checks, held for "
                "it (wire.device.hold_for_the_pass)"),
    "ps": ((2, 1), (6, 4), "every worker: 1 read at the step's end, of the downstream message's checks (held for "
           "it) with the mark of the root's broadcast; the root also: 1 read of the gathered messages' checks with "
           "the agreed verdict (which rode on the gather: SingleRound.passes_verdict_on) before it compresses their "
           "aggregate again; a bad verdict, or an aggregate that is not finite, goes on in place of its broadcast "
           "(wire.refusals.AbandonedHere), and every worker abandons the step at its step's end read"),
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


def topology_table() -> str:
    """The topologies' table of docs/gpu.md (tests/test_sync_count.py checks that the page shows these numbers)."""
    lines = [
        "| topology | root or owner | each other worker | at 2782a3e | what they are |",
        "|---|---:|---:|---:|---|",
    ]
    for name, ((root, other), (was_root, was_other), note) in TOPOLOGIES.items():
        lines.append(f"| `{name}` | {root} | {other} | {was_root} / {was_other} | {note} |")
    return "\n".join(lines)
