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
from dataclasses import dataclass
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
    scheme = _sketch_scheme(names, sketch_params)
    dev = _checked_device(device)
    say = progress or (lambda _msg: None)
    timer = timing.Timer(dev)
    started = time.perf_counter()
    run = _Run(repeats, timer, _meta(dev, size, repeats), say, scheme, sketch_params)
    if scheme is not None:
        run.meta["sketch_params"] = sketch_params
    # Every input is made, and the sketch's plan for it checked, before anything is timed.
    prepared = [_prepared_input(input_name, size, dev, scheme) for input_name in input_names]
    rows: list[dict[str, Any]] = []
    while prepared:
        input_name, x, desc, plan = prepared.pop(0)
        rows += _input_rows(run, names, input_name, x, desc, plan)
        del x
    run.meta["seconds"] = time.perf_counter() - started
    run.meta["loadavg_after"] = timing.loadavg()
    return targets.apply_targets({"meta": run.meta, "rows": rows})


@dataclass
class _Run:
    """What every row of one ``run_bench`` shares: the repeats, the clock, the metadata it fills in, the progress
    callback, and the sketch scheme with its parameters (None without sketch rows)."""

    repeats: int
    timer: timing.Timer
    meta: dict[str, Any]
    say: Callable[[str], None]
    scheme: SketchedSGD | None
    sketch_params: dict[str, Any]


def _sketch_scheme(names: Sequence[str], sketch_params: dict[str, Any]) -> SketchedSGD | None:
    """The sketched SGD scheme of the sketch rows, made from ``sketch_params`` (checked now); None without them,
    and ConfigError for parameters given without sketch among the compressors."""
    if "sketch" in names:
        scheme = make("sketch", **sketch_params)
        assert isinstance(scheme, SketchedSGD)
        return scheme
    if sketch_params:
        raise ConfigError("sketch parameters (--param) were given, but sketch is not among the compressors")
    return None


def _checked_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device; ConfigError for CUDA without a CUDA device, or a device other than cpu/cuda."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda requested but torch.cuda.is_available() is False")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu or cuda, got {str(device)!r}")
    return dev


def _meta(dev: torch.device, size: int, repeats: int) -> dict[str, Any]:
    """The result's ``meta`` as a run starts: the machine, the versions, the load, the settings; the inputs'
    descriptions and copy rates, the skipped rows and the run's seconds are filled in as it goes."""
    return {
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


def _prepared_input(input_name: str, size: int, dev: torch.device,
                    scheme: SketchedSGD | None) -> tuple[str, Tensor, str, SlotPlan | None]:
    """One input made on ``dev``: its name, tensor, description, and the sketch's plan for it (checked now, so a
    sketch that cannot run on it fails before anything is timed; None without sketch rows)."""
    if input_name == "synthetic":
        x = cases.synthetic_gradient(size).to(dev)
        desc = (
            f"heavy-tailed synthetic: N(0,1) x log-normal scale per {cases.SYNTHETIC_BLOCK}-element block "
            f"(sigma {cases.SYNTHETIC_LOG_SIGMA}), seed {cases.SYNTHETIC_SEED}"
        )
    else:
        x, desc = cases.model_gradient(dev)
    plan = None if scheme is None else sketch_halves.sketch_plan(scheme, x.numel(), f"input {input_name}")
    return input_name, x, desc, plan


def _input_rows(run: _Run, names: Sequence[str], input_name: str, x: Tensor, desc: str,
                plan: SlotPlan | None) -> list[dict[str, Any]]:
    """One input's rows: its memcpy reference first, then each compressor's (every setting; sketch's two halves),
    each timed beside a copy of the input; the input, its copy rate and what is skipped go into ``run.meta``."""
    numel = x.numel()
    run.meta["inputs"][input_name] = {"numel": numel, "description": desc}
    run.say(f"bench: input {input_name}: {numel:,} elements ({desc})")

    memcpy_s = timing.measure_memcpy(x, run.repeats, run.timer)
    copy_to = torch.empty_like(x)  # the copy timed beside each repeat (timing.bench_one)
    memcpy_gbps = timing.gbps(numel, memcpy_s)
    run.meta["memcpy_gbps"][input_name] = memcpy_gbps
    rows: list[dict[str, Any]] = [{
        "input": input_name, "numel": numel, "compressor": "memcpy", "setting": "y.copy_(x)", "params": {},
        "encoded_bytes": 4 * numel, "bits_per_element": 32.0, "ratio_vs_fp32": 1.0,
        "compress_encode_s": memcpy_s, "decode_decompress_s": memcpy_s, "compress_encode_gbps": memcpy_gbps,
        "decode_decompress_gbps": memcpy_gbps, "compress_encode_vs_memcpy": 1.0,
        "decode_decompress_vs_memcpy": 1.0, "verified": True,
    }]
    for name in names:
        if name == "sketch":
            assert plan is not None
            rows += _sketch_rows(run, plan, x, input_name, memcpy_gbps)
            continue
        for setting in cases.SETTINGS.get(name, [{}]):
            row = _compressor_row(run, name, setting, x, input_name, copy_to, memcpy_gbps)
            if row is not None:
                rows.append(row)
    return rows


def _sketch_rows(run: _Run, plan: SlotPlan, x: Tensor, input_name: str, memcpy_gbps: float) -> list[dict[str, Any]]:
    """Sketched SGD's two rows on one input (its round 1 timed in two halves), or none, noted as skipped, where
    the input is below the scheme's ``min_size`` and would be sent dense."""
    scheme = run.scheme
    assert scheme is not None
    numel = x.numel()
    label = cases.setting_label(run.sketch_params, run.sketch_params)
    what = f"sketch [{label}] on {input_name}"
    if not plan.compressed:
        note = f"{what}: {numel} coordinates are below min_size={scheme.min_size}: sent dense, no sketch"
        run.meta["skipped"].append(note)
        run.say(f"bench: skipped {note}")
        return []
    run.say(f"bench: {what} (sketch and unsketch)")
    m = sketch_halves.bench_sketch(scheme, plan, x, run.repeats, run.timer, what)
    return sketch_halves.sketch_rows(scheme, plan, m, input_name, numel, memcpy_gbps, label)


def _compressor_row(run: _Run, name: str, setting: dict[str, Any], x: Tensor, input_name: str, copy_to: Tensor,
                    memcpy_gbps: float) -> dict[str, Any] | None:
    """One compressor's row at one setting on one input (``timing.bench_one``: a sender and a separate receiver,
    every round trip verified); None, noted as skipped, where the setting is refused on this input."""
    numel = x.numel()
    resolved = {k: (v.resolve(x) if isinstance(v, cases.AbsQuantile) else v) for k, v in setting.items()}
    label = cases.setting_label(setting, resolved)
    what = f"{name} [{label}] on {input_name}"
    try:
        compressor = make(name, **resolved)
        receiver = make(name, **resolved)
    except ConfigError as exc:
        run.meta["skipped"].append(f"{what}: {exc}")
        run.say(f"bench: skipped {what}: {exc}")
        return None
    run.say(f"bench: {what}")
    cast_to = targets.CAST_DTYPES.get(name)
    m = timing.bench_one(compressor, receiver, x, run.repeats, run.timer, what, copy_to, cast_to)
    bits = 8.0 * m["encoded_bytes"] / numel
    ce_gbps = timing.gbps(numel, m["compress_encode_s"])
    dd_gbps = timing.gbps(numel, m["decode_decompress_s"])
    beside, cast, reference = m["memcpy_beside_s"], m["cast_beside_s"], m["cast_checksum_beside_s"]
    return {
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
    }


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
