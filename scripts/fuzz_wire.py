"""Fuzz every registered compressor's receiving path with mutated real messages (docs/wire.md).

For every compressor in ``gradcomp.registry.available()`` (methods that own their rounds send no framed
message and are listed as skipped) and every value of its wire-format parameters (``positions``: fixed /
golomb, qsgd's ``coding``, the dithering ``norm_codec``), plus a few compositions, the script builds real
messages — two slots (300 and 20 entries) compressed into ONE wire buffer, as a gathered exchange sends
them, from four different gradients — and feeds mutated copies through what a receiver does:
``decode_slots`` (wire decode + split per slot), then ``decompress`` and ``accumulate`` of every slot.

Mutation kinds (round robin; each mutated buffer differs from its original):

    flip1          one bit anywhere (header included)
    flip2          two distinct bits anywhere
    flip2-word     the same bit in two different 8-byte words of the body (what cancelled in the old
                   weighted-sum checksum)
    burst<=32      a burst of 3 to 32 bits: first and last bit flipped, the bits between at random
    byte-swap      two bytes of different values swapped
    word-swap      two different aligned 4- or 8-byte words of the body swapped
    truncate       the buffer cut short
    extend         1 to 16 random bytes appended
    random-bytes   a run of 1 to 16 bytes overwritten with random bytes
    header+crc     one header field (magic, version, flags, n_sections, reserved, body_length) or one
                   section header field (codec, param, count, nbytes) changed, the checksum recomputed
    resize+crc     one section's count changed by ±1 or more with its nbytes, its data and body_length made
                   to match (fixed-width codecs), the checksum recomputed: only cross-section checks can object
    payload+crc    1 or 2 bits of section data flipped, the checksum recomputed (no check can see most of
                   these: another float is a valid float; reported, not a failure)

``--path device`` feeds the same buffers through what a receiver on a GPU does instead: ``aggregate_buffers``
with the device path forced on CPU tensors (``wire.bits.set_device_path_on_cpu``, as the sync-count tests do), where every
field is decoded and summed before the message's checks (checksum, headers, positions, padding) are read, in one
transfer after the sums; "same" then means the aggregate bit for bit. A corrupted position that indexes past its
slot before that read is a crash here (an IndexError on the CPU; on a GPU a device-side assert, which ends the
process).

Outcome of each buffer: rejected (WireError from decode, or later from decompress/accumulate), accepted with
the original values (bit for bit), silent (accepted with different values), crash (any other exception).
Failure, exit status 1: any crash, or any silent corruption by a mutation of up to two flipped bits
(flip1, flip2, flip2-word). Other silent outcomes are counted and printed.

    nice -n 19 .venv/bin/python scripts/fuzz_wire.py                       # 100,000 buffers per decoder
    nice -n 19 .venv/bin/python scripts/fuzz_wire.py --per-decoder 2000 --only threshold topk
    nice -n 19 .venv/bin/python scripts/fuzz_wire.py --path device --per-decoder 20000 --per-scheme 0
    nice -n 19 .venv/bin/python scripts/fuzz_wire.py --checksum-speed     # CRC pair vs the old checksum
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import inspect
import itertools
import random
import struct
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

import gradcomp.registry as registry
from gradcomp.compressors.base import Compressor, Slot, accumulate, bind_worker
from gradcomp.compressors.natural import NORM_CODECS
from gradcomp.compressors.qsgd import CODINGS
from gradcomp.compressors.sparse import POSITION_CODECS
from gradcomp.errors import WireError
from gradcomp.schemes.base import Scheme
from gradcomp.schemes.single_round import aggregate_buffers, decode_slots, encode_slots
from gradcomp.wire import FLOAT_DTYPES, HEADER_BYTES, SECTION_HEADER_BYTES, Codec
from gradcomp.wire.bits import packed_nbytes
from gradcomp.wire.checksum import checksum64
from gradcomp.wire.format import free_sections

DEFAULT_PER_DECODER = 100_000
DEFAULT_PER_SCHEME = 10_000  # each replays a worker's whole step: slower than a decoder's
KINDS = (
    "flip1",
    "flip2",
    "flip2-word",
    "burst<=32",
    "byte-swap",
    "word-swap",
    "truncate",
    "extend",
    "random-bytes",
    "header+crc",
    "resize+crc",
    "payload+crc",
)
MUST_NOT_BE_SILENT = ("flip1", "flip2", "flip2-word")  # up to two flipped bits: the CRC guarantees these
OUTCOMES = ("rejected", "late", "same", "silent", "crash")  # late: rejected by decompress/accumulate

# values of the constructor parameters that change the wire format
WIRE_OPTIONS = {"positions": sorted(POSITION_CODECS), "coding": list(CODINGS), "norm_codec": list(NORM_CODECS)}
# settings that make messages of a useful size from N(0, 1) gradients
PARAMS = {
    "topk": {"density": 0.1},
    "randomk": {"density": 0.1},
    "randomblock": {"density": 0.1},
    "threshold": {"threshold": 1.0},
    "sbc": {"density": 0.1},
    "stc": {"density": 0.1},
    "dgc": {"density": 0.05},
}
# compositions (a second compressor on the first one's fp32 values): (name, the first one's parameters)
COMPOSITIONS = (
    ("topk+cnat", {"positions": "fixed"}),
    ("topk+cnat", {"positions": "golomb"}),
    ("random_dithering+cnat", {"norm_codec": "f32"}),
)
SLOTS = (Slot("fuzz.weight", 0, 300), Slot("fuzz.bias", 1, 20))


# ------------------------------------------------------------------------------------------- the decoders


@dataclass
class Message:
    step: int
    raw: bytes
    decoded: list[list[torch.Tensor]]  # the unmutated buffer's fields per slot (its aggregate: --path device)
    sections: list[tuple[int, int, int, int, int]]  # (offset in buffer, codec, param, count, nbytes)


@dataclass
class Decoder:
    label: str
    make: Callable[[], Compressor]
    messages: list[Message] = field(default_factory=list)
    device: bool = False  # received as on a GPU (receive_on_device)


def _variants(name: str) -> list[dict]:
    params = inspect.signature(registry.compressor_class(name).__init__).parameters
    options = {k: v for k, v in WIRE_OPTIONS.items() if k in params}
    keys = sorted(options)
    return [dict(zip(keys, values)) for values in itertools.product(*(options[k] for k in keys))]


def decoder_specs() -> tuple[list[tuple[str, str, dict]], list[str]]:
    """(label, name, params) of every decoder to fuzz, and the registered names that send no framed message."""
    out, skipped = [], []
    for name in registry.available():
        if issubclass(registry.compressor_class(name), Scheme):
            skipped.append(name)
            continue
        for variant in _variants(name):
            out.append((name, variant))
    out += COMPOSITIONS
    labelled = []
    for name, variant in out:
        label = name + "".join(f" {k}={v}" for k, v in sorted(variant.items()))
        labelled.append((label, name, {**PARAMS.get(name.split("+")[0], {}), **variant}))
    return labelled, skipped


def _gradients(index: int, gen: torch.Generator) -> list[torch.Tensor]:
    xs = [torch.randn(s.numel, generator=gen) for s in SLOTS]
    if index == 1:
        xs = [3.0 * x for x in xs]
    elif index == 2:  # mostly zeros
        xs = [x * (torch.rand(x.numel(), generator=gen) < 0.1) for x in xs]
    elif index == 3:  # tiny: a threshold keeps nothing
        xs = [1e-3 * x for x in xs]
    return xs


def _sections(raw: bytes) -> list[tuple[int, int, int, int, int]]:
    out, off = [], HEADER_BYTES
    while off + SECTION_HEADER_BYTES <= len(raw):
        codec, param, count, nbytes = struct.unpack_from("<BBII", raw, off)
        out.append((off, codec, param, count, nbytes))
        off += SECTION_HEADER_BYTES + nbytes
    assert off == len(raw)
    return out


def build_decoder(label: str, name: str, params: dict, n_messages: int = 4, device: bool = False) -> Decoder:
    def make() -> Compressor:
        c = registry.make(name, error_feedback=False, **params)
        bind_worker(c, 0)
        return c

    decoder = Decoder(label, make, device=device)
    sender, receiver = make(), make()
    gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(label.encode()).digest()[:4], "little"))
    for step in range(n_messages):
        fields = [sender.compress(x, s, step) for x, s in zip(_gradients(step, gen), SLOTS)]
        buf = encode_slots(sender, SLOTS, fields)
        raw = bytes(buf.tolist())
        if device:
            status, decoded, exc = receive_on_device(receiver, raw, step)
            assert status == "ok", exc
        else:
            decoded = decode_slots(receiver, SLOTS, buf)
        decoder.messages.append(Message(step, raw, decoded, _sections(raw)))
    return decoder


# ------------------------------------------------------------------------------------------- mutations


def _flip(raw: bytearray, bit: int) -> None:
    raw[bit // 8] ^= 1 << (bit % 8)


def _refit(raw: bytearray) -> None:
    """Recompute body_length and the checksum over the (changed) body."""
    struct.pack_into("<I", raw, 8, len(raw) - HEADER_BYTES)
    _refit_checksum_only(raw)


def mutate(kind: str, msg: Message, rng: random.Random) -> bytearray:
    raw = bytearray(msg.raw)
    n, body = len(raw), len(raw) - HEADER_BYTES
    if kind == "flip1":
        _flip(raw, rng.randrange(8 * n))
    elif kind == "flip2":
        a, b = rng.sample(range(8 * n), 2)
        _flip(raw, a)
        _flip(raw, b)
    elif kind == "flip2-word":
        words = body // 8
        if words < 2:
            return raw
        i, j = rng.sample(range(words), 2)
        bit = rng.randrange(64)
        _flip(raw, 8 * (HEADER_BYTES + 8 * i) + bit)
        _flip(raw, 8 * (HEADER_BYTES + 8 * j) + bit)
    elif kind == "burst<=32":
        length = rng.randint(3, 32)
        start = rng.randrange(8 * n - length + 1)
        _flip(raw, start)
        _flip(raw, start + length - 1)
        for bit in range(start + 1, start + length - 1):
            if rng.random() < 0.5:
                _flip(raw, bit)
    elif kind == "byte-swap":
        i, j = rng.sample(range(n), 2)
        raw[i], raw[j] = raw[j], raw[i]
    elif kind == "word-swap":
        width = rng.choice((4, 8))
        words = body // width
        if words < 2:
            return raw
        i, j = (HEADER_BYTES + width * w for w in rng.sample(range(words), 2))
        raw[i : i + width], raw[j : j + width] = raw[j : j + width], raw[i : i + width]
    elif kind == "truncate":
        del raw[rng.randrange(n) :]
    elif kind == "extend":
        raw += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == "random-bytes":
        i = rng.randrange(n)
        for j in range(i, min(n, i + rng.randint(1, 16))):
            raw[j] = rng.randrange(256)
    elif kind == "header+crc":
        _header_field(raw, msg, rng)
        _refit_checksum_only(raw)
    elif kind == "resize+crc":
        if not _resize(raw, msg, rng):
            return bytearray(msg.raw)
        _refit(raw)
    elif kind == "payload+crc":
        spans = [(off + SECTION_HEADER_BYTES, nbytes) for off, _, _, _, nbytes in msg.sections if nbytes]
        if not spans:
            return raw
        start, nbytes = rng.choice(spans)
        for bit in rng.sample(range(8 * nbytes), min(8 * nbytes, rng.randint(1, 2))):
            _flip(raw, 8 * start + bit)
        _refit_checksum_only(raw)
    else:
        raise ValueError(f"unknown mutation kind {kind!r}")
    return raw


def _refit_checksum_only(raw: bytearray) -> None:
    if len(raw) >= HEADER_BYTES:
        body = raw[HEADER_BYTES:]
        data = torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.zeros(0, dtype=torch.uint8)
        struct.pack_into("<Q", raw, 12, checksum64(data))


def _new_value(old: int, bits: int, rng: random.Random) -> int:
    top = (1 << bits) - 1
    choice = rng.randrange(5)
    if choice == 0:
        v = old + rng.choice((-1, 1))
    elif choice == 1:
        v = old + rng.randint(-16, 16)
    elif choice == 2:
        v = rng.choice((0, 1, top, top >> 1))
    elif choice == 3:
        v = old ^ (1 << rng.randrange(bits))
    else:
        v = rng.randrange(top + 1)
    return min(max(v, 0), top)


# (offset, struct format, bits) of the top header's fields other than the checksum
_TOP_FIELDS = ((0, "<B", 8), (1, "<B", 8), (2, "<B", 8), (3, "<B", 8), (4, "<H", 16), (6, "<H", 16), (8, "<I", 32))
# (offset inside the section header, struct format, bits): codec, param, count, nbytes
_SECTION_FIELDS = ((0, "<B", 8), (1, "<B", 8), (2, "<I", 32), (6, "<I", 32))


def _header_field(raw: bytearray, msg: Message, rng: random.Random) -> None:
    if msg.sections and rng.random() < 0.75:
        base = rng.choice(msg.sections)[0]
        off, fmt, bits = rng.choice(_SECTION_FIELDS)
        off += base
    else:
        off, fmt, bits = rng.choice(_TOP_FIELDS)
    old = struct.unpack_from(fmt, raw, off)[0]
    struct.pack_into(fmt, raw, off, _new_value(old, bits, rng))


def _implied_nbytes(codec: int, param: int, count: int) -> int | None:
    if codec in FLOAT_DTYPES:
        return count * FLOAT_DTYPES[Codec(codec)].itemsize
    if codec in (Codec.BITS, Codec.POSITIONS):
        return packed_nbytes(count, param)
    return None  # GOLOMB: the stream is left as it is


def _resize(raw: bytearray, msg: Message, rng: random.Random) -> bool:
    """Change one section's count (and its nbytes and data to match); False if nothing could be done."""
    if not msg.sections:
        return False
    off, codec, param, count, nbytes = rng.choice(msg.sections)
    new = count + rng.choice((-1, 1)) if rng.random() < 0.7 else rng.randint(0, max(1, 2 * count))
    if new < 0 or new == count:
        new = count + 1
    struct.pack_into("<I", raw, off + 2, new)
    size = _implied_nbytes(codec, param, new)
    if size is None:
        return True
    struct.pack_into("<I", raw, off + 6, size)
    data = off + SECTION_HEADER_BYTES
    if size < nbytes:
        del raw[data + size : data + nbytes]
    else:
        raw[data + nbytes : data + nbytes] = bytes(rng.randrange(256) for _ in range(size - nbytes))
    if codec in (Codec.BITS, Codec.POSITIONS) and size and (new * param) % 8:
        raw[data + size - 1] &= (1 << ((new * param) % 8)) - 1  # keep the padding bits zero
    return True


