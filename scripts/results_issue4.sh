#!/usr/bin/env bash
# The SBC runs behind docs/results.md (issue 4): MNIST, 4 gloo workers, one epoch of forward-backward passes.
set -e
mkdir -p runs
G="python -m gradcomp.cli train --no-progress"
for p in 0.01 0.001; do
  for n in 1 4 16; do
    $G --compressor sbc --param density=$p --local-steps $n --json runs/sbc_p${p}_n${n}.json > runs/sbc_p${p}_n${n}.log 2>&1
  done
done
$G --compressor sbc --param density=0.01 --local-steps 4 --topology ps --server-compressor sbc --server-param density=0.01 \
   --json runs/sbc_ps_both.json > runs/sbc_ps_both.log 2>&1
$G --compressor stc --param density=0.01 --json runs/stc_p0.01.json > runs/stc_p0.01.log 2>&1
$G --local-steps 16 --json runs/fedavg_n16.json > runs/fedavg_n16.log 2>&1
