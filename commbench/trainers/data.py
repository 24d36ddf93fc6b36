"""Datasets for the training loop: a learnable synthetic set, and MNIST / CIFAR-10 read from disk.

Every dataset yields ``(image, label)``: a float32 tensor of shape (C, H, W) and an int64 scalar
tensor. Real data is read from torchvision's on-disk layout by small readers here, so a missing or
damaged file is a one-line ``ValueError`` naming the path expected, never a download.
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

Shape = tuple[int, int, int]

DATASETS: tuple[str, ...] = ("synthetic", "mnist", "cifar10")

MNIST_SHAPE: Shape = (1, 28, 28)
CIFAR10_SHAPE: Shape = (3, 32, 32)
NUM_CLASSES_REAL = 10

# Per-channel mean and standard deviation of the training splits (the values usually quoted).
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)

MNIST_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
CIFAR10_FILES = {True: tuple(f"data_batch_{i}" for i in range(1, 6)), False: ("test_batch",)}

SYNTHETIC_TEST_SAMPLES = 10_000
# Signal and noise amplitudes: unit variance per pixel, and hard enough that learning takes some steps.
SYNTHETIC_SIGNAL_STD = 0.25
SYNTHETIC_NOISE_STD = math.sqrt(1.0 - SYNTHETIC_SIGNAL_STD**2)


def _check_shape(value: Any) -> Shape:
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 3:
        raise ValueError(f"input_shape must be three integers (C, H, W), got {value!r}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
        raise ValueError(f"input_shape must be three integers >= 1 (C, H, W), got {value!r}")
    return (value[0], value[1], value[2])


def _check_int(what: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")


def data_shape(name: str, requested: Sequence[int] = MNIST_SHAPE) -> Shape:
    """The (C, H, W) of a dataset's images: fixed for mnist and cifar10, ``requested`` for synthetic."""
    if name == "mnist":
        return MNIST_SHAPE
    if name == "cifar10":
        return CIFAR10_SHAPE
    if name == "synthetic":
        return _check_shape(requested)
    raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """What ``build_dataset`` builds; validated on construction.

    ``input_shape`` is the shape of synthetic images; mnist and cifar10 have their own (ask
    ``data_shape``), so there it is only checked for form, which lets a caller pass a model's
    default shape whatever the dataset. ``num_samples`` takes the first n samples of a real
    split, or sets a synthetic split's size (default: 60000 train for 1-channel shapes, 50000 for
    others, 10000 held out). ``replicate=k`` repeats the split k times without copying it.
    """

    name: str
    train: bool
    data_dir: str | None = None
    input_shape: Shape = MNIST_SHAPE
    num_classes: int = 10
    num_samples: int | None = None
    replicate: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose from {', '.join(DATASETS)}")
        if not isinstance(self.train, bool):
            raise ValueError(f"train must be True or False, got {self.train!r}")
        if self.data_dir is not None:
            if not isinstance(self.data_dir, str | os.PathLike):
                raise ValueError(f"data_dir must be a path, got {self.data_dir!r}")
            object.__setattr__(self, "data_dir", os.fspath(self.data_dir))
        object.__setattr__(self, "input_shape", _check_shape(self.input_shape))
        _check_int("num_classes", self.num_classes, 1)
        if self.name != "synthetic" and self.num_classes != NUM_CLASSES_REAL:
            raise ValueError(
                f"{self.name} has {NUM_CLASSES_REAL} classes, not num_classes={self.num_classes}"
            )
        if self.num_samples is not None:
            _check_int("num_samples", self.num_samples, 1)
        _check_int("replicate", self.replicate, 1)
        _check_int("seed", self.seed, 0)

    @property
    def shape(self) -> Shape:
        """The image shape the built dataset yields."""
        return data_shape(self.name, self.input_shape)


