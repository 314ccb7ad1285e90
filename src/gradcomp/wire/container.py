"""Message container: encode a list of tensor fields into one uint8 buffer, and decode and check one.

The bytes are :mod:`.format`'s (a 20-byte header with the body's CRC pair, then one section per field); both sides
know the list of :class:`FieldSpec`, so the buffer only carries what the receiver cannot know, and everything it
carries is validated.

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
last. The output is always freshly allocated, never a reused buffer: callers keep it (gathered messages, residuals,
several messages of one step alive at once), so reusing memory would silently overwrite a message still in use. On
the CPU the headers are written with ``struct.pack_into`` into the tensor's memory (no torch op per section) and small
sections are copied by numpy; on other devices all section headers travel in one transfer.

How decode reads it: headers are parsed from host memory (the buffer itself on the CPU; on other devices one copy,
which the checksum needs anyway, unless the layout is fixed: then :mod:`.device` decodes it where it is) and float
values are copied exactly once, into fresh tensors that do not alias the buffer.

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
on every platform PyTorch supports. Inside ``refusals.refusing_later`` a refused message is noted instead of raised.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

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
from gradcomp.wire.checksum import RunningChecksum64, checksum64, checksum64_tensor
from gradcomp.wire.device import (
    DeviceChecks,
    _data_fault,
    _decode_on_device,
    _defer,
    _fetch,
    _fetched_copy,
)
from gradcomp.wire.format import (
    _HEADER,
    _SECTION,
    _U32_MAX,
    FLOAT_DTYPES,
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    SECTION_HEADER_BYTES,
    Codec,
    FieldSpec,
    _check_positions,
    _check_specs,
    _expected_nbytes,
    _fixed_layout,
    _given_layout,
    _golomb_b,
    _golomb_lengths,
    _max_count,
    _received_positions,
)
from gradcomp.wire.golomb import golomb_decode, golomb_encode
from gradcomp.wire.refusals import _note_use

__all__ = ["encode", "decode", "float_message"]


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
    for i, f in enumerate(fields):
        if not isinstance(f, torch.Tensor):
            raise ConfigError(f"field {i}: expected a tensor, got {type(f).__name__}")
    device = fields[0].device if fields else torch.device("cpu")
    codecs = _check_specs(specs)
    on_host = host_device(device)
    flags: list = []  # the device path's deferred sender checks
    # the device path's Golomb stream lengths, all read at once: the one read of sizes a message needs
    if on_host:
        stream_bits = {}
    elif stream_bits is None:
        stream_bits = _golomb_lengths(fields, specs, codecs, device)
    plan, body_length = _plan_sections(fields, specs, codecs, device, on_host, stream_bits, flags)
    if on_host:
        return _write_on_host(fields, plan, body_length, len(specs))
    out = _write_on_device(plan, body_length, specs, codecs, device)
    if flags:
        _defer(flags)
    return out


def _plan_sections(
    fields: list, specs: list, codecs: list, device: torch.device, on_host: bool, stream_bits: dict, flags: list
) -> tuple[list[tuple[Codec, int, int, int, torch.Tensor, bool]], int]:
    """encode's first pass: every field checked against its spec, its section's size computed and the streams of the
    non-float codecs built. Returns ``(plan, body length)``, plan holding per field ``(codec, param, count, nbytes,
    tensor, packed_later)``: the tensor is the detached field itself for float codecs (read once, when written) and
    for BITS fields that the compiled packer writes straight into the output (packed_later), else its data bytes."""
    plan: list[tuple[Codec, int, int, int, torch.Tensor, bool]] = []
    body_length = 0
    for i, (f, spec, codec) in enumerate(zip(fields, specs, codecs)):
        t = f.detach()
        n = t.numel()
        later = False
        _check_count(fields, i, spec, codec, n)
        if codec in FLOAT_DTYPES:
            if not t.dtype.is_floating_point:
                raise ConfigError(f"field {i} ({codec.name}): expected a floating-point tensor, got dtype {t.dtype}")
            param, data, nbytes = 0, t, _expected_nbytes(codec, 0, n)
        elif codec == Codec.BITS and on_host and packs_into(t, spec.width):
            later = True  # packed when written, straight into the output by the compiled kernel (range-checked there)
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
    return plan, body_length


def _check_count(fields: list, i: int, spec: FieldSpec, codec: Codec, n: int) -> None:
    """ConfigError where field ``i``'s ``n`` elements are not what its spec allows."""
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


