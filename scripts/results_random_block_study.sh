#!/usr/bin/env bash
# Random-block sparsification and the sparsification study: the runs behind docs/papers/random_block_study.md
# (the study, its momentum-masking cells, random-block + error feedback to within one point of uncompressed,
# the independent reference checks, and the compression-time bench).
# Run from the repository root in the virtual environment (about 1.5 h on a 2-core machine, plus about 45 min
# for the momentum-masking cells).
set -e
mkdir -p runs

# The study: 4 schemes x 3 densities x 2 granularities x memory on/off x 2 seeds, one epoch each, lr 0.05,
# momentum 0.9, simulated cluster of 4 workers. Resumes; writes docs/study/{results.jsonl,table.md,*.png}.
python -m gradcomp.cli sweep --out docs/study --bandwidth 1Gbit --latency 50us
# The memory cells again with DGC's momentum correction and masking (layer granularity, seed 0): one more cell
# per scheme and density in the same table and plot.
python -m gradcomp.cli sweep --out docs/study --bandwidth 1Gbit --latency 50us --memory momentum_masking \
  --granularities layer --seeds 0

# Random-block (and random-k) at density 0.01 with error feedback at a learning rate where memory is stable
# (lr 0.004, no momentum), 20 epochs, test accuracy after every epoch; the uncompressed run at the same
# settings for comparison.
G="python -m gradcomp.cli train --simulate --no-progress --lr 0.004 --momentum 0 --epochs 20 --eval-every 468"
$G --compressor randomblock --param density=0.01 --error-feedback --json runs/rb_ef_lr004.json
$G --compressor randomk --param density=0.01 --error-feedback --json runs/rk_ef_lr004.json
$G --json runs/none_lr004.json
G6="python -m gradcomp.cli train --simulate --no-progress --lr 0.006 --momentum 0 --epochs 10 --eval-every 468"
$G6 --compressor randomblock --param density=0.01 --error-feedback --json runs/rb_ef_lr006.json
$G6 --json runs/none_lr006.json
$G6 --compressor randomblock --param density=0.01 --no-error-feedback --lr 0.004 --json runs/rb_noef_lr004.json
$G6 --compressor randomblock --param density=0.01 --error-feedback --granularity model --lr 0.004 \
  --json runs/rb_ef_model_lr004.json
python -m gradcomp.cli curves runs/none_lr006.json=uncompressed "runs/rb_ef_lr006.json=random-block 1% + EF" \
  --targets 0.95,0.9736,0.9756,0.98
python -m gradcomp.cli curves runs/none_lr004.json=uncompressed "runs/rb_ef_lr004.json=random-block 1% + EF" \
  "runs/rk_ef_lr004.json=random-k 1% + EF" --targets 0.95,0.9736,0.9756,0.98 --out docs/study/memory_lr004_curves.png

# Independent reference loop (no gradcomp compressor, feedback or transport code).
python scripts/reference_ef_random.py --scheme randomk --density 0.1 --steps 300
python scripts/reference_ef_random.py --scheme randomblock --memory off --density 0.1 --steps 200
python scripts/reference_ef_random.py --scheme randomblock --memory off --density 0.1 --momentum 0 --steps 300
python scripts/reference_ef_random.py --scheme randomk --memory off --density 0.1 --steps 300
for t in 2 4 2,4; do  # which tensors' blocks make random-block without memory unstable with momentum
  python scripts/reference_ef_random.py --scheme randomblock --memory off --density 0.1 --steps 300 --sparse-tensors $t
done
python scripts/reference_ef_random.py --scheme randomk --memory off --density 0.1 --steps 300 --sparse-tensors 2
python scripts/reference_ef_random.py --scheme randomk --memory off --density 0.1 --steps 300 --sparse-tensors 2,4
python scripts/block_curvature.py --density 0.1 --warmup-steps 100 --trials 8

# Compression time of random-block against top-k at the same density.
python -m gradcomp.cli bench --threads 1 --compressors topk,randomk,randomblock --inputs synthetic,model