# ----------------------------------------------------------------------------- synthetic


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: spreads nearby integers over unrelated 64-bit seeds."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class SyntheticImages(Dataset):
    """Images of a class-specific smooth pattern plus Gaussian noise, generated on demand.

    Each class has one prototype: random values on a coarse 4x4 grid per channel, upsampled to
    (H, W), with standard deviation ``SYNTHETIC_SIGNAL_STD``. Sample ``i`` adds noise (pixel
    variance about 1 in all) drawn from a generator seeded by (seed, split, i), so every rank sees
    the same data for a seed, the two splits share prototypes but not samples, and only the
    prototypes and the labels are stored.
    """

    def __init__(self, shape: Shape, num_classes: int, num_samples: int, *, train: bool, seed: int) -> None:
        self.shape = shape
        self.num_classes = num_classes
        shared = torch.Generator().manual_seed(_mix64(3 * seed))
        c, h, w = shape
        coarse = torch.randn(num_classes, c, 4, 4, generator=shared)
        protos = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
        protos = protos - protos.mean(dim=(1, 2, 3), keepdim=True)
        protos = protos / protos.std(dim=(1, 2, 3), keepdim=True, correction=0).clamp_min(1e-6)
        self.prototypes = SYNTHETIC_SIGNAL_STD * protos
        self._split_key = _mix64(3 * seed + (1 if train else 2))
        split = torch.Generator().manual_seed(self._split_key)
        self.targets = torch.randint(num_classes, (num_samples,), generator=split)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self.targets):
            raise IndexError(f"index {index} out of range for {len(self.targets)} samples")
        label = self.targets[index].clone()
        gen = torch.Generator().manual_seed(_mix64(self._split_key ^ int(index)))
        image = torch.randn(self.shape, generator=gen).mul_(SYNTHETIC_NOISE_STD)
        return image.add_(self.prototypes[label]), label


# ----------------------------------------------------------------------------- real datasets


class NormalizedImages(Dataset):
    """uint8 images (N, C, H, W) held as read, scaled to [0, 1] and normalised per channel on access."""

    def __init__(
        self, images: torch.Tensor, targets: torch.Tensor, mean: Sequence[float], std: Sequence[float]
    ) -> None:
        self.images = images
        self.targets = targets
        self._mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self._std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self.targets):
            raise IndexError(f"index {index} out of range for {len(self.targets)} samples")
        image = self.images[index].to(torch.float32).div_(255.0)
        return image.sub_(self._mean).div_(self._std), self.targets[index].clone()


def _find(directory: Path, filename: str, gz_ok: bool) -> Path:
    plain = directory / filename
    if plain.is_file():
        return plain
    if gz_ok and (directory / f"{filename}.gz").is_file():
        return directory / f"{filename}.gz"
    also = f" (or {plain}.gz)" if gz_ok else ""
    raise ValueError(f"expected {plain}{also}: no such file")


