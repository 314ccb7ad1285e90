"""How many planted heavy coordinates one step of sketched SGD's selection misses, per sketch size.

k heavy coordinates (±magnitude, the same on every worker; with --unequal, magnitudes spread over ×1–×2) are
planted in N(0, 1) noise on each of W workers; the workers' vectors are summed (what the allreduce does), the
sum is count-sketched with the given rows and cols_per_k (cols capped at d / (2·rows), as in the scheme), the
P·k largest estimates become candidates, and the k largest exact sums among them are selected — the
selection of ``gradcomp.schemes.sketch`` in one step. Prints the planted coordinates missed, summed over
seeds, and the worst seed.

    python scripts/sketch_recovery.py                      # the table in docs/methods/sketch.md
    python scripts/sketch_recovery.py --sizes 5x10x10,1x18x4 --seeds 50
"""

from __future__ import annotations

import argparse

import torch

from gradcomp.compressors.countsketch import CountSketch
from gradcomp.schemes.accumulation import largest


def missed(
    d: int,
    k: int,
    rows: int,
    cols_per_k: float,
    candidates: int,
    seed: int,
    workers: int,
    magnitude: float,
    unequal: bool,
) -> int:
    gen = torch.Generator().manual_seed(seed)
    heavy = torch.randperm(d, generator=gen)[:k]
    values = (torch.randint(0, 2, (k,), generator=gen).float() * 2 - 1) * magnitude
    if unequal:
        values = values * (1 + torch.rand(k, generator=gen))
    total = sum(torch.randn(d, generator=gen) for _ in range(workers))
    total[heavy] += workers * values
    cols = max(1, min(int(cols_per_k * k), d // (2 * rows)))
    cs = CountSketch(d, rows, cols, seed, 0)
    cand = largest(cs.estimate(cs.sketch(total)), min(candidates * k, d))
    chosen = cand[largest(total[cand], k)]
    return k - len(set(heavy.tolist()) & set(chosen.tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=20_000)
    parser.add_argument("--k", type=int, default=200)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--magnitude", type=float, default=20.0)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--sizes", default="5x10x10,5x3.6x4,1x10x12,1x18x4", help="rows x cols_per_k x P, ...")
    args = parser.parse_args()
    print("| rows × cols_per_k, P | sketch + candidates per k | missed over seeds (equal / unequal) | worst seed |")
    print("|---|---|---|---|")
    for size in args.sizes.split(","):
        rows, cpk, p = size.split("x")
        rows, cpk, p = int(rows), float(cpk), int(p)
        runs = {
            unequal: [
                missed(args.d, args.k, rows, cpk, p, s, args.workers, args.magnitude, unequal)
                for s in range(args.seeds)
            ]
            for unequal in (False, True)
        }
        print(
            f"| {rows} × {cpk:g}, {p} | {rows * cpk + p:g} | {sum(runs[False])} / {sum(runs[True])} | "
            f"{max(runs[False])} / {max(runs[True])} |"
        )


if __name__ == "__main__":
    main()
