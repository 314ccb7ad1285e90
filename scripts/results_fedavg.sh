#!/usr/bin/env bash
# Federated averaging / local SGD (no compressor, --local-steps n) against SBC's communication delay (SBC 1 %
# with --local-steps n), default job (MNIST, SmallCNN, 4 workers, batch 32, lr 0.05, momentum 0.9, one
# epoch), on the simulated cluster (the same bits as gloo workers; parameters equal up to gloo's order of summation in
# its allreduce). docs/methods/fedavg.md.
set -e
mkdir -p runs/fedavg
G="gradcomp train --no-progress --simulate"
run() { name=$1; shift; [ -f "runs/fedavg/$name.json" ] || $G "$@" --json "runs/fedavg/$name.json" > "runs/fedavg/$name.log" 2>&1 || true; }
for n in 1 4 16 64; do
  run fedavg_n$n --compressor none --local-steps $n
  run sbc_n$n --compressor sbc --param density=0.01 --local-steps $n
done
