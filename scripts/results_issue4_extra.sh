#!/usr/bin/env bash
# Follow-up SBC runs: intermediate densities at n = 16, and the effect of momentum on n = 1.
set -e
mkdir -p runs
G="python -m gradcomp.cli train --no-progress"
$G --compressor sbc --param density=0.003 --local-steps 16 --json runs/sbc_p0.003_n16.json > runs/sbc_p0.003_n16.log 2>&1
$G --compressor sbc --param density=0.002 --local-steps 16 --json runs/sbc_p0.002_n16.json > runs/sbc_p0.002_n16.log 2>&1
$G --compressor sbc --param density=0.01 --momentum 0 --lr 0.1 --json runs/sbc_p0.01_n1_nomom.json > runs/sbc_p0.01_n1_nomom.log 2>&1
$G --compressor sbc --param density=0.001 --local-steps 16 --momentum 0 --lr 0.1 --json runs/sbc_p0.001_n16_nomom.json > runs/sbc_p0.001_n16_nomom.log 2>&1
$G --compressor sbc --param density=0.001 --momentum 0 --lr 0.1 --json runs/sbc_p0.001_n1_nomom.json > runs/sbc_p0.001_n1_nomom.log 2>&1
