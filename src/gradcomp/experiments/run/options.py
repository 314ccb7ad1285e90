"""The model, data and optimizer options that ``train``, ``sweep`` and ``race`` share on the command line, and
the model's defaults filled in from them (``resolve_training_defaults``): TrainConfig keyword arguments."""

from __future__ import annotations

import argparse

from gradcomp.errors import ConfigError
from gradcomp.experiments.run.config import ADAM_FAMILY, DEFAULT_FREEZE_FRACTION, OPTIMIZERS
from gradcomp.experiments.run.models import TEXT_MODELS

# what `--model transformer` (and transformer_tiny) runs with unless told otherwise: sized so that one 4-worker
# run takes about 10 minutes on a 2-core machine (docs/workloads.md)
TRANSFORMER_DEFAULTS = {"steps": 300, "batch_size": 16, "optimizer": "adamw", "lr": 2e-3, "lr_schedule": "cosine",
                        "warmup_steps": 30, "context": 128}


def add_training_options(p: argparse.ArgumentParser, *, epochs: float | None = 1.0) -> None:
    """The model, data and optimizer options shared by ``train``, ``sweep`` and ``race``.

    Defaults that depend on the model are None here and filled in by :func:`resolve_training_defaults`.
    """
    if epochs is not None:
        p.add_argument("--epochs", type=float, default=epochs, help="passes over the training set")
        p.add_argument("--steps", type=int, default=None,
                       help="stop after this many steps (overrides --epochs; default for the transformer: "
                            f"{TRANSFORMER_DEFAULTS['steps']})")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"per worker (default: 32) for images; {TRANSFORMER_DEFAULTS['batch_size']} windows for the "
                        "transformer")
    p.add_argument("--optimizer", default=None, choices=list(OPTIMIZERS),
                   help="default: sgd, adamw for the transformer; onebit_adam (1-bit Adam) and zero_one_adam "
                        "(0/1 Adam) exchange their compressed momentum themselves (docs/adam.md)")
    p.add_argument("--freeze-step", type=int, default=None, metavar="N",
                   help="onebit_adam / zero_one_adam: steps of dense AdamW (0/1 Adam: of variance updates) before "
                        f"the variance freezes (default {round(100 * DEFAULT_FREEZE_FRACTION)} %% of --steps)")
    p.add_argument("--warmup-compressor", default="none", metavar="NAME",
                   help="onebit_adam / zero_one_adam: what the dense warm-up steps' gradients go through: none (fp32, "
                        "the papers'), fp16, bf16, cnat or natural_dithering")
    p.add_argument("--var-update-scaler", type=int, default=16, metavar="K",
                   help="zero_one_adam: variance updates per doubling of their interval (the paper's kappa)")
    p.add_argument("--local-step-scaler", type=int, default=50, metavar="N",
                   help="zero_one_adam: its local steps between syncs double every N steps after the freeze")
    p.add_argument("--local-step-clipper", type=int, default=16, metavar="H",
                   help="zero_one_adam: at most H local steps between syncs")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default: 0.05) with sgd; {TRANSFORMER_DEFAULTS['lr']:g} with adamw")
    p.add_argument("--momentum", type=float, default=None, help="SGD momentum, >= 0 (default: 0.9); SGD only")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="SGD: L2 added to the gradient; AdamW: decoupled weight decay; >= 0")
    p.add_argument("--beta1", type=float, default=None, help="AdamW's first-moment decay (default 0.9)")
    p.add_argument("--beta2", type=float, default=None, help="AdamW's second-moment decay (default 0.999)")
    p.add_argument("--eps", type=float, default=None, help="AdamW's epsilon (default 1e-8)")
    p.add_argument("--lr-schedule", default=None, choices=["constant", "cosine", "step"],
                   help="learning rate after the warm-up: constant, cosine (to 0 at the last step), step "
                        "(x --lr-gamma every --lr-step-size steps); default constant, cosine for the transformer")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help=f"linear warm-up steps (default 0; for the transformer 10 %% of the steps, at most "
                        f"{TRANSFORMER_DEFAULTS['warmup_steps']})")
    p.add_argument("--lr-step-size", type=int, default=None, metavar="N", help="with --lr-schedule step")
    p.add_argument("--lr-gamma", type=float, default=0.1, help="with --lr-schedule step: the factor every N steps")
    p.add_argument("--dataset", default=None,
                   help="mnist, digits (needs scikit-learn), synthetic, or pystdlib (text: the Python standard "
                        "library's source; the default for the transformer)")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="directory with MNIST-format IDX files (mnist), or of *.py files (pystdlib)")
    p.add_argument("--model", default="cnn",
                   help="cnn, mlp, convnet (1.2M parameters on MNIST), resnet (ResNet-20 with BatchNorm), "
                        "transformer (byte-level language model, 1.3M parameters) or transformer_tiny")
    p.add_argument("--context", type=int, default=None, metavar="BYTES",
                   help="the transformer's context (default 128)")



