#!/usr/bin/env bash
# The runs behind docs/methods/sketch.md: sketched SGD, local top-k and true top-k against fp32 allreduce on
# the default job (MNIST, SmallCNN, 4 gloo workers, batch 32 per worker, SGD lr 0.05, one epoch). The three
# methods apply momentum 0.9 themselves (the optimizer's momentum is set to 0 and the run says so).
# Run from the repository root in the virtual environment; each run writes runs/sketch/<name>.json and .log
# (a run whose JSON exists is skipped: delete it to run again).
set -e
mkdir -p runs/sketch
G="gradcomp train --no-progress"
run() { name=$1; shift; [ -f "runs/sketch/$name.json" ] || $G "$@" --json "runs/sketch/$name.json" > "runs/sketch/$name.log" 2>&1 || true; }
X4="--param density=0.01 --param rows=1 --param cols_per_k=18 --param candidates=4"
X8="--param density=0.005 --param rows=1 --param cols_per_k=16 --param candidates=4"
run fp32 --compressor none
run fp32_seed1 --compressor none --seed 1
# the paper's sizes (5 rows, 10·k columns capped at half the layer, 10·k candidates): exact heavy-hitter recovery
run default --compressor sketch
# x4 and x8 measured, and their baselines at the same k
run x4 --compressor sketch $X4
run x4_seed1 --compressor sketch $X4 --seed 1
run x8 --compressor sketch $X8
run x8_seed1 --compressor sketch $X8 --seed 1
run local_d01 --compressor local_topk --param density=0.01
run true_d01 --compressor true_topk --param density=0.01
run local_d005 --compressor local_topk --param density=0.005
run true_d005 --compressor true_topk --param density=0.005
# the same budget as x4 spent on 5 rows instead of one; the parameter server; one round
run x4_rows5 --compressor sketch --param density=0.01 --param rows=5 --param cols_per_k=3.6 --param candidates=4
run x4_ps --compressor sketch $X4 --topology ps
run rounds1 --compressor sketch --param rounds=1
# one round from a one-row sketch: stops at step 8 with a non-finite gradient (no JSON; see the .log)
run rounds1_rows1 --compressor sketch --param density=0.01 --param rows=1 --param cols_per_k=18 --param rounds=1
# too small a k for this sketch: the run that diverged
run d0025 --compressor sketch --param density=0.0025 --param rows=1 --param cols_per_k=36 --param candidates=4
run true_d0025 --compressor true_topk --param density=0.0025
