#!/usr/bin/env bash
# TernGrad: per-worker scaler (terngrad) against the paper's shared scaler (terngrad_shared), seeds 0 and 1,
# default job (MNIST, SmallCNN, 4 gloo workers, batch 32, lr 0.05, momentum 0.9, one epoch); clipping 2.5σ
# and off. docs/methods/terngrad.md. Each run writes runs/terngrad/<name>.json (skipped when present).
set -e
mkdir -p runs/terngrad
G="gradcomp train --no-progress --bandwidth 1Gbit"
run() { name=$1; shift; [ -f "runs/terngrad/$name.json" ] || $G "$@" --json "runs/terngrad/$name.json" > "runs/terngrad/$name.log" 2>&1 || true; }
# seed 0 of terngrad / terngrad_shared (both exchanges) are rows of docs/all_methods.md (runs/all/)
run terngrad_s1 --compressor terngrad --seed 1
run shared_s1 --compressor terngrad_shared --seed 1
run terngrad_noclip_s0 --compressor terngrad --param clip=0
run shared_noclip_s0 --compressor terngrad_shared --param clip=0
