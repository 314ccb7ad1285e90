"""The 64-bit body checksum of the wire container: CRC-32C and CRC-32 of the same bytes.

Definition (wire format version 2)::

    checksum64(body) = crc32(body) << 32 | crc32c(body)

``crc32c`` is CRC-32C (Castagnoli: polynomial 0x1EDC6F41, reflected, init and final xor 0xFFFFFFFF; check
value 0xE3069283 for b"123456789", the CRC of iSCSI, ext4 and SSE 4.2); ``crc32`` is the CRC-32 of zlib,
Ethernet and PNG (polynomial 0x04C11DB7, reflected, init and final xor 0xFFFFFFFF; check value 0xCBF43926).
Both read the bytes in order and each byte least significant bit first, which is also the order in which
:mod:`gradcomp.wire.bits` lays out its bit streams.

Why a CRC. The version-1 checksum was a weighted sum of 64-bit words modulo 2**64. It is linear over the
integers, so flipping the same bit in two words changes the sum by ±2^b·(w_i ± w_j), which vanishes modulo
2**64 whenever the weights agree in enough low bits: about 3.6 % of mutated buffers decoded to other values.
A CRC is linear over GF(2) instead: a change ``e`` of the body (a polynomial whose coefficients are the
flipped bits) goes unnoticed exactly when the generator polynomial divides ``e``.

What it detects. The pair of remainders is, by the Chinese remainder theorem, the remainder of the body
modulo the product ``G = G_C · G_I`` of the two generators (they share no factor), so the pair is a 64-bit
CRC with generator ``G`` computed as two 32-bit ones. ``G_C = (x + 1)·P31`` with ``P31`` primitive of degree 31
(the order of x modulo ``G_C`` is 2^31 − 1, a prime); ``G_I`` is primitive of degree 32 (order 2^32 − 1);
both facts are checked by tests/test_wire_checksum.py with polynomial arithmetic. Hence, for every body the
format can carry (the length field is a u32, so at most 2^35 bits):

- every single-bit error (``G`` has a nonzero constant term);
- every 2-bit error: x^i·(1 + x^s) is a multiple of ``G`` only when s is a multiple of the order of x
  modulo ``G``, lcm(2^31 − 1, 2^32 − 1) ≈ 9.2·10^18 bits, far beyond any body (CRC-32C alone would miss the
  pairs exactly 2^31 − 1 bits apart in bodies over 256 MiB, which gathered messages of large models reach);
- every error of an odd number of bits (``x + 1`` divides ``G``), so every 3-bit error too;
- every burst of up to 64 bits (deg ``G`` = 64), so certainly every burst of up to 32;
- any other change with probability 1 − 2^-64 for random corruption.

Speed, and why a wheel. CRC-32C comes from ``google-crc32c`` (Google's C library behind a small Python
extension, Apache-2.0, binary wheels on PyPI; it uses the SSE 4.2 / ARMv8 CRC instructions), CRC-32 from
Intel's ISA-L through ``isal`` (``isal.isal_zlib.crc32``: binary wheels on PyPI, PCLMUL folding, about
30 GB/s here against zlib's 2.9 GB/s, which made CRC-32 the largest part of encoding a 20 MB fp16 message;
the standard library's ``zlib.crc32`` computes the same values and is used if ``isal`` cannot be imported,
``CRC32_IMPLEMENTATION`` says which). A vectorised numpy or torch CRC would need per-byte table lookups or GF(2)
matrix folding in many array passes and would run far below the wheel's memory speed; the weighted sum
itself ran at about 2 GB/s. Both checksums timed in one run on the project's 2-core CPU machine
(``scripts/fuzz_wire.py --checksum-speed``; table in docs/wire.md): the CRC pair was 2.8x faster on 1 KB,
5.0x on 1 MB and 3.3x on 10 MB (1.3x to 8.8x over five runs on the busy machine), with zlib's CRC-32, which
was most of the cost (CRC-32C alone runs at about 15 GB/s); ISA-L's CRC-32 then took 0.67 ms for 20 MB
against zlib's 7.0 ms. If the package's C extension cannot load,
``google_crc32c`` falls back to its pure-Python code (correct, slow, with a RuntimeWarning):
``CRC32C_IMPLEMENTATION`` says which one is in use.

Device buffers (CUDA) are copied to the host first (one device-to-host copy of the body, :func:`to_host`,
into pinned memory that each thread reuses: on an H100 a 40 MB body took 33 ms to reach pageable memory and
0.8 ms to reach pinned memory); the old checksum computed its sum on the device and then synchronised anyway.
The CRCs themselves then run on the host (7.6 to 9.7 ms for 40 MB on the H100 machine's CPU in three runs): on
a GPU they are most of what encoding and decoding cost (docs/gpu.md). This is an integrity check against
corruption, not a cryptographic MAC.
"""

