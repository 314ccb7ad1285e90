"""Reference models for experiments, built with seed-determined initialization.

:func:`build_model` gives bit-identical replicas on every worker for the same seed, without touching the
caller's global RNG state.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from gradcomp.errors import ConfigError
from gradcomp.experiments.data import Dataset

__all__ = ["MLP", "MODEL_NAMES", "MnistConvNet", "SmallCNN", "build_model"]

MODEL_NAMES: tuple[str, ...] = ("cnn", "mlp", "convnet")


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


class SmallCNN(nn.Module):
    """Two conv(5x5) + ReLU + maxpool(2) stages (16 and 32 channels), then Linear(128) + ReLU + Linear.

    Takes square inputs of side ``input_size`` (at least 4), e.g. 28 for MNIST or 8 for digits/synthetic.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, input_size: int = 28) -> None:
        super().__init__()
        _check_positive("in_channels", in_channels)
        _check_positive("num_classes", num_classes)
        _check_positive("input_size", input_size)
        if input_size < 4:
            raise ConfigError(f"SmallCNN needs input_size >= 4 (two 2x2 poolings), got {input_size}")
        side = input_size // 2 // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * side * side, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class MnistConvNet(nn.Module):
    """PyTorch's classic MNIST example network (``pytorch/examples``, ``mnist/main.py``), without dropout.

    conv(in_channels → 32, 3x3) + ReLU, conv(32 → 64, 3x3) + ReLU, maxpool(2), flatten,
    Linear(64·m² → 128) + ReLU, Linear(128 → num_classes), where m = (input_size − 4) // 2 (two unpadded 3x3
    convolutions, then a 2x2 pooling). On MNIST (1x28x28, 10 classes) m = 12, the flatten size is 9216 and the
    model has 1,199,882 parameters — large enough that a 1e-3 top-k of its gradient is ~1200 values.

    The example's two dropout layers (0.25 after the pooling, 0.5 after the first Linear) are left out on
    purpose, so the parameter count is unchanged: ``nn.Dropout`` draws its masks from the global RNG, which
    is neither seeded per worker (each spawned gloo worker starts from the same default state, so its masks
    would repeat the other workers') nor private to a worker in the simulated cluster (its threads share one
    generator, so masks would depend on the threads' interleaving and differ from the gloo run). Without
    dropout the forward pass draws no random numbers and every run is reproducible bit for bit.

    Takes square inputs of side ``input_size`` (at least 6), e.g. 28 for MNIST or 8 for digits/synthetic.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, input_size: int = 28) -> None:
        super().__init__()
        _check_positive("in_channels", in_channels)
        _check_positive("num_classes", num_classes)
        _check_positive("input_size", input_size)
        if input_size < 6:
            raise ConfigError(
                f"MnistConvNet needs input_size >= 6 (two unpadded 3x3 convolutions, then a 2x2 pooling), "
                f"got {input_size}"
            )
        side = (input_size - 4) // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, kernel_size=3),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * side * side, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """Flatten, Linear(input_dim → hidden) + ReLU, Linear(hidden → num_classes)."""

    def __init__(self, input_dim: int, hidden: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        _check_positive("input_dim", input_dim)
        _check_positive("hidden", hidden)
        _check_positive("num_classes", num_classes)
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(input_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def build_model(name: str, dataset: Dataset, seed: int) -> nn.Module:
    """Build model ``name`` ("cnn", "mlp" or "convnet") sized for ``dataset``, initialized from ``seed`` alone.

    The model is created on the CPU inside ``torch.random.fork_rng`` with the CPU generator seeded by
    ``seed``, so the same seed gives bit-identical parameters on every worker and the caller's global RNG
    state (CPU and accelerator) is left as it was. Move the model to a device afterwards.
    """
    if not isinstance(name, str):
        raise ConfigError(f"model name must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    if key not in MODEL_NAMES:
        raise ConfigError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ConfigError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    channels, height, width = dataset.input_shape
    # Only the CPU generator is seeded (torch.manual_seed would also reseed accelerators outside the fork).
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.default_generator.manual_seed(seed)
        if key in ("cnn", "convnet"):
            if height != width:
                raise ConfigError(
                    f"model {key!r} needs square inputs, dataset {dataset.name!r} has {height}x{width}"
                )
            cls = SmallCNN if key == "cnn" else MnistConvNet
            return cls(channels, dataset.num_classes, height)
        return MLP(math.prod(dataset.input_shape), num_classes=dataset.num_classes)
