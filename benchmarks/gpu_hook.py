"""On one CUDA GPU: gradcomp's DDP hook against torch DDP's step, the simulated cluster's compression cost, and the
synchronisations a step makes (docs/gpu.md; run by scripts/gpu_check.sh).

    python benchmarks/gpu_hook.py step   [--rounds 10] [--batch 256 4096]   # world size 1 over NCCL: DDP step times
    python benchmarks/gpu_hook.py sim    [--workers 8]   # SimulatedCluster on one GPU: aggregator step per method
    python benchmarks/gpu_hook.py sync   [--only M ...]  # sync-debug warnings in one step (default: fixed-size methods)
    python benchmarks/gpu_hook.py topologies [--workers 3]  # the same per topology, on a simulated cluster

``step``: one MLP of 12.6M parameters (three 2048x2048 layers and a 2048x10 one, 50 MB of fp32 gradients, DDP's
default 25 MB buckets), batch 256 (``--batch``: others too; at 256 the step is bound by the host's kernel launches,
at 4096 by the GPU's work); variants torch DDP (no hook), torch DDP with torch's fp16_compress_hook, and gradcomp's
hook with none, fp16, top-k 1 % with error feedback, PowerSGD and Signum; then torch DDP, torch's fp16 hook,
gradcomp's none, fp16 and PowerSGD under a GradScaler (``+scaler``), and the same three with
``nonfinite="propagate"`` and no scaler (``+propagate``: no read of the verdict). Every round times 5 consecutive
steps of each variant in a new random order (median per step over the rounds); reported with its ratio to torch
DDP's step, and fp16's to torch's fp16 hook (targets: <= 1.05 for both). ``sim``: ``--workers`` simulated workers on
the GPU, each a GradientAggregator over the same MLP; the median step of rank 0 per method and its ratio to
``none``'s, which is the compression's cost (a simulated exchange moves tensors in device memory). ``sync``: the
number of "called a synchronizing CUDA operation" warnings under ``torch.cuda.set_sync_debug_mode("warn")`` during
one steady-state step of the aggregator and of the DDP hook (both threads), per fixed-size method (target: 0);
``sync --scaler --only none fp16 bf16 randomk randomblock powersgd sketch true_topk``: the hook under a GradScaler,
where these read nothing;
``sync --nonfinite propagate --only ...``: the same without a scaler. ``topologies``: the warnings of one steady-state
step of GradientAggregator over allgather, sharded and ps (C_nat, top-k, none) on a simulated cluster on the GPU,
against the reads ``tests/sync_budget.py.TOPOLOGIES`` counts on the CPU (a world of 1 cannot show them).
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import random
import statistics
import sys
from pathlib import Path
import tempfile
import threading
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the budgets the test suite enforces
from sync_budget import FIXED_SIZE, READS_NOTHING_HANDED_ON  # noqa: E402

METHODS = {
    "none": {},
    "fp16": {},
    "topk": {"density": 0.01, "error_feedback": True},
    "powersgd": {},
    "signum": {},
    "topk/bucket": {"density": 0.01, "error_feedback": True, "granularity": "bucket"},
    "signum/bucket": {"granularity": "bucket"},
}  # "/bucket": the hook compresses each DDP bucket as one slot instead of one slot per parameter (the default)
# "+scaler": the step under a torch.amp.GradScaler (scaled loss, scaler.step / update), beside torch's own under one;
# there none, fp16 and PowerSGD read no finiteness verdict of their own (docs/gpu.md)
SCALED = ["torch+scaler", "torch-fp16+scaler", "none+scaler", "fp16+scaler", "powersgd+scaler"]
# "+propagate": gradcomp's hook with nonfinite="propagate" and no scaler: a bad step's NaN goes to the user's own
# check, and none / fp16 / PowerSGD read nothing from the GPU (torch DDP's own semantics); timed against torch DDP / its
# fp16 hook
PROPAGATED = ["none+propagate", "fp16+propagate", "powersgd+propagate"]
STEP_TARGET = 1.05  # the hook with none (fp16) at most this many times torch DDP's step (torch's fp16 hook's)


# GRADCOMP_BENCH_CPU=1: the same code on the CPU over gloo, tiny and untimed in meaning (a check that the script
# runs where no GPU is; scripts/gpu_check.sh does not use it)
CPU = os.environ.get("GRADCOMP_BENCH_CPU") == "1"
DEVICE = torch.device("cpu") if CPU else torch.device("cuda", 0)


def _sync() -> None:
    if not CPU:
        torch.cuda.synchronize()


def _name() -> str:
    return "CPU (smoke run)" if CPU else torch.cuda.get_device_name()


def mlp(width: int = 2048, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)) if depth else nn.Sequential()


def _group() -> None:
    store = os.path.join(tempfile.mkdtemp(), "store")
    kwargs = {} if CPU else {"device_id": DEVICE}
    dist.init_process_group("gloo" if CPU else "nccl", init_method=f"file://{store}", rank=0, world_size=1, **kwargs)


def _variant(name: str, base: nn.Module):
    model = copy.deepcopy(base).to(DEVICE)
    ddp = DDP(model, device_ids=None if CPU else [0])
    state = None
    name, scaled = name.removesuffix("+scaler"), name.endswith("+scaler")
    name, propagate = name.removesuffix("+propagate"), name.endswith("+propagate")
    scaler = torch.amp.GradScaler(DEVICE.type) if scaled else None
    if name == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        ddp.register_comm_hook(None, fp16_compress_hook)
    elif name != "torch":
        params = dict(METHODS[name])
        granularity = params.pop("granularity", "layer")
        method = gradcomp.make(name.split("/")[0], **params)
        state = gradcomp.register_ddp_hook(ddp, method, granularity=granularity, scaler=scaler,
                                           nonfinite="propagate" if propagate else "raise")
    return ddp, state, torch.optim.SGD(ddp.parameters(), lr=1e-3), scaler


def _step(ddp, opt, x, y, scaler=None) -> None:
    opt.zero_grad(set_to_none=False)
    loss = F.cross_entropy(ddp(x), y)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def part_step(args) -> None:
    _group()
    base = mlp(width=64) if CPU else mlp()
    names = ["torch", "torch-fp16", *METHODS, *SCALED, *PROPAGATED]
    variants = {n: _variant(n, base) for n in names}
    for batch in args.batch:
        _time_steps(args, base, variants, batch)
    for _, state, _, _ in variants.values():
        if state is not None:
            state.close()
    dist.destroy_process_group()


def _time_steps(args, base: nn.Module, variants: dict, batch: int) -> None:
    """The step times of every variant at this batch size, and the profiles asked for."""
    names = list(variants)
    x, y = torch.randn(batch, base[0].in_features, device=DEVICE), torch.randint(0, 10, (batch,), device=DEVICE)
    for ddp, _, opt, scaler in variants.values():
        for _ in range(3):
            _step(ddp, opt, x, y, scaler)
    times = {n: [] for n in names}
    for _ in range(args.rounds):
        random.shuffle(names)
        for n in names:
            ddp, _, opt, scaler = variants[n]
            _sync()
            began = time.perf_counter()
            for _ in range(5):
                _step(ddp, opt, x, y, scaler)
            _sync()
            times[n].append((time.perf_counter() - began) / 5)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    size = sum(p.numel() for p in base.parameters()) / 1e6
    print(f"{_name()}: DDP step, world size 1 ({dist.get_backend()}), {size:.1f}M-parameter MLP, batch {batch}, "
          f"median of {args.rounds}")
    for n in variants:
        ref = "torch-fp16" if n.startswith("fp16") else "torch"
        ref += "+scaler" if n.endswith("+scaler") else ""
        print(f"  {n:18s} {med[n]:7.2f} ms  x{med[n] / med[ref]:.3f} of {ref}")
    judged = [  # (what, the variant, its reference): each at most STEP_TARGET x its reference, timed in this run
        ('none (nonfinite="raise")', "none", "torch"),
        ('none+propagate (nonfinite="propagate", the hook\'s default)', "none+propagate", "torch"),
        ('fp16 (nonfinite="raise")', "fp16", "torch-fp16"),
        ('fp16+propagate (the default)', "fp16+propagate", "torch-fp16"),
    ]
    print(f"  targets (<= {STEP_TARGET:g} x the reference's step, this run): " + "; ".join(
        f"{what} {med[n] / med[ref]:.3f} x {ref} {'met' if med[n] / med[ref] <= STEP_TARGET else 'MISSED'}"
        for what, n, ref in judged))
    print(f"  under a GradScaler (reported): {med['none+scaler'] / med['torch+scaler']:.3f} and "
          f"{med['fp16+scaler'] / med['torch-fp16+scaler']:.3f}")
    for n in (args.profile or ()) if batch == args.batch[0] else ():
        ddp, _, opt, scaler = variants[n]
        with torch.profiler.profile() as prof:
            for _ in range(5):
                _step(ddp, opt, x, y, scaler)
            _sync()
        print(f"profile of 5 steps of {n} (self CPU time, top 15):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=48))


def part_sim(args) -> None:
    from gradcomp.transport.sim import SimulatedCluster

    print(f"SimulatedCluster of {args.workers} on one {_name()}: aggregator step (rank 0, median)")
    base = mlp(width=64 if CPU else 1024)
    results = {}
    for name, params in METHODS.items():
        if "/" in name:  # the hook's granularity: not an aggregator setting
            continue

        def work(transport, name=name, params=params):
            model = copy.deepcopy(base).to(DEVICE)
            agg = gradcomp.GradientAggregator(model, gradcomp.make(name, **params), transport)
            x = torch.randn(64, base[0].in_features, device=DEVICE)
            y = torch.randint(0, 10, (64,), device=DEVICE)
            times = []
            for i in range(8):
                model.zero_grad()
                F.cross_entropy(model(x), y).backward()
                _sync()
                began = time.perf_counter()
                agg.step()
                _sync()
                if i >= 2:
                    times.append(time.perf_counter() - began)
            return statistics.median(times) * 1e3

        results[name] = SimulatedCluster(args.workers).run(work)[0]
        print(f"  {name:9s} {results[name]:8.2f} ms  x{results[name] / results['none']:.2f} of none", flush=True)


def _count_warnings(fn, where: collections.Counter) -> int:
    """The sync-debug warnings while ``fn`` runs (on any thread); ``where`` counts the innermost gradcomp frame of
    each (file:line function), which the warning's own location (inside torch) does not give."""
    count = 0
    lock = threading.Lock()

    def show(message, *_args, **_kwargs):
        nonlocal count
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack() if "gradcomp" in f.filename and "benchmarks" not in f.filename]
        if not frames:  # none of gradcomp's frames: the innermost three, whatever they are
            frames = traceback.extract_stack()[-4:-1] or [None]
            spot = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[::-1] if f)
            spot = f"(not gradcomp: {threading.current_thread().name}) {spot}"
        else:
            spot = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].name}"
        with lock:
            count += 1
            where[spot] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        if not CPU:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if not CPU:
                torch.cuda.set_sync_debug_mode("default")
    return count


