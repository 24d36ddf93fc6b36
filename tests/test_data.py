"""Datasets of commbench.trainers: synthetic data, MNIST/CIFAR-10 readers on real formats, replication."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from commbench.trainers.data import (
    DATASETS,
    DatasetConfig,
    Replicated,
    build_dataset,
    data_shape,
)
from commbench.trainers.models import build_model

# ----------------------------------------------------------------------------- writers of the real formats


def write_idx(path: Path, array: np.ndarray, compress: bool = False) -> None:
    """An IDX file of unsigned bytes: 0x0000, type 0x08, rank, big-endian dims, then the data."""
    payload = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload += array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        payload = gzip.compress(payload)
    path.write_bytes(payload)


def write_mnist(root: Path, n_train: int = 12, n_test: int = 5, compress: bool = False) -> dict:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images, compress)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels, compress)
        arrays[prefix] = (images, labels)
    return arrays


def write_cifar10(root: Path, per_batch: int = 3) -> dict:
    """Batches as CIFAR-10 ships them: protocol-2 pickles of dicts with bytes keys."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=per_batch)]
        batch = {
            b"batch_label": name.encode(),
            b"labels": labels,
            b"data": data,
            b"filenames": [b"x.png"] * per_batch,
        }
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
        batches[name] = (data, labels)
    return batches


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_items_and_default_sizes() -> None:
    train = build_dataset("synthetic", train=True)
    image, label = train[0]
    assert image.dtype == torch.float32 and image.shape == (1, 28, 28)
    assert label.dtype == torch.int64 and label.ndim == 0
    assert len(train) == 60_000 and len(build_dataset("synthetic", train=False)) == 10_000
    cifar_like = build_dataset("synthetic", train=True, input_shape=(3, 32, 32))
    assert len(cifar_like) == 50_000 and cifar_like[49_999][0].shape == (3, 32, 32)
    # Generated on demand: what it stores is a few prototypes and the labels, not 600 MB of floats.
    stored = sum(
        t.numel() * t.element_size() for t in vars(cifar_like).values() if isinstance(t, torch.Tensor)
    )
    assert stored < 1_000_000
    with pytest.raises(IndexError):
        cifar_like[50_000]


def test_synthetic_is_deterministic_per_seed_and_splits_differ() -> None:
    a = build_dataset("synthetic", train=True, num_samples=50, seed=3)
    b = build_dataset("synthetic", train=True, num_samples=50, seed=3)
    other_seed = build_dataset("synthetic", train=True, num_samples=50, seed=4)
    held_out = build_dataset("synthetic", train=False, num_samples=50, seed=3)
    for i in (0, 17, 49):
        assert torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1]
    assert not any(torch.equal(a[i][0], other_seed[i][0]) for i in range(50))
    assert not any(torch.equal(a[i][0], held_out[j][0]) for i in range(50) for j in range(50))


def test_synthetic_labels_cover_the_classes() -> None:
    ds = build_dataset("synthetic", train=True, num_samples=600, num_classes=3, input_shape=(2, 5, 7))
    labels = torch.stack([ds[i][1] for i in range(len(ds))])
    assert set(labels.tolist()) == {0, 1, 2}
    assert ds[0][0].shape == (2, 5, 7)


def test_synthetic_is_learnable_and_generalises() -> None:
    """A few SGD steps of a small MLP on the train split clearly lower the held-out loss."""
    torch.manual_seed(0)
    train = build_dataset("synthetic", train=True, num_samples=2048, seed=1)
    held_out = build_dataset("synthetic", train=False, num_samples=512, seed=1)
    model = build_model("mlp", widths=[64])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x_test, y_test = next(iter(DataLoader(held_out, batch_size=512)))

    def held_out_loss() -> float:
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(x_test), y_test).item()

    before = held_out_loss()
    for x, y in DataLoader(train, batch_size=64, shuffle=True):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert before > 2.0
    assert held_out_loss() < 0.5 * before


