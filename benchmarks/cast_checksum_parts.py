"""fp16 / bf16 on the CPU: compress + encode against a cast plus the wire's checksum of the cast's bytes (the
reference of ``gradcomp bench``'s target for these rows, docs/bench_targets.md), timed in CPU time of the thread.

    python benchmarks/cast_checksum_parts.py LABEL        # one thread, 10M entries of the bench's synthetic input

Each figure is the median of 21 calls after two warm-up calls, in ``time.thread_time()``: the CPU time this thread
spent, which leaves out the time other processes held the core. On a shared, loaded machine that keeps the parts
comparable where wall times move by a factor of two between calls (the bench itself times wall clock, beside each
row). To compare two versions of the code, run it with each on PYTHONPATH, alternately (``LABEL`` names them).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import gradcomp
from gradcomp import make, wire
from gradcomp.compressors.base import Slot
from gradcomp.experiments.bench import cases
from gradcomp.wire.checksum import checksum64


def cpu_ms(fn, calls: int = 21) -> float:
    fn()
    fn()
    out = []
    for _ in range(calls):
        began = time.thread_time()
        fn()
        out.append(time.thread_time() - began)
    return statistics.median(out) * 1e3


def main() -> None:
    gradcomp.keep_freed_memory()
    torch.set_num_threads(1)
    x = cases.synthetic_gradient(cases.DEFAULT_SIZE)
    slot = Slot("s", 0, x.numel())
    parts = []
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        compressor = make(name)
        specs = compressor.specs(slot)
        ref = cpu_ms(lambda: checksum64(x.to(dtype).view(torch.uint8)))
        compress = cpu_ms(lambda: compressor.compress(x, slot, 1))
        both = cpu_ms(lambda: wire.encode(compressor.compress(x, slot, 1), specs))
        parts.append(f"{name} cast+checksum {ref:.2f} ms, compress {compress:.2f}, compress+encode {both:.2f} = "
                     f"{both / ref:.3f} x")
    print(sys.argv[1] if len(sys.argv) > 1 else "", " | ".join(parts))


if __name__ == "__main__":
    main()
