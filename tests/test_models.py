"""The `convnet` model (PyTorch's MNIST example network, without dropout) and how build_model makes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradcomp.errors import ConfigError
from gradcomp.experiments.run import models
from gradcomp.experiments.run.config import TrainConfig
from gradcomp.experiments.run.data import Dataset
from gradcomp.experiments.run.models import MODEL_NAMES, MnistConvNet, build_model
from gradcomp.experiments.run.runner import run_simulated

MNIST_SHAPE = (1, 28, 28)
MNIST_PARAMETERS = 1_199_882


def fake_dataset(shape: tuple[int, int, int] = MNIST_SHAPE, num_classes: int = 10, n: int = 2) -> Dataset:
    z = torch.zeros(n, *shape)
    y = torch.zeros(n, dtype=torch.int64)
    return Dataset("fake", z, y, z, y, num_classes, shape)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def expected_parameters(channels: int, side: int, classes: int) -> int:
    m = (side - 4) // 2
    return (
        (channels * 9 * 32 + 32)  # conv 3x3, channels -> 32
        + (32 * 9 * 64 + 64)  # conv 3x3, 32 -> 64
        + (64 * m * m * 128 + 128)  # Linear(64·m² -> 128)
        + (128 * classes + classes)  # Linear(128 -> classes)
    )


def test_registered() -> None:
    assert "convnet" in MODEL_NAMES
    assert "MnistConvNet" in models.__all__
    assert isinstance(build_model(" ConvNet ", fake_dataset(), 0), MnistConvNet)


def test_mnist_parameter_count_and_layers() -> None:
    model = build_model("convnet", fake_dataset(), 0)
    assert num_parameters(model) == MNIST_PARAMETERS == expected_parameters(1, 28, 10)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [(32, 1, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 9216), (128,), (10, 128), (10,)]
    # dropout is left out on purpose (see the class docstring): no module may draw random numbers
    assert not any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())


@pytest.mark.parametrize("shape, classes", [((1, 8, 8), 10), ((3, 12, 12), 7), ((1, 6, 6), 3), ((1, 29, 29), 10)])
def test_other_square_inputs(shape: tuple[int, int, int], classes: int) -> None:
    model = build_model("convnet", fake_dataset(shape, classes), 0)
    assert num_parameters(model) == expected_parameters(shape[0], shape[1], classes)
    assert model(torch.randn(3, *shape)).shape == (3, classes)


def test_same_seed_same_parameters_other_seed_other_parameters() -> None:
    ds = fake_dataset()
    a, b, c = build_model("convnet", ds, 7), build_model("convnet", ds, 7), build_model("convnet", ds, 8)
    pa, pb, pc = (list(m.parameters()) for m in (a, b, c))
    assert all(torch.equal(p, q) for p, q in zip(pa, pb, strict=True))
    # every tensor differs under another seed, not just one
    assert all(not torch.equal(p, q) for p, q in zip(pa, pc, strict=True))


def test_global_rng_untouched() -> None:
    torch.manual_seed(12345)
    before = torch.get_rng_state()
    build_model("convnet", fake_dataset(), 3)
    assert torch.equal(torch.get_rng_state(), before)
    # and the global state does not leak into the initialisation
    torch.manual_seed(999)
    a = build_model("convnet", fake_dataset(), 3)
    torch.manual_seed(1)
    b = build_model("convnet", fake_dataset(), 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_forward_backward_finite_gradients() -> None:
    model = build_model("convnet", fake_dataset(), 0)
    x = torch.randn(4, *MNIST_SHAPE, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 3, 5, 9])
    out = model(x)
    assert out.shape == (4, 10)
    F.cross_entropy(out, y).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.shape == p.shape, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_training_forward_draws_no_random_numbers() -> None:
    """Replicas stay reproducible: a train-mode forward is deterministic and leaves the global RNG alone."""
    model = build_model("convnet", fake_dataset(), 0)
    model.train()
    x = torch.randn(4, *MNIST_SHAPE, generator=torch.Generator().manual_seed(1))
    before = torch.get_rng_state()
    first = model(x)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(model(x), first)


def test_too_small_or_non_square_input_refused() -> None:
    with pytest.raises(ConfigError, match="input_size >= 6"):
        MnistConvNet(1, 10, 5)
    with pytest.raises(ConfigError, match="input_size >= 6"):
        build_model("convnet", fake_dataset((1, 5, 5)), 0)
    with pytest.raises(ConfigError, match="square"):
        build_model("convnet", fake_dataset((1, 28, 27)), 0)
    with pytest.raises(ConfigError):
        MnistConvNet(0, 10, 28)
    with pytest.raises(ConfigError):
        MnistConvNet(1, 0, 28)


def test_a_few_sgd_steps_lower_the_loss() -> None:
    model = build_model("convnet", fake_dataset(), 0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, *MNIST_SHAPE, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_simulated_run_is_reproducible_whatever_the_global_rng(single_thread) -> None:
    """Two simulated runs from different global RNG states give the same bit-identical replicas."""
    cfg = TrainConfig(dataset="synthetic", model="convnet", workers=2, steps=3, batch_size=16, progress=False)
    digests = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        result = run_simulated(cfg)
        assert result["replicas_identical"]
        assert result["num_parameters"] == expected_parameters(1, 8, 10)
        digests.append(result["parameter_digest"])
    assert digests[0] == digests[1]