def part_sync(args) -> None:
    _group()
    print("synchronisation warnings (torch.cuda.set_sync_debug_mode('warn')) in one steady-state step; "
          "budget = tests/sync_budget.py, counted on the CPU")
    from sync_budget import BUDGETS

    base = mlp(width=256, depth=3)
    x, y = torch.randn(32, 256, device=DEVICE), torch.randint(0, 10, (32,), device=DEVICE)
    total = 0
    for name in args.only or FIXED_SIZE:
        try:
            model = copy.deepcopy(base).to(DEVICE)
            agg = gradcomp.GradientAggregator(model, gradcomp.make(name))
            for _ in range(2):
                model.zero_grad()
                F.cross_entropy(model(x), y).backward()
                agg.step()
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            _sync()
            where: collections.Counter = collections.Counter()
            n_agg = _count_warnings(agg.step, where)
            # several buckets (about 0.8 MB of gradients): the hook's count is per backward pass, not per bucket
            ddp = DDP(copy.deepcopy(base).to(DEVICE), device_ids=None if CPU else [0], bucket_cap_mb=0.25)
            scaler = torch.amp.GradScaler(DEVICE.type) if args.scaler else None
            state = gradcomp.register_ddp_hook(ddp, gradcomp.make(name), scaler=scaler, nonfinite=args.nonfinite)

            def backward():
                loss = F.cross_entropy(ddp(x), y)
                (loss if scaler is None else scaler.scale(loss)).backward()

            for _ in range(2):
                backward()
            _sync()
            n_ddp = _count_warnings(lambda: (backward(), state.wait()), where)
            buckets = len(state.bucket_sizes)
            state.close()
            total += n_agg + n_ddp
            b = BUDGETS[name]
            # under a scaler or propagated: 0 for the methods tests/test_sync_count.py counts so
            handed_on = args.scaler or args.nonfinite == "propagate"
            ddp_budget = 0 if handed_on and name in READS_NOTHING_HANDED_ON else b["ddp"]
            label = "+scaler" if args.scaler else "+propagate" if args.nonfinite == "propagate" else ""
            # fixed sizes: one read per backward pass whatever the buckets; variable: the CPU count is for one bucket
            per = "" if name in FIXED_SIZE else " with one bucket"
            print(f"  {name:18s} aggregator {n_agg:3d} (CPU count {b['aggregator']})  "
                  f"ddp{label} {n_ddp:3d} over {buckets} buckets (CPU count {ddp_budget}{per})", flush=True)
            for spot, k in where.most_common():
                print(f"      {k:3d} at {spot}")
        except Exception as exc:  # noqa: BLE001 - report and go on to the next method
            print(f"  {name:18s} error {type(exc).__name__}: {exc}", flush=True)
    print(f"  total {total} (target 0)")
    dist.destroy_process_group()


