"""Page faults, time and resident memory of a message loop with and without ``gradcomp.keep_freed_memory()``.

Encodes and decodes one fp32 message of ``--size`` entries (uncompressed: two buffers of about 4·size bytes per
round, of slightly different sizes) for ``--rounds`` rounds, in two fresh processes: one with glibc's default
policy (``GRADCOMP_KEEP_FREED_MEMORY=0``), one with freed memory kept for reuse. Prints, per block of rounds,
the minor page faults per round, the milliseconds per round and the resident set.

    python benchmarks/allocator_reuse.py                 # 10M entries (40 MB), 60 rounds
    python benchmarks/allocator_reuse.py --size 1000000
    python benchmarks/allocator_reuse.py --keep-previous # the last round's buffers alive during the next
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time


def _loop(size: int, rounds: int, block: int, keep_previous: bool) -> None:
    import torch

    from gradcomp import allocator, registry, wire
    from gradcomp.compressors.base import Slot

    allocator.keep_freed_memory()
    torch.set_num_threads(1)
    compressor, slot = registry.make("none"), Slot("message", 0, size)
    fields = compressor.compress(torch.randn(size), slot, 0)
    specs = compressor.specs(slot)
    print(f"{allocator.state()}")
    faults, started = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    alive: list = []  # with --keep-previous: the last round's buffers, alive while the next round allocates
    for i in range(1, rounds + 1):
        message = wire.encode(fields, specs)
        decoded = wire.decode(message, specs)
        alive[:] = [(message, decoded)] if keep_previous else []
        if i % block == 0:
            now_faults, now = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            with open("/proc/self/statm") as f:
                resident_mib = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
            print(f"  rounds {i - block + 1:3d}-{i:3d}: {(now_faults - faults) / block:8.0f} page faults/round  "
                  f"{1e3 * (now - started) / block:6.1f} ms/round  resident {resident_mib:5.0f} MiB")
            faults, started = now_faults, now


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=10_000_000, help="fp32 entries of the message")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--block", type=int, default=10, help="rounds per printed line")
    parser.add_argument("--keep-previous", action="store_true",
                        help="keep each round's buffers alive until the next round's exist (as gradcomp bench does)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _loop(args.size, args.rounds, args.block, args.keep_previous)
        return 0
    for setting in ("0", "1"):
        print(f"GRADCOMP_KEEP_FREED_MEMORY={setting}:", flush=True)
        subprocess.run(
            [sys.executable, __file__, "--child", "--size", str(args.size), "--rounds", str(args.rounds),
             "--block", str(args.block), *(["--keep-previous"] if args.keep_previous else [])],
            env={**os.environ, "GRADCOMP_KEEP_FREED_MEMORY": setting}, check=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
