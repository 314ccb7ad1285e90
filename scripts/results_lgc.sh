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
# at LGC's total measured bits (up + down over the run, ≈ 1.61 Gbit per worker): top-k with Golomb-coded
# positions, and top-k with natural-compression values
run topk_equal --compressor topk --granularity model --error-feedback --param positions=golomb --param density=0.0182
run topkcnat_equal --compressor topk+cnat --granularity model --error-feedback --param positions=golomb --param density=0.048
# LGC without the dense first stage (its bits are then stage 2's and stage 3's only)
run lgc_ring_nodense --compressor lgc --param variant=ring --param dense_steps=0 --param topk_steps=100 --param density=0.001
run lgc_ps_nodense --compressor lgc --param variant=ps --param dense_steps=0 --param topk_steps=100 --param density=0.001
# a second seed
run fp32_seed1 --compressor none --seed 1
run lgc_ring_seed1 --compressor lgc --param variant=ring $STAGES --seed 1
run lgc_ps_seed1 --compressor lgc --param variant=ps $STAGES --seed 1
run topk_d001_seed1 --compressor topk --granularity model --error-feedback --param density=0.001 --seed 1
# the simulated cluster on the same job: the same bits, the same model up to gloo's order of summation
run lgc_ring_sim --compressor lgc --param variant=ring $STAGES --simulate
run lgc_ps_sim --compressor lgc --param variant=ps $STAGES --simulate