def part_topologies(args) -> None:
    """The sync-debug warnings of a steady-state step (those of 3 steps less those of 2, as tests/test_sync_count.py
    counts reads on the CPU) of GradientAggregator over each topology, on a simulated cluster of ``--workers`` on the
    GPU, against ``sync_budget.TOPOLOGIES``: the root's (or an owner's) reads plus W - 1 times another worker's."""
    from sync_budget import TOPOLOGIES
    from gradcomp.transport.sim import SimulatedCluster

    world = args.workers
    print(f"synchronisation warnings of one steady-state step per topology, SimulatedCluster of {world} on one "
          f"{_name()}; budget = tests/sync_budget.py.TOPOLOGIES, counted on the CPU")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 10))
    x, y = torch.randn(32, 40, device=DEVICE), torch.randint(0, 10, (32,), device=DEVICE)

    def warnings_of(name: str, topology: str, steps: int, where: collections.Counter) -> int:
        def work(transport):
            model = copy.deepcopy(base).to(DEVICE)
            aggregator = gradcomp.GradientAggregator(model, gradcomp.make(name), transport, topology=topology)
            for _ in range(steps):
                model.zero_grad()
                F.cross_entropy(model(x), y).backward()
                aggregator.step()

        with SimulatedCluster(world) as cluster:
            return _count_warnings(lambda: cluster.run(work), where)

    total = over = 0
    for topology, ((root, other), _, _) in TOPOLOGIES.items():
        budget = root + (world - 1) * other
        for name in ("cnat", "topk", "none"):
            try:
                where: collections.Counter = collections.Counter()
                three = warnings_of(name, topology, 3, where)
                n = three - warnings_of(name, topology, 2, collections.Counter())
                total, over = total + n, over + max(0, n - budget)
                print(f"  {topology:9s} {name:5s} {n:3d} (budget {budget}: {root} + {world - 1} x {other})", flush=True)
                for spot, k in where.most_common(6):
                    print(f"      {k:3d} at {spot} (3 steps)")
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"  {topology:9s} {name:5s} error {type(exc).__name__}: {exc}", flush=True)
    print(f"  total {total}, above the budgets {over} (target 0)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["step", "sim", "sync", "topologies"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--profile", nargs="*", help="step: print a torch.profiler table of these variants")
    parser.add_argument("--only", nargs="*", help="sync: these methods only (default: every fixed-size one)")
    parser.add_argument("--scaler", action="store_true", help="sync: the DDP hook under a GradScaler")
    parser.add_argument("--nonfinite", choices=["raise", "propagate"], default="raise",
                        help="sync: the DDP hook's nonfinite policy")
    parser.add_argument("--batch", type=int, nargs="+", default=[256],
                        help="step: batch sizes (256: a step bound by the host's launches; 4096: by the GPU's work)")
    args = parser.parse_args(argv)
    if not CPU and not torch.cuda.is_available():
        print(f"benchmarks/gpu_hook.py {args.part}: skipped, no CUDA device")
        return 0
    {"step": part_step, "sim": part_sim, "sync": part_sync, "topologies": part_topologies}[args.part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
