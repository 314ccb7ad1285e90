"""What ``gradcomp bench`` times: the inputs (a seeded heavy-tailed synthetic gradient, a real model's gradient),
the compressors and their representative settings, checked before anything is timed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradcomp.errors import ConfigError
from gradcomp.registry import available, compressor_class
from gradcomp.schemes.base import Scheme

DEFAULT_SIZE = 10_000_000
INPUT_NAMES: tuple[str, ...] = ("synthetic", "model")
SYNTHETIC_SEED = 0
SYNTHETIC_BLOCK = 4096  # elements sharing one log-normal scale (a "layer" or "channel")
SYNTHETIC_BASE_SCALE = 1e-3
SYNTHETIC_LOG_SIGMA = 1.5  # sigma of log(scale): scales span about three orders of magnitude
MODEL_NAME = "cnn"
MODEL_SEED = 0
MODEL_BATCH = 64


@dataclass(frozen=True)
class AbsQuantile:
    """A parameter value chosen at bench time: the ``q``-quantile of ``|x|`` of the input being benchmarked.

    Used for ``threshold``: a fixed tau would keep wildly different fractions of different tensors, so tau is
    taken from the tensor's own magnitudes to keep about ``1 - q`` of its entries (ties aside).
    """

    q: float

    def resolve(self, x: Tensor) -> float:
        a = x.detach().reshape(-1).abs()
        k = min(a.numel(), max(1, math.ceil(self.q * a.numel())))  # k-th smallest: exactly n - k entries exceed it
        return float(torch.kthvalue(a.float(), k).values)

    def label(self) -> str:
        return f"q{self.q:g}(|x|)"


# Representative settings per registered name. Each dict is passed to registry.make(name, **params) after
# resolving AbsQuantile values against the input tensor. Names not listed run once with their defaults.
SETTINGS: dict[str, list[dict[str, Any]]] = {
    "none": [{}],
    "fp16": [{}],
    "bf16": [{}],
    "topk": [
        {"density": 0.01},
        {"density": 0.001},
        {"density": 0.01, "positions": "golomb"},
        {"density": 0.001, "positions": "golomb"},
    ],
    "randomk": [{"density": 0.01}, {"density": 0.001}],
    "randomblock": [{"density": 0.01}, {"density": 0.001}],
    "threshold": [{"threshold": AbsQuantile(0.99)}],  # keeps about 1% of the tensor
    # sbc, stc, efsignsgd and onebit turn error feedback on by default (the ErrorFeedback wrapper of
    # gradcomp.feedback); each also runs without it, to time the compressor alone
    "sbc": [
        {"density": 0.01},
        {"density": 0.001},
        {"density": 0.01, "error_feedback": False},
        {"density": 0.001, "error_feedback": False},
    ],
    "cnat": [{}],
    "topk+cnat": [{"density": 0.01}],
    "natural_dithering": [{"levels": 8}],
    "random_dithering": [{"levels": 8}, {"levels": 127}],
    "terngrad": [{}],
    "stc": [{"density": 0.01}, {"density": 0.01, "error_feedback": False}],
    "qsgd": [{"levels": 127}],
    "efsignsgd": [{}, {"error_feedback": False}],
    "onebit": [{}, {"error_feedback": False}],
}
# Schemes (methods that own their rounds) that bench times anyway, as the two local halves of their round 1.
SCHEME_HALVES: tuple[str, ...] = ("sketch",)


def synthetic_gradient(size: int, seed: int = SYNTHETIC_SEED) -> Tensor:
    """A seeded heavy-tailed float32 vector: N(0, 1) times a log-normal scale shared by blocks of 4096."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"size must be a positive integer, got {size!r}")
    g = torch.Generator().manual_seed(seed)
    blocks = -(-size // SYNTHETIC_BLOCK)
    scale = SYNTHETIC_BASE_SCALE * torch.exp(SYNTHETIC_LOG_SIGMA * torch.randn(blocks, generator=g))
    x = torch.randn(size, generator=g)
    return x.mul_(scale.repeat_interleave(SYNTHETIC_BLOCK)[:size])


def model_gradient(device: torch.device | str = "cpu") -> tuple[Tensor, str]:
    """SmallCNN's (seed 0) flattened gradient on one training batch of 64; returns (gradient, description).

    The batch is the first one a single worker sees in epoch 0 with seed 0. Uses MNIST when it is installed,
    else the "synthetic" dataset, and says which in the description.
    """
    from torch import nn

    from gradcomp.experiments.run.data import iterate_batches, load_dataset, shard_indices
    from gradcomp.experiments.run.models import build_model

    note = ""
    try:
        data = load_dataset("mnist")
    except ConfigError as exc:
        data = load_dataset("synthetic")
        note = f" [MNIST unavailable, fell back to the synthetic dataset: {exc}]"
    model = build_model(MODEL_NAME, data, MODEL_SEED).to(device)
    model.train()
    idx = shard_indices(data.num_train, 0, 1, 0, MODEL_SEED)
    xb, yb = next(iterate_batches(data.train_x, data.train_y, idx, MODEL_BATCH))
    loss = nn.functional.cross_entropy(model(xb.to(device)), yb.to(device))
    model.zero_grad(set_to_none=True)
    loss.backward()
    grad = torch.cat([p.grad.detach().reshape(-1) for p in model.parameters() if p.grad is not None])
    desc = f"SmallCNN gradient, {data.name} batch {MODEL_BATCH}, seed {MODEL_SEED}{note}"
    return grad.to(torch.float32).contiguous(), desc


def setting_label(setting: dict[str, Any], resolved: dict[str, Any]) -> str:
    if not setting:
        return "defaults"
    parts = []
    for key, value in setting.items():
        if isinstance(value, AbsQuantile):
            parts.append(f"{key}={resolved[key]:.3g} ({value.label()})")
        else:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def check_names(compressors: Sequence[str] | None) -> list[str]:
    # single-message compressors only: a method that owns its rounds (PowerSGD) has no one message to time;
    # the exception is sketch (SCHEME_HALVES), whose round 1 is timed in two halves (bench_sketch)
    every = available()
    registered = [n for n in every if not issubclass(compressor_class(n), Scheme)]
    # The SETTINGS order (dense baselines first, compositions whose parts are registered), then any other
    # registered name alphabetically, then the schemes timed in halves.
    known = set(registered)
    names = [n for n in SETTINGS if all(part in known for part in n.split("+"))]
    names += [n for n in registered if n not in SETTINGS]
    names += [n for n in SCHEME_HALVES if n in every]
    if compressors is None:
        return names
    chosen = [c.strip() for c in compressors if c.strip()]
    schemes = [c for c in chosen if c in every and c not in names]
    if schemes:
        raise ConfigError(
            f"{', '.join(map(repr, schemes))} own(s) its communication rounds: no single message to time "
            f"(of such methods, bench times only {', '.join(SCHEME_HALVES)})"
        )
    unknown = [c for c in chosen if c not in names]
    if unknown:
        benched = sorted(registered + [n for n in SCHEME_HALVES if n in every])
        raise ConfigError(f"unknown compressor(s) {', '.join(map(repr, unknown))}; available: {', '.join(benched)}")
    if not chosen:
        raise ConfigError("no compressor selected")
    return list(dict.fromkeys(chosen))


def check_inputs(inputs: Sequence[str]) -> list[str]:
    chosen = list(dict.fromkeys(i.strip() for i in inputs if i.strip()))
    bad = [i for i in chosen if i not in INPUT_NAMES]
    if bad:
        raise ConfigError(f"unknown input(s) {', '.join(map(repr, bad))}; valid: {', '.join(INPUT_NAMES)}")
    if not chosen:
        raise ConfigError("no input selected")
    return chosen
