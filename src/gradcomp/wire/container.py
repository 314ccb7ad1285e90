"""Message container: a list of tensor fields serialized into one contiguous uint8 buffer.

Both sides know the list of :class:`FieldSpec` (the receiver rebuilds it from its own configuration), so
the buffer only carries what the receiver cannot know, and everything it carries is validated.

Byte layout (all integers little-endian)::

    header (HEADER_BYTES = 20):
        0  magic        2 bytes  b"GC"
        2  version      u8       FORMAT_VERSION = 2
        3  flags        u8       0
        4  n_sections   u16      number of fields
        6  reserved     u16      0
        8  body_length  u32      bytes after the header
        12 checksum     u64      checksum64(body) = crc32(body) << 32 | crc32c(body) (see .checksum)
    body: one section per field, in spec order (SECTION_HEADER_BYTES = 10 + data):
        0  codec        u8       Codec value
        1  param        u8       width (BITS), bits_needed(universe) (POSITIONS), b (GOLOMB: the spec's
                                 golomb_b, else optimal_rice_parameter(count / universe)), 0 (floats)
        2  count        u32      number of elements
        6  nbytes       u32      data bytes that follow
        10 data         nbytes   F32/F16/BF16: raw little-endian values; BITS/POSITIONS: pack_bits
                                 stream; GOLOMB: golomb_encode stream

How encode writes it: one copy of the data. Every field is checked and its section's size computed first (fixed for
F32/F16/BF16/BITS/POSITIONS, known once the stream is built for GOLOMB; BITS, POSITIONS and GOLOMB streams are built
in this pass, each a small tensor next to its field, except BITS fields that a compiled kernel packs: those are packed
in the second pass straight into the output, range-checked there, with no stream of their own), so the exact message
length is known before anything is written. Then ONE uint8 tensor of that length is allocated on the first field's
device and filled at increasing offsets: each section header, and each section's data. Float values go from the
caller's tensor straight into the output: through a ``view(dtype)`` of the output slice when its offset is a multiple
of the item size (``copy_`` casts on the way, so an fp32 field sent as F16 is read once and written once), as bytes
otherwise (F32 data starts at byte 30 in a one-field message). The checksum is then computed over the body slice of
the output in place (on the CPU, a large float section's checksum is taken piece by piece as it is written, while each
piece is in the cache; the other bytes are checksummed after they are written), and the 20-byte header is written
last. Earlier code (same bytes) encoded every field into its
own tensor, concatenated them into the body and concatenated header and body: two full copies of the body and two
fresh allocations, which dominated the dense fp16/bf16 compressors. The output is always freshly allocated, never a
reused buffer: callers keep it (gathered messages, residuals, several messages of one step alive at once), so reusing
memory would silently overwrite a message still in use. On
the CPU the headers are written with ``struct.pack_into`` into the tensor's memory (no torch op per
section) and small sections are copied by numpy; on other devices all section headers travel in one
transfer. The decoder likewise parses headers from host memory (the buffer itself on the CPU; on other
devices one copy, which the checksum needs anyway) and copies float values exactly once, into fresh tensors
that do not alias the buffer.

Versions: 2 replaced version 1's weighted word sum (which missed some 2-bit errors) by a CRC pair; the
layout is otherwise unchanged. A decoder reads only its own version and refuses any other with a WireError
that names both.

What the decoder checks, in this order, before anything is returned: the header (magic, version, flags,
reserved, the section count, the body length against the bytes present, the checksum); then, per
section, the codec, the count (exact, or at most the maximum; equal to an earlier section's count where the
spec links them with ``same_count_as``, e.g. threshold's positions and values), the parameter (float: 0,
BITS: the width, POSITIONS: bits_needed(universe), GOLOMB: the Rice parameter encode() uses, the spec's
``golomb_b`` or else optimal_rice_parameter(count / universe)), the data length the count implies
(GOLOMB streams: bounds, then the exact code structure), padding bits, positions in [0, universe) and
strictly increasing; finally that no bytes trail the last section.

The decoder raises only :class:`WireError` for any buffer contents (sizes are checked against the bytes
actually present before anything is allocated); misuse on either side (bad specs, fields that do not match
their specs) raises :class:`ConfigError`. Raw float bytes use the host byte order, which is little-endian
on every platform PyTorch supports.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradcomp.errors import ConfigError, WireError
from gradcomp.wire.bits import (
    _as_uint8_buffer,
    _pack,
    _unpack,
    bits_needed,
    decoded_dtype,
    host_device,
    host_path,
    ints_on,
    pack_bits,
    pack_bits_into,
    packed_nbytes,
    packs_into,
)
from gradcomp.wire.checksum import RunningChecksum64, checksum64, checksum64_tensor, to_host
from gradcomp.wire.golomb import (
    MAX_RICE_PARAMETER,
    MAX_UNIVERSE,
    golomb_decode,
    golomb_encode,
    golomb_stream_bits,
    optimal_rice_parameter,
)

__all__ = [
    "Codec",
    "FieldSpec",
    "FLOAT_DTYPES",
    "encode",
    "decode",
    "encoded_size",
    "HEADER_BYTES",
    "SECTION_HEADER_BYTES",
    "MAX_MESSAGE_BYTES",
    "max_encoded_size",
    "FORMAT_VERSION",
    "MAGIC",
    "DeviceChecks",
    "Refusals",
    "refusing_later",
    "abandon_later",
    "check_pending",
    "check_received",
    "check_received_range",
    "StepAbandoned",
    "AbandonedHere",
    "ABANDON_MARK",
    "abandon_message",
    "abandon_flags",
    "defer_verdict",
    "add_to_verdict",
    "deferring",
    "take_verdict",
]

MAGIC = b"GC"
FORMAT_VERSION = 2  # 1: weighted-sum checksum (refused); 2: CRC-32C + CRC-32
HEADER_BYTES = 20
SECTION_HEADER_BYTES = 10
_HEADER = struct.Struct("<2sBBHHIQ")
_SECTION = struct.Struct("<BBII")
assert _HEADER.size == HEADER_BYTES and _SECTION.size == SECTION_HEADER_BYTES
_U32_MAX = (1 << 32) - 1
MAX_MESSAGE_BYTES = HEADER_BYTES + _U32_MAX  # the header's u32 body length bounds every message
_MAX_POSITIONS_UNIVERSE = 1 << 32  # bits_needed(universe) must fit pack_bits' 32-bit maximum


class Codec(enum.IntEnum):
    F32 = 1  # float32 values, raw little-endian bytes
    F16 = 2  # float16
    BF16 = 3  # bfloat16
    BITS = 4  # unsigned ints bit-packed with `width` bits (pack_bits)
    POSITIONS = 5  # sorted, strictly increasing positions in [0, universe): bits_needed(universe) bits each
    GOLOMB = 6  # sorted positions in [0, universe), Golomb–Rice coded; b stored in the section header


FLOAT_DTYPES = {Codec.F32: torch.float32, Codec.F16: torch.float16, Codec.BF16: torch.bfloat16}


@dataclass(frozen=True)
class FieldSpec:
    """What both sides know about one field. See the module docstring for the wire layout."""

    codec: Codec
    count: int | None = None  # exact element count when the receiver knows it, else None (variable)
    max_count: int | None = None  # upper bound when count is None (required then)
    width: int | None = None  # for BITS
    universe: int | None = None  # for POSITIONS / GOLOMB
    # for GOLOMB: the parameter to encode with; None = optimal_rice_parameter(count / universe)
    golomb_b: int | None = None
    # relative index (< 0) of an earlier field of the same spec list whose element count this field's must
    # equal (threshold's values: -1, the positions just before them); relative, so that the spec lists of
    # several slots can be concatenated into one message
    same_count_as: int | None = None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_spec(spec: object, i: int) -> Codec:
    if not isinstance(spec, FieldSpec):
        raise ConfigError(f"spec {i}: expected a FieldSpec, got {type(spec).__name__}")
    try:
        codec = Codec(spec.codec)
    except ValueError:
        raise ConfigError(f"spec {i}: unknown codec {spec.codec!r}") from None
    if spec.count is not None:
        if not _is_int(spec.count) or not 0 <= spec.count <= _U32_MAX:
            raise ConfigError(f"spec {i}: count must be an int in [0, 2**32 - 1], got {spec.count!r}")
    else:
        if spec.max_count is None:
            raise ConfigError(f"spec {i}: max_count is required when count is None")
    if spec.max_count is not None and (not _is_int(spec.max_count) or spec.max_count < 0):
        raise ConfigError(f"spec {i}: max_count must be a non-negative int, got {spec.max_count!r}")
    if codec == Codec.BITS:
        if not _is_int(spec.width) or not 1 <= spec.width <= 32:
            raise ConfigError(f"spec {i}: BITS needs width in [1, 32], got {spec.width!r}")
    if codec in (Codec.POSITIONS, Codec.GOLOMB):
        limit = _MAX_POSITIONS_UNIVERSE if codec == Codec.POSITIONS else MAX_UNIVERSE
        if not _is_int(spec.universe) or not 0 <= spec.universe <= limit:
            raise ConfigError(f"spec {i}: {codec.name} needs universe in [0, {limit}], got {spec.universe!r}")
        if spec.count is not None and spec.count > spec.universe:
            raise ConfigError(f"spec {i}: count {spec.count} exceeds universe {spec.universe}")
    if codec == Codec.GOLOMB and spec.golomb_b is not None:
        if not _is_int(spec.golomb_b) or not 0 <= spec.golomb_b <= 31:
            raise ConfigError(f"spec {i}: golomb_b must be in [0, 31], got {spec.golomb_b!r}")
    if spec.same_count_as is not None:
        link = spec.same_count_as
        if not _is_int(link) or link >= 0 or i + link < 0:
            raise ConfigError(
                f"spec {i}: same_count_as must be a negative int pointing at an earlier field, got {link!r}"
            )
    return codec


def _check_specs(specs: list) -> list[Codec]:
    """Checks every spec and the links between them; returns the codecs."""
    codecs = [_check_spec(s, i) for i, s in enumerate(specs)]
    for i, spec in enumerate(specs):
        if spec.same_count_as is not None:
            other = specs[i + spec.same_count_as]
            if spec.count is not None and other.count is not None and spec.count != other.count:
                raise ConfigError(
                    f"spec {i}: exact count {spec.count} contradicts the count {other.count} of field "
                    f"{i + spec.same_count_as} it must equal (same_count_as)"
                )
    return codecs


def _max_count(spec: FieldSpec) -> int:
    m = spec.count if spec.count is not None else spec.max_count
    m = min(m, _U32_MAX)
    if spec.codec in (Codec.POSITIONS, Codec.GOLOMB):
        m = min(m, spec.universe)
    return m


def _golomb_b(spec: FieldSpec, count: int) -> int:
    if spec.golomb_b is not None:
        return spec.golomb_b
    return optimal_rice_parameter(count / spec.universe if spec.universe else 1.0)


def _positions_ok(pos: torch.Tensor, universe: int) -> torch.Tensor:
    """The position checks of :func:`_check_positions` as one bool tensor on the positions' device (not read)."""
    if pos.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=pos.device)
    ok = (pos[0] >= 0) & (pos[-1] < universe)
    if pos.numel() > 1:
        ok = ok & (pos[1:] > pos[:-1]).all()
    return ok


