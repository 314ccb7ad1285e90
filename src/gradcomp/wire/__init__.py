"""Wire layer of gradcomp: bit packing, Golomb–Rice position coding, checksums and the message container.

Every function works on CPU and CUDA tensors with vectorized torch ops. Byte layouts are documented in the
submodules: :mod:`.bits` (LSB-first fixed-width packing), :mod:`.golomb` (Rice codes of position gaps),
:mod:`.checksum` (64-bit body checksum), :mod:`.format` (20-byte header + one section per field) and
:mod:`.container` (encode, decode); :mod:`.device` decodes where a message lies, :mod:`.refusals` is how a worker
refuses a message or abandons a step without leaving the others.
Decoders raise only :class:`gradcomp.errors.WireError` for bad bytes; encoders raise
:class:`gradcomp.errors.ConfigError` for misuse.
"""

from gradcomp.wire.bits import bits_needed, pack_bits, pack_bool, unpack_bits, unpack_bool
from gradcomp.wire.checksum import checksum64
from gradcomp.wire.container import decode, encode
from gradcomp.wire.format import (
    FLOAT_DTYPES,
    FORMAT_VERSION,
    HEADER_BYTES,
    MAX_MESSAGE_BYTES,
    SECTION_HEADER_BYTES,
    Codec,
    FieldSpec,
    encoded_size,
)
from gradcomp.wire.golomb import golomb_decode, golomb_encode, optimal_rice_parameter

__all__ = [
    "Codec", "FieldSpec", "FLOAT_DTYPES", "encode", "decode", "encoded_size", "HEADER_BYTES", "SECTION_HEADER_BYTES",
    "MAX_MESSAGE_BYTES", "FORMAT_VERSION", "pack_bits", "unpack_bits", "bits_needed", "pack_bool", "unpack_bool",
    "golomb_encode", "golomb_decode", "optimal_rice_parameter", "checksum64",
]
