#!/usr/bin/env bash
# The baselines' first runs, behind docs/papers/baselines.md: uncompressed fp32, fp16, top-k 1 % with error
# feedback (gathered, on the simulated cluster, and compressed both ways through a parameter server) and
# random-k 1 % with error feedback. MNIST, SmallCNN, 4 gloo workers, one epoch. Run from the repository root
# in the virtual environment; each run writes runs/<name>.json and .log.
set -e
mkdir -p runs
G="python -m gradcomp.cli train --no-progress --allow-untrained-defaults"
$G --json runs/none.json > runs/none.log 2>&1
$G --compressor topk --param density=0.01 --error-feedback --json runs/topk.json > runs/topk.log 2>&1
$G --compressor topk --param density=0.01 --error-feedback --simulate --json runs/topk_sim.json > runs/topk_sim.log 2>&1
$G --compressor fp16 --json runs/fp16.json > runs/fp16.log 2>&1
$G --compressor randomk --param density=0.01 --error-feedback --json runs/randomk.json > runs/randomk.log 2>&1
$G --compressor topk --param density=0.01 --error-feedback --topology ps --server-compressor topk --server-param density=0.01 --json runs/topk_ps.json > runs/topk_ps.log 2>&1