def _received_positions(pos: torch.Tensor, universe: int, checks: list) -> torch.Tensor:
    """Decoded positions on the device path, whose checks are read later (with the message's others): their check
    joins ``checks`` and the positions come back clamped into [0, universe) in place. A sound message's are
    unchanged; a corrupted one's can no longer index past its slot before the read refuses the message (on a GPU
    an index out of range is a device-side assert, which ends the process instead of raising WireError)."""
    checks.append(_positions_ok(pos, universe))
    return pos.clamp_(0, max(universe - 1, 0))


def _check_positions(
    pos: torch.Tensor, universe: int, exc: type[Exception], where: str, flags: list | None = None
) -> None:
    if flags is not None:  # the device path: checked later with the caller's other checks (see encode)
        message = f"{where}: positions must be strictly increasing in [0, {universe})"
        flags.append((_positions_ok(pos, universe), message))
        return
    if pos.numel() == 0:
        return
    if pos.numel() > 1 and bool((pos[1:] <= pos[:-1]).any()):
        raise exc(f"{where}: positions are not strictly increasing")
    lo, hi = int(pos[0]), int(pos[-1])
    if lo < 0 or hi >= universe:
        raise exc(f"{where}: positions must lie in [0, {universe}), got range [{lo}, {hi}]")


def _encode_field(
    t: torch.Tensor, spec: FieldSpec, codec: Codec, i: int, flags: list | None = None, stream_bits: int | None = None
) -> tuple[int, torch.Tensor]:
    """Returns (param, data bytes) for one BITS / POSITIONS / GOLOMB field (float fields: :func:`_put_float`).

    With ``flags`` (the device path), the range and order checks of BITS, POSITIONS and GOLOMB fields are appended to
    it as ``(bool tensor, message)`` instead of being read back (see :func:`encode`); ``stream_bits``: a GOLOMB
    field's stream length, read beforehand with the message's others (:func:`_golomb_lengths`)."""
    where = f"field {i} ({codec.name})"
    if t.dtype.is_floating_point or t.dtype.is_complex:
        raise ConfigError(f"{where}: expected an integer tensor, got dtype {t.dtype}")
    if codec == Codec.BITS:
        return spec.width, pack_bits(t, spec.width, flags)
    if t.dtype == torch.bool:
        raise ConfigError(f"{where}: positions must be an integer tensor, got dtype bool")
    pos = t.to(torch.int64)
    _check_positions(pos, spec.universe, ConfigError, where, flags)
    if codec == Codec.POSITIONS:
        width = bits_needed(spec.universe)
        return width, _pack(pos, width)
    b = _golomb_b(spec, pos.numel())
    # the device path: the order and range were deferred above, golomb_encode's own order check adds nothing
    data, _ = golomb_encode(pos, b, None if flags is None else [], stream_bits)
    return b, data


def _golomb_lengths(fields: list, specs: list, codecs: list, device: torch.device) -> dict[int, int]:
    """The device path's stream lengths in bits of the message's GOLOMB fields, by field index, in ONE read (they
    size the message; golomb_encode would read each field's on its own)."""
    which, lengths = _golomb_bits(fields, specs, codecs, device)
    return dict(zip(which, lengths.tolist())) if which else {}


def _golomb_bits(fields: list, specs: list, codecs: list, device: torch.device) -> tuple[list[int], torch.Tensor]:
    """(the indices of the message's GOLOMB fields, their stream lengths in bits as an int64 tensor on ``device``),
    computed and not read. Fields that encode() will refuse (not a tensor of integers) are left out: their error is
    raised where it always was."""
    which, lengths = [], []
    for i, (f, spec, codec) in enumerate(zip(fields, specs, codecs)):
        t = f.detach()
        if codec != Codec.GOLOMB or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            continue
        which.append(i)
        lengths.append(golomb_stream_bits(t.reshape(-1).to(device), _golomb_b(spec, t.numel())))
    stacked = torch.stack(lengths) if lengths else torch.zeros(0, dtype=torch.int64, device=device)
    return which, stacked


