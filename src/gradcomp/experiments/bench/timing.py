"""Timing primitives of ``gradcomp bench``: the clock, the memory-copy reference, page faults, and one
compressor's timed, verified round trips (:func:`bench_one`). docs/bench.md says what is measured and why."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

try:
    import resource
except ImportError:  # pragma: no cover - Windows has no resource module: the warm-up is then one round
    resource = None  # type: ignore[assignment]

from gradcomp import wire
from gradcomp.wire.checksum import checksum64, checksum64_tensor
from gradcomp.compressors.base import Compressor, Slot


class BenchError(RuntimeError):
    """The benchmark found a broken round trip (or a compressor that changed its input) and stopped."""


MAX_WARMUP_ROUNDS = 10  # warm-up rounds of one row at most, waiting for a round without page faults


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages, recorded so a reader can tell a busy machine's numbers apart."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def gbps(numel: int, seconds: float) -> float:
    return 4.0 * numel / seconds / 1e9 if seconds > 0 else float("inf")


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def measure_memcpy(x: Tensor, repeats: int, timer: Timer) -> float:
    """Median seconds of one ``y.copy_(x)`` into a preallocated tensor.

    A small input's copy is too short to time alone and a process's first parallel regions are slow
    (docs/bench.md): warm-up copies until the last ten are all within twice the fastest seen (at most 2 s),
    then each of the ``repeats`` samples times a batch of copies lasting at least 5 ms, divided by its size.
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
    return median(times)


def minor_faults() -> int:
    """Minor page faults this process has taken so far (0 where ``resource`` is unavailable)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


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


def wire_checksum(buf: Tensor) -> None:
    """The wire's body checksum of the uint8 ``buf``, computed as ``wire.encode`` computes it for a message on
    ``buf``'s device: the CRC pair of the host wheels on the CPU, :func:`checksum64_tensor` elsewhere."""
    if buf.device.type == "cpu":
        checksum64(buf)
    else:
        checksum64_tensor(buf)


def bench_one(
    compressor: Compressor, receiver: Compressor, x: Tensor, repeats: int, timer: Timer, what: str, copy_to: Tensor,
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
    (``cast_beside_s``, median; None without it), then the wire's checksum of the cast's bytes
    (:func:`wire_checksum`; ``checksum_beside_s``): the reference of those rows' target is the two together
    (``cast_checksum_beside_s``, the median of their per-repeat sums), what any checksummed message of the cast
    must at least do. Also returned: ``encode_decode_s``, the median of the per-repeat encode + decode.
    """
    numel = x.numel()
    slot = Slot(name="bench", index=0, numel=numel)
    x_ref = x.clone()
    kept = _Repeats()
    deterministic = True
    warmups, step = 0, 0
    while True:  # warm-up rounds first (step 0, 1, ...), then the repeats, each with a fresh step
        warming = len(kept.copies) == 0 and warmups < MAX_WARMUP_ROUNDS
        faults_before = minor_faults()
        t0 = timer.now()
        fields = compressor.compress(x, slot, step)
        t1 = timer.now()
        buf = wire.encode(fields, compressor.specs(slot))
        t2 = timer.now()
        decoded = wire.decode(buf, receiver.specs(slot))
        t3 = timer.now()
        out = receiver.decompress(decoded, slot, step)
        t4 = timer.now()
        faulted = minor_faults() - faults_before
        copy_to.copy_(x)
        t5 = timer.now()
        if cast_to is not None:
            cast = x.to(cast_to)
            t6 = timer.now()
            wire_checksum(cast.reshape(-1).view(torch.uint8))
            kept.casts.append(t6 - t5)
            kept.checksums.append(timer.now() - t6)
            del cast

        # Verification, outside the timed regions.
        expected = receiver.decompress(fields, slot, step)
        if step == 0:
            deterministic = torch.equal(expected, receiver.decompress(fields, slot, step))
        _check_round_trip(out, expected, deterministic, numel, step, what)
        step += 1
        if warming and (warmups == 0 or faulted > 0):
            warmups += 1
            continue
        kept.add((t0, t1, t2, t3, t4, t5), faulted, int(buf.numel()))
        if len(kept.copies) >= repeats:
            break
    if not torch.equal(x, x_ref):
        raise BenchError(f"{what}: the compressor modified its input tensor")
    return kept.summary(position_bits(compressor, fields, slot), warmups, deterministic)


def _check_round_trip(out: Tensor, expected: Tensor, deterministic: bool, numel: int, step: int, what: str) -> None:
    """BenchError unless the receiver's output is ``numel`` float32 entries equal to ``decompress(fields)``
    (compared only for a deterministic decompress): broken code is never timed."""
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


@dataclass
class _Repeats:
    """The timed repeats of one ``bench_one`` row: each part's seconds, the copy timed beside it, the message's
    size and the page faults; and the cast and checksum timed beside every round (the warm-up's too)."""

    parts: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {"compress": [], "encode": [], "decode": [], "decompress": []})
    sizes: list[int] = dataclasses.field(default_factory=list)
    copies: list[float] = dataclasses.field(default_factory=list)
    casts: list[float] = dataclasses.field(default_factory=list)
    checksums: list[float] = dataclasses.field(default_factory=list)
    faults: list[int] = dataclasses.field(default_factory=list)

    def add(self, times: tuple[float, ...], faulted: int, size: int) -> None:
        """One timed repeat, from its six clock readings: before compress, after compress, encode, decode,
        decompress, and after the copy beside it."""
        t0, t1, t2, t3, t4, t5 = times
        self.parts["compress"].append(t1 - t0)
        self.parts["encode"].append(t2 - t1)
        self.parts["decode"].append(t3 - t2)
        self.parts["decompress"].append(t4 - t3)
        self.copies.append(t5 - t4)
        self.faults.append(faulted)
        self.sizes.append(size)

    def summary(self, positions: tuple[float, float] | None, warmups: int, deterministic: bool) -> dict[str, Any]:
        """``bench_one``'s result: the medians over the timed repeats (the casts and checksums of the last rounds,
        the timed ones), the mean encoded size, the position bits, the warm-up and the verification."""
        parts = self.parts
        ce = [a + b for a, b in zip(parts["compress"], parts["encode"])]
        dd = [a + b for a, b in zip(parts["decode"], parts["decompress"])]
        ed = [a + b for a, b in zip(parts["encode"], parts["decode"])]
        timed = len(self.copies)  # the timed repeats' casts and checksums: the last ones
        casts, checksums = self.casts[len(self.casts) - timed:], self.checksums[len(self.checksums) - timed:]
        encoded_bytes = statistics.mean(self.sizes)  # constant for all built-ins; a mean for data-dependent sizes
        return {
            "position_bits": positions[0] if positions else None,
            "entropy_bits": positions[1] if positions else None,
            "encoded_bytes": encoded_bytes,
            "compress_encode_s": median(ce),
            "decode_decompress_s": median(dd),
            **{f"{k}_s": median(v) for k, v in parts.items()},
            "memcpy_beside_s": median(self.copies),
            "encode_decode_s": median(ed),
            "cast_beside_s": median(casts) if casts else None,
            "checksum_beside_s": median(checksums) if checksums else None,
            "cast_checksum_beside_s": median([a + b for a, b in zip(casts, checksums)]) if casts else None,
            "warmup_rounds": warmups,
            "first_timed_step": warmups,  # steps 0 .. warmups - 1 were the discarded rounds
            "minor_faults_per_repeat": median(self.faults),
            "verified": deterministic,
        }
