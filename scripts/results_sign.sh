#!/usr/bin/env bash
# The sign family behind docs/methods/sign.md: MNIST, SmallCNN, 4 gloo workers, one epoch each, one run at a time.
# Learning rates were picked with 200-step runs (--steps 200, same flags; see the doc's pick table).
# Then the packing speed of 10^7 floats against a memory copy, on one thread (alone: --speed).
set -e
cd "$(dirname "$0")/.."
mkdir -p runs/sign
G=".venv/bin/gradcomp train --no-progress --allow-untrained-defaults"
run() { tag=$1; shift; $G "$@" --json "runs/sign/$tag.json" > "runs/sign/$tag.log" 2>&1; }

if [ "${1:-}" = "--picks" ]; then  # the 200-step runs that chose the learning rates
    P="--steps 200"
    for lr in 0.0003 0.001 0.003; do
        run "pick_signsgd_$lr" --compressor signsgd --lr $lr --momentum 0 $P
        run "pick_signum_$lr" --compressor signum --lr $lr --momentum 0 $P
    done
    for m in efsignsgd onebit; do
        run "pick_${m}_0.05_m0.9" --compressor $m --lr 0.05 --momentum 0.9 $P
        run "pick_${m}_0.01_m0.9" --compressor $m --lr 0.01 --momentum 0.9 $P
        for lr in 0.05 0.1 0.2 0.4 0.8; do
            run "pick_${m}_${lr}_m0" --compressor $m --lr $lr --momentum 0 $P
        done
    done
    run pick_none_0.05_m0.9 --compressor none --lr 0.05 --momentum 0.9 $P
    run pick_none_0.4_m0 --compressor none --lr 0.4 --momentum 0 $P
fi

if [ "${1:-}" != "--speed" ]; then
run none --compressor none --lr 0.05 --momentum 0.9                     # fp32 reference (the CLI defaults)
run signsgd_1e-3 --compressor signsgd --lr 0.001 --momentum 0
run signsgd_3e-3 --compressor signsgd --lr 0.003 --momentum 0
run signum_1e-3 --compressor signum --lr 0.001 --momentum 0              # signum's own momentum=0.9
run efsignsgd_0.4 --compressor efsignsgd --lr 0.4 --momentum 0          # error feedback on by default
run onebit_0.4 --compressor onebit --lr 0.4 --momentum 0                # error feedback on by default
# the vote sent down in one bit too (parameter server; a tie travels as +1)
run signsgd_1e-3_ps --compressor signsgd --lr 0.001 --momentum 0 --topology ps --server-compressor signsgd

.venv/bin/python - <<'EOF' | tee runs/sign/table.md
import json
rows = ["none", "signsgd_1e-3", "signsgd_3e-3", "signum_1e-3", "efsignsgd_0.4", "onebit_0.4", "signsgd_1e-3_ps"]
print("| run | test acc. | bits / coord. / step (up) | × fewer up | × fewer down | wall s | lr, momentum |")
print("|---|---|---|---|---|---|---|")
for tag in rows:
    r = json.load(open(f"runs/sign/{tag}.json"))
    bits = r["bits_up_per_worker"] / (r["num_parameters"] * r["steps"])
    print(f"| {tag} | {100 * r['test_accuracy']:.2f} % | {bits:.4f} | {r['compression_ratio_up']:.1f} "
          f"| {r['compression_ratio_down']:.1f} "
          f"| {r['wall_time_s']:.0f} | {r['lr']:g}, {r['momentum']:g} |")
EOF
fi

# packing speed: compress + encode of 10^7 floats, as a fraction of a memory copy (best of 15, one thread)
.venv/bin/python - <<'EOF' | tee runs/sign/speed.txt
import time
import torch
import gradcomp
from gradcomp import Slot
from gradcomp.compressors.sign import pack_signs
from gradcomp.wire import decode, encode

torch.set_num_threads(1)
d = 10_000_000
x = torch.randn(d, generator=torch.Generator().manual_seed(0))
slot = Slot("w", 0, d)


def best(f, n=15):
    f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


y = torch.empty_like(x)
copy = best(lambda: y.copy_(x))
clone = best(lambda: x.clone())
print(f"d = {d:,}: memcpy y.copy_(x) {1e3 * copy:.2f} ms, x.clone() {1e3 * clone:.2f} ms")
for name in ("signsgd", "signum", "efsignsgd", "onebit"):
    for ef in (False, True) if name in ("efsignsgd", "onebit") else (False,):
        c = gradcomp.make(name, error_feedback=ef)
        specs = c.specs(slot)
        compress = best(lambda: c.compress(x, slot, 0))
        fields = c.compress(x, slot, 0)
        enc = best(lambda: encode(fields, specs))
        ce = best(lambda: encode(c.compress(x, slot, 0), specs))
        buf = encode(fields, specs)
        dd = best(lambda: c.decompress(decode(buf, specs), slot, 0))
        da = best(lambda: c.accumulate(decode(buf, specs), slot, 0, y))
        print(f"{name:9s} EF={str(ef):5s} compress {1e3 * compress:6.2f} ms + encode {1e3 * enc:5.2f} ms; "
              f"compress+encode {1e3 * ce:6.2f} ms = {copy / ce:.2f} of copy_, {clone / ce:.2f} of clone; "
              f"decode+decompress {1e3 * dd:6.2f} ms = {copy / dd:.2f} of copy_; "
              f"decode+accumulate {1e3 * da:6.2f} ms = {copy / da:.2f} of copy_")
print(f"pack_signs alone {1e3 * best(lambda: pack_signs(x)):.2f} ms")
EOF