# ----------------------------------------------------------------------------- MNIST


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gz"])
def test_mnist_reads_idx_files(tmp_path: Path, compress: bool) -> None:
    arrays = write_mnist(tmp_path, compress=compress)
    for train, prefix in ((True, "train"), (False, "t10k")):
        ds = build_dataset("mnist", train=train, data_dir=tmp_path)
        images, labels = arrays[prefix]
        assert len(ds) == len(labels)
        image, label = ds[len(ds) - 1]
        assert image.dtype == torch.float32 and image.shape == (1, 28, 28)
        expected = (torch.from_numpy(images[-1]).float() / 255 - 0.1307) / 0.3081
        assert torch.allclose(image[0], expected, atol=1e-5)
        assert label.dtype == torch.int64 and label.item() == labels[-1]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: raw.joinpath("train-images-idx3-ubyte").unlink(), "expected .*train-images-idx3-ubyte"),
        (lambda raw: raw.joinpath("train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08"), "not an IDX file"),
        (
            lambda raw: raw.joinpath("train-images-idx3-ubyte").write_bytes(b"\x00\x00\x0d\x03" + bytes(12)),
            "magic",
        ),
        (lambda raw: _truncate(raw / "train-images-idx3-ubyte"), "header says"),
        (
            lambda raw: write_idx(raw / "train-labels-idx1-ubyte", np.zeros(11, np.uint8)),
            "11 labels for the 12",
        ),
        (lambda raw: write_idx(raw / "train-labels-idx1-ubyte", np.full(12, 10, np.uint8)), "label 10"),
        (lambda raw: write_idx(raw / "train-images-idx3-ubyte", np.zeros((12, 32, 32))), "expected 28x28"),
    ],
    ids=["missing", "short", "magic", "truncated", "count", "label", "size"],
)
def test_mnist_damaged_files_raise_value_error(tmp_path: Path, damage, message: str) -> None:
    write_mnist(tmp_path)
    damage(tmp_path / "MNIST" / "raw")
    with pytest.raises(ValueError, match=message):
        build_dataset("mnist", train=True, data_dir=tmp_path)


def test_mnist_split_of_no_images_is_empty(tmp_path: Path) -> None:
    """An IDX pair of 0 images is a well-formed split: torch.frombuffer refused its empty payload
    with "both buffer length (0) and count (-1) must not be 0", naming no file."""
    write_mnist(tmp_path, n_test=0)
    assert len(build_dataset("mnist", train=False, data_dir=tmp_path)) == 0


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-5])


def test_mnist_bad_gzip_raises_value_error(tmp_path: Path) -> None:
    write_mnist(tmp_path, compress=True)
    (tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte.gz"):
        build_dataset("mnist", train=False, data_dir=tmp_path)


def test_mnist_gzip_with_a_damaged_stream_raises_value_error(tmp_path: Path) -> None:
    """A gzip header followed by bytes that do not inflate: zlib's own error, not an OSError, came
    out of the reader (the CLI printed a traceback and exited 1)."""
    write_mnist(tmp_path, compress=True)
    path = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte.gz"
    damaged = bytearray(path.read_bytes())
    damaged[10:13] = b"\xff\xff\xff"  # the first bytes of the deflate stream, after the 10-byte header
    path.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="cannot read .*train-images-idx3-ubyte.gz: .*decompressing"):
        build_dataset("mnist", train=True, data_dir=tmp_path)


# ----------------------------------------------------------------------------- CIFAR-10


