"""Majority vote on the receiving side: counting sign bits (``sign.VoteTally``) against adding decoded floats.

    PYTHONPATH=src python benchmarks/vote_aggregate.py                      # W = 4; 1.2M and 10M coordinates
    PYTHONPATH=src python benchmarks/vote_aggregate.py --workers 8 --sizes 1199882 --repeats 30

What every signsgd / signum receiver does per step (``single_round.aggregate_buffers``; the all-gather, ps
and sharded topologies all use it): decode W encoded sign buffers and turn them into the vote. Timed on one
torch thread: the path the exchange takes now (``Compressor.new_tally``: bit-sliced counting, only the vote
expanded to float32) and the float path it replaced (each worker's ±1 decoded to float32 and added, then
``sign``), both from the same encoded buffers, and a memory copy of the float32 vector of the same size as the
reference (``y.copy_(x)``). Both paths must give the same bits; the script checks that before it reports.
Each row is the median of ``--repeats`` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradcomp
from gradcomp import Slot
from gradcomp.compressors.base import accumulate
from gradcomp.schemes.single_round import aggregate_buffers, decode_slots, encode_slots


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sizes", default="1199882,10000000", help="coordinates per message, comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    compressor = gradcomp.make("signsgd")
    print(f"W = {args.workers}, one thread, median of {args.repeats}")
    print("| coordinates | memcpy (ms) | vote by counting (ms) | float sum + sign (ms) | float ÷ counting |")
    print("|---:|---:|---:|---:|---:|")
    for n in (int(s) for s in args.sizes.split(",")):
        copy_s, count_s, float_s = time_one_size(compressor, n, args.workers, args.repeats)
        print(f"| {n:,} | {copy_s * 1e3:.2f} | {count_s * 1e3:.2f} | {float_s * 1e3:.2f} | {float_s / count_s:.1f} |")


def time_one_size(compressor, n: int, workers: int, repeats: int) -> tuple[float, float, float]:
    """(memcpy, vote by counting, float sum + sign) in median seconds for W messages of n coordinates."""
    cpu = torch.device("cpu")
    slots = [Slot("w", 0, n)]
    g = torch.Generator().manual_seed(n)
    buffers = [
        encode_slots(compressor, slots, [compressor.compress(torch.randn(n, generator=g), slots[0], 0)])
        for _ in range(workers)
    ]

    def counted() -> torch.Tensor:
        return aggregate_buffers(compressor, slots, buffers, 0, cpu)[0]

    def floated() -> torch.Tensor:
        total = torch.zeros(n, dtype=torch.float32)
        for buffer in buffers:
            for fields in decode_slots(compressor, slots, buffer):
                accumulate(compressor, fields, slots[0], 0, total)
        return compressor.aggregate(total, len(buffers))

    if not torch.equal(counted().view(torch.int32), floated().view(torch.int32)):
        raise SystemExit("the two paths disagree: not timing broken code")
    x = torch.randn(n)
    y = torch.empty_like(x)
    return (
        median_seconds(lambda: y.copy_(x), repeats),
        median_seconds(counted, repeats),
        median_seconds(floated, repeats),
    )


if __name__ == "__main__":
    main()
