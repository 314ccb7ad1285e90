"""What each rank does at a bad step: a NaN on one rank only, an fp16-style overflow under GradScaler, and a
message corrupted on its way to one rank.

    PYTHONPATH=src python scripts/fault_demo.py [--workers 3] [--method topk|signum] [--bad-step 2] [--bad-rank 1]

Spawns real gloo workers on 127.0.0.1 (a 10 s process-group time-out, so a rank that waited for one would show
it) and runs four short trainings per rank, each 4 steps of a small MLP with the chosen method:

- ``aggregator / NaN``: GradientAggregator, no scaler; rank ``--bad-rank`` gets a NaN input at ``--bad-step``.
- ``hook / NaN``: the same through DistributedDataParallel and gradcomp's hook (several buckets).
- ``aggregator / overflow`` and ``hook / overflow``: a GradScaler("cpu", init_scale=4096), the bad rank's loss
  multiplied by Inf at the bad step.
- ``aggregator / corrupt`` and ``hook / corrupt``: at the bad step, rank ``--bad-rank`` receives another rank's
  gathered message with one bit of its body flipped (the sender's copy is sound); the aggregator's caller catches
  the WireError and goes on with the next step.

Per rank and step it prints what happened (applied, skipped, or the error raised and how long backward or the
step took), whether the method's state (residuals, momentum) changed, the loss scale, and at the end whether
every rank's parameters are bit-identical.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.experiments.run.launch import join_group, rendezvous_store

STEPS = 4


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _method(name: str):
    return gradcomp.make("topk", density=0.25, error_feedback=True) if name == "topk" else gradcomp.make(name)


def _corrupt(transport, armed: list) -> None:
    """While ``armed[0]``, the next container message this rank gathers from another rank arrives with one bit of its
    body flipped (then ``armed[0]`` is cleared)."""
    gather, rank = transport._all_gather, transport.rank

    def gathered(t: torch.Tensor) -> list[torch.Tensor]:
        out = gather(t)
        for i, x in enumerate(out):
            if armed[0] and i != rank and x.dtype == torch.uint8 and bytes(x[:2].tolist()) == b"GC":
                armed[0], out[i] = False, x.clone()
                out[i][-1] ^= 4
        return out

    transport._all_gather = gathered


def _scenario(rank: int, args, driver: str, fault: str, group) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0, growth_interval=1000) if fault == "overflow" else None
    if driver == "hook":
        ddp = DDP(model, bucket_cap_mb=0.001, process_group=group)
        # without a scaler: nonfinite="raise", the typed error from backward (the default hands the NaN on instead)
        state = gradcomp.register_ddp_hook(ddp, _method(args.method), scaler=scaler,
                                           nonfinite="propagate" if scaler else "raise")
        forward = ddp
    else:
        state = gradcomp.GradientAggregator(model, _method(args.method), scaler=scaler)
        forward = model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    armed = [False]
    if fault == "corrupt" and rank == args.bad_rank:
        _corrupt(state.transport, armed)
    lines = []
    for step in range(STEPS):
        opt.zero_grad()
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)
        bad = step == args.bad_step and rank == args.bad_rank
        armed[0] = armed[0] or (bad and fault == "corrupt")
        if bad and fault == "nan":
            x[0, 0] = float("nan")
        loss = F.cross_entropy(forward(x), y)
        if bad and fault == "overflow":
            loss = loss * float("inf")
        before = state.state_dict()["exchange"]
        params = [p.detach().clone() for p in model.parameters()]
        started = time.monotonic()
        try:
            (scaler.scale(loss) if scaler else loss).backward()
            if driver == "aggregator":
                state.step()
        except Exception as exc:  # noqa: BLE001 - reported, the demo ends this run here
            seconds = time.monotonic() - started
            error = exc if isinstance(exc, gradcomp.NonFiniteGradientError) or driver != "hook" else state.failure
            unchanged = _same(before, state.state_dict()["exchange"])
            here = {"nan": "  <- NaN here", "corrupt": "  <- received the corrupted message"}.get(fault, "")
            lines.append(
                f"step {step}: raised {type(error).__name__} (step={getattr(error, 'step', None)}) after "
                f"{seconds:.2f} s{' from backward' if driver == 'hook' else ''}; method state unchanged: "
                f"{'yes' if unchanged else 'NO'}{here if bad else ''}"
            )
            if fault == "corrupt":
                lines.append(f"         {str(error).splitlines()[0][:100]}")
            if driver == "hook" or fault != "corrupt":
                break
            continue  # the aggregator: the caller catches the error and goes on
        scale = scaler.get_scale() if scaler else None
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        moved = any(not torch.equal(a, b) for a, b in zip(params, model.parameters()))
        unchanged = _same(before, state.state_dict()["exchange"])
        scale_text = f"; scale {scale:g} -> {scaler.get_scale():g}" if scaler else ""
        what = "applied" if moved else "SKIPPED (parameters not moved)"
        lines.append(
            f"step {step}: {what}; method state {'unchanged' if unchanged else 'updated'}{scale_text}"
            f"{'  <- overflow here' if bad and fault == 'overflow' else ''}"
        )
    if driver == "hook":
        state.close(timeout=20)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"lines": lines, "params": flat}


def _worker(rank: int, args, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    join_group("gloo", port, rank, args.workers, timeout_s=60)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=10))
    results = {}
    for fault in ("nan", "overflow", "corrupt"):
        for driver in ("aggregator", "hook"):
            results[driver, fault] = _scenario(rank, args, driver, fault, group)
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--method", default="topk", choices=["topk", "signum", "none"])
    parser.add_argument("--bad-step", type=int, default=2)
    parser.add_argument("--bad-rank", type=int, default=1)
    args = parser.parse_args()
    if not 0 <= args.bad_rank < args.workers or not 0 <= args.bad_step < STEPS:
        parser.error(f"--bad-rank must be in [0, {args.workers}), --bad-step in [0, {STEPS})")
    store = rendezvous_store(args.workers, timeout_s=60)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(args, store.port, out_dir), nprocs=args.workers, start_method="spawn")
        per_rank = []
        for rank in range(args.workers):
            with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
                per_rank.append(pickle.load(f))
    method = "top-k 25 % + error feedback" if args.method == "topk" else args.method
    print(f"{args.workers} gloo workers, {method}, bad rank {args.bad_rank} at step {args.bad_step}, "
          f"process-group time-out 10 s, torch {torch.__version__}")
    for key in per_rank[0]:
        driver, fault = key
        title = {"nan": "a NaN on one rank, no scaler", "overflow": "an overflow on one rank, GradScaler",
                 "corrupt": "a message corrupted on its way to one rank"}[fault]
        print(f"\n== {driver}: {title}")
        for rank, results in enumerate(per_rank):
            for line in results[key]["lines"]:
                print(f"  rank {rank}  {line}")
        identical = all(torch.equal(r[key]["params"], per_rank[0][key]["params"]) for r in per_rank)
        print(f"  parameters bit-identical on every rank: {'yes' if identical else 'NO'}")


if __name__ == "__main__":
    main()