def test_cifar10_reads_python_pickles(tmp_path: Path) -> None:
    batches = write_cifar10(tmp_path)
    train = build_dataset("cifar10", train=True, data_dir=str(tmp_path))
    test = build_dataset("cifar10", train=False, data_dir=tmp_path)
    assert (len(train), len(test)) == (15, 3)
    data, labels = batches["data_batch_2"]
    image, label = train[3 + 1]  # second image of the second batch
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert label.dtype == torch.int64 and label.item() == labels[1]
    # Rows hold 1024 red, then 1024 green, then 1024 blue values, each 32x32 row-major.
    green = torch.from_numpy(data[1, 1024 + 5 * 32 + 7 : 1024 + 5 * 32 + 8]).float() / 255
    assert torch.allclose(image[1, 5, 7], (green - 0.4822) / 0.2435, atol=1e-5)
    assert test[2][1].item() == batches["test_batch"][1][2]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d.joinpath("data_batch_4").unlink(), "expected .*cifar-10-batches-py/data_batch_4"),
        (
            lambda d: d.joinpath("data_batch_1").write_bytes(b"garbage"),
            "data_batch_1 is not a CIFAR-10 pickle",
        ),
        (lambda d: d.joinpath("data_batch_2").write_bytes(pickle.dumps([1, 2])), "not a CIFAR-10 batch dict"),
        (
            lambda d: d.joinpath("data_batch_3").write_bytes(
                pickle.dumps({b"data": np.zeros((3, 100), np.uint8), b"labels": [0, 0, 0]})
            ),
            r"shape \(n, 3072\)",
        ),
        (
            lambda d: d.joinpath("data_batch_5").write_bytes(
                pickle.dumps({b"data": np.zeros((3, 3072), np.uint8), b"labels": [0, 1]})
            ),
            "one label per image",
        ),
        # one number, not a list: len() raised a TypeError that named no file
        (
            lambda d: d.joinpath("data_batch_5").write_bytes(
                pickle.dumps({b"data": np.zeros((3, 3072), np.uint8), b"labels": 7})
            ),
            "data_batch_5: 'labels' must list one label per image",
        ),
        # fractional labels were cut to integers without a word
        (
            lambda d: d.joinpath("data_batch_2").write_bytes(
                pickle.dumps({b"data": np.zeros((3, 3072), np.uint8), b"labels": [0.5, 1.7, 2.0]})
            ),
            "data_batch_2: labels must be integers, got float64",
        ),
        # a uint64 label past int64's range was called negative once cast
        (
            lambda d: d.joinpath("data_batch_3").write_bytes(
                pickle.dumps(
                    {b"data": np.zeros((2, 3072), np.uint8), b"labels": np.array([1, 2**64 - 1], np.uint64)}
                )
            ),
            "data_batch_3: label 18446744073709551615 outside 0..9",
        ),
        (
            lambda d: d.joinpath("data_batch_4").write_bytes(
                pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [3, -2]})
            ),
            "data_batch_4: label -2 outside 0..9",
        ),
        (
            lambda d: d.joinpath("data_batch_1").write_bytes(
                pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [10, 0]})
            ),
            "data_batch_1: label 10 outside 0..9",
        ),
    ],
    ids=[
        "missing",
        "garbage",
        "not-dict",
        "shape",
        "labels",
        "labels-not-a-list",
        "labels-fractional",
        "label-uint64",
        "label-negative",
        "label-past-the-classes",
    ],
)
def test_cifar10_damaged_files_raise_value_error(tmp_path: Path, damage, message: str) -> None:
    write_cifar10(tmp_path)
    damage(tmp_path / "cifar-10-batches-py")
    with pytest.raises(ValueError, match=message):
        build_dataset("cifar10", train=True, data_dir=tmp_path)


