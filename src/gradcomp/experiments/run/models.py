"""Reference models for experiments, built with seed-determined initialization.

:func:`build_model` gives bit-identical replicas on every worker for the same seed, without touching the
caller's global RNG state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradcomp.errors import ConfigError
from gradcomp.experiments.run.data import Dataset

__all__ = [
    "ALL_MODELS", "MLP", "MODEL_NAMES", "MnistConvNet", "ResNet", "SmallCNN", "TEXT_MODELS", "TransformerLM",
    "build_model",
]

# the image classifiers, and the language models that read text (dataset pystdlib)
MODEL_NAMES: tuple[str, ...] = ("cnn", "mlp", "convnet", "resnet")
TEXT_MODELS: tuple[str, ...] = ("transformer", "transformer_tiny")
ALL_MODELS: tuple[str, ...] = MODEL_NAMES + TEXT_MODELS
# (layers, width, heads) of the named transformers: "transformer" is the workload (about 1.3M parameters with a
# context of 128), "transformer_tiny" the smallest useful one, for tests and smoke runs
TRANSFORMER_SIZES: dict[str, tuple[int, int, int]] = {"transformer": (4, 160, 5), "transformer_tiny": (2, 32, 2)}


def _check_positive(**values: object) -> None:
    """Each keyword's value must be a positive integer (checked in the order given)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


class SmallCNN(nn.Module):
    """Two conv(5x5) + ReLU + maxpool(2) stages (16 and 32 channels), then Linear(128) + ReLU + Linear.

    Takes square inputs of side ``input_size`` (at least 4), e.g. 28 for MNIST or 8 for digits/synthetic.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, input_size: int = 28) -> None:
        super().__init__()
        _check_positive(in_channels=in_channels, num_classes=num_classes, input_size=input_size)
        if input_size < 4:
            raise ConfigError(f"SmallCNN needs input_size >= 4 (two 2x2 poolings), got {input_size}")
        side = input_size // 2 // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * side * side, 128), nn.ReLU(),
                                        nn.Linear(128, num_classes))

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
        _check_positive(in_channels=in_channels, num_classes=num_classes, input_size=input_size)
        if input_size < 6:
            raise ConfigError(
                f"MnistConvNet needs input_size >= 6 (two unpadded 3x3 convolutions, then a 2x2 pooling), "
                f"got {input_size}"
            )
        side = (input_size - 4) // 2
        self.features = nn.Sequential(nn.Conv2d(in_channels, 32, kernel_size=3), nn.ReLU(),
                                      nn.Conv2d(32, 64, kernel_size=3), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * side * side, 128), nn.ReLU(),
                                        nn.Linear(128, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """Flatten, Linear(input_dim → hidden) + ReLU, Linear(hidden → num_classes)."""

    def __init__(self, input_dim: int, hidden: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        _check_positive(input_dim=input_dim, hidden=hidden, num_classes=num_classes)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(input_dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class _Block(nn.Module):
    """One pre-norm Transformer block: x + attn(LN(x)), then x + MLP(LN(x)) (GELU, 4x width)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, d / heads)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TransformerLM(nn.Module):
    """A decoder-only, byte-level Transformer language model (GPT-2-like, pre-norm, no dropout).

    Token embedding (``vocab`` x ``dim``) plus a learned position embedding (``context`` x ``dim``), ``layers``
    pre-norm blocks of causal multi-head self-attention (``torch.nn.functional.scaled_dot_product_attention``
    with ``is_causal=True``: position t sees positions <= t only) and a GELU MLP of width 4·dim, a final
    LayerNorm, and an output layer that shares the token embedding's weight (tied embeddings). Input: uint8 or
    integer bytes (B, T) with T <= context; output: logits (B, T, vocab). Weights start from N(0, 0.02), the
    residual output projections from N(0, 0.02 / sqrt(2·layers)) as in GPT-2, biases from 0.

    No dropout, for the reason given for MnistConvNet: the forward pass draws no random numbers.
    """

    def __init__(self, vocab: int = 256, context: int = 128, layers: int = 4, dim: int = 160, heads: int = 5) -> None:
        super().__init__()
        _check_positive(vocab=vocab, context=context, layers=layers, dim=dim, heads=heads)
        if dim % heads:
            raise ConfigError(f"TransformerLM needs dim divisible by heads, got dim={dim}, heads={heads}")
        self.context = context
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, counted and exchanged once
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for residual in (block.proj, block.out):
                nn.init.normal_(residual.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        if t > self.context:
            raise ConfigError(f"TransformerLM got a sequence of {t} tokens, more than its context of {self.context}")
        h = self.embed(x.long()) + self.position(torch.arange(t, device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


class _BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, plus the input (a 1x1 conv + BN where the shape changes), then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet-20-style residual network with BatchNorm (He et al. 2016, the CIFAR variant), for small images.

    conv3x3(in → 16) + BN + ReLU, three stages of ``blocks`` basic blocks (16, 32, 64 channels; the second
    and third stages halve the side with a stride-2 first block and a 1x1 projection shortcut), global average
    pooling, Linear(64 → num_classes). ``blocks`` = 3 gives ResNet-20 (about 0.27M parameters). The BatchNorm
    layers carry buffers (running mean, running variance, batches seen) that the optimizer does not touch:
    training keeps them identical across replicas by broadcasting rank 0's before every step, as DDP does.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, blocks: int = 3) -> None:
        super().__init__()
        _check_positive(in_channels=in_channels, num_classes=num_classes, blocks=blocks)
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        layers: list[nn.Module] = []
        cin = 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(blocks):
                layers.append(_BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.stages(self.stem(x)).mean(dim=(2, 3)))


def build_model(name: str, dataset: Dataset, seed: int) -> nn.Module:
    """Build model ``name`` (one of ALL_MODELS) sized for ``dataset``, initialized from ``seed`` alone.

    The model is created on the CPU inside ``torch.random.fork_rng`` with the CPU generator seeded by
    ``seed``, so the same seed gives bit-identical parameters on every worker and the caller's global RNG
    state (CPU and accelerator) is left as it was. Move the model to a device afterwards.
    """
    if not isinstance(name, str):
        raise ConfigError(f"model name must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    if key not in ALL_MODELS:
        raise ConfigError(f"unknown model {name!r}; valid names: {', '.join(ALL_MODELS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ConfigError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    text = getattr(dataset, "context", None) is not None
    if (key in TEXT_MODELS) != text:
        if text:
            raise ConfigError(f"model {key!r} classifies images; dataset {dataset.name!r} is text: use --model "
                              f"{' or '.join(TEXT_MODELS)}, or an image dataset")
        raise ConfigError(f"model {key!r} is a language model; dataset {dataset.name!r} is images: use "
                          "--dataset pystdlib (the default for it), or an image model")
    # Only the CPU generator is seeded (torch.manual_seed would also reseed accelerators outside the fork).
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.default_generator.manual_seed(seed)
        if key in TEXT_MODELS:
            layers, dim, heads = TRANSFORMER_SIZES[key]
            return TransformerLM(dataset.num_classes, dataset.context, layers, dim, heads)
        channels, height, width = dataset.input_shape
        if key == "resnet":
            return ResNet(channels, dataset.num_classes)
        if key in ("cnn", "convnet"):
            if height != width:
                raise ConfigError(
                    f"model {key!r} needs square inputs, dataset {dataset.name!r} has {height}x{width}"
                )
            cls = SmallCNN if key == "cnn" else MnistConvNet
            return cls(channels, dataset.num_classes, height)
        return MLP(math.prod(dataset.input_shape), num_classes=dataset.num_classes)