# ------------------------------------------------------------------------------------------- one buffer


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    for fa, fb in zip(a, b):
        if len(fa) != len(fb):
            return False
        for x, y in zip(fa, fb):
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            if x.dtype.is_floating_point:
                x, y = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
            if not torch.equal(x, y):
                return False
    return True


def receive(compressor: Compressor, raw: bytes | bytearray, step: int) -> tuple[str, list | None, BaseException | None]:
    """What a receiver does with one buffer: ("rejected" | "late" | "ok" | "crash", fields, exception)."""
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    try:
        decoded = decode_slots(compressor, SLOTS, buf)
    except WireError as e:
        return "rejected", None, e
    except Exception as e:  # counting every other exception is the point
        return "crash", None, e
    try:
        for fields, slot in zip(decoded, SLOTS):
            dense = compressor.decompress(fields, slot, step)
            out = torch.zeros(slot.numel, dtype=torch.float32)
            accumulate(compressor, fields, slot, step, out)
            if dense.shape != (slot.numel,) or dense.dtype != torch.float32:
                raise TypeError(f"decompress gave {tuple(dense.shape)} {dense.dtype}")
    except WireError as e:
        return "late", None, e
    except Exception as e:
        return "crash", None, e
    return "ok", decoded, None


@contextlib.contextmanager
def _device_path():
    """CPU tensors take the device path (``wire.bits.host_path``) while inside."""
    from gradcomp.wire.bits import set_device_path_on_cpu

    before = set_device_path_on_cpu(True)
    try:
        yield
    finally:
        set_device_path_on_cpu(before)


