#!/usr/bin/env bash
# Random selection with memory at the default learning rate (lr 0.05, momentum 0.9): plain error feedback
# against DGC's momentum correction and momentum factor masking (docs/methods/feedback.md). Default job:
# MNIST, SmallCNN, 4 gloo workers, batch 32 per worker, one epoch. Each run writes runs/feedback/<name>.json
# and .log (a run whose JSON exists is skipped).
set -e
mkdir -p runs/feedback
G="gradcomp train --no-progress --allow-untrained-defaults"
run() { name=$1; shift; [ -f "runs/feedback/$name.json" ] || $G "$@" --json "runs/feedback/$name.json" > "runs/feedback/$name.log" 2>&1 || true; }
run fp32 --compressor none
for method in randomblock randomk; do
  run ${method}_residual --compressor $method --param density=0.01 --feedback residual
  run ${method}_correction --compressor $method --param density=0.01 --feedback momentum_correction
  run ${method}_masking --compressor $method --param density=0.01 --feedback momentum_masking
done
run topk_residual --compressor topk --param density=0.01 --feedback residual
run topk_masking --compressor topk --param density=0.01 --feedback momentum_masking
# the learning rate random-block needs with memory (the staleness of ~1/p steps): lower lr, momentum 0.9 kept
for lr in 0.02 0.01 0.005; do
  run randomblock_masking_lr$lr --compressor randomblock --param density=0.01 --feedback momentum_masking --lr $lr
  run randomblock_residual_lr$lr --compressor randomblock --param density=0.01 --feedback residual --lr $lr
done
# curves (test accuracy every 50 steps, simulated cluster: the same bits and trajectory as gloo workers):
# fp32, random-block with masking at the lrs that did not diverge, and random-k with masking
C="--simulate --eval-every 50"
run curve_fp32 --compressor none $C
run curve_randomblock_masking_lr0.005 --compressor randomblock --param density=0.01 --feedback momentum_masking --lr 0.005 $C
run curve_randomblock_masking_lr0.002 --compressor randomblock --param density=0.01 --feedback momentum_masking --lr 0.002 $C
run curve_randomk_masking_lr0.005 --compressor randomk --param density=0.01 --feedback momentum_masking --lr 0.005 $C
run curve_randomblock_none_lr0.05 --compressor randomblock --param density=0.01 $C
gradcomp curves runs/feedback/curve_fp32.json=fp32 \
  runs/feedback/curve_randomblock_masking_lr0.005.json="random-block 1 %, masking, lr 0.005" \
  runs/feedback/curve_randomblock_masking_lr0.002.json="random-block 1 %, masking, lr 0.002" \
  runs/feedback/curve_randomk_masking_lr0.005.json="random-k 1 %, masking, lr 0.005" \
  runs/feedback/curve_randomblock_none_lr0.05.json="random-block 1 %, no memory, lr 0.05" \
  --targets 0.5,0.9,0.97 --out docs/methods/img/random_selection_curves.png > runs/feedback/curves.md
