"""Keep freed host memory in the process for reuse, instead of handing it back to the OS after every call.

Why: a compressor's outputs (a 20 MB fp16 copy of a 10M-entry gradient, the 40 MB fp32 tensor a receiver
decompresses into) are allocated once per message. With glibc's default settings, blocks above its mmap
threshold (128 KiB, raised on the fly up to 32 MiB) come from a fresh ``mmap`` and go back with ``munmap``
when freed, so every step touches fresh pages: one page fault and one zeroed 4 KiB page per 4 KiB written.
Measured on the 2-core VM (``gradcomp bench --threads 1 --no-model``, 10M fp32 entries): fp16 compress
12.5 ms with those page faults against 3.8 ms without, and a 40 MB decompress 18 ms against 2-9 ms. Which
blocks fault depends on what the process allocated before (the dynamic threshold), which made bench rows
swing by 2x between runs.

What: :func:`keep_freed_memory` asks glibc (``mallopt``) to serve every block from its heap
(``M_MMAP_MAX = 0``) and never to shrink the heap (``M_TRIM_THRESHOLD`` at its largest, 2 GiB - 1): a freed
block is reused by the next allocation of its size, as torch's CUDA caching allocator does on the GPU and as
jemalloc/tcmalloc (PyTorch's CPU performance guide recommends them) do on the host. The price: the resident
set stays at the process's peak instead of shrinking between steps (the race's peak-memory columns measure
it), and the heap can fragment. It is a process-wide setting, so the library never applies it on import:
gradcomp's own processes do (the ``gradcomp`` command and every worker it starts) unless
``GRADCOMP_KEEP_FREED_MEMORY=0``; a user's own training script may call it once at start.

Elsewhere (macOS, musl, Windows: no glibc ``mallopt``) it does nothing and says so (returns False).
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


def _wanted() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def keep_freed_memory(force: bool = False) -> bool:
    """Make glibc keep freed blocks for reuse in this process (see the module docstring); True if in effect.

    Does nothing (returns False) where glibc's ``mallopt`` is absent, or where ``GRADCOMP_KEEP_FREED_MEMORY``
    is 0/false/no/off unless ``force``. Applying it twice is harmless. Call it before the training loop:
    blocks already mapped stay mapped until freed, and the setting governs every later allocation.
    """
    global _applied
    if _applied:
        return True
    if not (force or _wanted()) or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; False if either setting is refused
    if mallopt(_M_TRIM_THRESHOLD, _INT_MAX) != 1 or mallopt(_M_MMAP_MAX, 0) != 1:
        return False
    _applied = True
    return True


def state() -> str:
    """One line for reports: whether freed memory is kept in this process, and how."""
    if _applied:
        return "freed memory kept for reuse (glibc mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2^31-1)"
    why = f"{ENV_VAR}=0" if not _wanted() else "not applied in this process (no glibc, or never asked)"
    return f"system allocator defaults ({why})"