def resolve_training_defaults(args: argparse.Namespace) -> dict:
    """TrainConfig keyword arguments from the shared training options, with the model's defaults filled in."""
    text = isinstance(args.model, str) and args.model.strip().lower() in TEXT_MODELS
    d = TRANSFORMER_DEFAULTS if text else {"batch_size": 32, "optimizer": "sgd", "lr_schedule": "constant",
                                           "warmup_steps": 0, "context": 128}
    optimizer = args.optimizer or d["optimizer"]
    if optimizer in ADAM_FAMILY and args.momentum is not None:
        raise ConfigError(f"--momentum is SGD's; {optimizer}'s first-moment decay is --beta1")
    if optimizer not in ADAM_FAMILY and any(v is not None for v in (args.beta1, args.beta2, args.eps)):
        raise ConfigError("--beta1 / --beta2 / --eps are AdamW's: give --optimizer adamw")
    out = {
        "batch_size": args.batch_size if args.batch_size is not None else d["batch_size"],
        "optimizer": optimizer,
        "lr": args.lr if args.lr is not None else (0.05 if optimizer == "sgd" else TRANSFORMER_DEFAULTS["lr"]),
        "momentum": (0.9 if args.momentum is None else args.momentum) if optimizer == "sgd" else 0.0,
        "weight_decay": args.weight_decay,
        "betas": (0.9 if args.beta1 is None else args.beta1, 0.999 if args.beta2 is None else args.beta2),
        "eps": 1e-8 if args.eps is None else args.eps,
        "lr_schedule": args.lr_schedule or d["lr_schedule"],
        "warmup_steps": d["warmup_steps"] if args.warmup_steps is None else args.warmup_steps,
        "lr_step_size": args.lr_step_size,
        "lr_gamma": args.lr_gamma,
        "dataset": args.dataset or ("pystdlib" if text else "mnist"),
        "data_root": args.data,
        "model": args.model,
        "context": d["context"] if args.context is None else args.context,
        "freeze_step": getattr(args, "freeze_step", None),
        "warmup_compressor": getattr(args, "warmup_compressor", "none"),
        "var_update_scaler": getattr(args, "var_update_scaler", 16),
        "local_step_scaler": getattr(args, "local_step_scaler", 50),
        "local_step_clipper": getattr(args, "local_step_clipper", 16),
    }
    if hasattr(args, "epochs"):
        out["steps"] = args.steps if (args.steps is not None or not text) else TRANSFORMER_DEFAULTS["steps"]
        out["epochs"] = args.epochs
    steps = out.get("steps", getattr(args, "steps", None))
    if text and args.warmup_steps is None and steps is not None:  # the default warm-up: 10 % of the steps
        out["warmup_steps"] = min(d["warmup_steps"], steps // 10)
    return out