# ----------------------------------------------------------------------------- arguments and wrappers


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_real_datasets_need_an_existing_data_dir(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="needs data_dir"):
        build_dataset(name, train=True)
    with pytest.raises(ValueError, match="not a directory"):
        build_dataset(name, train=True, data_dir=tmp_path / "absent")
    with pytest.raises(ValueError, match="expected .*(MNIST/raw|cifar-10-batches-py)"):
        build_dataset(name, train=True, data_dir=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "imagenet"}, "'imagenet'.*synthetic, mnist, cifar10"),
        ({"name": "mnist", "input_shape": (3, 32)}, "input_shape"),
        ({"name": "cifar10", "num_classes": 100}, "num_classes=100"),
        ({"name": "synthetic", "input_shape": (1, 0, 28)}, "input_shape"),
        ({"name": "synthetic", "num_samples": 0}, "num_samples"),
        ({"name": "synthetic", "replicate": 0}, "replicate"),
        ({"name": "synthetic", "num_classes": True}, "num_classes"),
        ({"name": "synthetic", "seed": -1}, "seed"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_dataset(train=True, **kwargs)


def test_num_samples_takes_a_prefix_of_real_data(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    full = build_dataset("mnist", train=True, data_dir=tmp_path)
    head = build_dataset("mnist", train=True, data_dir=tmp_path, num_samples=4, input_shape=(1, 28, 28))
    assert len(head) == 4 and torch.equal(head[3][0], full[3][0])
    with pytest.raises(IndexError):
        head[4]
    with pytest.raises(ValueError, match="exceeds the 12 samples"):
        build_dataset("mnist", train=True, data_dir=tmp_path, num_samples=13)


@pytest.mark.parametrize("times", [1, 4, 8])
def test_replicate_repeats_without_copying(tmp_path: Path, times: int) -> None:
    write_mnist(tmp_path)
    base = build_dataset("mnist", train=True, data_dir=tmp_path)
    ds = build_dataset("mnist", train=True, data_dir=tmp_path, replicate=times)
    assert len(ds) == 12 * times
    assert torch.equal(ds[12 * times - 1][0], base[11][0]) and ds[12 * (times - 1)][1] == base[0][1]
    if times > 1:
        assert isinstance(ds, Replicated) and ds.base.images.shape[0] == 12  # one copy, indexed modulo
    with pytest.raises(IndexError):
        ds[12 * times]
    synthetic = build_dataset("synthetic", train=True, num_samples=10, replicate=times)
    assert len(synthetic) == 10 * times and torch.equal(synthetic[10 * times - 3][0], synthetic[7][0])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 20), times=st.integers(1, 9), data=st.data())
def test_replicated_index_maps_to_base_modulo_length(n: int, times: int, data: st.DataObject) -> None:
    ds = Replicated(list(range(n)), times)
    index = data.draw(st.integers(0, n * times - 1))
    assert len(ds) == n * times and ds[index] == index % n


def test_data_shape_and_config() -> None:
    assert DATASETS == ("synthetic", "mnist", "cifar10")
    assert data_shape("mnist") == (1, 28, 28)
    assert data_shape("cifar10", (1, 28, 28)) == (3, 32, 32)
    assert data_shape("synthetic", [3, 64, 64]) == (3, 64, 64)
    assert data_shape("synthetic") == (1, 28, 28)
    with pytest.raises(ValueError, match="'svhn'"):
        data_shape("svhn")
    config = DatasetConfig(name="synthetic", train=False, input_shape=[3, 8, 8])
    assert config.input_shape == (3, 8, 8) and config.shape == (3, 8, 8)
    assert DatasetConfig(name="cifar10", train=True).shape == (3, 32, 32)
    assert DatasetConfig(name="mnist", train=True, input_shape=(3, 32, 32)).shape == (1, 28, 28)


def test_real_datasets_keep_their_own_shape(tmp_path: Path) -> None:
    """A caller may pass a model's default shape; mnist still yields 1x28x28 (see data_shape)."""
    write_mnist(tmp_path)
    ds = build_dataset("mnist", train=False, data_dir=tmp_path, input_shape=(3, 32, 32))
    assert ds[0][0].shape == data_shape("mnist") == (1, 28, 28)


def test_batches_collate_to_float_images_and_int64_labels(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    x, y = next(iter(DataLoader(build_dataset("cifar10", train=True, data_dir=tmp_path), batch_size=6)))
    assert x.shape == (6, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