def length_from_counts(
    specs: Sequence[FieldSpec], counts: Sequence[int | torch.Tensor], golomb_bits: torch.Tensor | None = None
) -> torch.Tensor:
    """The length in bytes (a one-element int64 tensor) of the message of these ``specs`` whose fields have these
    element counts, some of them 0-d int64 tensors on the device (``compressors.base.SizedSelection``): computed
    there, not read. A GOLOMB field's length depends on its positions, not on its count: ``golomb_bits`` gives the
    lengths in bits of the message's GOLOMB streams, in field order (ConfigError if they are not given, one each)."""
    specs = list(specs)
    codecs = _check_specs(specs)
    if len(counts) != len(specs):
        raise ConfigError(f"{len(counts)} counts but {len(specs)} specs")
    golomb = free_sections(specs)[1]
    given = 0 if golomb_bits is None else golomb_bits.numel()
    if given != len(golomb):
        raise ConfigError(f"{len(golomb)} GOLOMB fields, whose lengths depend on their positions, but {given} lengths")
    device = next((c.device for c in counts if isinstance(c, torch.Tensor)), torch.device("cpu"))
    total = torch.full((1,), HEADER_BYTES + SECTION_HEADER_BYTES * len(specs), dtype=torch.int64, device=device)
    for count, spec, codec in zip(counts, specs, codecs):
        if codec != Codec.GOLOMB:
            total = total + _expected_nbytes(codec, _fixed_param(spec, codec), count)  # (ints and tensors alike)
    if golomb:
        total = total + ((golomb_bits.to(device) + 7) // 8).sum()
    return total


def length_on_device(
    fields: Sequence[torch.Tensor], specs: Sequence[FieldSpec]
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """What :func:`encode` needs to read before it can size a device message, computed and NOT read: ``(the
    message's length in bytes, a one-element int64 tensor; the indices of its GOLOMB fields; their stream lengths in
    bits, an int64 tensor)``, on the first field's device. A caller that must read the length anyway (a size
    exchange) reads the stream lengths in the same transfer and hands them to ``encode(stream_bits=...)``, which
    then reads nothing. The fields are checked against their specs by encode, not here."""
    fields, specs = list(fields), list(specs)
    codecs = _check_specs(specs)
    device = fields[0].device if fields else torch.device("cpu")
    which, bits = _golomb_bits(fields, specs, codecs, device)
    fixed = HEADER_BYTES + SECTION_HEADER_BYTES * len(specs)
    fixed += sum(
        _expected_nbytes(codec, _fixed_param(spec, codec), f.numel())
        for f, spec, codec in zip(fields, specs, codecs)
        if codec != Codec.GOLOMB  # (a GOLOMB field encode() will refuse adds nothing: its error comes there)
    )
    return ((bits + 7) // 8).sum().reshape(1) + fixed, which, bits


def free_sections(specs: Sequence[FieldSpec]) -> tuple[list[int], list[int]]:
    """Where a message of these ``specs`` leaves its layout to the data: ``(the sections whose count is free: no exact
    count and no ``same_count_as`` link; the GOLOMB sections, whose stream length depends on their positions)``.
    Their values (:func:`layout_values`) fix every section's place; the specs alone fix how many there are."""
    free = [i for i, spec in enumerate(specs) if spec.count is None and spec.same_count_as is None]
    golomb = [i for i, spec in enumerate(specs) if Codec(spec.codec) == Codec.GOLOMB]
    return free, golomb


def layout_values(
    specs: Sequence[FieldSpec], counts: Sequence[int | torch.Tensor], golomb_bits: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """The values that fix the layout of a message with these ``specs`` beyond what they fix themselves, as an int64
    tensor on ``device``, computed and not read: the count of every free section (``counts``: every section's, ints
    or 0-d int64 tensors on the device), then every GOLOMB section's stream length in bytes (``golomb_bits``: their
    lengths in bits, in order, from :func:`length_on_device`). A size exchange sends them with the message's length,
    so that receivers decode the message where it is (:func:`decode` ``layout=``) instead of bringing it to the host
    for its headers. Host ints go in one transfer that does not make the host wait (``ints_on``)."""
    free, golomb = free_sections(specs)
    chosen = [counts[i] for i in free]
    from_host = iter(ints_on(device, [int(c) for c in chosen if not isinstance(c, torch.Tensor)]).unbind())
    pieces = [c.reshape(()).to(torch.int64) if isinstance(c, torch.Tensor) else next(from_host) for c in chosen]
    if golomb:
        nbytes = (golomb_bits + 7) // 8 if golomb_bits is not None and golomb_bits.numel() == len(golomb) else None
        if nbytes is None:  # (a field encode() will refuse: its error comes there; the values keep their number)
            nbytes = torch.zeros(len(golomb), dtype=torch.int64, device=device)
        pieces.extend(nbytes.unbind())
    return torch.stack(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=device)


def _given_layout(specs: list, codecs: list, values: Sequence[int]) -> tuple[list, int] | None:
    """Where every section's data lies in a message whose free counts and GOLOMB stream lengths are ``values`` (a
    size exchange's, :func:`layout_values`): ``([(data offset, codec, param, count, nbytes)], message length)``, or
    None for values no message of these specs can have (the host path then reads the message's own headers)."""
    free, golomb = free_sections(specs)
    if len(values) != len(free) + len(golomb):
        return None
    counts = [spec.count for spec in specs]
    for i, v in zip(free, values):
        counts[i] = int(v)
    for i, spec in enumerate(specs):
        if spec.same_count_as is not None:
            counts[i] = counts[i + spec.same_count_as]
    streams = dict(zip(golomb, (int(v) for v in values[len(free):])))
    if any(c is None or not 0 <= c <= _max_count(spec) for c, spec in zip(counts, specs)) or any(
        n < 0 for n in streams.values()
    ):
        return None
    return _placed(specs, codecs, counts, streams)


# Up to this many data bytes, CPU sections are copied by numpy rather than by a torch slice, view and copy_
# (several times numpy's fixed cost), which matters for messages of many small sections (one per layer);
# above it torch's copy, faster than numpy's on large bodies, wins (docs/host_performance.md).
_SMALL_COPY = 1 << 16


def _put_float(
    out: torch.Tensor, mem: np.ndarray | None, off: int, nbytes: int, src: torch.Tensor, dtype: torch.dtype
) -> None:
    """Writes ``src`` (any float dtype, shape, strides or device) cast to ``dtype`` into ``out[off : off + nbytes]``.

    ``nbytes`` is exactly ``numel * itemsize``; ``mem`` is ``out.numpy()`` on the CPU, else None. Aligned
    (``off`` a multiple of the item size: every F16 / BF16 section whose predecessors have even lengths), the
    slice is viewed as ``dtype`` and ``copy_`` casts and writes in one pass, with no temporary whatever
    ``src`` is. Misaligned (``view(dtype)`` refuses it: the first F32 section, at byte 30, is one), the bytes
    of ``src`` in ``dtype`` are copied as bytes; that needs no temporary either when ``src`` is already a
    contiguous tensor of ``dtype`` (fp32 for ``none``), else one cast copy of the field. ``copy_`` rounds
    exactly as ``Tensor.to`` does (it is what ``to`` calls), so the bytes are those of ``src.to(dtype)``.
    """
    if nbytes == 0:
        return
    if mem is not None and nbytes <= _SMALL_COPY and src.dtype == dtype and src.device.type == "cpu":
        mem[off : off + nbytes] = _raw_bytes(src, dtype, src.device).numpy()
    elif off % dtype.itemsize == 0:
        out[off : off + nbytes].view(dtype).view(src.shape).copy_(src)
    else:
        out[off : off + nbytes].copy_(_raw_bytes(src, dtype, out.device))


# A float section of at least two pieces of this many bytes is written and checksummed piece by piece on the CPU
# (_put_float_summed); smaller ones are written whole and checksummed with the bytes around them.
_SUMMED_PIECE = 1 << 19


def _summed_applies(off: int, nbytes: int, src: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`_put_float_summed` writes this float section: at least two pieces, aligned, from one
    contiguous run of CPU memory (the others are written whole by :func:`_put_float`)."""
    return nbytes >= 2 * _SUMMED_PIECE and off % dtype.itemsize == 0 and src.device.type == "cpu" and (
        src.is_contiguous()
    )


def _put_float_summed(
    out: torch.Tensor, mem: np.ndarray, off: int, nbytes: int, src: torch.Tensor, dtype: torch.dtype,
    running: RunningChecksum64,
) -> None:
    """:func:`_put_float` for a large section on the CPU (:func:`_summed_applies`), the checksum taken as it goes:
    each piece of :data:`_SUMMED_PIECE` bytes is written (cast on the way, as ``copy_`` casts) and at once added to
    ``running`` while it is still in the cache, so the body is not read back from memory for its checksum
    afterwards (on the project's machine that read was most of what encoding an fp16 message cost beyond the
    cast). The bytes are those of :func:`_put_float`."""
    item = dtype.itemsize
    flat, target = src.reshape(-1), out[off : off + nbytes].view(dtype)
    step = _SUMMED_PIECE // item
    for start in range(0, flat.numel(), step):
        piece = target[start : start + step]
        piece.copy_(flat[start : start + step])
        running.update(mem[off + start * item : off + (start + piece.numel()) * item])


_IN_PLACE = {Codec.F16: torch.float16, Codec.BF16: torch.bfloat16}  # their data starts aligned, at byte 30
_MESSAGE = "_gradcomp_message"  # float_message's field: attribute holding its message buffer until encoded


def float_message(codec: Codec, count: int) -> torch.Tensor:
    """An uninitialised host tensor of ``count`` values of ``codec`` (F16 or BF16) placed where :func:`encode` puts
    the data of a one-field message of that codec and count, inside a freshly allocated buffer of the message's
    length. A compressor that writes its output into it (the dense casts: the cast straight into it) saves encode
    the copy of the body: ``encode([field], [FieldSpec(codec, count=count)])`` then writes the headers around the
    data, checksums the body and returns that buffer itself, so the message and the field share their memory (the
    field is the message's data: modifying one afterwards changes the other, and a changed message fails its
    checksum). That happens once, on this tensor's first encode, and only for exactly that message; any other
    encode of it, and every encode of another tensor (a view, a clone), copies the data, as for any tensor."""
    dtype = _IN_PLACE[Codec(codec)]
    buf = torch.empty(HEADER_BYTES + SECTION_HEADER_BYTES + count * dtype.itemsize, dtype=torch.uint8)
    field = buf[HEADER_BYTES + SECTION_HEADER_BYTES :].view(dtype)
    setattr(field, _MESSAGE, buf)
    return field


def _reserved_buffer(fields: list, plan: list, body_length: int) -> torch.Tensor | None:
    """The buffer of :func:`float_message` that already holds this one-section message's data, taken from the
    field (so that no later encode uses it again), or None (any other message, or a field not laid out there)."""
    if len(plan) != 1 or plan[0][0] not in _IN_PLACE:
        return None
    buf = getattr(fields[0], _MESSAGE, None)
    codec, t = plan[0][0], plan[0][4]
    if (
        buf is None or t.dtype != _IN_PLACE[codec] or not t.is_contiguous()
        or buf.numel() != HEADER_BYTES + body_length
        or t.data_ptr() != buf.data_ptr() + HEADER_BYTES + SECTION_HEADER_BYTES
    ):
        return None
    delattr(fields[0], _MESSAGE)
    return buf


def _raw_bytes(src: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The values of the non-empty ``src`` in ``dtype`` on ``device`` as a flat uint8 view (a copy only when needed)."""
    flat = src.reshape(-1).to(device=device, dtype=dtype).contiguous()
    if flat.stride(0) != 1:  # one element counts as contiguous whatever its stride, which view(uint8) refuses
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def _put_heads(out: torch.Tensor, heads: list[tuple[int, bytes]], keep: bool = False) -> None:
    """Writes byte strings ``(offset, bytes)`` (the header's first 12 bytes, the section headers) into ``out`` on
    the device path in one indexed write, instead of one transfer per section (the host path writes them with
    ``struct.pack_into`` into the tensor's memory as it goes).

    ``keep`` (a layout the specs fix: every count exact, no Golomb stream): the same heads come at every step, so
    their offsets and bytes go to the device once and are kept (``_kept_heads``); otherwise they go in one
    asynchronous transfer through pinned memory, each time, without making the host wait.
    """
    if heads:
        index, values = (_kept_heads if keep else _heads_on)(out.device, tuple(heads))
        out.index_put_((index,), values)


def _heads_on(device: torch.device, heads: tuple[tuple[int, bytes], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The offsets (int64) and bytes (uint8) of ``heads`` on ``device``, in one host-to-device transfer that does not
    make the host wait on CUDA (pinned memory: torch's pinned allocator keeps the block until the copy is done)."""
    index = [off + k for off, h in heads for k in range(len(h))]
    both = ints_on(device, index + list(b"".join(h for _, h in heads)))
    return both[: len(index)], both[len(index):].to(torch.uint8)


@functools.lru_cache(maxsize=256)
def _kept_heads(device: torch.device, heads: tuple[tuple[int, bytes], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_heads_on`, made once per distinct heads and kept. The copy is then waited for, once, so that a kept
    tensor is complete before any stream uses it (the first message of a fixed layout pays that wait; no later one
    waits, and no variable layout comes here)."""
    index, values = _heads_on(device, heads)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return index, values


# The sender-side checks of device-path encodes (BITS ranges, POSITIONS order), not yet read: per thread, a list of
# (bool tensor, message). They are read with the next device-path decode's one transfer in the same thread, or by
# check_pending(), or when _PENDING_LIMIT of them have gathered; a false one raises ConfigError (the caller's bug).
_pending = threading.local()
_PENDING_LIMIT = 256


def _defer(flags: list) -> None:
    checks = getattr(_pending, "checks", None)
    if checks is None:
        checks = _pending.checks = []
    checks.extend(flags)
    if len(checks) >= _PENDING_LIMIT:
        check_pending()


def _take_pending() -> list:
    checks = getattr(_pending, "checks", None) or []
    _pending.checks = []
    return checks


def _raise_failed(checks: list, values) -> None:
    for (_, message), ok in zip(checks, values):
        if not ok:
            raise ConfigError(f"a message encoded on the device: {message}")


def check_pending() -> None:
    """Reads this thread's outstanding device-path encode checks (one transfer) and raises ConfigError if one failed."""
    checks = _take_pending()
    if checks:
        flags = torch.stack([f.reshape(()).to(torch.bool) for f, _ in checks]).to(torch.uint8)
        _raise_failed(checks, _read_bytes(flags))


def encode(
    fields: Sequence[torch.Tensor], specs: Sequence[FieldSpec], stream_bits: dict[int, int] | None = None
) -> torch.Tensor:
    """Serialize ``fields`` (flattened) according to ``specs`` into one uint8 tensor.

    The output lives on the device of the first field (CPU when there are none); other fields are moved
    there. Raises ConfigError when a field does not match its spec.

    Single copy (see the module docstring): every field is checked and its data size computed first (BITS,
    POSITIONS and GOLOMB fields are encoded then, their streams being small next to the field), then ONE
    output of the exact size is allocated and every section is written at its offset; float values go
    from the caller's tensor straight into the output, cast on the way when needed.

    ``stream_bits``: on the device path, the GOLOMB fields' stream lengths, by field index, that the caller read
    (:func:`length_on_device`); encode then reads nothing back.
    """
    _note_use()
    fields = list(fields)
    specs = list(specs)
    if len(fields) != len(specs):
        raise ConfigError(f"{len(fields)} fields but {len(specs)} specs")
    if len(specs) > 0xFFFF:
        raise ConfigError(f"at most 65535 fields per message, got {len(specs)}")
    device = torch.device("cpu")
    for i, f in enumerate(fields):
        if not isinstance(f, torch.Tensor):
            raise ConfigError(f"field {i}: expected a tensor, got {type(f).__name__}")
    if fields:
        device = fields[0].device
    codecs = _check_specs(specs)
    on_host = host_device(device)
    flags: list = []  # the device path's deferred sender checks
    # the device path's Golomb stream lengths, all read at once: the one read of sizes a message needs
    if on_host:
        stream_bits = {}
    elif stream_bits is None:
        stream_bits = _golomb_lengths(fields, specs, codecs, device)
    # Pass 1: checks, sizes, and the streams of the non-float codecs. plan: (codec, param, count, nbytes, tensor,
    # packed_later) where tensor is the detached field itself for float codecs (read once, in pass 2) and for BITS
    # fields that the compiled packer writes straight into the output in pass 2 (packed_later), else its data bytes.
    plan: list[tuple[Codec, int, int, int, torch.Tensor, bool]] = []
    body_length = 0
    for i, (f, spec, codec) in enumerate(zip(fields, specs, codecs)):
        t = f.detach()
        n = t.numel()
        later = False
        if spec.count is not None and n != spec.count:
            raise ConfigError(f"field {i} ({codec.name}): {n} elements, spec expects exactly {spec.count}")
        if spec.same_count_as is not None:
            j = i + spec.same_count_as
            if n != fields[j].numel():
                raise ConfigError(
                    f"field {i} ({codec.name}): {n} elements, but field {j} has {fields[j].numel()} and the "
                    "spec links their counts (same_count_as)"
                )
        if spec.count is None and n > spec.max_count:
            raise ConfigError(f"field {i} ({codec.name}): {n} elements exceed max_count {spec.max_count}")
        if n > _U32_MAX:
            raise ConfigError(f"field {i} ({codec.name}): {n} elements do not fit the u32 count")
        if codec in FLOAT_DTYPES:
            if not t.dtype.is_floating_point:
                raise ConfigError(f"field {i} ({codec.name}): expected a floating-point tensor, got dtype {t.dtype}")
            param, data, nbytes = 0, t, _expected_nbytes(codec, 0, n)
        elif codec == Codec.BITS and on_host and packs_into(t, spec.width):
            later = True  # packed in pass 2 straight into the output by the compiled kernel (range-checked there)
            param, data, nbytes = spec.width, t, packed_nbytes(n, spec.width)
        else:
            param, data = _encode_field(
                t.reshape(-1).to(device), spec, codec, i, None if on_host else flags, stream_bits.get(i)
            )
            data = data.reshape(-1)
            nbytes = data.numel()
        if nbytes > _U32_MAX:
            raise ConfigError(f"field {i} ({codec.name}): {nbytes} data bytes do not fit the u32 size")
        body_length += SECTION_HEADER_BYTES + nbytes
        plan.append((codec, param, n, nbytes, data, later))
    if body_length > _U32_MAX:
        raise ConfigError(f"message body of {body_length} bytes does not fit the u32 length")
    # Pass 2: one allocation, every section written at its offset, then the checksum of the body in place. (A one-field
    # F16 / BF16 message whose data a compressor wrote in place, float_message: no allocation, no copy of the data.)
    placed = _reserved_buffer(fields, plan, body_length) if on_host else None
    out = placed if placed is not None else torch.empty(HEADER_BYTES + body_length, dtype=torch.uint8, device=device)
    mem = out.numpy() if on_host else None  # the output's own memory, for struct and small copies
    heads: list[tuple[int, bytes]] = []  # section headers to write on other devices
    # the host path's checksum of a message with a large float section, taken in order: such sections as they are
    # written (_put_float_summed), the other bytes from `summed` up to the next one, or up to the end (summed None:
    # none yet; a message without one is checksummed whole at the end, as before)
    running, summed = RunningChecksum64(), None
    off = HEADER_BYTES
    for codec, param, n, nbytes, data, later in plan:
        if mem is not None:
            _SECTION.pack_into(mem, off, int(codec), param, n, nbytes)
        else:
            heads.append((off, _SECTION.pack(int(codec), param, n, nbytes)))
        off += SECTION_HEADER_BYTES
        if codec in FLOAT_DTYPES:
            dtype = FLOAT_DTYPES[codec]
            if placed is not None:
                pass  # the data is already there
            elif mem is not None and _summed_applies(off, nbytes, data, dtype):
                running.update(mem[HEADER_BYTES if summed is None else summed : off])  # before it, its header too
                _put_float_summed(out, mem, off, nbytes, data, dtype, running)
                summed = off + nbytes
            else:
                _put_float(out, mem, off, nbytes, data, dtype)
        elif later:  # a BITS field left for this pass (see pass 1); CPU only, so mem is the output's memory
            pack_bits_into(data, param, mem[off : off + nbytes])
        elif mem is not None and nbytes <= _SMALL_COPY:
            mem[off : off + nbytes] = data.numpy()
        elif nbytes:
            out[off : off + nbytes].copy_(data)
        off += nbytes
    if mem is not None:
        if summed is None:
            checksum = checksum64(out[HEADER_BYTES:])
        else:
            running.update(mem[summed:off])
            checksum = running.value()
        _HEADER.pack_into(mem, 0, MAGIC, FORMAT_VERSION, 0, len(specs), 0, body_length, checksum)
        return out
    # The device path: nothing is read back. The header's first 12 bytes go with the section headers; the checksum is
    # computed where the body is (checksum64_tensor) and written as the header's last 8 bytes (little-endian u64).
    heads.insert(0, (0, _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(specs), 0, body_length, 0)[:12]))
    _put_heads(out, heads, keep=all(spec.count is not None and c != Codec.GOLOMB for spec, c in zip(specs, codecs)))
    out[12:HEADER_BYTES].copy_(checksum64_tensor(out[HEADER_BYTES:]).reshape(1).view(torch.uint8))
    if flags:
        _defer(flags)
    return out


def _expected_nbytes(codec: Codec, param: int, count: int) -> int | None:
    if codec in (Codec.F32,):
        return 4 * count
    if codec in (Codec.F16, Codec.BF16):
        return 2 * count
    if codec in (Codec.BITS, Codec.POSITIONS):
        return packed_nbytes(count, param)
    return None  # GOLOMB: variable


def decode(
    buf: torch.Tensor, specs: Sequence[FieldSpec], later: DeviceChecks | None = None,
    layout: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Parse a buffer produced by :func:`encode` with the same ``specs``; returns one tensor per field.

    Output dtypes: float32 / float16 / bfloat16 for the float codecs; for BITS the narrowest signed integer
    that holds the width (``bits.decoded_dtype``: int16 up to 15 bits, int32 up to 31, int64 for 32); int64 for
    POSITIONS and GOLOMB (they index); outputs live on the buffer's device. Raises WireError (only) for any
    malformed, truncated, oversized or corrupted buffer; ConfigError for invalid specs.

    ``later`` (a :class:`DeviceChecks`): a device buffer whose layout the specs fix is decoded without reading
    anything back; its checks are read, with others, by ``later.read()``, which raises what decode would have. One
    whose layout depends on the data (variable counts, Golomb streams) still comes to the host once for its headers
    and checksum, but its data checks (padding, positions, Golomb code structure) join ``later`` too, unless
    ``layout`` gives its free counts and Golomb stream lengths (:func:`layout_values`, as a size exchange brought
    them): it is then decoded where it is, like a fixed layout, its headers checked against the ones those values
    imply (with ``later``, nothing is read). Ignored on the host path, which reads the headers themselves.

    Inside :func:`refusing_later`, a buffer that fails its checks does not raise: its fault is noted and decode
    returns stand-ins (zeros of the sizes the specs fix; empty where they leave the count free).
    """
    refusals = _note_use()
    if refusals is None:
        return _decode(buf, specs, None, later, layout)
    try:
        return _decode(buf, specs, None, later, layout)
    except WireError as e:
        refusals.messages.append(str(e))
        return _stand_ins(specs, buf.device)


def _stand_ins(specs: Sequence[FieldSpec], device: torch.device) -> list[torch.Tensor]:
    """What :func:`decode` returns for a refused message inside :func:`refusing_later`: zeros of each field's decoded
    dtype, of the count its spec fixes (the count of the field it must match, or none at all where it is free), so
    that the scheme's later rounds send what they would send, in sizes every receiver accepts."""
    out: list[torch.Tensor] = []
    for i, spec in enumerate(specs):
        codec = Codec(spec.codec)
        count = spec.count
        if count is None:
            count = out[i + spec.same_count_as].numel() if spec.same_count_as is not None else 0
        if codec in FLOAT_DTYPES:
            dtype = FLOAT_DTYPES[codec]
        else:
            dtype = decoded_dtype(spec.width) if codec == Codec.BITS else torch.int64
        out.append(torch.zeros(count, dtype=dtype, device=device))
    return out


def _decode(
    buf: torch.Tensor, specs: Sequence[FieldSpec], on_host: bool | None, later: DeviceChecks | None = None,
    layout: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """:func:`decode`; ``on_host`` True forces the host path (the device path's diagnosis of a failed check)."""
    specs = list(specs)
    codecs = _check_specs(specs)
    buf = _as_uint8_buffer(buf)
    total = buf.numel()
    if on_host is None:
        on_host = host_path(buf)
    if total < HEADER_BYTES:
        raise WireError(f"truncated buffer: {total} bytes, shorter than the {HEADER_BYTES}-byte header")
    if not on_host:
        fixed = _fixed_layout(specs, codecs, total) if layout is None else _given_layout(specs, codecs, layout)
        if fixed is not None and fixed[1] == total:
            got = _decode_on_device(buf, specs, fixed[0], later)
            if got is not None:
                return got
        # A message with variable counts (or one that failed a check): the whole buffer and its checksum computed on
        # the device go to the host in one transfer, and the host path below names what is wrong, if anything.
    # Headers are parsed from host memory with struct: on the CPU the buffer's own memory (no copy); on another
    # device the whole buffer, in one transfer (it used to be one more transfer, and a sync, per section header).
    fetched = None if on_host else (getattr(_fetched, "hosts", None) or {}).get((buf.data_ptr(), total))
    if on_host:
        host, computed = buf, None
        mem = host.numpy()
    else:  # from fetch_together, or one transfer now (a view of this thread's staging buffer: this call only)
        mem, computed = fetched if fetched is not None else _fetch([buf])[0]
        host = torch.from_numpy(mem)
    checks: list | None = None if on_host else []  # the device's data checks, read together at the end
    magic, version, flags, n_sections, reserved, body_length, checksum = _HEADER.unpack_from(mem, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        older = " (an older format, whose checksum missed some 2-bit errors)" if version < FORMAT_VERSION else ""
        raise WireError(
            f"unsupported format version {version}{older}: this decoder reads version {FORMAT_VERSION} only; "
            "encode the message with the same gradcomp version on every worker"
        )
    if flags != 0:
        raise WireError(f"unsupported flags 0x{flags:02x} (expected 0)")
    if reserved != 0:
        raise WireError(f"nonzero reserved header field 0x{reserved:04x}")
    if n_sections != len(specs):
        raise WireError(f"header says {n_sections} sections, expected {len(specs)}")
    got = total - HEADER_BYTES
    if got < body_length:
        # The length field is outside the checksum, so a flipped bit in it reads as a cut or a padded buffer
        raise WireError(
            f"truncated buffer: header says {body_length} body bytes, got {got} (or the header's length field "
            "is corrupted)"
        )
    if got > body_length:
        raise WireError(
            f"oversized buffer: header says {body_length} body bytes, got {got} (trailing bytes, or the header's "
            "length field is corrupted)"
        )
    if (checksum64(host[HEADER_BYTES:]) if computed is None else computed) != checksum:
        raise WireError("checksum mismatch: the message body is corrupted")

    out: list[torch.Tensor] = []
    counts: list[int] = []
    off = HEADER_BYTES
    try:
        for i, (spec, codec) in enumerate(zip(specs, codecs)):
            where = f"section {i}"
            if off + SECTION_HEADER_BYTES > total:
                raise WireError(f"{where}: section header runs past the end of the body")
            s_codec, param, count, nbytes = _SECTION.unpack_from(mem, off)
            off += SECTION_HEADER_BYTES
            if s_codec != codec:
                name = Codec(s_codec).name if s_codec in Codec._value2member_map_ else "unknown"
                raise WireError(f"{where}: codec {s_codec} ({name}) where {codec.name} expected")
            if spec.count is not None and count != spec.count:
                raise WireError(f"{where}: count {count} != expected {spec.count}")
            if count > _max_count(spec):
                raise WireError(f"{where}: count {count} exceeds the maximum {_max_count(spec)}")
            if spec.same_count_as is not None:
                j = i + spec.same_count_as
                if count != counts[j]:
                    raise WireError(
                        f"{where}: count {count} != count {counts[j]} of section {j}: the sections disagree "
                        f"({codec.name} must have one element per element of section {j}, {codecs[j].name})"
                    )
            counts.append(count)
            if codec in FLOAT_DTYPES and param != 0:
                raise WireError(f"{where}: param {param} != 0 for a float codec")
            if codec == Codec.BITS and param != spec.width:
                raise WireError(f"{where}: bit width {param} != expected {spec.width}")
            if codec == Codec.POSITIONS and param != bits_needed(spec.universe):
                raise WireError(f"{where}: position width {param} != expected {bits_needed(spec.universe)}")
            if codec == Codec.GOLOMB:
                implied = _golomb_b(spec, count)  # what encode() uses: the spec's golomb_b, else the optimal one
                if param != implied:
                    raise WireError(
                        f"{where}: Rice parameter {param} != expected {implied} (the spec's for {count} positions)"
                    )
            expected = _expected_nbytes(codec, param, count)
            if expected is not None and nbytes != expected:
                raise WireError(f"{where}: {nbytes} data bytes, expected {expected} for {count} elements")
            if off + nbytes > total:
                raise WireError(f"{where}: {nbytes} data bytes run past the end of the body ({total - off} bytes left)")
            data = buf[off : off + nbytes]
            off += nbytes
            if codec in FLOAT_DTYPES:
                # clone: the one copy of the values, into fresh, aligned storage that does not alias the caller's
                # buffer (a view would be misaligned for F32 at byte 30, and would change when a receive buffer is
                # reused or corrupt it when a decompressor works in place)
                out.append(data.clone().view(FLOAT_DTYPES[codec]))
            elif codec == Codec.BITS:
                out.append(_unpack_checked(data, param, count, where, decoded_dtype(param), checks))
            elif codec == Codec.POSITIONS:
                pos = _unpack_checked(data, param, count, where, torch.int64, checks)  # indices
                if checks is None:
                    _check_positions(pos, spec.universe, WireError, where)
                else:
                    pos = _received_positions(pos, spec.universe, checks)
                out.append(pos)
            else:
                try:
                    out.append(golomb_decode(data, param, count, spec.universe, checks))
                except WireError as e:
                    raise WireError(f"{where}: {e}") from None
        if off != total:
            raise WireError(f"trailing bytes: {total - off} bytes after the last section")
    except WireError:
        if checks:  # data checks of earlier sections were deferred: the host path names the first fault, as always
            return _decode(host.clone(), specs, True)
        raise
    if checks:
        summary = torch.stack([f.reshape(()).to(torch.bool) for f in checks]).to(torch.uint8)
        if later is not None:  # read with the caller's others; a failed one makes later.read() decode on the host
            later._items.append((summary, _data_fault, buf, specs, None))
        elif not all(summary.tolist()):
            return _decode(host.clone(), specs, True)  # a data check failed: the host path says which
    return out


_fetched = threading.local()  # .hosts: {(data_ptr, length): (host copy, device checksum)} (fetch_together)


@contextlib.contextmanager
def fetch_together(messages: Sequence[tuple[torch.Tensor, Sequence[FieldSpec]]]):
    """While inside, :func:`decode` of any of the ``messages``' buffers (device buffers, each with its specs) on this
    thread takes the host copy made here: every buffer whose layout depends on the data comes to the host in ONE
    transfer, with its checksum computed on the device (and the step's deferred verdict, if one is pending:
    StepAbandoned here if it is bad), instead of one transfer per buffer. A buffer whose layout the specs fix
    needs none and is left on the device. Nothing happens on the host path. The buffers must stay alive and
    unchanged inside (they are known by their memory and length)."""
    wanted = []
    for buf, specs in messages:
        total = buf.numel()
        if host_path(buf) or total < HEADER_BYTES:
            continue
        specs = list(specs)
        fixed = _fixed_layout(specs, _check_specs(specs), total)
        if fixed is None or fixed[1] != total:
            wanted.append(_as_uint8_buffer(buf))
    before = getattr(_fetched, "hosts", None)
    hosts = dict(before or {})
    if len(wanted) > 1:  # (one buffer: decode makes the same single transfer itself)
        for b, (mem, computed) in zip(wanted, _fetch(wanted)):  # copies: the staging buffer is reused
            hosts[(b.data_ptr(), b.numel())] = (mem.copy(), computed)
    _fetched.hosts = hosts
    try:
        yield
    finally:
        _fetched.hosts = before


def _fetch(bufs: list[torch.Tensor]) -> list[tuple[np.ndarray, int]]:
    """Device buffers to the host in ONE transfer, each with its body's checksum computed on the device, and the
    step's deferred verdict if one is pending (StepAbandoned if it is bad): per buffer (its bytes, a view of this
    thread's staging buffer valid until its next transfer; the checksum)."""
    sums = [checksum64_tensor(b[HEADER_BYTES:]).reshape(1).view(torch.uint8) for b in bufs]
    flag = take_verdict()
    verdict = [] if flag is None else [flag.reshape(1).to(torch.uint8)]
    staged = to_host(torch.cat([*bufs, *sums, *verdict])).numpy()
    if verdict and staged[-1]:
        raise StepAbandoned
    out, at, end = [], 0, sum(b.numel() for b in bufs)
    for i, b in enumerate(bufs):
        computed = int.from_bytes(staged[end + 8 * i : end + 8 * i + 8].tobytes(), "little")
        out.append((staged[at : at + b.numel()], computed))
        at += b.numel()
    return out


def _fixed_layout(specs: list, codecs: list, total: int) -> tuple[list, int] | None:
    """Where every section's data lies when the specs and the message's length ``total`` fix it: ``([(data offset,
    codec, param, count, nbytes)], message length)``; None when a count is variable. One GOLOMB field of an exact
    count is allowed (LGC's positions): its stream's length is what ``total`` leaves over."""
    golomb = [i for i, (spec, codec) in enumerate(zip(specs, codecs)) if codec == Codec.GOLOMB]
    if len(golomb) > 1 or any(spec.count is None for spec in specs):
        return None
    rest = HEADER_BYTES + SECTION_HEADER_BYTES * len(specs)
    rest += sum(
        _expected_nbytes(codec, _fixed_param(spec, codec), spec.count)
        for spec, codec in zip(specs, codecs)
        if codec != Codec.GOLOMB
    )
    if golomb and total - rest < 0:
        return None
    return _placed(specs, codecs, [spec.count for spec in specs], {i: total - rest for i in golomb})


def _placed(specs: list, codecs: list, counts: list[int], streams: dict[int, int]) -> tuple[list, int]:
    """``([(data offset, codec, param, count, nbytes)], message length)`` for every section's ``counts`` and the
    GOLOMB sections' stream lengths in bytes (``streams``, by section index)."""
    layout, off = [], HEADER_BYTES
    for i, (spec, codec, count) in enumerate(zip(specs, codecs, counts)):
        param = _golomb_b(spec, count) if codec == Codec.GOLOMB else _fixed_param(spec, codec)
        nbytes = streams[i] if codec == Codec.GOLOMB else _expected_nbytes(codec, param, count)
        off += SECTION_HEADER_BYTES
        layout.append((off, codec, param, count, nbytes))
        off += nbytes
    return layout, off


def _fixed_param(spec: FieldSpec, codec: Codec) -> int:
    """The section header's parameter that the spec implies (GOLOMB: the Rice parameter encode() uses)."""
    if codec == Codec.BITS:
        return spec.width
    if codec == Codec.POSITIONS:
        return bits_needed(spec.universe)
    if codec == Codec.GOLOMB:
        return _golomb_b(spec, spec.count)
    return 0


def _data_fault(checks: bytes) -> str | None:
    """What the data checks' bytes ``checks`` (one per check, 1: passed) say is wrong, or None."""
    return None if all(checks) else "a data check failed (padding bits, positions or a Golomb stream)"


def _decode_on_device(
    buf: torch.Tensor, specs: list, layout: list, later: DeviceChecks | None = None
) -> list[torch.Tensor] | None:
    """decode's device path for a message whose layout the specs and its length fix (every count exact, at most
    one GOLOMB field, whose stream is what the length leaves over), or that a size exchange's values fix
    (:func:`layout_values`).

    Every field is decoded where the buffer is and every check is computed there: the checksum
    (checksum64_tensor), the padding bits, the positions' order and range, a Golomb stream's code structure. What
    the host must compare comes back in ONE small transfer: the 20-byte header, the computed checksum, the section
    headers and the check results (with this thread's pending sender checks of device-path encodes). Returns the
    fields when every byte is the one the specs imply and every check passed, else None: the caller then runs the
    host path, which says what is wrong.
    With ``later``, nothing is read: the summary joins ``later``, whose :meth:`DeviceChecks.read` checks it.
    """
    flags: list[torch.Tensor] = []
    out: list[torch.Tensor] = []
    heads = []
    for spec, (off, codec, param, count, nbytes) in zip(specs, layout):
        data = buf[off : off + nbytes]
        heads.append(buf[off - SECTION_HEADER_BYTES : off])
        if codec in FLOAT_DTYPES:
            out.append(data.clone().view(FLOAT_DTYPES[codec]))
        elif codec == Codec.BITS:
            out.append(_unpack(data, param, count, decoded_dtype(param), flags))
        elif codec == Codec.GOLOMB:
            try:
                out.append(golomb_decode(data, param, count, spec.universe, flags))
            except WireError:  # a stream length the count rules out: the host path names it
                return None
        else:
            out.append(_received_positions(_unpack(data, param, count, torch.int64, flags), spec.universe, flags))
    pending = _take_pending()
    flags.extend(f for f, _ in pending)
    pieces = [buf[:HEADER_BYTES], checksum64_tensor(buf[HEADER_BYTES:]).reshape(1).view(torch.uint8), *heads]
    if flags:
        pieces.append(torch.stack([f.reshape(()).to(torch.bool) for f in flags]).to(torch.uint8))
    summary = torch.cat(pieces)
    body = layout[-1][0] + layout[-1][4] - HEADER_BYTES if layout else 0
    # the bytes a sound message's summary holds: its header's first 12, then (after the header's stored checksum
    # and the computed one) its section headers; DeviceChecks.fault_flag compares them on the device
    head_bytes = b"".join(_SECTION.pack(int(codec), param, count, nbytes) for _, codec, param, count, nbytes in layout)
    want = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(specs), 0, body, 0)[:12] + head_bytes

    def fault(got: bytes) -> str | None:
        """What is wrong with the message whose summary's bytes are ``got``, in the host path's order, or None for
        a sound one (ConfigError for a failed sender check)."""
        checks = got[HEADER_BYTES + 8 + len(head_bytes) :]
        if pending:
            _raise_failed(pending, checks[len(checks) - len(pending) :])
        if got[:12] != want[:12]:
            return "its header is not the one its layout implies (magic, version, flags, sections or length)"
        if got[12:HEADER_BYTES] != got[HEADER_BYTES : HEADER_BYTES + 8]:
            return "checksum mismatch: the message body is corrupted"
        if got[HEADER_BYTES + 8 : HEADER_BYTES + 8 + len(head_bytes)] != head_bytes:
            return "a section header is not the one its layout implies"
        return _data_fault(checks)

    if later is not None:
        later._items.append((summary, fault, buf, specs, want))
        return out
    return out if fault(_read_bytes(summary)) is None else None  # the one read back (tens of bytes, ten per section)


class DeviceChecks:
    """The checks of several device-path decodes, read back together: one host synchronisation for all of them.

    ``decode(buf, specs, later=checks)`` of a fixed layout returns its fields at once and leaves its summary here;
    :meth:`read` then reads every summary (and any bool tensors the caller adds) in one transfer and raises the
    WireError the host path gives for the first message that failed. Until :meth:`read` has returned, the decoded
    values must not leave the caller (the aggregation sums them into temporaries and reads before returning), except
    to the DDP hook's backward pass (:func:`hold_for_the_pass`), which reads them before anything of it is applied.
    """

    def __init__(self) -> None:
        self._items: list = []
        self._received: list = []  # (bool tensor, message): checks of decoded fields made by their receivers
        self._abandon: list[torch.Tensor] = []  # held for a pass: flags that abandon the step on every worker

    def collecting(self):
        """While inside, :func:`check_received` on this thread hands its checks to this object (read with it)."""
        return _checks_set(_receiving, self)

    @property
    def pending(self) -> bool:
        """Whether checks (or flags held for a pass) wait here to be read."""
        return bool(self._items or self._received or self._abandon)

    def abandon(self, flag: torch.Tensor) -> None:
        """Holds ``flag`` (a one-element bool tensor, True: abandon the step) to be read with the checks, as
        :func:`hold_for_the_pass` does with an aggregate's."""
        self._abandon.append(flag)

    def abandon_flag(self, device: torch.device) -> torch.Tensor:
        """Whether any flag held here says abandon, as a one-element bool tensor on ``device`` (nothing read): for
        the workers to agree on it where only this worker holds it (``train.exchange.settle``; an FSDP owner's
        aggregate of its own shard)."""
        if not self._abandon:
            return torch.zeros((), dtype=torch.bool, device=device)
        return torch.stack([f.reshape(()).to(device=device, dtype=torch.bool) for f in self._abandon]).any()

    def copy_from(self, other: DeviceChecks) -> None:
        """Adds ``other``'s pending checks and held flags to these, leaving ``other`` as it is (a simulated cluster's
        aggregate, computed once: every worker holds the checks it would have made itself)."""
        self._items += other._items
        self._received += other._received
        self._abandon += other._abandon

    def take(self, other: DeviceChecks) -> None:
        """Moves ``other``'s pending checks here, to be read with these. The messages' buffers are let go: a failed
        one is then named from its checks alone, not decoded again on the host (keeping every received buffer of a
        backward pass until its end would cost W times the pass's messages)."""
        self._items += [(summary, fault, None, specs, want) for summary, fault, _, specs, want in other._items]
        self._received += other._received
        other._items, other._received = [], []

    def read_after(self, verdicts: Sequence[torch.Tensor], extra: Sequence[torch.Tensor] = ()) -> tuple[bool, list]:
        """Reads the step's ``verdicts`` (one-element bool tensors, True: every worker abandons the step), the flags
        held here by :func:`hold_for_the_pass`, every pending check and ``extra`` (as :meth:`read`), in one
        transfer. ``(True, [])`` when some flag says abandon: the checks are then not looked at (an abandoned step's
        messages may carry its mark, and nothing of the step is applied). Else WireError for a failed check, or
        ``(False, the values of extra)``."""
        flags, self._abandon = [*verdicts, *self._abandon], []
        if not flags:
            return False, self.read(extra)
        verdict = torch.stack([f.reshape(()).to(flags[0].device) for f in flags]).any()
        if not self.pending and not extra:
            return bool(verdict), []
        _verdict.flag = verdict
        try:
            return False, self.read(extra)
        except StepAbandoned:
            return True, []
        finally:
            _verdict.flag = None

    def fault_flag(self, device: torch.device) -> torch.Tensor:
        """Whether any pending check failed, as a one-element bool tensor computed where the checks are (nothing
        read): what :meth:`read` would refuse, for the workers to agree on before any of them reads
        (``train.exchange.settle``). The expected header and section bytes of every message come to the device in
        one transfer that does not make the host wait."""
        wants = [want for _, _, _, _, want in self._items if want is not None]
        expected = ints_on(device, list(b"".join(wants))).to(torch.uint8) if wants else None
        bad, at = [], 0
        for summary, _, _, _, want in self._items:
            if want is None:  # a host-read layout's data checks: one byte each, 1 passed
                bad.append((summary == 0).any())
                continue
            heads = len(want) - 12  # summary: header (20), computed checksum (8), section heads, check bytes
            got = torch.cat([summary[:12], summary[HEADER_BYTES + 8 : HEADER_BYTES + 8 + heads]])
            bad.append((got != expected[at : at + len(want)]).any()
                       | (summary[12:HEADER_BYTES] != summary[HEADER_BYTES : HEADER_BYTES + 8]).any()
                       | (summary[HEADER_BYTES + 8 + heads :] == 0).any())
            at += len(want)
        bad += [~ok.reshape(()).to(torch.bool) for ok, _ in self._received]
        if not bad:
            return torch.zeros((), dtype=torch.bool, device=device)
        return torch.stack([b.to(device) for b in bad]).any()

    def read(self, extra: Sequence[torch.Tensor] = ()) -> list[bool]:
        """Reads every pending summary, every check handed over by :func:`check_received` and ``extra`` (bool
        tensors of one element), raises WireError for the first failed message or check (inside
        :func:`refusing_later`: notes it there instead), returns the values of ``extra``."""
        items, self._items = self._items, []
        received, self._received = self._received, []
        pieces = [summary for summary, _, _, _, _ in items]
        flags = [ok for ok, _ in received] + list(extra)
        if flags:
            pieces.append(torch.stack([e.reshape(()).to(torch.bool) for e in flags]).to(torch.uint8))
        if not pieces:
            return []
        got = _read_bytes(torch.cat(pieces))  # (with the step's deferred verdict, if one is pending)
        at, failed = 0, None
        for summary, fault, buf, specs, _ in items:
            n = summary.numel()
            wrong = fault(got[at : at + n]) if failed is None else None  # (the first failure is the one named)
            if wrong is not None:
                failed = _named_fault(buf, specs, wrong)
            at += n
        for (_, message), ok in zip(received, got[at:]):
            if not ok and failed is None:
                failed = WireError(message)
        if failed is not None:
            _refuse(failed)
        return [bool(b) for b in got[at + len(received) :]]


def _named_fault(buf: torch.Tensor | None, specs: list, wrong: str) -> WireError:
    """The WireError for a message that failed the device's checks (``wrong``: which): the host path's, which names
    the fault, where the buffer was kept; else one from the checks alone."""
    if buf is None:  # let go (``DeviceChecks.take``): named from its checks
        return WireError(f"a received message failed the device's checks: {wrong}")
    try:
        _decode(buf, specs, None)  # the host path names the fault
    except WireError as e:
        return e
    return WireError(  # sound headers, other than the layout values of the size exchange announced
        f"a received message failed the device's checks: {wrong} (its own headers are sound: they differ from the "
        "layout values its sender's size exchange announced)"
    )


class Refusals:
    """The messages a worker refused during a step (or a backward pass), kept instead of raised
    (:func:`refusing_later`), and how many messages it encoded or decoded: a step that used the wire on one worker
    used it on every worker, so the workers can agree on the refusals with one more collective, and only then.
    """

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.used = 0
        self.abandoned = False  # this worker alone found that the step must be abandoned (``abandon_later``)


_refusals = threading.local()  # .now: the Refusals of the step this thread runs, inside refusing_later


def abandon_later() -> bool:
    """Notes, in the step's Refusals, that this worker alone found that the step must be abandoned (a server's or a
    shard owner's aggregate that a message made non-finite, where the verdict is not deferred), for the workers to
    agree on at the step's end with the refusals (``train.exchange.settle``); False outside
    :func:`refusing_later` (the caller then goes on as before)."""
    refusals = getattr(_refusals, "now", None)
    if refusals is None:
        return False
    refusals.abandoned = True
    return True


def refusing_later(refusals: Refusals | None):
    """While inside, a received message that fails its checks on this thread is noted in ``refusals`` instead of
    raising WireError (:func:`decode` returns stand-ins, :meth:`DeviceChecks.read` and :func:`check_received` go
    on), so that this worker runs the step's rounds to their end like every other and all of them learn of it
    together (``train.exchange.settle``). None: raise at once, as outside."""
    return _checks_set(_refusals, refusals, "now")


def _note_use() -> Refusals | None:
    """Counts one message encoded or decoded in the step under way; its Refusals, if any."""
    refusals = getattr(_refusals, "now", None)
    if refusals is not None:
        refusals.used += 1
    return refusals


def _refuse(error: WireError) -> None:
    """Raises ``error``, or notes it in the step's Refusals (inside :func:`refusing_later`)."""
    refusals = getattr(_refusals, "now", None)
    if refusals is None:
        raise error
    refusals.messages.append(str(error))


_receiving = threading.local()  # .checks: the DeviceChecks collecting this thread's check_received calls, if any
_pass = threading.local()  # .checks: the DeviceChecks that holds a DDP backward pass's checks until its last bucket


@contextlib.contextmanager
def _checks_set(local: threading.local, checks: object, name: str = "checks"):
    """``local.<name>`` is ``checks`` while inside, then what it was before."""
    before = getattr(local, name, None)
    setattr(local, name, checks)
    try:
        yield checks
    finally:
        setattr(local, name, before)


def holding_for_the_pass(checks: DeviceChecks | None):
    """While inside, :func:`hold_for_the_pass` on this thread moves an exchange's checks to ``checks`` (the DDP
    hook's communication thread, one backward pass, the device path; None: nothing is held)."""
    return _checks_set(_pass, checks)


def held_for_the_pass() -> DeviceChecks | None:
    """The DeviceChecks that holds this thread's pass (inside :func:`holding_for_the_pass`), or None."""
    return getattr(_pass, "checks", None)


def hold_for_the_pass(checks: DeviceChecks, abandon: torch.Tensor | None = None) -> bool:
    """Whether an exchange's pending ``checks`` were held for the backward pass instead of read now.

    Inside :func:`holding_for_the_pass`, ``checks`` move to the pass's and ``abandon`` (a one-element bool tensor,
    True where every worker must abandon the step, such as an aggregate that is not finite: the same on every
    worker) is kept with them; :meth:`DeviceChecks.read_after` reads them once, at the pass's last bucket, with its
    verdicts. The decoded values leave before that read, which refuses a bad message before anything of the pass is
    applied. Nothing is read here. False outside such a pass: the caller reads as before.
    """
    held = getattr(_pass, "checks", None)
    if held is None:
        return False
    held.take(checks)
    if abandon is not None:
        held._abandon.append(abandon)
    return True


class StepAbandoned(Exception):
    """A device read found the step's deferred verdict bad (some worker's gradients were not finite): the step is
    abandoned there, on every worker (``train.exchange.drive_agreeing`` catches it; nothing of the step is applied).
    """


class AbandonedHere(Exception):
    """Only this worker found that the step must be abandoned, as a server (a parameter server's root, a shard's
    owner) whose aggregate of finite-looking messages is not finite, or the only worker to read a gathered verdict
    (the root). Raised only while the verdict is deferred (``deferring``): the server then sends an abandoned
    message (``abandon_message``) in place of its aggregate, and every worker learns of it from that message at its
    next read, at the same point (``abandon_flags``, ``add_to_verdict``)."""


ABANDON_MARK = b"NF"  # the first two bytes of a message that says "abandon this step" (a container starts with MAGIC)


def abandon_message(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` (at least 2; a fixed-size message's length, which every receiver expects) that
    says "abandon this step" and nothing else: ``ABANDON_MARK``, then zeros."""
    out = torch.zeros(int(nbytes), dtype=torch.uint8, device=device)
    out[0], out[1] = ABANDON_MARK
    return out


def abandon_flags(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether any of the received uint8 ``buffers`` says "abandon this step" (starts with ``ABANDON_MARK``): a
    one-element bool tensor on their device, nothing read (an empty buffer says nothing)."""
    heads = [b[:2] for b in buffers if b.numel() >= 2]
    if not heads:
        device = buffers[0].device if buffers else None
        return torch.zeros((), dtype=torch.bool, device=device)
    head = torch.stack(heads)
    return ((head[:, 0] == ABANDON_MARK[0]) & (head[:, 1] == ABANDON_MARK[1])).any()


_verdict = threading.local()  # .flag: this thread's pending verdict of the step (a bool tensor, True = abandon)


def defer_verdict(flag: torch.Tensor | None) -> None:
    """Hands the step's agreed verdict (a one-element bool tensor on the device, True when some worker's gradients
    were not finite) to this thread's next device read in this module, which reads it in the same transfer and
    raises StepAbandoned if it is True; None withdraws it and ends the deferred step (``deferring``)."""
    _verdict.flag = flag
    _verdict.deferring = flag is not None


def deferring() -> bool:
    """Whether this thread runs a step whose verdict was deferred (from ``defer_verdict(flag)`` until
    ``defer_verdict(None)``, whether or not a read has taken the flag yet): such a step may be abandoned by
    raising StepAbandoned on every worker at the same point."""
    return getattr(_verdict, "deferring", False)


def add_to_verdict(flag: torch.Tensor) -> None:
    """Adds ``flag`` (a one-element bool tensor, True: abandon) to the step's deferred verdict: the next device read
    reads both (the pending verdict or'ed with it, or ``flag`` alone where a read took the verdict already)."""
    pending = take_verdict()
    defer_verdict(flag.reshape(()) if pending is None else pending.reshape(()) | flag.reshape(()).to(pending.device))


def take_verdict() -> torch.Tensor | None:
    """The verdict :func:`defer_verdict` left that no read has taken yet (and withdraws it), or None."""
    flag = getattr(_verdict, "flag", None)
    _verdict.flag = None
    return flag


def _read_bytes(t: torch.Tensor) -> bytes:
    """The uint8 tensor ``t`` read back in one transfer, with the step's pending verdict if there is one (one byte
    more in the same transfer): StepAbandoned if that verdict is bad."""
    flag = take_verdict()
    if flag is None:
        return bytes(t.tolist())
    got = bytes(torch.cat([t.reshape(-1), flag.reshape(1).to(torch.uint8)]).tolist())
    if got[-1]:
        raise StepAbandoned
    return got[:-1]


def check_received(ok: torch.Tensor | bool, message: str) -> None:
    """A receiver's check of a decoded field (``ok``: a one-element bool tensor, True for a sound message, such as
    the zero padding bits of a sign bitmap): handed to the :class:`DeviceChecks` collecting on this thread (read
    with its one transfer: no host synchronisation here), or read now where none is collecting or ``ok`` is a
    Python bool (the host path's). WireError(message) for a failed one (inside :func:`refusing_later`: noted)."""
    later = getattr(_receiving, "checks", None)
    if later is not None and isinstance(ok, torch.Tensor):
        later._received.append((ok, message))
    elif not bool(ok):
        _refuse(WireError(message))


def check_received_range(values: torch.Tensor, low: float | None, high: float | None, message: str) -> None:
    """A receiver's check that a decoded field lies in ``[low, high]`` (None: unbounded), through
    :func:`check_received`: one read now on the host path, handed to the collecting :class:`DeviceChecks` on the
    device path. Non-finite values pass (NaN, and ±Inf for floats): a non-finite scale is how the device path sends
    a non-finite gradient (a C_nat-coded NaN norm decodes to ±Inf), and the finiteness check of the sums deals with
    it. For values a sender never makes (a negative norm, a level above the method's), which a checksum cannot
    catch when the sender itself is wrong. On the device path a check is made only where a DeviceChecks collects
    it (every receiving path decodes inside one); elsewhere, as for a worker's own message decoded for error
    feedback, it is left out rather than read at once (a host synchronisation for a message this worker made)."""
    if values.numel() == 0:
        return
    if not host_path(values) and getattr(_receiving, "checks", None) is None:
        return
    if values.is_floating_point():  # (scales: a few entries)
        out = torch.zeros_like(values, dtype=torch.bool)
        if low is not None:
            out |= values < low
        if high is not None:
            out |= values > high
        bad = (out & torch.isfinite(values)).any()
    else:  # (codes: one min/max pass)
        least, most = torch.aminmax(values)
        bad = torch.zeros((), dtype=torch.bool, device=values.device)
        if low is not None:
            bad = bad | (least < low)
        if high is not None:
            bad = bad | (most > high)
    check_received(not bool(bad) if host_path(values) else ~bad, message)


def _unpack_checked(
    data: torch.Tensor, width: int, count: int, where: str, dtype: torch.dtype, flags: list | None = None
) -> torch.Tensor:
    try:
        return _unpack(data, width, count, dtype, flags)
    except WireError as e:
        raise WireError(f"{where}: {e}") from None


def max_encoded_size(specs: Sequence[FieldSpec]) -> int:
    """The most bytes a message of ``specs`` can have and still decode: every field at its count (or max_count), a
    GOLOMB stream at the longest :func:`decode` accepts (universe + count · b + 7 bits, b at the spec's or the
    largest Rice parameter). A receiver bounds the lengths a size round brings by it
    (``protocols.sizes.received_lengths``) before it allocates anything for them."""
    total = HEADER_BYTES
    for i, spec in enumerate(specs):
        codec = _check_spec(spec, i)
        n = spec.count if spec.count is not None else spec.max_count
        if codec == Codec.GOLOMB:
            b = spec.golomb_b if spec.golomb_b is not None else MAX_RICE_PARAMETER
            nbytes = -(-(spec.universe + n * b + 7) // 8)
        else:
            param = spec.width if codec == Codec.BITS else bits_needed(spec.universe) if codec == Codec.POSITIONS else 0
            nbytes = _expected_nbytes(codec, param, n)
        total += SECTION_HEADER_BYTES + nbytes
    return total


def encoded_size(specs: Sequence[FieldSpec], counts: Sequence[int] | None = None) -> int | None:
    """Exact encoded size in bytes for fixed-width codecs, or None if a GOLOMB field makes it data-dependent.

    ``counts`` gives the element count of each field (defaults to each spec's ``count``).
    """
    specs = list(specs)
    total = HEADER_BYTES
    for i, spec in enumerate(specs):
        codec = _check_spec(spec, i)
        n = counts[i] if counts is not None else spec.count
        if n is None:
            raise ConfigError(f"spec {i}: variable count; pass counts=")
        if codec == Codec.GOLOMB:
            return None
        param = 0
        if codec == Codec.BITS:
            param = spec.width
        elif codec == Codec.POSITIONS:
            param = bits_needed(spec.universe)
        total += SECTION_HEADER_BYTES + _expected_nbytes(codec, param, n)
    return total
