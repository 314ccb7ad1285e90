"""Keep freed host memory in the process for reuse, instead of handing it back to the OS after every call.

Why: a compressor's outputs (a 20 MB fp16 copy of a 10M-entry gradient, the 40 MB fp32 tensor a receiver
decompresses into) are allocated once per message. With glibc's default settings, blocks above its mmap
threshold (128 KiB, raised on the fly up to 32 MiB) come from a fresh ``mmap`` and go back with ``munmap``
when freed, so every step touches fresh pages: one page fault and one zeroed 4 KiB page per 4 KiB written.
The faults cost compress and decompress several times their time, and which blocks fault depends on what
the process allocated before (the dynamic threshold), so timings swing between runs (docs/host_performance.md).

What: :func:`keep_freed_memory` asks glibc (``mallopt``) to serve every block from its heap
(``M_MMAP_MAX = 0``) and never to shrink the heap (``M_TRIM_THRESHOLD`` at its largest, 2 GiB - 1): a freed
block is reused by the next allocation of its size, as torch's CUDA caching allocator does on the GPU and as
jemalloc/tcmalloc (PyTorch's CPU performance guide recommends them) do on the host. The price: the resident
set stays at the process's peak instead of shrinking between steps (the race's peak-memory columns measure
it), and the heap fragments until it has holes of every size a step asks for: it holds as many buffers as are
ever alive at once, plus the holes between them (``benchmarks/allocator_reuse.py``; docs/host_performance.md
has the times and resident sets).

It is a process-wide setting, so the library never applies it on import:
gradcomp's own processes do (the ``gradcomp`` command, ``cli.run``, and every worker it starts, each applying
it itself) unless ``GRADCOMP_KEEP_FREED_MEMORY=0``; a user's own training script may call it once at start.

Limits: glibc's threads other than the main one allocate from arenas of at most 64 MiB each, so a block of
64 MiB or more allocated on another thread (e.g. a DDP communication hook's buffer for a bucket that large)
is still mapped and unmapped on its own; torch's default DDP buckets (25 MB) stay below it. Where another
allocator replaces glibc's (jemalloc or tcmalloc through ``LD_PRELOAD``), glibc's ``mallopt`` still answers
but changes nothing; those allocators keep freed memory by themselves. Elsewhere (macOS, musl, Windows: no
glibc ``mallopt``) it does nothing and says so (returns False).
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["ENV_VAR", "keep_freed_memory", "state"]

ENV_VAR = "GRADCOMP_KEEP_FREED_MEMORY"
_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1  # mallopt takes a C int

_applied: bool = False
_refused: list[str] = []  # the settings glibc refused, if any


def _wanted() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def keep_freed_memory(force: bool = False) -> bool:
    """Make glibc keep freed blocks for reuse in this process (see the module docstring); True if in effect.

    Does nothing (returns False) where glibc's ``mallopt`` is absent, or where ``GRADCOMP_KEEP_FREED_MEMORY``
    is 0/false/no/off unless ``force``. Applying it twice is harmless. Call it before the training loop:
    blocks already mapped stay mapped until freed, and the setting governs every later allocation.
    """
    global _applied, _refused
    if _applied:
        return True
    if not (force or _wanted()) or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; a setting refused is remembered, so that state() can say so
    _refused = [name for name, param, value in (("M_TRIM_THRESHOLD", _M_TRIM_THRESHOLD, _INT_MAX),
                                                ("M_MMAP_MAX", _M_MMAP_MAX, 0)) if mallopt(param, value) != 1]
    _applied = not _refused
    return _applied


def state() -> str:
    """One line for reports: whether freed memory is kept in this process, and how."""
    preload = os.environ.get("LD_PRELOAD", "")
    other = f"; LD_PRELOAD={preload}: if that is another allocator, it decides" if preload else ""
    if _applied:
        return f"freed memory kept for reuse (glibc mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2^31-1){other}"
    if _refused:
        return f"partly applied: glibc refused {', '.join(_refused)}{other}"
    why = f"{ENV_VAR}=0" if not _wanted() else "not applied in this process (no glibc, or never asked)"
    return f"system allocator defaults ({why}){other}"
