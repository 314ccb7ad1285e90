#!/usr/bin/env bash
# The runs behind docs/methods/powersgd.md: PowerSGD against fp32 allreduce on the default job
# (MNIST, SmallCNN, 4 gloo workers, batch 32 per worker, SGD lr 0.05 momentum 0.9, one epoch).
# Run from the repository root in the virtual environment; each run writes runs/powersgd_*.json and .log.
set -e
mkdir -p runs
G="gradcomp train --no-progress"
$G --compressor none --json runs/powersgd_fp32.json > runs/powersgd_fp32.log 2>&1
$G --compressor powersgd --param rank=2 --json runs/powersgd_r2.json > runs/powersgd_r2.log 2>&1
$G --compressor powersgd --param rank=2 --param start_iter=10 --json runs/powersgd_r2_s10.json > runs/powersgd_r2_s10.log 2>&1
$G --compressor powersgd --param rank=1 --json runs/powersgd_r1.json > runs/powersgd_r1.log 2>&1
$G --compressor powersgd --param rank=4 --json runs/powersgd_r4.json > runs/powersgd_r4.log 2>&1
# a second seed, to tell a method's effect from the spread of one end-of-epoch evaluation
$G --compressor none --seed 1 --json runs/powersgd_fp32_seed1.json > runs/powersgd_fp32_seed1.log 2>&1
$G --compressor powersgd --param rank=2 --seed 1 --json runs/powersgd_r2_seed1.json > runs/powersgd_r2_seed1.log 2>&1
$G --compressor powersgd --param rank=4 --seed 1 --json runs/powersgd_r4_seed1.json > runs/powersgd_r4_seed1.log 2>&1
# through the DDP communication hook (DDP's default buckets)
$G --ddp --compressor none --json runs/ddp_none.json > runs/ddp_none.log 2>&1
$G --ddp --compressor powersgd --param rank=2 --json runs/ddp_powersgd_r2.json > runs/ddp_powersgd_r2.log 2>&1