from __future__ import annotations

import threading
import zlib

import google_crc32c
import torch

try:  # Intel ISA-L's CRC-32: the same function as zlib's, about ten times faster (PCLMUL folding)
    from isal.isal_zlib import crc32 as _crc32

    CRC32_IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values, slower
    _crc32 = zlib.crc32
    CRC32_IMPLEMENTATION = "zlib"

from gradcomp.wire.bits import _as_uint8_buffer

__all__ = ["checksum64", "crc32c", "crc32", "to_host", "CRC32C_IMPLEMENTATION", "CRC32_IMPLEMENTATION"]

CRC32C_IMPLEMENTATION: str = google_crc32c.implementation  # "c" (hardware-accelerated) or "python"


_staging = threading.local()  # .buffer: this thread's pinned host buffer for device-to-host copies


def to_host(buf: torch.Tensor) -> torch.Tensor:
    """The uint8 buffer in host memory: itself on the CPU; from a CUDA device, a copy in pinned memory.

    The pinned buffer belongs to the calling thread and is reused by its next call: use the result before
    calling again, and do not keep it. It is replaced by a larger one when a larger buffer comes; torch's
    pinned-memory cache rounds sizes up to powers of two and keeps the outgrown blocks, so a thread holds up to
    about twice its largest message in pinned memory. Where pinned memory cannot be had (a container's
    locked-memory limit), the copy goes to ordinary memory, as ``tensor.cpu()`` does.
    """
    buf = _as_uint8_buffer(buf)
    if buf.device.type == "cpu":
        return buf
    if buf.device.type != "cuda":
        return buf.cpu()
    n = buf.numel()
    staged = getattr(_staging, "buffer", None)
    if staged is None or staged.numel() < n:
        try:
            staged = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no pinned memory to be had: pageable, as before
            return buf.cpu()
        _staging.buffer = staged
    out = staged[:n]
    out.copy_(buf)  # a pinned destination: synchronous for the host, and the fastest transfer
    return out


def _host_bytes(buf: torch.Tensor):
    """A contiguous CPU view of the uint8 buffer as a numpy array (no copy for a CPU tensor)."""
    return to_host(buf).numpy()


def crc32c(buf: torch.Tensor) -> int:
    """CRC-32C (Castagnoli) of a uint8 tensor, flattened; an int in [0, 2**32)."""
    return google_crc32c.value(_host_bytes(buf))


def crc32(buf: torch.Tensor) -> int:
    """CRC-32 (zlib / IEEE 802.3) of a uint8 tensor, flattened; an int in [0, 2**32)."""
    return _crc32(_host_bytes(buf))


def checksum64(buf: torch.Tensor) -> int:
    """The container's body checksum: ``crc32(buf) << 32 | crc32c(buf)``, an int in [0, 2**64).

    ``buf`` is a uint8 tensor of any shape (flattened) on any device; anything else raises WireError.
    """
    data = _host_bytes(buf)
    return (_crc32(data) << 32) | google_crc32c.value(data)
