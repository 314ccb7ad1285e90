"""The message format: what a container message's bytes are, and what fixes their layout.

A message is a list of tensor fields serialized into one contiguous uint8 buffer. Both sides know the list of
:class:`FieldSpec` (the receiver rebuilds it from its own configuration), so the buffer only carries what the receiver
cannot know, and everything it carries is validated (:mod:`.container` writes and parses it).

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

Versions: 2 replaced version 1's weighted word sum (which missed some 2-bit errors) by a CRC pair; the layout is
otherwise unchanged. A decoder reads only its own version and refuses any other with a WireError that names both.

This module holds the constants, the spec records and their checks, and the arithmetic of sizes and layouts: how long
a message of given counts is (:func:`encoded_size`, :func:`length_from_counts`, :func:`length_on_device`), the most
bytes a receiver accepts (:func:`max_encoded_size`), and where every section lies when the specs, or a size
exchange's values (:func:`layout_values`), fix it (``_fixed_layout``, ``_given_layout``).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradcomp.errors import ConfigError
from gradcomp.wire.bits import bits_needed, ints_on, packed_nbytes
from gradcomp.wire.golomb import MAX_RICE_PARAMETER, MAX_UNIVERSE, golomb_stream_bits, optimal_rice_parameter

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "SECTION_HEADER_BYTES",
    "MAX_MESSAGE_BYTES",
    "Codec",
    "FLOAT_DTYPES",
    "FieldSpec",
    "encoded_size",
    "max_encoded_size",
    "length_from_counts",
    "length_on_device",
    "free_sections",
    "layout_values",
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


def _expected_nbytes(codec: Codec, param: int, count: int) -> int | None:
    if codec in (Codec.F32,):
        return 4 * count
    if codec in (Codec.F16, Codec.BF16):
        return 2 * count
    if codec in (Codec.BITS, Codec.POSITIONS):
        return packed_nbytes(count, param)
    return None  # GOLOMB: variable


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