def _write_on_host(fields: list, plan: list, body_length: int, n_sections: int) -> torch.Tensor:
    """encode's second pass on the CPU: one allocation (none for a one-field F16 / BF16 message whose data a
    compressor wrote in place, :func:`float_message`), every section written at its offset through the output's own
    memory, the body's checksum (a large float section's taken as it is written), the header last."""
    placed = _reserved_buffer(fields, plan, body_length)
    out = placed if placed is not None else torch.empty(HEADER_BYTES + body_length, dtype=torch.uint8)
    mem = out.numpy()
    # the checksum of a message with a large float section, taken in order: such sections as they are written
    # (_put_float_summed), the other bytes from `summed` up to the next one, or up to the end (summed None: none yet;
    # a message without one is checksummed whole at the end)
    running, summed = RunningChecksum64(), None
    off = HEADER_BYTES
    for codec, param, n, nbytes, data, later in plan:
        _SECTION.pack_into(mem, off, int(codec), param, n, nbytes)
        off += SECTION_HEADER_BYTES
        if codec in FLOAT_DTYPES:
            dtype = FLOAT_DTYPES[codec]
            if placed is not None:
                pass  # the data is already there
            elif _summed_applies(off, nbytes, data, dtype):
                running.update(mem[HEADER_BYTES if summed is None else summed : off])  # before it, its header too
                _put_float_summed(out, mem, off, nbytes, data, dtype, running)
                summed = off + nbytes
            else:
                _put_float(out, mem, off, nbytes, data, dtype)
        elif later:  # a BITS field the compiled kernel packs here (see _plan_sections)
            pack_bits_into(data, param, mem[off : off + nbytes])
        elif nbytes <= _SMALL_COPY:
            mem[off : off + nbytes] = data.numpy()
        elif nbytes:
            out[off : off + nbytes].copy_(data)
        off += nbytes
    if summed is None:
        checksum = checksum64(out[HEADER_BYTES:])
    else:
        running.update(mem[summed:off])
        checksum = running.value()
    _HEADER.pack_into(mem, 0, MAGIC, FORMAT_VERSION, 0, n_sections, 0, body_length, checksum)
    return out


def _write_on_device(plan: list, body_length: int, specs: list, codecs: list, device: torch.device) -> torch.Tensor:
    """encode's second pass on another device, where nothing is read back: one allocation, the data written at its
    offsets, every section header and the header's first 12 bytes in one transfer, the checksum computed where the
    body is (checksum64_tensor) and written as the header's last 8 bytes (little-endian u64)."""
    out = torch.empty(HEADER_BYTES + body_length, dtype=torch.uint8, device=device)
    heads: list[tuple[int, bytes]] = [(0, _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(specs), 0, body_length, 0)[:12])]
    off = HEADER_BYTES
    for codec, param, n, nbytes, data, _ in plan:
        heads.append((off, _SECTION.pack(int(codec), param, n, nbytes)))
        off += SECTION_HEADER_BYTES
        if codec in FLOAT_DTYPES:
            _put_float(out, None, off, nbytes, data, FLOAT_DTYPES[codec])
        elif nbytes:
            out[off : off + nbytes].copy_(data)
        off += nbytes
    _put_heads(out, heads, keep=all(spec.count is not None and c != Codec.GOLOMB for spec, c in zip(specs, codecs)))
    out[12:HEADER_BYTES].copy_(checksum64_tensor(out[HEADER_BYTES:]).reshape(1).view(torch.uint8))
    return out



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


def _check_header(mem, host: torch.Tensor, computed: int | None, n_specs: int, total: int) -> None:
    """WireError unless the 20-byte header in ``mem`` is the one a message of ``n_specs`` sections and ``total`` bytes
    has, and the body's checksum (``computed`` on the device, else computed here from ``host``) matches it."""
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
    if n_sections != n_specs:
        raise WireError(f"header says {n_sections} sections, expected {n_specs}")
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


def _read_section_header(
    mem, off: int, total: int, where: str, spec: FieldSpec, codec: Codec, counts: list[int], codecs: list
) -> tuple[int, int, int]:
    """``(param, count, nbytes)`` of the section header at ``off`` in ``mem``, WireError unless it is what the spec
    allows (``counts``: the earlier sections', for ``same_count_as``) and its data lies within the ``total`` bytes."""
    if off + SECTION_HEADER_BYTES > total:
        raise WireError(f"{where}: section header runs past the end of the body")
    s_codec, param, count, nbytes = _SECTION.unpack_from(mem, off)
    if s_codec != codec:
        name = Codec(s_codec).name if s_codec in Codec._value2member_map_ else "unknown"
        raise WireError(f"{where}: codec {s_codec} ({name}) where {codec.name} expected")
    if spec.count is not None and count != spec.count:
        raise WireError(f"{where}: count {count} != expected {spec.count}")
    if count > _max_count(spec):
        raise WireError(f"{where}: count {count} exceeds the maximum {_max_count(spec)}")
    if spec.same_count_as is not None:
        j = len(counts) + spec.same_count_as  # (counts: the sections before this one)
        if count != counts[j]:
            raise WireError(
                f"{where}: count {count} != count {counts[j]} of section {j}: the sections disagree "
                f"({codec.name} must have one element per element of section {j}, {codecs[j].name})"
            )
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
    if off + SECTION_HEADER_BYTES + nbytes > total:
        left = total - off - SECTION_HEADER_BYTES
        raise WireError(f"{where}: {nbytes} data bytes run past the end of the body ({left} bytes left)")
    return param, count, nbytes


