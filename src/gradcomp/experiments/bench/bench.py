"""``gradcomp bench``: bits per element and throughput of every registered compressor, wire format included.

What is measured, for every registered compressor (one or more representative parameter settings each, see
:data:`SETTINGS`) on each input tensor:

- **compress+encode**: ``compressor.compress(x, slot, step)`` then
  ``wire.encode(fields, compressor.specs(slot))`` -- everything a sender does to turn a flat gradient into bytes;
- **decode+decompress**: ``wire.decode(buf, specs)`` then ``receiver.decompress(fields, slot, step)`` --
  everything a receiver does to get the dense fp32 tensor back. The receiver is a second instance built with
  the same parameters, as on a server or peer that did not compress the message itself, so state the sender
  caches (random-k keeps the step's positions) does not hide the receiver's own work;
- **bits per element**: ``8 * len(buf) / numel`` of the encoded buffer, container and section headers
  included, and the **ratio** to fp32, ``32 / bits``;
- **throughputs** in GB/s of fp32 *input* (``4 * numel`` bytes divided by the time), each also given as a
  **fraction of the memory-copy rate**.

The inputs are (1) ``synthetic``: a seeded, heavy-tailed, gradient-like float32 tensor of ``--size`` elements
(standard normal times a log-normal scale per block of 4096 elements, so sparsifiers see realistic magnitude
spreads) and (2) ``model``: the gradient of SmallCNN (seed 0) on one MNIST batch of 64, flattened into one
vector (the "synthetic" dataset stands in when MNIST is not installed; the output says so).

How: each row's first round, and every later round that takes a minor page fault, is discarded (at most
:data:`MAX_WARMUP_ROUNDS` rounds): the first round without a fault is the first of ``--repeats`` timed
repeats, so rows are timed once the heap has settled, as in training's steady state; the **median** is
reported. The JSON rows say how many rounds were discarded (``warmup_rounds``, also the step of the first
timed repeat, ``first_timed_step``) and how many faults the repeats still took (``minor_faults_per_repeat``).
Every round uses a fresh step number, so step-seeded randomness (random-k positions) changes between repeats;
error feedback's state accumulates through the warm-up as through the repeats. On CUDA the device is
synchronized before and after every timed region (and the host's page faults say nothing about the device's
memory: the warm-up is one round there).

Two memory-copy references, both ``y.copy_(x)`` of the same tensor into a preallocated one, in the same run:

- the ``memcpy`` row printed first for each input: batches of back-to-back copies (median of ``--repeats``
  batches) measured before the rows; ``xmemcpy`` uses it (earlier rounds of this benchmark judged the targets
  against it; the report still gives that count);
- one copy timed beside each repeat of each row, after its decompress (``memcpy_beside_s``, median; the
  ``xbeside`` column, for inputs of at least :data:`BESIDE_MIN_NUMEL` entries): a single copy, not back to back
  with others, within the same second as the row's repeat. Measured over seven runs on the project's 2-core
  CPU machine (benchmarks/README.md), the batched copies took 1.9 to 3.3 ms for 40 MB (they run partly from
  the CPU's shared L3 cache), the single copies beside the rows 2.8 to 3.1 ms in all but one run, and a row's
  fraction of the copy beside it varied about a third less between runs than its fraction of the batched
  copy. The targets are judged against the copy beside the row.

Why ratios: absolute GB/s on a shared or noisy machine (CPU frequency scaling, other tenants, thread count)
move by tens of percent between runs, and memory bandwidth bounds any compressor that must at least read its
input. The fraction of memcpy measured minutes apart on the same tensor is far more stable and comparable
across machines than the raw number; bits per element are exact and do not depend on the machine at all.

Correctness guard: a benchmark must not time broken code. Every repeat checks that decompressing the decoded
fields gives exactly (``torch.equal``) the tensor that decompressing the un-encoded fields gives, and that
the compressor left its input untouched; the bench aborts with :class:`BenchError` otherwise. A compressor
whose ``decompress`` is not reproducible on identical fields (detected during warm-up: two calls differ) is
not checked for exact equality, and its rows say ``verified: false``.

Compressors without an entry in :data:`SETTINGS` run once, with their default parameters.

Targets (the figures live in ``bench_targets.json`` beside this module, not in code; docs/bench_targets.md
explains them):
every row of the synthetic input at the default size whose compressor has one is judged against references
timed beside it — the same tensor, in the same cache state, within the same second:

- fp16 and bf16: compress + encode at most 1.25 x a bare cast of the same tensor (``x.to(dtype)``, timed
  beside each repeat, ``cast_beside_s``; the row's ``compress_encode_vs_cast`` is the multiple);
- every other row: its compress+encode fraction of the copy timed beside it (``xbeside``) at least the largest
  of those that apply: twice GRACE's fraction where GRACE has the compressor (at GRACE's setting), 0.25 for
  single-pass compressors, 0.10 for the top-k family (:func:`row_target`).

The table says met or MISSED per row (``target_met``); the report ends with the rows that missed, and says
how the memcpy-fraction rows would fare against the batched ``memcpy`` row instead (``target_met_batched``);
``--json`` has all of it. They are CPU targets: with ``--device cuda`` no row has one (a GPU's copy runs at
TB/s, another reference).

Methods that own their communication rounds (Schemes: ``powersgd``, ``local_topk``, ``true_topk``) have no
single message to time and are not benchmarked, with one exception, ``sketch`` (sketched SGD), of which the
two halves of one worker's local work in round 1 are timed, the whole input being one slot:

- ``sketch (sketch)``: ``CountSketch.sketch(x, out=table)`` into a preallocated r×c table (the c+e columns);
- ``sketch (unsketch)``: ``CountSketch.estimate(table)`` (all d estimates, median over the r rows) followed by
  the selection of the P·k largest (``accumulation.largest``; k with ``rounds=1``) (the d+d columns),

with the r, c, k and P·k that ``SketchedSGD.plan()`` gives for a slot of the input's length and the parameters
given by ``--param KEY=VALUE`` (``sketch_params``; bad ones are a ConfigError before anything is timed). Both
throughputs are GB/s of the d-float input, as for every other row. The hash tables are built once per slot (as
in training, where they are cached) outside the timed region. The sketch row's bits per element are those of
the r×c fp32 table (``32·r·c / d``; sent raw by an allreduce, no wire headers; round 2's P·k exact values are
not counted); the unsketch row has none. Verification (warm-up): the table matches a float64 per-row bincount
of the same hashes, the estimates equal ``torch.median`` over rows exactly, the selection holds ``take``
distinct coordinates whose |estimates| are no smaller than any other's, and the input is untouched.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import resource
except ImportError:  # pragma: no cover - Windows has no resource module: the warm-up is then one round
    resource = None  # type: ignore[assignment]

import torch
from torch import Tensor

from gradcomp import allocator, wire
from gradcomp.compressors.base import Compressor, Slot
from gradcomp.compressors.countsketch import CountSketch
from gradcomp.errors import ConfigError
from gradcomp.registry import available, compressor_class, make, parse_param_strings
from gradcomp.schemes.accumulation import largest
from gradcomp.schemes.base import Scheme
from gradcomp.schemes.sketch import SketchedSGD, SlotPlan

__all__ = [
    "DEFAULT_REPEATS",
    "DEFAULT_SIZE",
    "INPUT_NAMES",
    "SCHEME_HALVES",
    "SETTINGS",
    "GRACE_FRACTIONS",
    "AbsQuantile",
    "BenchError",
    "add_arguments",
    "apply_targets",
    "format_table",
    "main",
    "model_gradient",
    "row_target",
    "run_bench",
    "synthetic_gradient",
]

DEFAULT_SIZE = 10_000_000
DEFAULT_REPEATS = 5
MAX_WARMUP_ROUNDS = 10  # warm-up rounds of one row at most, waiting for a round without page faults
# A single copy of fewer entries (the model input's 0.9 MB: 0.02 ms) is too short to time alone: no xbeside there.
BESIDE_MIN_NUMEL = 1_000_000
INPUT_NAMES: tuple[str, ...] = ("synthetic", "model")

SYNTHETIC_SEED = 0
SYNTHETIC_BLOCK = 4096  # elements sharing one log-normal scale (a "layer" or "channel")
SYNTHETIC_BASE_SCALE = 1e-3
SYNTHETIC_LOG_SIGMA = 1.5  # sigma of log(scale): scales span about three orders of magnitude

MODEL_NAME = "cnn"
MODEL_SEED = 0
MODEL_BATCH = 64


class BenchError(RuntimeError):
    """The benchmark found a broken round trip (or a compressor that changed its input) and stopped."""


@dataclass(frozen=True)
class AbsQuantile:
    """A parameter value chosen at bench time: the ``q``-quantile of ``|x|`` of the input being benchmarked.

    Used for ``threshold``: a fixed tau would keep wildly different fractions of different tensors, so tau is
    taken from the tensor's own magnitudes to keep about ``1 - q`` of its entries (ties aside).
    """

    q: float

    def resolve(self, x: Tensor) -> float:
        a = x.detach().reshape(-1).abs()
        k = min(a.numel(), max(1, math.ceil(self.q * a.numel())))  # k-th smallest: exactly n - k entries exceed it
        return float(torch.kthvalue(a.float(), k).values)

    def label(self) -> str:
        return f"q{self.q:g}(|x|)"


# Representative settings per registered name. Each dict is passed to registry.make(name, **params) after
# resolving AbsQuantile values against the input tensor. Names not listed run once with their defaults.
SETTINGS: dict[str, list[dict[str, Any]]] = {
    "none": [{}],
    "fp16": [{}],
    "bf16": [{}],
    "topk": [
        {"density": 0.01},
        {"density": 0.001},
        {"density": 0.01, "positions": "golomb"},
        {"density": 0.001, "positions": "golomb"},
    ],
    "randomk": [{"density": 0.01}, {"density": 0.001}],
    "randomblock": [{"density": 0.01}, {"density": 0.001}],
    "threshold": [{"threshold": AbsQuantile(0.99)}],  # keeps about 1% of the tensor
    # sbc, stc, efsignsgd and onebit turn error feedback on by default (the ErrorFeedback wrapper of
    # gradcomp.feedback); each also runs without it, to time the compressor alone
    "sbc": [
        {"density": 0.01},
        {"density": 0.001},
        {"density": 0.01, "error_feedback": False},
        {"density": 0.001, "error_feedback": False},
    ],
    "cnat": [{}],
    "topk+cnat": [{"density": 0.01}],
    "natural_dithering": [{"levels": 8}],
    "random_dithering": [{"levels": 8}, {"levels": 127}],
    "terngrad": [{}],
    "stc": [{"density": 0.01}, {"density": 0.01, "error_feedback": False}],
    "qsgd": [{"levels": 127}],
    "efsignsgd": [{}, {"error_feedback": False}],
    "onebit": [{}, {"error_feedback": False}],
}


# ------------------------------------------------------------------------------------------------ targets
#
# The figures are data (bench_targets.json, explained in docs/bench_targets.md): GRACE's fractions of memcpy
# (compress only, no encoding, same machine kind, 10M fp32, one thread), the factor over them, the single-pass and
# top-k family fractions, and the cast target of fp16 and bf16. Rows of other compressors, of compositions
# (topk+cnat), of the model input and sketched SGD's halves have no target.

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
CAST_TIMES = float(TARGETS["casts"]["times"])  # compress + encode <= this many bare casts of the same tensor
CAST_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, d) for name, d in TARGETS["casts"]["compressors"].items()}
TARGET_INPUTS = tuple(TARGETS["inputs"])
TARGET_SIZE = int(TARGETS["size"])  # at other sizes the copy (and the compressors) run from cache: no comparison


def row_target(row: dict[str, Any]) -> tuple[float, str] | None:
    """(target, how it was derived) for a bench row, or None. For fp16 / bf16 (:data:`CAST_DTYPES`) the target
    is the most compress+encode may take as a multiple of a bare cast; for the others, the least compress+encode
    must reach as a fraction of a memory copy (:func:`target_kind` says which)."""
    name, params = row["compressor"], row.get("params") or {}
    if row["input"] not in TARGET_INPUTS or row.get("numel") != TARGET_SIZE or "part" in row:
        return None
    if name in CAST_DTYPES:
        return CAST_TIMES, f"<= {CAST_TIMES:g} x a bare cast to {str(CAST_DTYPES[name]).removeprefix('torch.')}"
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


def _targets_apply_to(meta: dict[str, Any]) -> bool:
    """The targets were set on the CPU (GRACE's figures: one thread); a GPU's memcpy is another reference."""
    return str(meta.get("device", "cpu")).startswith("cpu")


def target_kind(row: dict[str, Any]) -> str:
    """``cast`` (compress+encode as a multiple of a bare cast, at most the target) or ``memcpy`` (as a fraction
    of the copy timed beside the row, at least the target)."""
    return "cast" if row["compressor"] in CAST_DTYPES else "memcpy"


def apply_targets(result: dict[str, Any]) -> dict[str, Any]:
    """Adds to every row ``target``, ``target_basis``, ``target_kind``, ``target_value`` (the measured figure it
    is judged on: ``compress_encode_vs_cast`` or ``compress_encode_vs_memcpy_beside``), ``target_met`` (judged
    against the reference timed beside the row) and ``target_met_batched`` (a memcpy-fraction target against the
    batched ``memcpy`` row instead: the earlier reference, for comparison), None where they do not apply, and
    ``meta["targets"]`` = {"met": [...], "missed": [...], "missed_batched": [...]} (short row descriptions);
    returns ``result``."""
    met, missed, missed_batched = [], [], []
    on_cpu = _targets_apply_to(result["meta"])
    for r in result["rows"]:
        found = row_target(r) if on_cpu else None
        r["target"], r["target_basis"] = (None, None) if found is None else found
        r["target_kind"] = None if found is None else target_kind(r)
        r["target_value"] = r["target_met"] = r["target_met_batched"] = None
        if found is None:
            continue
        if r["target_kind"] == "cast":
            value = r.get("compress_encode_vs_cast")
            ok = None if value is None else bool(value <= r["target"])
            unit = " x cast"
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


# Schemes (methods that own their rounds) that bench times anyway, as the two local halves of their round 1.
SCHEME_HALVES: tuple[str, ...] = ("sketch",)


def position_bits(compressor: Compressor, fields: list[Tensor], slot: Slot) -> tuple[float, float] | None:
    """(bits the encoder produced per kept position, the minimum log2 C(d, k) / k) for sparse messages.

    The bits are the position field's own encoder output (the Golomb stream's exact bit count, or count ×
    width for fixed-width positions), without section header or byte padding; None without a position field.
    """
    for spec, field in zip(compressor.specs(slot), fields):
        if spec.codec not in (wire.Codec.POSITIONS, wire.Codec.GOLOMB):
            continue
        k, d = field.numel(), slot.numel
        if k == 0:
            return None
        if spec.codec == wire.Codec.GOLOMB:
            b = spec.golomb_b if spec.golomb_b is not None else wire.optimal_rice_parameter(k / d)
            produced = wire.golomb_encode(field, b)[1]
        else:
            produced = k * wire.bits_needed(d)
        minimum = (math.lgamma(d + 1) - math.lgamma(k + 1) - math.lgamma(d - k + 1)) / math.log(2)
        return produced / k, minimum / k
    return None


# ------------------------------------------------------------------------------------------------- inputs


def synthetic_gradient(size: int, seed: int = SYNTHETIC_SEED) -> Tensor:
    """A seeded heavy-tailed float32 vector: N(0, 1) times a log-normal scale shared by blocks of 4096."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"size must be a positive integer, got {size!r}")
    g = torch.Generator().manual_seed(seed)
    blocks = -(-size // SYNTHETIC_BLOCK)
    scale = SYNTHETIC_BASE_SCALE * torch.exp(SYNTHETIC_LOG_SIGMA * torch.randn(blocks, generator=g))
    x = torch.randn(size, generator=g)
    return x.mul_(scale.repeat_interleave(SYNTHETIC_BLOCK)[:size])


def model_gradient(device: torch.device | str = "cpu") -> tuple[Tensor, str]:
    """SmallCNN's (seed 0) flattened gradient on one training batch of 64; returns (gradient, description).

    The batch is the first one a single worker sees in epoch 0 with seed 0. Uses MNIST when it is installed,
    else the "synthetic" dataset, and says which in the description.
    """
    from torch import nn

    from gradcomp.experiments.run.data import iterate_batches, load_dataset, shard_indices
    from gradcomp.experiments.run.models import build_model

    note = ""
    try:
        data = load_dataset("mnist")
    except ConfigError as exc:
        data = load_dataset("synthetic")
        note = f" [MNIST unavailable, fell back to the synthetic dataset: {exc}]"
    model = build_model(MODEL_NAME, data, MODEL_SEED).to(device)
    model.train()
    idx = shard_indices(data.num_train, 0, 1, 0, MODEL_SEED)
    xb, yb = next(iterate_batches(data.train_x, data.train_y, idx, MODEL_BATCH))
    loss = nn.functional.cross_entropy(model(xb.to(device)), yb.to(device))
    model.zero_grad(set_to_none=True)
    loss.backward()
    grad = torch.cat([p.grad.detach().reshape(-1) for p in model.parameters() if p.grad is not None])
    desc = f"SmallCNN gradient, {data.name} batch {MODEL_BATCH}, seed {MODEL_SEED}{note}"
    return grad.to(torch.float32).contiguous(), desc


# ------------------------------------------------------------------------------------------------- timing


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _loadavg() -> list[float] | None:
    """1/5/15-minute load averages, recorded so a reader can tell a busy machine's numbers apart."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _gbps(numel: int, seconds: float) -> float:
    return 4.0 * numel / seconds / 1e9 if seconds > 0 else float("inf")


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _measure_memcpy(x: Tensor, repeats: int, timer: _Timer) -> float:
    """Median seconds of one ``y.copy_(x)`` into a preallocated tensor.

    A copy of a small input (the model gradient: 0.9 MB) is too short to time alone, and on the shared CPU
    machines this project runs on, the first parallel regions of a process are slow: measured, the first
    6–20 copies took 8 ms each, every later one 0.012 ms. So: warm-up copies until the last ten are all
    within twice the fastest seen (at most 2 s), then each of the ``repeats`` samples times a batch of
    copies lasting at least 5 ms and divides by the batch size.
    """
    y = torch.empty_like(x)
    start, fastest, recent = timer.now(), float("inf"), []
    while timer.now() - start < 2.0:
        t0 = timer.now()
        y.copy_(x)
        elapsed = timer.now() - t0
        fastest = min(fastest, elapsed)
        recent = [*recent[-9:], elapsed]
        if len(recent) == 10 and max(recent) <= 2 * fastest:
            break
    batch = 1
    while True:  # the number of copies that lasts at least 5 ms
        t0 = timer.now()
        for _ in range(batch):
            y.copy_(x)
        if timer.now() - t0 >= 0.005:
            break
        batch *= 2
    times = []
    for _ in range(repeats):
        t0 = timer.now()
        for _ in range(batch):
            y.copy_(x)
        times.append((timer.now() - t0) / batch)
    return _median(times)


def _label(setting: dict[str, Any], resolved: dict[str, Any]) -> str:
    if not setting:
        return "defaults"
    parts = []
    for key, value in setting.items():
        if isinstance(value, AbsQuantile):
            parts.append(f"{key}={resolved[key]:.3g} ({value.label()})")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def _minor_faults() -> int:
    """Minor page faults this process has taken so far (0 where ``resource`` is unavailable)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def _bench_one(
    compressor: Compressor, receiver: Compressor, x: Tensor, repeats: int, timer: _Timer, what: str, copy_to: Tensor,
    cast_to: torch.dtype | None = None,
) -> dict[str, Any]:
    """Time one compressor on one input; verify every round trip. Returns the measured medians and sizes.

    ``compressor`` is the sender, ``receiver`` a second instance with the same parameters that decodes and
    decompresses, so nothing the sender cached (e.g. random-k positions of the step) shortens the receiver's work.

    Warm-up: the first round is discarded, and so is every later one that takes a minor page fault in its four
    timed parts, up to :data:`MAX_WARMUP_ROUNDS` discarded rounds; the first round without a fault is the first
    timed repeat (the heap has settled: every buffer a round needs is served from memory already faulted in, as
    in training's steady state). A round's fresh multi-megabyte outputs can take several rounds to stop faulting
    (benchmarks/allocator_reuse.py), and a fault per 4 KiB page costs about as much as writing the page.
    Returned: the rounds discarded (``warmup_rounds``), the step of the first timed repeat (``first_timed_step``
    = ``warmup_rounds``; steps, and error feedback's accumulated state, advance through the warm-up) and the
    median faults per timed repeat. Faults are the host's (``getrusage``): on CUDA, where the outputs stay on
    the device, the warm-up is one round.

    Beside each repeat, between the decompress and the verification, one ``copy_to.copy_(x)`` is timed: a memory
    copy of the same input, within the same second as the compressor's repeat and, like it, not run back to back
    with other copies of the same tensor, so the row can also be read against the copy timed beside it
    (``memcpy_beside_s``), which drifts with the machine the way the row does. (The compressor's repeat follows
    the previous repeat's verification; the copy follows this repeat's decompress.)

    ``cast_to`` (fp16 and bf16 rows): after the copy, a bare cast ``x.to(cast_to)`` is timed too
    (``cast_beside_s``, median; None without it), the reference of those rows' target.
    """
    numel = x.numel()
    slot = Slot(name="bench", index=0, numel=numel)
    x_ref = x.clone()
    parts: dict[str, list[float]] = {"compress": [], "encode": [], "decode": [], "decompress": []}
    sizes: list[int] = []
    copies: list[float] = []
    casts: list[float] = []
    faults: list[int] = []
    deterministic = True
    warmups, step = 0, 0
    while True:  # warm-up rounds first (step 0, 1, ...), then the repeats, each with a fresh step
        warming = len(copies) == 0 and warmups < MAX_WARMUP_ROUNDS
        faults_before = _minor_faults()
        t0 = timer.now()
        fields = compressor.compress(x, slot, step)
        t1 = timer.now()
        buf = wire.encode(fields, compressor.specs(slot))
        t2 = timer.now()
        decoded = wire.decode(buf, receiver.specs(slot))
        t3 = timer.now()
        out = receiver.decompress(decoded, slot, step)
        t4 = timer.now()
        faulted = _minor_faults() - faults_before
        copy_to.copy_(x)
        t5 = timer.now()
        if cast_to is not None:
            cast = x.to(cast_to)
            casts.append(timer.now() - t5)
            del cast

        # Verification, outside the timed regions.
        expected = receiver.decompress(fields, slot, step)
        if step == 0:
            deterministic = torch.equal(expected, receiver.decompress(fields, slot, step))
        if deterministic and not torch.equal(out, expected):
            diff = (out.float() - expected.float()).abs()
            raise BenchError(
                f"{what}: round trip is broken at step {step}: decompress(decode(encode(fields))) differs from "
                f"decompress(fields) in {int((diff != 0).sum())} of {numel} entries (max |diff| "
                f"{float(diff.max()):.3g}, shapes {tuple(out.shape)} vs {tuple(expected.shape)}); not timing it"
            )
        if out.numel() != numel or out.dtype != torch.float32:
            raise BenchError(
                f"{what}: decompress returned {out.numel()} elements of {out.dtype}, expected {numel} float32"
            )
        step += 1
        if warming and (warmups == 0 or faulted > 0):
            warmups += 1
            continue
        parts["compress"].append(t1 - t0)
        parts["encode"].append(t2 - t1)
        parts["decode"].append(t3 - t2)
        parts["decompress"].append(t4 - t3)
        copies.append(t5 - t4)
        faults.append(faulted)
        sizes.append(int(buf.numel()))
        if len(copies) >= repeats:
            break
    if not torch.equal(x, x_ref):
        raise BenchError(f"{what}: the compressor modified its input tensor")
    ce = [a + b for a, b in zip(parts["compress"], parts["encode"])]
    dd = [a + b for a, b in zip(parts["decode"], parts["decompress"])]
    encoded_bytes = statistics.mean(sizes)  # constant for all built-ins; a mean for data-dependent sizes
    positions = position_bits(compressor, fields, slot)
    return {
        "position_bits": positions[0] if positions else None,
        "entropy_bits": positions[1] if positions else None,
        "encoded_bytes": encoded_bytes,
        "compress_encode_s": _median(ce),
        "decode_decompress_s": _median(dd),
        **{f"{k}_s": _median(v) for k, v in parts.items()},
        "memcpy_beside_s": _median(copies),
        "cast_beside_s": _median(casts[-len(copies):]) if casts else None,  # the timed repeats' casts
        "warmup_rounds": warmups,
        "first_timed_step": warmups,  # steps 0 .. warmups - 1 were the discarded rounds
        "minor_faults_per_repeat": _median(faults),
        "verified": deterministic,
    }


def _sketch_plan(scheme: SketchedSGD, numel: int, what: str) -> SlotPlan:
    """The plan sketched SGD makes for the input as one slot; ConfigError (naming the input) if it cannot work."""
    try:
        return scheme.plan(Slot(name="bench", index=0, numel=numel))
    except ConfigError as exc:
        raise ConfigError(f"sketch on {what}: {exc}") from None


def _sketch_selection_size(scheme: SketchedSGD, plan: SlotPlan) -> int:
    """How many estimates round 1 selects: the P·k candidates, or the k sent with ``rounds=1``."""
    return plan.candidates if scheme.rounds == 2 else plan.k


def _verify_sketch(cs: CountSketch, x: Tensor, table: Tensor, chosen: Tensor, take: int, what: str) -> None:
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


def _bench_sketch(
    scheme: SketchedSGD, plan: SlotPlan, x: Tensor, repeats: int, timer: _Timer, what: str
) -> dict[str, Any]:
    """Time one worker's round 1 of sketched SGD on ``x`` as one slot: sketching, then unsketching.

    Sketching is ``CountSketch.sketch`` into a preallocated table; unsketching is ``estimate`` of that table and
    the selection of the ``_sketch_selection_size`` largest estimates. The hash tables are built here, before the
    timed loop (training builds them once per slot and caches them). Verified on the warm-up (``_verify_sketch``).
    """
    numel = x.numel()
    cs = CountSketch(numel, scheme.rows, plan.cols, scheme.seed, 0, x.device)  # as SketchedSGD builds them
    take = _sketch_selection_size(scheme, plan)
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
            _verify_sketch(cs, x, table, chosen, take, what)
            continue
        if chosen.numel() != take:
            raise BenchError(f"{what}: selected {chosen.numel()} coordinates, not {take}")
        parts["sketch"].append(t1 - t0)
        parts["unsketch"].append(t2 - t1)
    if not torch.equal(x, x_ref):
        raise BenchError(f"{what}: sketching modified its input tensor")
    return {"sketch_s": _median(parts["sketch"]), "unsketch_s": _median(parts["unsketch"]), "selected": take}


def _sketch_rows(
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
    sketch_gbps = _gbps(numel, m["sketch_s"])
    unsketch_gbps = _gbps(numel, m["unsketch_s"])
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


# ------------------------------------------------------------------------------------------------- driver


def _check_names(compressors: Sequence[str] | None) -> list[str]:
    # single-message compressors only: a method that owns its rounds (PowerSGD) has no one message to time;
    # the exception is sketch (SCHEME_HALVES), whose round 1 is timed in two halves (_bench_sketch)
    every = available()
    registered = [n for n in every if not issubclass(compressor_class(n), Scheme)]
    # The SETTINGS order (dense baselines first, compositions whose parts are registered), then any other
    # registered name alphabetically, then the schemes timed in halves.
    known = set(registered)
    names = [n for n in SETTINGS if all(part in known for part in n.split("+"))]
    names += [n for n in registered if n not in SETTINGS]
    names += [n for n in SCHEME_HALVES if n in every]
    if compressors is None:
        return names
    chosen = [c.strip() for c in compressors if c.strip()]
    schemes = [c for c in chosen if c in every and c not in names]
    if schemes:
        raise ConfigError(
            f"{', '.join(map(repr, schemes))} own(s) its communication rounds: no single message to time "
            f"(of such methods, bench times only {', '.join(SCHEME_HALVES)})"
        )
    unknown = [c for c in chosen if c not in names]
    if unknown:
        benched = sorted(registered + [n for n in SCHEME_HALVES if n in every])
        raise ConfigError(f"unknown compressor(s) {', '.join(map(repr, unknown))}; available: {', '.join(benched)}")
    if not chosen:
        raise ConfigError("no compressor selected")
    return list(dict.fromkeys(chosen))


def _check_inputs(inputs: Sequence[str]) -> list[str]:
    chosen = list(dict.fromkeys(i.strip() for i in inputs if i.strip()))
    bad = [i for i in chosen if i not in INPUT_NAMES]
    if bad:
        raise ConfigError(f"unknown input(s) {', '.join(map(repr, bad))}; valid: {', '.join(INPUT_NAMES)}")
    if not chosen:
        raise ConfigError("no input selected")
    return chosen


def run_bench(
    size: int = DEFAULT_SIZE,
    repeats: int = DEFAULT_REPEATS,
    compressors: Sequence[str] | None = None,
    inputs: Sequence[str] = INPUT_NAMES,
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

    Every row also has ``target`` (the compress+encode fraction of memcpy it should reach; None where none
    applies), ``target_basis`` (how the target was set) and ``target_met``; ``meta["targets"]`` lists the rows
    that met and that missed theirs (:func:`apply_targets`, :data:`GRACE_FRACTIONS`).

    ``sketch`` gives two rows, ``sketch (sketch)`` (its time in the ``compress_encode_*`` keys and
    ``compress_s``) and ``sketch (unsketch)`` (in ``decode_decompress_*`` and ``decompress_s``); their other keys
    are None, and they add ``method``, ``part``, ``plan`` and ``hash_tables``. ``sketch_params`` go to
    ``gradcomp.make("sketch", ...)``; they and the plan for every input are checked before anything is timed.
    Raises ConfigError for bad arguments and BenchError when a round trip is broken.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be a positive integer, got {repeats!r}")
    names = _check_names(compressors)
    input_names = _check_inputs(inputs)
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
    timer = _Timer(dev)
    started = time.perf_counter()

    meta: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "allocator": allocator.state(),
        "loadavg_before": _loadavg(),
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
            x = synthetic_gradient(size).to(dev)
            desc = (
                f"heavy-tailed synthetic: N(0,1) x log-normal scale per {SYNTHETIC_BLOCK}-element block "
                f"(sigma {SYNTHETIC_LOG_SIGMA}), seed {SYNTHETIC_SEED}"
            )
        else:
            x, desc = model_gradient(dev)
        plan = None if scheme is None else _sketch_plan(scheme, x.numel(), f"input {input_name}")
        prepared.append((input_name, x, desc, plan))
        del x
    rows: list[dict[str, Any]] = []
    while prepared:
        input_name, x, desc, plan = prepared.pop(0)
        numel = x.numel()
        meta["inputs"][input_name] = {"numel": numel, "description": desc}
        say(f"bench: input {input_name}: {numel:,} elements ({desc})")

        memcpy_s = _measure_memcpy(x, repeats, timer)
        copy_to = torch.empty_like(x)  # the copy timed beside each repeat (_bench_one)
        memcpy_gbps = _gbps(numel, memcpy_s)
        meta["memcpy_gbps"][input_name] = memcpy_gbps
        rows.append(
            {
                "input": input_name,
                "numel": numel,
                "compressor": "memcpy",
                "setting": "y.copy_(x)",
                "params": {},
                "encoded_bytes": 4 * numel,
                "bits_per_element": 32.0,
                "ratio_vs_fp32": 1.0,
                "compress_encode_s": memcpy_s,
                "decode_decompress_s": memcpy_s,
                "compress_encode_gbps": memcpy_gbps,
                "decode_decompress_gbps": memcpy_gbps,
                "compress_encode_vs_memcpy": 1.0,
                "decode_decompress_vs_memcpy": 1.0,
                "verified": True,
            }
        )
        for name in names:
            if name == "sketch":
                assert scheme is not None and plan is not None
                label = _label(sketch_params, sketch_params)
                what = f"sketch [{label}] on {input_name}"
                if not plan.compressed:
                    note = f"{what}: {numel} coordinates are below min_size={scheme.min_size}: sent dense, no sketch"
                    meta["skipped"].append(note)
                    say(f"bench: skipped {note}")
                    continue
                say(f"bench: {what} (sketch and unsketch)")
                m = _bench_sketch(scheme, plan, x, repeats, timer, what)
                rows += _sketch_rows(scheme, plan, m, input_name, numel, memcpy_gbps, label)
                continue
            for setting in SETTINGS.get(name, [{}]):
                resolved = {k: (v.resolve(x) if isinstance(v, AbsQuantile) else v) for k, v in setting.items()}
                label = _label(setting, resolved)
                what = f"{name} [{label}] on {input_name}"
                try:
                    compressor = make(name, **resolved)
                    receiver = make(name, **resolved)
                except ConfigError as exc:
                    meta["skipped"].append(f"{what}: {exc}")
                    say(f"bench: skipped {what}: {exc}")
                    continue
                say(f"bench: {what}")
                m = _bench_one(compressor, receiver, x, repeats, timer, what, copy_to, CAST_DTYPES.get(name))
                bits = 8.0 * m["encoded_bytes"] / numel
                ce_gbps = _gbps(numel, m["compress_encode_s"])
                dd_gbps = _gbps(numel, m["decode_decompress_s"])
                rows.append(
                    {
                        "input": input_name,
                        "numel": numel,
                        "compressor": name,
                        "setting": label,
                        "params": compressor.params(),
                        "encoded_bytes": m["encoded_bytes"],
                        "bits_per_element": bits,
                        "ratio_vs_fp32": 32.0 / bits,
                        "compress_encode_s": m["compress_encode_s"],
                        "decode_decompress_s": m["decode_decompress_s"],
                        "compress_s": m["compress_s"],
                        "encode_s": m["encode_s"],
                        "decode_s": m["decode_s"],
                        "decompress_s": m["decompress_s"],
                        "compress_encode_gbps": ce_gbps,
                        "decode_decompress_gbps": dd_gbps,
                        "compress_encode_vs_memcpy": ce_gbps / memcpy_gbps,
                        "decode_decompress_vs_memcpy": dd_gbps / memcpy_gbps,
                        "memcpy_beside_s": m["memcpy_beside_s"],
                        "compress_encode_vs_memcpy_beside": (
                            m["memcpy_beside_s"] / m["compress_encode_s"] if numel >= BESIDE_MIN_NUMEL else None
                        ),
                        "cast_beside_s": m["cast_beside_s"],
                        "compress_encode_vs_cast": (
                            m["compress_encode_s"] / m["cast_beside_s"] if m["cast_beside_s"] else None
                        ),
                        "warmup_rounds": m["warmup_rounds"],
                        "first_timed_step": m["first_timed_step"],
                        "minor_faults_per_repeat": m["minor_faults_per_repeat"],
                        "verified": m["verified"],
                        "position_bits_per_kept": m["position_bits"],
                        "entropy_bits_per_kept": m["entropy_bits"],
                    }
                )
        del x
    meta["seconds"] = time.perf_counter() - started
    meta["loadavg_after"] = _loadavg()
    return apply_targets({"meta": meta, "rows": rows})


# ----------------------------------------------------------------------------------------------- printing


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
    header = [
        "input",
        "compressor",
        "params",
        "bits/elem",
        "ratio",
        "c+e GB/s",
        "xmemcpy",
        "xbeside",
        "d+d GB/s",
        "xmemcpy",
        "pos bits/kept",
        "min bits/kept",
        "xcast",
        "target",
        "met",
    ]
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
                "-" if r.get("target") is None else (
                    f"<={r['target']:.3g}xcast" if r.get("target_kind") == "cast" else f">={r['target']:.3g}xbeside"
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


def format_report(result: dict[str, Any]) -> str:
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
        "compress+encode time as a multiple of a bare cast of the input timed beside each repeat (fp16, bf16)"
    )
    if any(r.get("method") == "sketch" for r in result["rows"]):
        lines.append(
            "  sketch (sketch) / sketch (unsketch): one worker's round 1 of sketched SGD on the input as one slot, "
            "sizes from SketchedSGD.plan(): count-sketching it into a preallocated r x c table (c+e columns), "
            "then estimating all d coordinates and selecting the P*k largest (d+d columns); GB/s of the d-float "
            "input; the hash tables are built once per slot, outside the timed region; bits/elem = the r x c fp32 "
            "table (32*r*c/d, no headers; round 2's P*k values not counted)"
        )
    lines.append("")
    lines.append(format_table(result))
    for note in meta["skipped"]:
        lines.append(f"skipped: {note}")
    targets = meta.get("targets")
    if not _targets_apply_to(meta):
        lines += ["", f"targets: none checked (they are set for the CPU; this ran on {meta['device']})"]
    elif "synthetic" in meta["inputs"] and meta["inputs"]["synthetic"]["numel"] != TARGET_SIZE:
        lines += ["", f"targets: none checked (they are set for the synthetic input at --size {TARGET_SIZE})"]
    elif targets and (targets["met"] or targets["missed"]):
        total = len(targets["met"]) + len(targets["missed"])
        lines += [
            "",
            f"targets ({'/'.join(TARGET_INPUTS)} input; each row against references timed beside it: compress+"
            f"encode as a fraction of the copy (xbeside), fp16 / bf16 as a multiple of a bare cast (xcast)): "
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
    for name in meta["inputs"]:
        rows = [r for r in result["rows"] if r["input"] == name]
        copies = [r["memcpy_beside_s"] for r in rows if r.get("memcpy_beside_s")]
        batched = [r["compress_encode_s"] for r in rows if r["compressor"] == "memcpy"]
        if copies and batched:
            lines.append(
                f"input {name}: copies timed beside the rows {1e3 * min(copies):.3g} to {1e3 * max(copies):.3g} ms "
                f"(median {1e3 * _median(copies):.3g}); the memcpy row's batched copies {1e3 * batched[0]:.3g} ms"
            )
    faulting = [r for r in result["rows"] if r.get("minor_faults_per_repeat")]
    if faulting:
        lines.append(
            "still taking page faults after the warm-up (median per repeat): "
            + ", ".join(f"{r['compressor']} [{r['setting']}] {r['minor_faults_per_repeat']:g}" for r in faulting)
        )
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


# ---------------------------------------------------------------------------------------------------- CLI


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="elements of the synthetic input tensor")
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help="timed runs after the warm-up (median); each row warms up until a round takes no page fault, "
        f"1 to {MAX_WARMUP_ROUNDS} rounds",
    )
    parser.add_argument(
        "--compressors", type=_csv, default=None, metavar="A,B,C", help="subset of compressors (default: all)"
    )
    parser.add_argument("--inputs", type=_csv, default=list(INPUT_NAMES), metavar="I,J", help="synthetic and/or model")
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="parameter of the sketch rows, as gradcomp.make('sketch', ...) takes it (repeatable; e.g. "
        "density=0.001, rows=3); the other compressors run their fixed settings",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows and metadata as JSON")
    parser.add_argument("--no-model", action="store_true", help="skip the model-gradient input")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


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
            size=args.size,
            repeats=args.repeats,
            compressors=args.compressors,
            inputs=inputs,
            device=args.device,
            progress=None if args.quiet else progress,
            sketch_params=parse_param_strings(getattr(args, "param", [])),
        )
    except BenchError as exc:
        print(f"gradcomp bench: aborted: {exc}", file=sys.stderr)
        return 1
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0
