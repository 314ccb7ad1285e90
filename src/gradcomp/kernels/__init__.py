"""Compiled CPU kernels (numba) for the loops that numpy and torch cannot fuse.

Two loops set the cost of the dense quantizers on the CPU, and both are one pass over memory when compiled
but five to twenty passes as numpy or torch operations:

- bit packing of fixed-width codes (``bitpack_generated``: widths 2-7 and 9-15, 64 codes to ``width``
  64-bit words, straight-line code written by scripts/generate_bitpack_kernels.py), used by
  ``gradcomp.wire.bits`` for every BITS field on the CPU (C_nat's 9-bit codes, TernGrad's 2-bit codes, the
  ditherings' level codes, QSGD's packed codes);
- C_nat's codes (``cnat``): the float's exponent rounded up with probability mantissa / 2^23 by a counter-based
  random number (SplitMix64 of the entry's index and a key), sign attached, range checked, in one pass
  (``gradcomp.compressors.natural``);
- the sign family's bitmap (``sign``): packing x < 0 eight entries to a byte, and adding or subtracting the
  decoded ±values without materialising them (``gradcomp.compressors.sign``);
- the ditherings' codes (``dither``): level index and sign from |x|/||x|| and the draws, in one pass per
  chunk instead of eight torch operations (``gradcomp.compressors.natural``; the draws stay torch's);
- random-k's positions (``sample``): the first k distinct values of the draws, found with a bitmap and sorted
  with a radix sort instead of a stable sort of every draw (``gradcomp.compressors.sparse``; the same draws,
  the same positions);
- the ditherings' and TernGrad's receiving side (``lookup``): each code's value from a table of its level's
  float32 value, times the message's scale, signed, into a new tensor or added to a running sum
  (``gradcomp.compressors.natural``).

Why numba: the issue that asked for these speeds allows a compiled kernel where it is the only route, from a
dependency that installs as a wheel from the package index on this machine kind and works on CPU and CUDA
tensors. numba (with llvmlite) is such a wheel for CPython 3.10-3.13 on Linux, macOS and Windows; torch's own
``torch.compile`` needs a C++ compiler at run time and compiles per tensor shape; a C extension needs a
compiler at install time. CUDA tensors never reach these kernels: on a GPU the torch paths are already fast
and give the same bytes (the kernels reproduce them exactly; tests/test_kernels.py compares both on the CPU).

Fallback: ``enabled()`` is False when numba cannot be imported or the environment sets ``GRADCOMP_KERNELS=0``;
every caller then takes its numpy/torch path, which produces the same bytes, only slower.

Cost: the kernels are compiled the first time a process uses them and cached on disk next to this package
(numba's ``cache=True``). Importing numba and loading the first kernel costs time and resident memory (LLVM) once per
process, whatever the model size (docs/host_performance.md). So the bit-packing, dithering, lookup and sign kernels load
numba only for large tensors (``BITPACK_MIN_COUNT``, ``SIGN_MIN_COUNT``), and are used for any size once it is loaded;
C_nat always loads it. Training a model of a few million parameters with top-k, Signum or EF-signSGD thus never imports
numba; with C_nat it does.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import ModuleType

__all__ = ["enabled", "bitpack", "cnat", "dither", "lookup", "sample", "sign", "BITPACK_WIDTHS"]

# SplitMix64's increment and mixing constants: C_nat's counter-based random numbers, in the kernel
# (cnat_kernel) and in torch operations (compressors.natural.uniform23); defined once here, where numba is not
# imported.
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_MIX1 = 0xBF58476D1CE4E5B9
SPLITMIX_MIX2 = 0x94D049BB133111EB

BITPACK_WIDTHS = frozenset((2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15))

_numba_state: dict[str, bool] = {}


def _numba_importable() -> bool:
    if "ok" not in _numba_state:
        try:
            import numba  # noqa: F401
        except Exception as exc:  # missing, or built against another numpy: use the numpy/torch paths
            warnings.warn(f"gradcomp: numba unavailable ({exc}); using the slower numpy/torch paths", stacklevel=3)
            _numba_state["ok"] = False
        else:
            _numba_state["ok"] = True
    return _numba_state["ok"]


def enabled() -> bool:
    """Whether the compiled kernels are used (numba importable and ``GRADCOMP_KERNELS`` is not ``0``)."""
    return os.environ.get("GRADCOMP_KERNELS", "1") != "0" and _numba_importable()


def loaded() -> bool:
    """Whether this process has already paid for numba (imported it), so any kernel is now nearly free."""
    return "numba" in sys.modules and _numba_state.get("ok", False)


# Below these sizes a kernel is used only once numba is loaded anyway: loading it once per process costs more than the
# kernel saves on small tensors (docs/host_performance.md). C_nat always loads it: its kernel is the method's speed.
BITPACK_MIN_COUNT = 4097  # above the wire's small-array path (gradcomp.wire.bits._SMALL)
SIGN_MIN_COUNT = 1 << 22
SAMPLE_MAX_SPREAD = 1024  # random-k's bitmap kernel for densities k / n down to 1 / 1024


def _worth_it(count: int, minimum: int) -> bool:
    """Whether a kernel is used for ``count`` entries: kernels enabled, and the array large enough to pay for
    loading numba or numba already loaded. (``enabled()`` imports numba: asked last.)"""
    return (count >= minimum or loaded()) and enabled()


def bitpack(width: int, count: int):
    """(pack, unpack) kernels for ``count`` values of ``width`` bits, or None (width not covered, kernels
    disabled, or a small array in a process that has not loaded numba)."""
    if width not in BITPACK_WIDTHS or not _worth_it(count, BITPACK_MIN_COUNT):
        return None
    from gradcomp.kernels.bitpack_generated import KERNELS

    return KERNELS[width]


def cnat() -> ModuleType | None:
    """The C_nat kernel module, or None when kernels are disabled."""
    if not enabled():
        return None
    from gradcomp.kernels import cnat_kernel

    return cnat_kernel


def dither(count: int) -> ModuleType | None:
    """The dithering-codes kernels for a tensor of ``count`` entries, or None (kernels disabled, or fewer than
    ``BITPACK_MIN_COUNT`` entries in a process that has not loaded numba)."""
    if not _worth_it(count, BITPACK_MIN_COUNT):
        return None
    from gradcomp.kernels import dither_kernel

    return dither_kernel


def lookup(count: int) -> ModuleType | None:
    """The table-lookup decoder for ``count`` codes, or None (kernels disabled, or fewer than
    ``BITPACK_MIN_COUNT`` codes in a process that has not loaded numba)."""
    if not _worth_it(count, BITPACK_MIN_COUNT):
        return None
    from gradcomp.kernels import lookup_kernel

    return lookup_kernel


def sample(n: int, k: int) -> ModuleType | None:
    """The random-k sampling kernels for k of n positions, or None (kernels disabled, fewer than
    ``BITPACK_MIN_COUNT`` positions in a process that has not loaded numba, or k below n / ``SAMPLE_MAX_SPREAD``,
    where the n-bit bitmap would cost more than sorting the few draws)."""
    if n > SAMPLE_MAX_SPREAD * k or not _worth_it(k, BITPACK_MIN_COUNT):
        return None
    from gradcomp.kernels import sample_kernel

    return sample_kernel


def sign(count: int) -> ModuleType | None:
    """The sign-bitmap kernel module for a tensor of ``count`` entries, or None (kernels disabled, or a tensor
    below ``SIGN_MIN_COUNT`` in a process that has not loaded numba)."""
    if not _worth_it(count, SIGN_MIN_COUNT):
        return None
    from gradcomp.kernels import sign_kernel

    return sign_kernel
