#!/usr/bin/env bash
# SBC with n = 1 exchanging each step's weight update (momentum included), as the paper does.
set -e
mkdir -p runs
G="python -m gradcomp.cli train --no-progress"
for p in 0.01 0.001; do
  $G --compressor sbc --param density=$p --local-steps 1 --json runs/sbc_p${p}_n1u.json > runs/sbc_p${p}_n1u.log 2>&1
done
$G --compressor sbc --param density=0.001 --local-steps 8 --json runs/sbc_p0.001_n8.json > runs/sbc_p0.001_n8.log 2>&1