def receive_on_device(
    compressor: Compressor, raw: bytes | bytearray, step: int, layout: list[int] | None = None
) -> tuple[str, list | None, BaseException | None]:
    """What a receiver on a GPU does with one buffer: decode, sum, then read every check (``aggregate_buffers`` on
    the device path); ("rejected" | "ok" | "crash", the aggregate per slot as one-field lists, exception). ``layout``:
    the layout values its sender's size exchange announced (a gathered message whose layout varies: decoded where
    it is, from them), else None (its headers read on the host, as the sharded topology and a server do)."""
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    try:
        with _device_path():
            layouts = None if layout is None else [layout]
            aggregates = aggregate_buffers(compressor, list(SLOTS), [buf], step, torch.device("cpu"), layouts=layouts)
    except WireError as e:
        return "rejected", None, e
    except Exception as e:  # counting every other exception is the point
        return "crash", None, e
    return "ok", [[a] for a in aggregates], None


@dataclass
class Result:
    counts: dict[str, Counter] = field(default_factory=dict)  # decoder label -> Counter[(kind, outcome)]
    crashes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    summed_only: list[str] = field(default_factory=list)  # scheme cases that send nothing but allreduces
    unframed: dict[str, list[str]] = field(default_factory=dict)  # scheme cases that send raw, unframed messages

    def total(self, kinds: Iterable[str] | None = None, outcome: str | None = None, label: str | None = None) -> int:
        kinds = set(KINDS if kinds is None else kinds)
        rows = [self.counts[label]] if label is not None else list(self.counts.values())
        return sum(n for c in rows for (k, o), n in c.items() if k in kinds and (outcome is None or o == outcome))

    @property
    def failed(self) -> bool:
        return self.total(outcome="crash") > 0 or self.total(MUST_NOT_BE_SILENT, "silent") > 0 or bool(self.unframed)


