#!/usr/bin/env bash
# A worker killed mid-run is restarted by torchrun and training continues from the last checkpoint.
#
#   scripts/torchrun_restart.sh [OUT_DIR]        (run from the repository root; OUT_DIR defaults to a temp dir)
#
# 1. reference: 2 gloo workers under torchrun, uninterrupted;
# 2. the same job with --checkpoint DIR --checkpoint-every 10 --resume-if-present under
#    `torchrun --max-restarts 1`; the tests' fault injection (tests/faults: GCTEST_CRASH_AT_STEP, on PYTHONPATH)
#    makes rank 1 SIGKILL itself before step 26 on the first
#    attempt only (TORCHELASTIC_RESTART_COUNT=0); rank 0 then fails in its collective, torchrun restarts both
#    workers, they find DIR/latest (step 20) and go on from there;
# 3. prints both accuracy curves side by side and checks that the final parameters are bit-identical.
#
# Environment: PYTHON (default .venv/bin/python), TORCHRUN (default .venv/bin/torchrun), STEPS (default 40).
set -euo pipefail

OUT=${1:-$(mktemp -d -t gradcomp-restart-XXXXXX)}
PYTHON=${PYTHON:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
STEPS=${STEPS:-40}
mkdir -p "$OUT"
rm -rf "$OUT/checkpoints"

JOB=(-m gradcomp.cli train --dataset synthetic --model mlp --steps "$STEPS" --eval-every 4 --batch-size 16
     --compressor topk --param density=0.05 --error-feedback --no-progress)

echo "== reference run (uninterrupted)"
"$TORCHRUN" --standalone --nproc-per-node 2 "${JOB[@]}" --json "$OUT/reference.json" > "$OUT/reference.log" 2>&1 \
  || { cat "$OUT/reference.log"; exit 1; }

echo "== the same run; rank 1 killed before step 26 on the first attempt; torchrun --max-restarts 1"
GCTEST_CRASH_AT_STEP=26 PYTHONPATH="$PWD/tests/faults${PYTHONPATH:+:$PYTHONPATH}" "$TORCHRUN" --standalone --max-restarts 1 --nproc-per-node 2 "${JOB[@]}" \
  --checkpoint "$OUT/checkpoints" --checkpoint-every 10 --resume-if-present --json "$OUT/restarted.json" \
  > "$OUT/restarted.log" 2>&1 || { cat "$OUT/restarted.log"; exit 1; }
grep -E "GCTEST_CRASH_AT_STEP|resuming from|restart|exitcode|Failures|failed" "$OUT/restarted.log" | sed 's/^/   log: /' || true

"$PYTHON" - "$OUT/reference.json" "$OUT/restarted.json" <<'EOF'
import json
import sys

reference, restarted = (json.load(open(path)) for path in sys.argv[1:3])
resumed = restarted["resumed_from_step"]
print(f"resumed from step {resumed}; final test accuracy {restarted['test_accuracy']:.4f} "
      f"(uninterrupted {reference['test_accuracy']:.4f})")
print("step  accuracy (uninterrupted)  accuracy (killed, restarted)")
for (step, a), (step_b, b) in zip(reference["accuracy_curve"], restarted["accuracy_curve"]):
    assert step == step_b
    mark = "   <- restarted attempt from here" if resumed is not None and step > resumed and step - 4 <= resumed else ""
    print(f"{step:4d}  {a:24.4f}  {b:28.4f}{mark}")
same = reference["parameter_digest"] == restarted["parameter_digest"]
print(f"parameter digest: uninterrupted {reference['parameter_digest']}, restarted {restarted['parameter_digest']}"
      f" -> {'bit-identical' if same else 'DIFFERENT'}")
print(f"bits up per worker: {reference['bits_up_per_worker']:.0f} / {restarted['bits_up_per_worker']:.0f}")
sys.exit(0 if same and resumed is not None and reference["bits_up_by_worker"] == restarted["bits_up_by_worker"] else 1)
EOF
