#!/usr/bin/env bash
# The GPU check of docs/gpu.md, at most 8 minutes on one CUDA GPU (the parts' time-outs add up to 480 s; an H200 took
# about 2 minutes): the CUDA tests; per compressor, compress +
# encode + decode against a device copy of the same 10M-entry fp32 tensor; the DDP hook's step against torch DDP's
# (none, fp16, top-k, PowerSGD, Signum; world size 1 over NCCL) and the simulated cluster of 8 for the compression
# cost; the synchronisation warnings (torch.cuda.set_sync_debug_mode("warn")) in a step per fixed-size method.
# Targets (ratios measured in the same run): encode + decode of 40 MB fp32 <= 3 x a device copy; fp16 and bf16
# compress + encode <= 1.25 x (a cast of the same tensor + the wire's device checksum of the cast's bytes), with
# encode + decode reported against the same reference; the hook with none <= 1.05 x torch DDP's step, both with
# nonfinite="raise" (none) and with the default "propagate" (none+propagate), with fp16 <= 1.05 x torch's fp16 hook;
# zero sync warnings for fixed-size methods. (On the CPU the same ratios come from gradcomp bench and
# benchmarks/ddp_overlap.py: docs/bench_targets.md.)
#
#   scripts/gpu_check.sh [OUT_DIR]        (run from the repository root; OUT_DIR defaults to a temp dir)
#
# Without a GPU every part says it is skipped and the script exits 0. The longer check (NCCL training runs, every
# compressor in a simulated cluster, the bench, the race; well over 8 minutes) is scripts/gpu_check_full.sh.
set -uo pipefail

OUT=${1:-$(mktemp -d -t gradcomp-gpu-XXXXXX)}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS

{
  nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
  $PYTHON -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available())"
  git rev-parse --short HEAD 2>/dev/null
} 2>&1 | tee "$OUT/env.log"

# gradcomp's own dependencies, which a GPU machine's image may lack: say so at once, not in every part below
if ! $PYTHON -c "import google_crc32c, isal, numba" 2>/dev/null; then
  echo "== missing dependencies: $PYTHON cannot import google_crc32c, isal or numba;"
  echo "   pip install -c constraints.txt google-crc32c isal numba (or install their wheels, carried, with --no-deps)"
  exit 2
fi

if ! $PYTHON -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "== no CUDA device: every GPU part is skipped"
  $PYTHON benchmarks/cuda_encode.py
  for part in step sim sync topologies; do $PYTHON benchmarks/gpu_hook.py $part; done
  echo "results in $OUT (nothing measured)"
  exit 0
fi

echo "== 1. the CUDA tests (timeout 90 s)"
timeout 90 $PYTHON -m pytest -q -p no:cacheprovider -k "cuda or pinned" tests/test_natural.py tests/test_qsgd.py \
  tests/test_sign.py tests/test_wire_bits.py tests/test_wire_container.py tests/test_wire_elias.py \
  tests/test_wire_golomb.py tests/test_wire_checksum.py 2>&1 | tail -5 | tee "$OUT/cuda_tests.log"

echo "== 2. compress + encode + decode per compressor vs a device copy, 10M fp32; fp16 / bf16 vs a cast + its checksum (timeout 80 s)"
timeout 80 $PYTHON benchmarks/cuda_encode.py --profile 2>&1 | tee "$OUT/encode.log"

echo "== 3. the DDP hook's step vs torch DDP's, world size 1 over NCCL, batch 256 and 4096 (timeout 100 s)"
timeout 100 $PYTHON benchmarks/gpu_hook.py step --rounds 10 --batch 256 4096 --profile none fp16 2>&1 \
  | tee "$OUT/step.log"

echo "== 4. compression cost: a simulated cluster of 8 on the GPU (timeout 50 s)"
timeout 50 $PYTHON benchmarks/gpu_hook.py sim --workers 8 2>&1 | tee "$OUT/sim.log"

echo "== 5. synchronisation warnings in one step per fixed-size method (timeout 40 s)"
timeout 40 $PYTHON benchmarks/gpu_hook.py sync 2>&1 | tee "$OUT/sync.log"

ALLREDUCE_ONLY="none fp16 bf16 randomk randomblock powersgd sketch true_topk"
echo "== 5b. the same under a GradScaler, for the methods that only all-reduce (timeout 30 s)"
timeout 30 $PYTHON benchmarks/gpu_hook.py sync --scaler --only $ALLREDUCE_ONLY 2>&1 \
  | tee "$OUT/sync_scaler.log"

echo "== 5c. the same with nonfinite=\"propagate\" and no scaler (timeout 30 s)"
timeout 30 $PYTHON benchmarks/gpu_hook.py sync --nonfinite propagate --only $ALLREDUCE_ONLY 2>&1 \
  | tee "$OUT/sync_propagate.log"

echo "== 6. the same for the variable-size methods (their budgets allow a size exchange; timeout 30 s)"
timeout 30 $PYTHON benchmarks/gpu_hook.py sync --only threshold sbc stc dgc lgc 2>&1 | tee "$OUT/sync_variable.log"

echo "== 7. the topologies' reads: a simulated cluster of 3 on the GPU, allgather / sharded / ps (timeout 30 s)"
timeout 30 $PYTHON benchmarks/gpu_hook.py topologies --workers 3 2>&1 | tee "$OUT/sync_topologies.log"

echo "done in $((SECONDS - START)) s; results in $OUT"