def _section_values(
    data: torch.Tensor, spec: FieldSpec, codec: Codec, param: int, count: int, where: str, checks: list | None
) -> torch.Tensor:
    """One section's field decoded from its ``data`` bytes, WireError for bytes no encoder writes; on the device path
    (``checks`` a list) the data checks are appended to ``checks`` instead of read."""
    if codec in FLOAT_DTYPES:
        # clone: the one copy of the values, into fresh, aligned storage that does not alias the caller's
        # buffer (a view would be misaligned for F32 at byte 30, and would change when a receive buffer is
        # reused or corrupt it when a decompressor works in place)
        return data.clone().view(FLOAT_DTYPES[codec])
    if codec == Codec.BITS:
        return _unpack_checked(data, param, count, where, decoded_dtype(param), checks)
    if codec == Codec.POSITIONS:
        pos = _unpack_checked(data, param, count, where, torch.int64, checks)  # indices
        if checks is None:
            _check_positions(pos, spec.universe, WireError, where)
            return pos
        return _received_positions(pos, spec.universe, checks)
    try:
        return golomb_decode(data, param, count, spec.universe, checks)
    except WireError as e:
        raise WireError(f"{where}: {e}") from None


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
            got = _decode_on_device(buf, specs, fixed[0], later, functools.partial(_named_fault, buf, specs))
            if got is not None:
                return got
        # A message with variable counts (or one that failed a check): the whole buffer and its checksum computed on
        # the device go to the host in one transfer, and the host path below names what is wrong, if anything.
    # Headers are parsed from host memory with struct: on the CPU the buffer's own memory (no copy); on another
    # device the whole buffer, in one transfer.
    fetched = None if on_host else _fetched_copy(buf)
    if on_host:
        host, computed = buf, None
        mem = host.numpy()
    else:  # from fetch_together, or one transfer now (a view of this thread's staging buffer: this call only)
        mem, computed = fetched if fetched is not None else _fetch([buf])[0]
        host = torch.from_numpy(mem)
    checks: list | None = None if on_host else []  # the device's data checks, read together at the end
    _check_header(mem, host, computed, len(specs), total)

    out: list[torch.Tensor] = []
    counts: list[int] = []
    off = HEADER_BYTES
    try:
        for i, (spec, codec) in enumerate(zip(specs, codecs)):
            where = f"section {i}"
            param, count, nbytes = _read_section_header(mem, off, total, where, spec, codec, counts, codecs)
            counts.append(count)
            off += SECTION_HEADER_BYTES
            data = buf[off : off + nbytes]
            off += nbytes
            out.append(_section_values(data, spec, codec, param, count, where, checks))
        if off != total:
            raise WireError(f"trailing bytes: {total - off} bytes after the last section")
    except WireError:
        if checks:  # data checks of earlier sections were deferred: the host path names the first fault, as always
            return _decode(host.clone(), specs, True)
        raise
    if checks:
        summary = torch.stack([f.reshape(()).to(torch.bool) for f in checks]).to(torch.uint8)
        if later is not None:  # read with the caller's others; a failed one makes later.read() decode on the host
            later.add(summary, _data_fault, functools.partial(_named_fault, buf, specs), None)
        elif not all(summary.tolist()):
            return _decode(host.clone(), specs, True)  # a data check failed: the host path says which
    return out


def _named_fault(buf: torch.Tensor, specs: list, wrong: str) -> WireError:
    """The WireError for a message that failed the device's checks (``wrong``: which): the host path's, which names
    the fault (a message whose buffer was let go is named from its checks alone, by ``DeviceChecks.read``)."""
    try:
        _decode(buf, specs, None)  # the host path names the fault
    except WireError as e:
        return e
    return WireError(  # sound headers, other than the layout values of the size exchange announced
        f"a received message failed the device's checks: {wrong} (its own headers are sound: they differ from the "
        "layout values its sender's size exchange announced)"
    )


def _unpack_checked(
    data: torch.Tensor, width: int, count: int, where: str, dtype: torch.dtype, flags: list | None = None
) -> torch.Tensor:
    try:
        return _unpack(data, width, count, dtype, flags)
    except WireError as e:
        raise WireError(f"{where}: {e}") from None
