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
  decoded ±values without materialising them (``gradcomp.compressors.sign``).

Why numba: the issue that asked for these speeds allows a compiled kernel where it is the only route, from a
dependency that installs as a wheel from the package index on this machine kind and works on CPU and CUDA
tensors. numba (with llvmlite) is such a wheel for CPython 3.10-3.13 on Linux, macOS and Windows; torch's own
``torch.compile`` needs a C++ compiler at run time and compiles per tensor shape; a C extension needs a
compiler at install time. CUDA tensors never reach these kernels: on a GPU the torch paths are already fast
and give the same bytes (the kernels reproduce them exactly; tests/test_kernels.py compares both on the CPU).

Fallback: ``enabled()`` is False when numba cannot be imported or the environment sets ``GRADCOMP_KERNELS=0``;
every caller then takes its numpy/torch path, which produces the same bytes, only slower.

Cost: the kernels are compiled the first time a process uses them and cached on disk next to this package
(numba's ``cache=True``; about a second per kernel the first time, milliseconds after). Importing numba and
loading the first kernel adds about 110 MB of resident memory to the process (LLVM), once, whatever the model
size; a process that never packs a BITS field of width 2-7 or 9-15 and never compresses with C_nat or a sign
method on the CPU never imports numba.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

__all__ = ["enabled", "bitpack", "cnat", "sign", "BITPACK_WIDTHS"]

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


def bitpack(width: int):
    """(pack, unpack) kernels for ``width`` bits, or None (width not covered, or kernels disabled)."""
    if width not in BITPACK_WIDTHS or not enabled():
        return None
    from gradcomp.kernels.bitpack_generated import KERNELS

    return KERNELS[width]


def cnat() -> ModuleType | None:
    """The C_nat kernel module, or None when kernels are disabled."""
    if not enabled():
        return None
    from gradcomp.kernels import cnat_kernel

    return cnat_kernel


def sign() -> ModuleType | None:
    """The sign-bitmap kernel module, or None when kernels are disabled."""
    if not enabled():
        return None
    from gradcomp.kernels import sign_kernel

    return sign_kernel