def _read_idx(path: Path, ndim: int) -> tuple[tuple[int, ...], bytes]:
    """Dimensions and payload of an unsigned-byte IDX file (plain or gzip)."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: a damaged deflate stream inside the gzip
        raise ValueError(f"cannot read {path}: {e}") from e
    header = 4 + 4 * ndim
    if len(raw) < header or raw[0:2] != b"\0\0" or raw[2] != 0x08 or raw[3] != ndim:
        magic = raw[:4].hex() if len(raw) >= 4 else "(too short)"
        raise ValueError(f"{path} is not an IDX file of {ndim}-d unsigned bytes (magic {magic})")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(raw) - header != math.prod(dims):
        raise ValueError(f"{path}: header says {dims} but holds {len(raw) - header} bytes of data")
    return dims, raw[header:]


def _check_labels(labels: torch.Tensor, path: Path) -> None:
    if len(labels) and int(labels.max()) >= NUM_CLASSES_REAL:
        raise ValueError(f"{path}: label {int(labels.max())} outside 0..{NUM_CLASSES_REAL - 1}")


def load_mnist(data_dir: str | os.PathLike[str], *, train: bool) -> NormalizedImages:
    """MNIST from ``<data_dir>/MNIST/raw/`` IDX files (plain or .gz), as torchvision stores them."""
    raw_dir = Path(data_dir) / "MNIST" / "raw"
    image_name, label_name = MNIST_FILES[train]
    image_path = _find(raw_dir, image_name, gz_ok=True)
    label_path = _find(raw_dir, label_name, gz_ok=True)
    dims, pixels = _read_idx(image_path, 3)
    if dims[1:] != MNIST_SHAPE[1:]:
        raise ValueError(f"{image_path}: images are {dims[1]}x{dims[2]}, expected 28x28")
    (count,), label_bytes = _read_idx(label_path, 1)
    if count != dims[0]:
        raise ValueError(f"{label_path} has {count} labels for the {dims[0]} images of {image_path}")
    # through numpy: torch.frombuffer refuses an empty buffer, a split of no images
    images = torch.from_numpy(np.frombuffer(bytearray(pixels), dtype=np.uint8)).view(dims[0], *MNIST_SHAPE)
    labels = torch.from_numpy(np.frombuffer(bytearray(label_bytes), dtype=np.uint8)).to(torch.int64)
    _check_labels(labels, label_path)
    return NormalizedImages(images, labels, MNIST_MEAN, MNIST_STD)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    # The batches are Python pickles, like torchvision's reader: only read data you trust.
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
    except Exception as e:
        raise ValueError(f"{path} is not a CIFAR-10 pickle ({type(e).__name__}: {e})") from e
    if not isinstance(batch, dict):
        raise ValueError(f"{path} holds a {type(batch).__name__}, not a CIFAR-10 batch dict")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise ValueError(f"{path}: 'data' must be a uint8 array of shape (n, 3072)")
    try:
        label_array = np.asarray(labels)
    except ValueError:  # a ragged list
        label_array = np.asarray(None)
    if label_array.ndim != 1 or len(label_array) != len(data):
        raise ValueError(f"{path}: 'labels' must list one label per image ({len(data)})")
    if len(label_array) and label_array.dtype.kind not in "iu":  # floats were cut to integers
        raise ValueError(f"{path}: labels must be integers, got {label_array.dtype} values")
    if len(label_array):  # before the cast, which turned a uint64 past int64's range negative
        low, high = int(label_array.min()), int(label_array.max())
        if low < 0 or high >= NUM_CLASSES_REAL:
            raise ValueError(f"{path}: label {low if low < 0 else high} outside 0..{NUM_CLASSES_REAL - 1}")
    return data, label_array.astype(np.int64)


def load_cifar10(data_dir: str | os.PathLike[str], *, train: bool) -> NormalizedImages:
    """CIFAR-10 from the python pickles in ``<data_dir>/cifar-10-batches-py/``."""
    batch_dir = Path(data_dir) / "cifar-10-batches-py"
    paths = [_find(batch_dir, name, gz_ok=False) for name in CIFAR10_FILES[train]]
    batches = [_read_cifar_batch(p) for p in paths]
    images = torch.from_numpy(np.concatenate([d for d, _ in batches])).view(-1, *CIFAR10_SHAPE)
    labels = torch.from_numpy(np.concatenate([ls for _, ls in batches]))
    return NormalizedImages(images, labels, CIFAR10_MEAN, CIFAR10_STD)


# ----------------------------------------------------------------------------- wrappers


class FirstSamples(Dataset):
    """The first ``n`` samples of a dataset (a view, no copy)."""

    def __init__(self, base: Dataset, n: int) -> None:
        self.base = base
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} samples")
        return self.base[index]


class Replicated(Dataset):
    """A dataset repeated ``times`` times: index i reads sample i mod len(base), nothing is copied."""

    def __init__(self, base: Dataset, times: int) -> None:
        _check_int("replicate", times, 1)
        self.base = base
        self.times = times
        self._n = len(base)

    def __len__(self) -> int:
        return self._n * self.times

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        return self.base[index % self._n]


def build_dataset(
    name: str,
    *,
    train: bool,
    data_dir: str | os.PathLike[str] | None = None,
    input_shape: Sequence[int] = MNIST_SHAPE,
    num_classes: int = 10,
    num_samples: int | None = None,
    replicate: int = 1,
    seed: int = 0,
) -> Dataset:
    """Build the train or held-out split of a dataset (see ``DatasetConfig`` for the arguments).

    Raises:
        ValueError: unknown name, bad argument, or a missing or malformed file under ``data_dir``.
    """
    return dataset_from_config(
        DatasetConfig(
            name=name,
            train=train,
            data_dir=data_dir,
            input_shape=input_shape,
            num_classes=num_classes,
            num_samples=num_samples,
            replicate=replicate,
            seed=seed,
        )
    )


def split_size(config: DatasetConfig) -> int:
    """Samples in a synthetic split, before ``replicate``: ``num_samples``, else the default."""
    if config.num_samples is not None:
        return config.num_samples
    if not config.train:
        return SYNTHETIC_TEST_SAMPLES
    return 60_000 if config.shape[0] == 1 else 50_000


def dataset_from_config(config: DatasetConfig) -> Dataset:
    """Build the dataset a ``DatasetConfig`` describes."""
    dataset: Dataset
    if config.name == "synthetic":
        dataset = SyntheticImages(
            config.shape, config.num_classes, split_size(config), train=config.train, seed=config.seed
        )
    else:
        if config.data_dir is None:
            raise ValueError(f"{config.name} needs data_dir (the folder torchvision would download into)")
        if not Path(config.data_dir).is_dir():
            raise ValueError(f"{config.name}: data_dir {config.data_dir} is not a directory")
        loader = load_mnist if config.name == "mnist" else load_cifar10
        dataset = loader(config.data_dir, train=config.train)
        if config.num_samples is not None:
            if config.num_samples > len(dataset):
                raise ValueError(
                    f"num_samples={config.num_samples} exceeds the {len(dataset)} samples of {config.name}"
                )
            dataset = FirstSamples(dataset, config.num_samples)
    return Replicated(dataset, config.replicate) if config.replicate > 1 else dataset