def _announced(compressor: Compressor, msg: Message) -> list[int] | None:
    """The layout values the sender of the unmutated ``msg`` announced in its size exchange (its free sections'
    counts, its Golomb streams' bytes: ``wire.format.layout_values``), or None for a layout the specs fix."""
    specs = [spec for slot in SLOTS for spec in compressor.specs(slot)]
    free, golomb = free_sections(specs)
    if not free and not golomb:
        return None
    return [msg.sections[i][3] for i in free] + [msg.sections[i][4] for i in golomb]


def fuzz_decoder(decoder: Decoder, per_decoder: int, seed: int, result: Result) -> None:
    rng = random.Random(f"{seed}:{decoder.label}")
    compressor = decoder.make()
    counts = result.counts.setdefault(decoder.label, Counter())
    started = time.perf_counter()
    for i in range(per_decoder):
        kind = KINDS[i % len(KINDS)]
        msg = decoder.messages[(i // len(KINDS)) % len(decoder.messages)]
        for _ in range(20):  # a mutation that changes nothing (a swap of equal bytes) is drawn again
            raw = mutate(kind, msg, rng)
            if raw != msg.raw:
                break
        else:
            counts[(kind, "unchanged")] += 1
            continue
        if decoder.device:  # a message whose layout varies: every other one with the layout values announced
            layout = _announced(compressor, msg) if i % 2 == 0 else None
            status, decoded, exc = receive_on_device(compressor, raw, msg.step, layout)
        else:
            status, decoded, exc = receive(compressor, raw, msg.step)
        if status == "ok":
            status = "same" if _same(decoded, msg.decoded) else "silent"
        counts[(kind, status)] += 1
        if status == "crash" and len(result.crashes) < 20:
            result.crashes.append(f"{decoder.label} / {kind}: {type(exc).__name__}: {exc} (buffer {bytes(raw).hex()})")
    result.seconds[decoder.label] = time.perf_counter() - started


def run(
    per_decoder: int = DEFAULT_PER_DECODER,
    seed: int = 0,
    only: Iterable[str] | None = None,
    log: Callable[[str], None] | None = None,
    per_scheme: int | None = None,
    device: bool = False,
) -> Result:
    """Fuzz every compressor's decoder with ``per_decoder`` buffers, then every scheme case's messages with
    ``per_scheme`` (default ``per_decoder``; 0: none); ``device``: the decoders as a GPU receiver runs them
    (``receive_on_device``) and the schemes' steps on the device path too."""
    specs, skipped = decoder_specs()
    if only:
        wanted = set(only)
        specs = [s for s in specs if s[1] in wanted or s[0] in wanted]
    result = Result(skipped=skipped)
    for label, name, params in specs:
        decoder = build_decoder(label, name, params, device=device)
        fuzz_decoder(decoder, per_decoder, seed, result)
        if log:
            c = result.counts[label]
            log(
                f"{label:<40} {per_decoder} buffers in {result.seconds[label]:.1f} s: "
                f"silent {sum(n for (_, o), n in c.items() if o == 'silent')}, "
                f"crash {sum(n for (_, o), n in c.items() if o == 'crash')}"
            )
    per_scheme = per_decoder if per_scheme is None else per_scheme
    if per_scheme:
        with _device_path() if device else contextlib.nullcontext():
            run_schemes(per_scheme, seed, result, only, log)
    return result


# ------------------------------------------------------------------------------- the schemes' own messages

# Methods that own their rounds (``Scheme``s) and the sharded topology: W workers run a few steps on the simulated
# cluster and every result a worker receives is recorded; a message is a uint8 payload it received (an
# all-gathered, gathered, all-to-all or broadcast buffer). A mutated copy of one message is fed to a fresh copy
# of that worker's scheme, replaying its step with every other result as recorded: rejected (WireError), crash
# (any other exception), same (the step's outputs bit for bit), silent (other outputs).
SCHEME_WORLD = 2
SCHEME_SLOTS = (
    Slot("fuzz.a.weight", 0, 1200, (40, 30)),
    Slot("fuzz.b.weight", 1, 1500, (30, 50)),
    Slot("fuzz.b.bias", 2, 30, (30,)),
)
SCHEME_CASES = (  # (label, name, params, topology, steps)
    ("sketch topology=ps", "sketch", {"k": 20, "min_size": 100, "cols": 40}, "ps", 2),
    ("sketch rounds=1 topology=ps", "sketch", {"k": 20, "min_size": 100, "cols": 40, "rounds": 1}, "ps", 2),
    ("sketch topology=allreduce", "sketch", {"k": 20, "min_size": 100, "cols": 40}, "allreduce", 1),
    ("local_topk", "local_topk", {"k": 20, "min_size": 100}, "auto", 2),
    ("true_topk", "true_topk", {"k": 20, "min_size": 100}, "auto", 1),
    ("lgc variant=ring", "lgc", {"dense_steps": 1, "topk_steps": 1, "density": 0.05}, "auto", 3),
    ("lgc variant=ps", "lgc", {"variant": "ps", "dense_steps": 1, "topk_steps": 1, "density": 0.05}, "auto", 3),
    ("powersgd", "powersgd", {}, "auto", 2),
    ("terngrad_shared", "terngrad_shared", {}, "auto", 2),
    ("topk topology=sharded", "topk", {"density": 0.1, "error_feedback": False}, "sharded", 1),
    # a size that varies over the sharded topology: its all-to-all's control round runs (its lengths cut the
    # buffers that the mutated messages are taken from)
    ("threshold topology=sharded", "threshold", {"threshold": 1.0, "error_feedback": False}, "sharded", 1),
)


@dataclass
class SchemeStep:
    """One worker's step as it ran: the scheme before it, its inputs, every result it received, its outputs."""

    rank: int
    step: int
    before: Scheme
    grads: list[torch.Tensor]
    results: list
    outputs: list[torch.Tensor]


@dataclass
class SchemeDecoder:
    label: str
    name: str
    steps: list[SchemeStep] = field(default_factory=list)
    messages: list[tuple[int, int, int | None, Message]] = field(default_factory=list)  # (step#, round, index, msg)
    unframed: list[str] = field(default_factory=list)  # requests neither summed nor framed (must stay empty)


def _clone(result):
    if isinstance(result, torch.Tensor):
        return result.clone()
    if isinstance(result, list):
        return [_clone(r) for r in result]
    return result


def _scheme_gradients(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7919 * step + 31 * rank + 5)
    return [torch.randn(s.numel, generator=gen) * (1 + s.index) for s in SCHEME_SLOTS]


def _is_framed(t: torch.Tensor) -> bool:
    return t.dtype == torch.uint8 and t.numel() >= HEADER_BYTES and bytes(t[:2].tolist()) == b"GC"


def _sent(request, rank: int, world: int) -> list[torch.Tensor]:
    """The messages a request sends that are not summed: none for an allreduce, a size round (control) or a
    broadcast this worker receives; an all-to-all's W chunks; else its tensor."""
    from gradcomp.transport.requests import AllReduce, AllToAll, Broadcast
    from gradcomp.transport.base import CONTROL

    if isinstance(request, AllReduce) or request.kind == CONTROL:
        return []
    if isinstance(request, Broadcast) and request.root != rank:
        return []
    if isinstance(request, AllToAll):
        return list(request.tensor.reshape(world, -1).unbind(0))
    return [request.tensor]


def _framed_message(t: torch.Tensor, step: int) -> Message | None:
    if not _is_framed(t):
        return None
    length = HEADER_BYTES + struct.unpack_from("<I", bytes(t[8:12].tolist()))[0]
    raw = bytes(t[:length].tolist())  # without the padding of an equal-size collective
    return Message(step, raw, [], _sections(raw))


def build_scheme_decoder(label: str, name: str, params: dict, topology: str, steps: int) -> SchemeDecoder:
    from gradcomp.transport.requests import AllToAll, execute
    from gradcomp.train.exchange import build_scheme
    from gradcomp.transport.sim import SimulatedCluster

    decoder = SchemeDecoder(label, name)

    def worker(transport) -> list[SchemeStep]:
        scheme = build_scheme(registry.make(name, **params), topology=topology)
        scheme.bind(transport.rank, transport.world_size)
        done = []
        for step in range(steps):
            before, grads, results = copy.deepcopy(scheme), _scheme_gradients(transport.rank, step), []
            rounds = scheme.run(list(SCHEME_SLOTS), grads, step)
            try:
                request = next(rounds)
                while True:
                    for t in _sent(request, transport.rank, transport.world_size):
                        if not _is_framed(t):
                            decoder.unframed.append(f"{type(request).__name__} of {t.dtype}")
                    result = execute(transport, request)
                    chunked = isinstance(request, AllToAll)
                    results.append((_clone(result), chunked))
                    request = rounds.send(result)
            except StopIteration as finished:
                outputs = [o.clone() for o in finished.value]
            done.append(SchemeStep(transport.rank, step, before, grads, results, outputs))
        return done

    with SimulatedCluster(SCHEME_WORLD) as cluster:
        for history in cluster.run(worker):
            decoder.steps += history
    for n, record in enumerate(decoder.steps):
        for r, (result, chunked) in enumerate(record.results):
            if chunked:
                parts = list(result.reshape(SCHEME_WORLD, -1).unbind(0))
            else:
                parts = result if isinstance(result, list) else [result]
            for i, t in enumerate(parts):
                msg = _framed_message(t, record.step) if isinstance(t, torch.Tensor) else None
                if msg is not None:
                    decoder.messages.append((n, r, i if chunked or isinstance(result, list) else None, msg))
    return decoder


def _with_message(result, chunked: bool, index: int | None, buf: torch.Tensor):
    """A copy of a recorded result with ``buf`` in place of its message ``index``. An all-to-all chunk keeps its
    size, as the collective does: a shorter message is followed by zeros, a longer one cut."""
    result = _clone(result)
    if chunked:
        chunks = result.view(SCHEME_WORLD, -1)
        n = min(buf.numel(), chunks.shape[1])
        chunks[index].zero_()
        chunks[index, :n] = buf[:n]
        return result
    if index is None:
        return buf
    result[index] = buf
    return result


def replay(record: SchemeStep, round_: int, index: int | None, raw: bytes | bytearray) -> tuple[str, BaseException | None]:
    """The worker's step again, with message ``raw`` in place of the one it received: an outcome of OUTCOMES."""
    scheme = copy.deepcopy(record.before)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    try:
        rounds = scheme.run(list(SCHEME_SLOTS), [g.clone() for g in record.grads], record.step)
        next(rounds)
        for r, (result, chunked) in enumerate(record.results):
            rounds.send(_with_message(result, chunked, index, buf) if r == round_ else _clone(result))
        return "crash", RuntimeError("the scheme asked for more rounds than it had")
    except StopIteration as finished:
        outputs = finished.value
    except WireError as e:
        return "rejected", e
    except Exception as e:  # counting every other exception is the point
        return "crash", e
    same = len(outputs) == len(record.outputs) and all(
        o.dtype == r.dtype and o.shape == r.shape and torch.equal(_bytes_of(o), _bytes_of(r))
        for o, r in zip(outputs, record.outputs)
    )
    return ("same" if same else "silent"), None


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def fuzz_scheme(decoder: SchemeDecoder, per_decoder: int, seed: int, result: Result) -> None:
    rng = random.Random(f"{seed}:{decoder.label}")
    counts = result.counts.setdefault(decoder.label, Counter())
    started = time.perf_counter()
    for i in range(per_decoder):
        kind = KINDS[i % len(KINDS)]
        n, round_, index, msg = decoder.messages[rng.randrange(len(decoder.messages))]
        for _ in range(20):
            raw = mutate(kind, msg, rng)
            if raw != msg.raw:
                break
        else:
            counts[(kind, "unchanged")] += 1
            continue
        status, exc = replay(decoder.steps[n], round_, index, raw)
        counts[(kind, status)] += 1
        if status == "crash" and len(result.crashes) < 20:
            result.crashes.append(f"{decoder.label} / {kind}: {type(exc).__name__}: {exc}")
    result.seconds[decoder.label] = time.perf_counter() - started


def run_schemes(per_decoder: int, seed: int, result: Result, only: Iterable[str] | None = None, log=None) -> None:
    """Fuzz the messages of every case of SCHEME_CASES (``only``: names or labels) into ``result``; a case whose
    every message is summed (an allreduce) goes to ``result.summed_only``, one that sends a message neither summed
    nor framed to ``result.unframed``."""
    wanted = set(only) if only else None
    for label, name, params, topology, steps in SCHEME_CASES:
        if wanted is not None and name not in wanted and label not in wanted:
            continue
        decoder = build_scheme_decoder(label, name, params, topology, steps)
        if decoder.unframed:
            result.unframed[label] = sorted(set(decoder.unframed))
        if not decoder.messages:
            result.summed_only.append(label)
            continue
        fuzz_scheme(decoder, per_decoder, seed, result)
        if log:
            c = result.counts[label]
            log(
                f"{label:<40} {per_decoder} buffers ({len(decoder.messages)} messages) in "
                f"{result.seconds[label]:.1f} s: silent {sum(n for (_, o), n in c.items() if o == 'silent')}, "
                f"crash {sum(n for (_, o), n in c.items() if o == 'crash')}"
            )


# ------------------------------------------------------------------------------------------- the report


def format_report(result: Result) -> str:
    lines = []
    head = (
        f"{'decoder':<40} {'buffers':>8} {'rejected':>9} {'late':>6} {'same':>6} "
        f"{'silent<=2b':>10} {'silent other':>12} {'crash':>6}"
    )
    lines += [head, "-" * len(head)]
    for label in result.counts:
        n = result.total(label=label) - result.total(outcome="unchanged", label=label)
        other = [k for k in KINDS if k not in MUST_NOT_BE_SILENT]
        lines.append(
            f"{label:<40} {n:>8} {result.total(outcome='rejected', label=label):>9} "
            f"{result.total(outcome='late', label=label):>6} {result.total(outcome='same', label=label):>6} "
            f"{result.total(MUST_NOT_BE_SILENT, 'silent', label):>10} {result.total(other, 'silent', label):>12} "
            f"{result.total(outcome='crash', label=label):>6}"
        )
    lines.append("")
    head = f"{'mutation':<14} {'buffers':>9} {'rejected':>9} {'late':>7} {'same':>7} {'silent':>8} {'crash':>6}"
    lines += [head, "-" * len(head)]
    for kind in KINDS:
        tried = result.total([kind]) - result.total([kind], "unchanged")
        cells = [result.total([kind], o) for o in ("rejected", "late", "same", "silent", "crash")]
        lines.append(f"{kind:<14} {tried:>9} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, (9, 7, 7, 8, 6))))
    total = result.total() - result.total(outcome="unchanged")
    cells = [result.total(outcome=o) for o in ("rejected", "late", "same", "silent", "crash")]
    lines.append(f"{'all':<14} {total:>9} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, (9, 7, 7, 8, 6))))
    lines.append("")
    lines.append("late: a WireError from decompress/accumulate, not from decode; same: accepted, values unchanged")
    lines.append(f"methods that own their rounds (fuzzed as schemes below, not as compressors): {', '.join(result.skipped) or '-'}")
    lines.append(f"scheme cases that only sum (allreduce), nothing framed to fuzz: {', '.join(result.summed_only) or '-'}")
    for label, what in result.unframed.items():
        lines.append(f"  UNFRAMED: {label} sends {', '.join(what)} neither summed nor as a container message")
    crashes = result.total(outcome="crash")
    silent = result.total(MUST_NOT_BE_SILENT, "silent")
    lines.append(f"exceptions other than WireError: {crashes} (must be 0)")
    lines.append(f"silent corruptions by up to 2 flipped bits: {silent} (must be 0)")
    for c in result.crashes:
        lines.append(f"  crash: {c[:400]}")
    lines.append("FAILED" if result.failed else "OK")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- checksum speed


def weighted_sum_checksum_v1(buf: torch.Tensor) -> int:
    """Wire format version 1's checksum (CPU path), kept here only to time it against the CRC pair."""
    raw = buf.reshape(-1).contiguous().numpy()
    pad = -raw.size % 8
    if pad or raw.ctypes.data % 8:
        raw = np.concatenate([raw, np.zeros(pad, dtype=np.uint8)])
    words = raw.view("<u8")
    with np.errstate(over="ignore"):
        weights = np.arange(words.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        weights *= np.uint64(0x9E3779B97F4A7C15)
        z = (int((words * weights).sum(dtype=np.uint64)) + (buf.numel() + 1) * 0xD6E8FEB86659FD93) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def checksum_speed(sizes=(1 << 10, 1 << 20, 10 << 20), repeats: int = 7) -> str:
    """Best-of-``repeats`` time of both checksums on random CPU buffers of each size, in one run."""
    lines = [f"{'bytes':>10} {'v1 weighted sum':>16} {'v2 CRC pair':>12} {'v1 / v2':>8}"]
    gen = torch.Generator().manual_seed(0)
    for size in sizes:
        buf = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        calls = max(1, (1 << 22) // size)
        best = {}
        for name, fn in (("v1", weighted_sum_checksum_v1), ("v2", checksum64)):
            fn(buf)
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                for _ in range(calls):
                    fn(buf)
                times.append((time.perf_counter() - started) / calls)
            best[name] = min(times)
        lines.append(
            f"{size:>10} {best['v1'] * 1e6:>13.1f} us {best['v2'] * 1e6:>9.1f} us {best['v1'] / best['v2']:>7.1f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-decoder", type=int, default=DEFAULT_PER_DECODER, help="mutated buffers per decoder")
    parser.add_argument(
        "--per-scheme", type=int, default=DEFAULT_PER_SCHEME, help="mutated messages per scheme case (0: none)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", help="compressor names (or decoder labels) to fuzz; default all")
    parser.add_argument("--quiet", action="store_true", help="no progress line per decoder")
    parser.add_argument(
        "--path", choices=("host", "device"), default="host",
        help="device: receive as on a GPU (decode and sum, then read the checks), on CPU tensors",
    )
    parser.add_argument(
        "--checksum-speed", action="store_true", help="only time the CRC pair against the version-1 checksum"
    )
    args = parser.parse_args(argv)
    if args.checksum_speed:
        print(checksum_speed())
        return 0
    started = time.perf_counter()
    log = None if args.quiet else lambda s: print(s, flush=True)
    result = run(args.per_decoder, args.seed, args.only, log, per_scheme=args.per_scheme, device=args.path == "device")
    print()
    print(format_report(result))
    print(f"{time.perf_counter() - started:.0f} s")
    return 1 if result.failed else 0


if __name__ == "__main__":
    torch.set_num_threads(1)  # small messages: threads only add overhead (and the machine is shared)
    sys.exit(main())
