#!/usr/bin/env bash
# Natural compression and natural dithering: the runs behind docs/papers/natural_compression.md. MNIST,
# SmallCNN, 4 gloo workers, one epoch. Run from the repository root in the virtual environment; each run
# writes runs/<name>.json and .log.
set -e
mkdir -p runs
G="python -m gradcomp.cli train --no-progress"
$G --compressor cnat --json runs/cnat.json > runs/cnat.log 2>&1
$G --compressor topk+cnat --param density=0.01 --error-feedback --json runs/topk_cnat.json > runs/topk_cnat.log 2>&1
$G --compressor natural_dithering --param levels=8 --json runs/natdith8.json > runs/natdith8.log 2>&1
$G --compressor random_dithering --param levels=8 --json runs/randdith8.json > runs/randdith8.log 2>&1
$G --compressor cnat --topology ps --server-compressor cnat --json runs/cnat_bidir.json > runs/cnat_bidir.log 2>&1
$G --compressor terngrad --json runs/terngrad.json > runs/terngrad.log 2>&1
# Throughput: compress+encode / decode+decompress as fractions of a memory copy (10^7 elements and the CNN's
# gradient), and bits per entry.
python -m gradcomp.cli bench --threads 1 --compressors cnat,topk+cnat,natural_dithering,random_dithering,terngrad,topk,randomblock
