"""``gradcomp bench``: bits per element and throughput of every registered compressor, wire format included.

For each compressor (its representative settings, :data:`~gradcomp.experiments.bench.cases.SETTINGS`) on each
input, it times what a sender does (compress + encode) and what a receiver does (decode + decompress, on a
second instance), gives the encoded bits per element, and reads each throughput against a memory copy of the
same tensor timed beside the row: absolute GB/s move with the machine, a fraction of the copy far less. Every
round trip is verified, so broken code is never timed (:class:`BenchError`). Sketched SGD's round 1 is timed in
its two halves. The targets are data (bench_targets.json). docs/bench.md says what is measured and how;
docs/bench_targets.md the targets.

The parts: ``cases`` (inputs and settings), ``timing`` (the clock, the copy reference, one row's timed and
verified rounds), ``sketch_halves``, ``targets``, ``report``; this module runs them and is the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from gradcomp import allocator
from gradcomp.errors import ConfigError
from gradcomp.experiments.bench import cases, sketch_halves, targets, timing
from gradcomp.experiments.bench.report import format_report
from gradcomp.registry import make, parse_param_strings
from gradcomp.schemes.sketch import SketchedSGD, SlotPlan

DEFAULT_REPEATS = 5
# A single copy of fewer entries is too short to time alone (docs/bench.md): no xbeside there.
BESIDE_MIN_NUMEL = 1_000_000


def run_bench(
    size: int = cases.DEFAULT_SIZE,
    repeats: int = DEFAULT_REPEATS,
    compressors: Sequence[str] | None = None,
    inputs: Sequence[str] = cases.INPUT_NAMES,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
    sketch_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns ``{"meta": {...}, "rows": [...]}`` (the same object ``--json`` writes).

    Rows come grouped by input, a ``memcpy`` reference row first in each group. Every row has: ``input``,
    ``numel``, ``compressor``, ``setting`` (printable), ``params`` (the compressor's full ``params()``),
    ``encoded_bytes``, ``bits_per_element`` (= 8 * encoded_bytes / numel), ``ratio_vs_fp32``, the median
    seconds ``compress_encode_s`` / ``decode_decompress_s`` (and their four parts), the throughputs
    ``compress_encode_gbps`` / ``decode_decompress_gbps`` (GB/s of fp32 input) and ``*_vs_memcpy`` fractions.

    fp16 and bf16 rows also have ``cast_beside_s``, ``checksum_beside_s`` and ``cast_checksum_beside_s`` (a cast of
    the input and the wire's checksum of its bytes, timed beside each repeat), ``compress_encode_vs_cast`` (against
    the bare cast) and ``compress_encode_vs_cast_checksum`` / ``encode_decode_vs_cast_checksum`` /
    ``decode_decompress_vs_cast_checksum`` (against the cast plus its checksum).

    Every row also has ``target`` (None where none applies), ``target_kind``, ``target_basis`` (how the target was
    set), ``target_value`` (the figure judged) and ``target_met``; ``meta["targets"]`` lists the rows that met and
    that missed theirs (``targets.apply_targets``).

    ``sketch`` gives two rows, ``sketch (sketch)`` (its time in the ``compress_encode_*`` keys and
    ``compress_s``) and ``sketch (unsketch)`` (in ``decode_decompress_*`` and ``decompress_s``); their other keys
    are None, and they add ``method``, ``part``, ``plan`` and ``hash_tables``. ``sketch_params`` go to
    ``gradcomp.make("sketch", ...)``; they and the plan for every input are checked before anything is timed.
    Raises ConfigError for bad arguments and BenchError when a round trip is broken.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be a positive integer, got {repeats!r}")
    names = cases.check_names(compressors)
    input_names = cases.check_inputs(inputs)
    sketch_params = dict(sketch_params or {})
    scheme: SketchedSGD | None = None
    if "sketch" in names:
        scheme = make("sketch", **sketch_params)
        assert isinstance(scheme, SketchedSGD)
    elif sketch_params:
        raise ConfigError("sketch parameters (--param) were given, but sketch is not among the compressors")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda requested but torch.cuda.is_available() is False")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu or cuda, got {str(device)!r}")
    say = progress or (lambda _msg: None)
    timer = timing.Timer(dev)
    started = time.perf_counter()

    meta: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "allocator": allocator.state(),
        "loadavg_before": timing.loadavg(),
        "size": size,
        "repeats": repeats,
        "statistic": "median",
        "inputs": {},
        "memcpy_gbps": {},
        "skipped": [],
    }
    if scheme is not None:
        meta["sketch_params"] = sketch_params
    # Every input is made, and the sketch's plan for it checked, before anything is timed.
    prepared: list[tuple[str, Tensor, str, SlotPlan | None]] = []
    for input_name in input_names:
        if input_name == "synthetic":
            x = cases.synthetic_gradient(size).to(dev)
            desc = (
                f"heavy-tailed synthetic: N(0,1) x log-normal scale per {cases.SYNTHETIC_BLOCK}-element block "
                f"(sigma {cases.SYNTHETIC_LOG_SIGMA}), seed {cases.SYNTHETIC_SEED}"
            )
        else:
            x, desc = cases.model_gradient(dev)
        plan = None if scheme is None else sketch_halves.sketch_plan(scheme, x.numel(), f"input {input_name}")
        prepared.append((input_name, x, desc, plan))
        del x
    rows: list[dict[str, Any]] = []
    while prepared:
        input_name, x, desc, plan = prepared.pop(0)
        numel = x.numel()
        meta["inputs"][input_name] = {"numel": numel, "description": desc}
        say(f"bench: input {input_name}: {numel:,} elements ({desc})")

        memcpy_s = timing.measure_memcpy(x, repeats, timer)
        copy_to = torch.empty_like(x)  # the copy timed beside each repeat (timing.bench_one)
        memcpy_gbps = timing.gbps(numel, memcpy_s)
        meta["memcpy_gbps"][input_name] = memcpy_gbps
        rows.append({
            "input": input_name, "numel": numel, "compressor": "memcpy", "setting": "y.copy_(x)", "params": {},
            "encoded_bytes": 4 * numel, "bits_per_element": 32.0, "ratio_vs_fp32": 1.0,
            "compress_encode_s": memcpy_s, "decode_decompress_s": memcpy_s, "compress_encode_gbps": memcpy_gbps,
            "decode_decompress_gbps": memcpy_gbps, "compress_encode_vs_memcpy": 1.0,
            "decode_decompress_vs_memcpy": 1.0, "verified": True,
        })
        for name in names:
            if name == "sketch":
                assert scheme is not None and plan is not None
                label = cases.setting_label(sketch_params, sketch_params)
                what = f"sketch [{label}] on {input_name}"
                if not plan.compressed:
                    note = f"{what}: {numel} coordinates are below min_size={scheme.min_size}: sent dense, no sketch"
                    meta["skipped"].append(note)
                    say(f"bench: skipped {note}")
                    continue
                say(f"bench: {what} (sketch and unsketch)")
                m = sketch_halves.bench_sketch(scheme, plan, x, repeats, timer, what)
                rows += sketch_halves.sketch_rows(scheme, plan, m, input_name, numel, memcpy_gbps, label)
                continue
            for setting in cases.SETTINGS.get(name, [{}]):
                resolved = {k: (v.resolve(x) if isinstance(v, cases.AbsQuantile) else v) for k, v in setting.items()}
                label = cases.setting_label(setting, resolved)
                what = f"{name} [{label}] on {input_name}"
                try:
                    compressor = make(name, **resolved)
                    receiver = make(name, **resolved)
                except ConfigError as exc:
                    meta["skipped"].append(f"{what}: {exc}")
                    say(f"bench: skipped {what}: {exc}")
                    continue
                say(f"bench: {what}")
                cast_to = targets.CAST_DTYPES.get(name)
                m = timing.bench_one(compressor, receiver, x, repeats, timer, what, copy_to, cast_to)
                bits = 8.0 * m["encoded_bytes"] / numel
                ce_gbps = timing.gbps(numel, m["compress_encode_s"])
                dd_gbps = timing.gbps(numel, m["decode_decompress_s"])
                beside, cast, reference = m["memcpy_beside_s"], m["cast_beside_s"], m["cast_checksum_beside_s"]
                rows.append({
                    "input": input_name, "numel": numel, "compressor": name, "setting": label,
                    "params": compressor.params(), "bits_per_element": bits, "ratio_vs_fp32": 32.0 / bits,
                    **{k: m[k] for k in (
                        "encoded_bytes", "compress_encode_s", "decode_decompress_s", "compress_s", "encode_s",
                        "decode_s", "decompress_s", "encode_decode_s", "memcpy_beside_s", "cast_beside_s",
                        "checksum_beside_s", "cast_checksum_beside_s", "warmup_rounds",
                        "first_timed_step", "minor_faults_per_repeat", "verified",
                    )},
                    "compress_encode_gbps": ce_gbps, "decode_decompress_gbps": dd_gbps,
                    "compress_encode_vs_memcpy": ce_gbps / memcpy_gbps,
                    "decode_decompress_vs_memcpy": dd_gbps / memcpy_gbps,
                    "compress_encode_vs_memcpy_beside": (
                        beside / m["compress_encode_s"] if numel >= BESIDE_MIN_NUMEL else None
                    ),
                    "compress_encode_vs_cast": m["compress_encode_s"] / cast if cast else None,
                    # fp16 / bf16: against a cast plus the wire's checksum of its bytes, timed beside each repeat
                    # (the target's reference); the sender's and the wire's round trip's parts against it
                    **{f"{k}_vs_cast_checksum": m[f"{k}_s"] / reference if reference else None
                       for k in ("compress_encode", "encode_decode", "decode_decompress")},
                    "position_bits_per_kept": m["position_bits"], "entropy_bits_per_kept": m["entropy_bits"],
                })
        del x
    meta["seconds"] = time.perf_counter() - started
    meta["loadavg_after"] = timing.loadavg()
    return targets.apply_targets({"meta": meta, "rows": rows})


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--size", type=int, default=cases.DEFAULT_SIZE, help="elements of the synthetic input tensor")
    add("--repeats", type=int, default=DEFAULT_REPEATS,
        help="timed runs after the warm-up (median); each row warms up until a round takes no page fault, "
        f"1 to {timing.MAX_WARMUP_ROUNDS} rounds")
    add("--compressors", type=_csv, default=None, metavar="A,B,C", help="subset of compressors (default: all)")
    add("--inputs", type=_csv, default=list(cases.INPUT_NAMES), metavar="I,J", help="synthetic and/or model")
    add("--param", action="append", default=[], metavar="KEY=VALUE",
        help="parameter of the sketch rows, as gradcomp.make('sketch', ...) takes it (repeatable; e.g. "
        "density=0.001, rows=3); the other compressors run their fixed settings")
    add("--device", default="cpu", choices=["cpu", "cuda"])
    add("--json", default=None, metavar="PATH", help="write the rows and metadata as JSON")
    add("--no-model", action="store_true", help="skip the model-gradient input")
    add("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)")
    add("--quiet", action="store_true", help="no progress lines on stderr")


def main(args: argparse.Namespace) -> int:
    inputs = [i for i in args.inputs if not (args.no_model and i == "model")]
    if args.size < 1:
        raise ConfigError(f"--size must be positive, got {args.size}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be positive, got {args.threads}")
    if args.json:
        from gradcomp.experiments.run.report import check_output_file

        check_output_file(args.json, "--json")  # now, not after the whole benchmark
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        result = run_bench(
            size=args.size, repeats=args.repeats, compressors=args.compressors, inputs=inputs, device=args.device,
            progress=None if args.quiet else progress, sketch_params=parse_param_strings(getattr(args, "param", [])),
        )
    except timing.BenchError as exc:
        print(f"gradcomp bench: aborted: {exc}", file=sys.stderr)
        return 1
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0
