#!/usr/bin/env bash
# Natural compression runs behind docs/results.md (issue 5): MNIST, 4 gloo workers, one epoch.
set -e
mkdir -p runs
G="python -m gradcomp.cli train --no-progress"
$G --compressor cnat --json runs/cnat.json > runs/cnat.log 2>&1
$G --compressor topk+cnat --param density=0.01 --error-feedback --json runs/topk_cnat.json > runs/topk_cnat.log 2>&1
$G --compressor natural_dithering --param levels=8 --json runs/natdith8.json > runs/natdith8.log 2>&1
$G --compressor random_dithering --param levels=8 --json runs/randdith8.json > runs/randdith8.log 2>&1
$G --compressor cnat --topology ps --server-compressor cnat --json runs/cnat_bidir.json > runs/cnat_bidir.log 2>&1
$G --compressor terngrad --json runs/terngrad.json > runs/terngrad.log 2>&1
