#!/usr/bin/env bash
# Sparse Binary Compression: the runs behind docs/papers/sbc.md. MNIST, SmallCNN, 4 gloo workers, one epoch of
# forward-backward passes (468 per worker). Run from the repository root in the virtual environment; each run
# writes runs/<name>.json and .log.
set -e
mkdir -p runs
G="python -m gradcomp.cli train --no-progress --allow-untrained-defaults"  # its n = 1 rows measure refused defaults

# Density p x communication delay n. "grad" rows (n = 1 in the default gradient-exchange mode: momentum applied
# after aggregation) take no --local-steps; --local-steps N exchanges the weight update of N local steps
# (N = 1: each step's update, momentum applied locally before compression).
for p in 0.01 0.001; do
  $G --compressor sbc --param density=$p --json runs/sbc_p${p}_n1.json > runs/sbc_p${p}_n1.log 2>&1
  $G --compressor sbc --param density=$p --local-steps 1 --json runs/sbc_p${p}_n1u.json > runs/sbc_p${p}_n1u.log 2>&1
  for n in 4 16; do
    $G --compressor sbc --param density=$p --local-steps $n --json runs/sbc_p${p}_n${n}.json > runs/sbc_p${p}_n${n}.log 2>&1
  done
done
$G --compressor sbc --param density=0.001 --local-steps 8 --json runs/sbc_p0.001_n8.json > runs/sbc_p0.001_n8.log 2>&1
# intermediate densities at n = 16
$G --compressor sbc --param density=0.003 --local-steps 16 --json runs/sbc_p0.003_n16.json > runs/sbc_p0.003_n16.log 2>&1
$G --compressor sbc --param density=0.002 --local-steps 16 --json runs/sbc_p0.002_n16.json > runs/sbc_p0.002_n16.log 2>&1

# Related runs: SBC both ways through a parameter server, STC, federated averaging (the delay alone).
$G --compressor sbc --param density=0.01 --local-steps 4 --topology ps --server-compressor sbc --server-param density=0.01 \
   --json runs/sbc_ps_both.json > runs/sbc_ps_both.log 2>&1
$G --compressor stc --param density=0.01 --json runs/stc_p0.01.json > runs/stc_p0.01.log 2>&1
$G --local-steps 16 --json runs/fedavg_n16.json > runs/fedavg_n16.log 2>&1

# The effect of momentum: the same without momentum, at lr 0.1.
$G --compressor sbc --param density=0.01 --momentum 0 --lr 0.1 --json runs/sbc_p0.01_n1_nomom.json > runs/sbc_p0.01_n1_nomom.log 2>&1
$G --compressor sbc --param density=0.001 --momentum 0 --lr 0.1 --json runs/sbc_p0.001_n1_nomom.json > runs/sbc_p0.001_n1_nomom.log 2>&1
$G --compressor sbc --param density=0.001 --local-steps 16 --momentum 0 --lr 0.1 --json runs/sbc_p0.001_n16_nomom.json > runs/sbc_p0.001_n16_nomom.log 2>&1

# Golomb position bits against the entropy minimum (bits per kept position, bench's table).
python -m gradcomp.cli bench --threads 1 --compressors topk,sbc,stc,none
