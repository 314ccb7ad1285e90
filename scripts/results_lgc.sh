#!/usr/bin/env bash
# The runs behind docs/methods/lgc.md: Learned Gradient Compression (ring and parameter-server variants)
# against fp32 allreduce and top-k on MNIST with the 1.2M-parameter convnet, 4 gloo workers, batch 32 per
# worker, SGD lr 0.05 momentum 0.9, one epoch (468 steps).
# Run from the repository root in the virtual environment; each run writes runs/lgc/<name>.json and .log
# (a run whose JSON exists is skipped: delete it to run again).
set -e
mkdir -p runs/lgc
G="gradcomp train --no-progress --model convnet"
run() { name=$1; shift; [ -f "runs/lgc/$name.json" ] || $G "$@" --json "runs/lgc/$name.json" > "runs/lgc/$name.log" 2>&1 || true; }
STAGES="--param dense_steps=20 --param topk_steps=100 --param density=0.001"
run fp32 --compressor none
run lgc_ring --compressor lgc --param variant=ring $STAGES
run lgc_ps --compressor lgc --param variant=ps $STAGES
# top-k over the whole model with error feedback, at the density of LGC's k and at LGC's total bits
run topk_d001 --compressor topk --granularity model --error-feedback --param density=0.001
