"""Models of commbench.trainers: study parameter counts, shapes, options and their errors."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st

from commbench.trainers.models import (
    MIN_IMAGE_SIZE,
    MODELS,
    build_model,
    check_model_options,
    default_input_shape,
    model_options,
    parse_model_options,
    trainable_parameters,
)

BACKBONES = ("resnet18", "alexnet", "vgg16", "densenet121", "squeezenet1_0")


@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        # study 000: frozen backbones, trained head
        ("resnet18", {}, 5130),
        ("squeezenet1_0", {}, 5130),
        ("alexnet", {}, 54_575_114),
        ("densenet121", {}, 21_020_682),
        ("vgg16", {}, 119_586_826),
        ("vgg16", {"hidden": 2048}, 55_599_114),
        ("vgg16", {"hidden": 1024}, 26_750_986),
        # study 002's CNN, study 001's VGG-11, study 004's ResNet-18
        ("mnist_cnn", {}, 21_840),
        ("vgg11", {}, 9_231_114),
        ("vgg11", {"batch_norm": False}, 9_225_610),
        ("resnet18_cifar", {}, 11_173_962),
        ("mlp", {}, 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10),
        ("mnist_cnn", {"input_shape": (3, 32, 32)}, 760 + 5020 + 500 * 50 + 50 + 510),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_trainable_parameters_match_the_studies(name: str, options: dict, expected: int) -> None:
    if name in BACKBONES:
        options = {"image_size": MIN_IMAGE_SIZE[name], **options}
    with torch.device("meta"):  # shapes alone: vgg16's 138M weights took 4 s to initialise on the CPU
        model = build_model(name, **options)
    assert trainable_parameters(model) == expected
    if name not in BACKBONES:
        assert sum(p.numel() for p in model.parameters()) == expected
        return
    assert all(not p.requires_grad for p in model.features.parameters())
    assert sum(p.numel() for p in model.head.parameters()) == expected


@pytest.mark.parametrize("name", BACKBONES)
def test_the_smallest_image_size_runs_and_one_pixel_less_is_refused(name: str) -> None:
    """The minimum runs on a 1x28x28 batch; one pixel less fails in torchvision and in build_model."""
    smallest = MIN_IMAGE_SIZE[name]
    assert smallest <= 64
    model = build_model(name, image_size=smallest, hidden=16)  # a narrow head: the backbone is judged
    with torch.no_grad():
        assert model.eval()(torch.rand(2, 1, 28, 28)).shape == (2, 10)
    if smallest > 1:
        with pytest.raises(ValueError, match=f"image_size.*{name}.*{smallest}"):
            build_model(name, image_size=smallest - 1)
        # as the launch checks the options before any rank starts (the ranks said it, once started)
        with pytest.raises(ValueError, match=f"image_size.*{name}.*{smallest}"):
            check_model_options(name, image_size=smallest - 1)
        with pytest.raises(RuntimeError), torch.no_grad():
            model.features(torch.zeros(1, 3, smallest - 1, smallest - 1))


def test_any_backbone_takes_any_head_width() -> None:
    assert (
        trainable_parameters(build_model("resnet18", hidden=16))
        == 512 * 16 + 16 + 16 * 16 + 16 + 16 * 10 + 10
    )
    assert trainable_parameters(build_model("densenet121", hidden=0, num_classes=3)) == 1024 * 3 + 3


def test_the_dropout_option_reaches_every_dropout_layer() -> None:
    """The option is the probability of each dropout in the model: mnist_cnn's two (after conv2 and
    after fc1) and a backbone head's two, not their default 0.5."""

    def dropouts(model: torch.nn.Module) -> list[tuple[type, float]]:
        kinds = (torch.nn.Dropout, torch.nn.Dropout2d)
        return [(type(m), m.p) for m in model.modules() if isinstance(m, kinds)]

    assert dropouts(build_model("mnist_cnn", dropout=0.25)) == [
        (torch.nn.Dropout2d, 0.25),
        (torch.nn.Dropout, 0.25),
    ]
    backbone = build_model("resnet18", hidden=16, dropout=0.1)
    assert dropouts(backbone.head) == [(torch.nn.Dropout, 0.1)] * 2
    assert dropouts(backbone) == dropouts(backbone.head)  # resnet18's own features have none


def test_frozen_backbone_trains_only_its_head() -> None:
    model = build_model("resnet18", image_size=64, input_shape=(3, 20, 24), num_classes=4).train()
    assert model.training and model.head.training and not model.features.training
    stats = [b.clone() for b in model.features.buffers()]
    loss = torch.nn.functional.cross_entropy(model(torch.randn(3, 3, 20, 24)), torch.tensor([0, 1, 3]))
    loss.backward()
    assert all(p.grad is None for p in model.features.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.head.parameters())
    assert all(torch.equal(a, b) for a, b in zip(stats, model.features.buffers(), strict=True))


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("mnist_cnn", (1, 28, 28)),
        ("mnist_cnn", (3, 32, 32)),
        ("mnist_cnn", (1, 16, 21)),
        ("mlp", (1, 28, 28)),
        ("mlp", (3, 32, 32)),
        ("vgg11", (3, 32, 32)),
        ("vgg11", (1, 12, 20)),
        ("resnet18_cifar", (3, 16, 16)),
        ("resnet18_cifar", (1, 8, 12)),
    ],
)
def test_small_models_forward_and_backward(name: str, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    model = build_model(name, input_shape=shape, num_classes=7).train()
    out = model(torch.randn(2, *shape))
    assert out.shape == (2, 7)
    torch.nn.functional.cross_entropy(out, torch.tensor([1, 6])).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_vgg11_head_follows_the_input_shape() -> None:
    model = build_model("vgg11", input_shape=(3, 64, 40))
    assert model.classifier.in_features == 512 * 2 * math.ceil(40 / 32)
    assert model.eval()(torch.randn(1, 3, 64, 40)).shape == (1, 10)


@settings(max_examples=20, deadline=None)
@given(
    c=st.integers(1, 4),
    h=st.integers(16, 40),
    w=st.integers(16, 40),
    widths=st.lists(st.integers(1, 64), max_size=3),
)
def test_input_shape_sizes_the_first_layers(c: int, h: int, w: int, widths: list[int]) -> None:
    cnn = build_model("mnist_cnn", input_shape=(c, h, w))
    assert cnn.eval()(torch.zeros(1, c, h, w)).shape == (1, 10)
    net = build_model("mlp", input_shape=[c, h, w], widths=widths)
    sizes = [c * h * w, *widths, 10]
    assert trainable_parameters(net) == sum(a * b + b for a, b in zip(sizes, sizes[1:], strict=False))


def test_default_input_shapes() -> None:
    expected = {
        "mnist_cnn": (1, 28, 28),
        "mlp": (1, 28, 28),
        "vgg11": (3, 32, 32),
        "resnet18_cifar": (3, 32, 32),
    }
    expected |= dict.fromkeys(BACKBONES, (1, 28, 28))
    assert {name: default_input_shape(name) for name in MODELS} == expected
    assert all("input_shape" in model_options(name) for name in MODELS)


def test_unknown_model_and_option_are_named() -> None:
    with pytest.raises(ValueError, match=r"'lenet'.*mnist_cnn.*vgg16"):
        build_model("lenet")
    with pytest.raises(ValueError, match=r"hiden.*accepts.*hidden.*image_size"):
        build_model("vgg16", hiden=10)
    with pytest.raises(ValueError, match="'nope'"):
        default_input_shape("nope")


@pytest.mark.parametrize(
    ("name", "options", "named"),
    [
        ("resnet18", {"hidden": -1}, "hidden"),
        ("resnet18", {"hidden": True}, "hidden"),
        ("resnet18", {"dropout": 1.5}, "dropout"),
        ("resnet18", {"input_shape": (2, 28, 28)}, "input_shape"),
        ("resnet18", {"weights": 3}, "weights"),
        ("mlp", {"input_shape": (1, 28)}, "input_shape"),
        ("mlp", {"input_shape": "1,28,28"}, "input_shape"),
        ("mlp", {"widths": [64, 0]}, "widths"),
        ("mlp", {"widths": "wide"}, "widths"),
        ("vgg11", {"batch_norm": "yes"}, "batch_norm"),
        ("mnist_cnn", {"input_shape": (1, 15, 28)}, "input_shape"),
        ("mnist_cnn", {"num_classes": 0}, "num_classes"),
    ],
)
def test_bad_option_values_are_named(name: str, options: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        build_model(name, **options)


def test_backbone_loads_local_weights(tmp_path) -> None:
    torch.manual_seed(123)
    reference = torchvision.models.squeezenet1_0(weights=None)
    path = tmp_path / "squeezenet.pth"
    torch.save(reference.state_dict(), path)
    model = build_model("squeezenet1_0", weights=str(path), image_size=32)
    assert torch.equal(model.features[0][0].weight, reference.features[0].weight)
    assert trainable_parameters(model) == 5130

    with pytest.raises(ValueError, match="no file at .*missing.pth"):
        build_model("squeezenet1_0", weights=str(tmp_path / "missing.pth"))
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pth is not a readable state dict"):
        build_model("squeezenet1_0", weights=tmp_path / "junk.pth")
    torch.save(torch.zeros(3), tmp_path / "tensor.pth")
    with pytest.raises(ValueError, match="not a state dict"):
        build_model("squeezenet1_0", weights=str(tmp_path / "tensor.pth"))
    torch.save({"features.0.weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="does not fit torchvision's squeezenet1_0"):
        build_model("squeezenet1_0", weights=str(tmp_path / "other.pth"))


def test_another_models_weights_are_refused_in_a_short_line(tmp_path) -> None:
    """Another model's file gave torch's list of every key: a line of hundreds of characters."""
    path = tmp_path / "r18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    with pytest.raises(ValueError) as caught:
        build_model("alexnet", weights=str(path))
    said = str(caught.value)
    assert said == (
        f"alexnet weights: {path} does not fit torchvision's alexnet: 16 of its 16 entries missing "
        "(features.0.weight, features.0.bias, features.3.weight, ...); 122 entries not its own "
        "(conv1.weight, bn1.weight, bn1.bias, ...)"
    )
    state = torchvision.models.alexnet(weights=None, num_classes=5).state_dict()  # a head of 5 classes
    torch.save(state, path)
    with pytest.raises(
        ValueError, match=r"2 of another shape \(classifier.6.weight: \(5, 4096\) where the model"
    ):
        build_model("alexnet", weights=str(path))


@pytest.mark.parametrize(
    "state, said",
    [
        ({1: torch.zeros(3)}, "holds a key 1, not a state dict of named tensors"),
        ({"features.0.weight": 1}, "holds a value of type int at features.0.weight, not a state dict"),
        (
            {"features.0.weight": torch.zeros(3, dtype=torch.complex64)},
            "a complex tensor at features.0.weight",
        ),
        ({"features.0.weight": torch.zeros(3).to_sparse()}, "a sparse tensor at features.0.weight"),
    ],
    ids=["int-key", "number", "complex", "sparse"],
)
def test_backbone_weights_of_other_kinds_are_refused_without_warnings(tmp_path, state, said) -> None:
    """An int key failed in torch ("'int' object has no attribute 'startswith'", exit 1); complex
    tensors were cast to real with a warning from every rank, and a sparse one's load warned
    above its refusal."""
    import warnings

    path = tmp_path / "w.pth"
    torch.save(state, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        with pytest.raises(ValueError, match=re.escape(said)):
            build_model("squeezenet1_0", weights=str(path))


def test_parse_model_options_types() -> None:
    options = parse_model_options(
        [
            "hidden=2048",
            "dropout=0.25",
            "batch_norm=False",
            "widths=2048,2048",
            "weights=/w/vgg16.pth",
            "name=a,b",
        ]
    )
    assert options == {
        "hidden": 2048,
        "dropout": 0.25,
        "batch_norm": False,
        "widths": [2048, 2048],
        "weights": "/w/vgg16.pth",
        "name": "a,b",
    }
    assert type(options["hidden"]) is int and type(options["batch_norm"]) is bool
    assert parse_model_options([]) == {}
    # a file path is a path, whatever it looks like (1.5 was refused as 'must be a file path')
    for name in ("1.5", "true", "2048,2048", "7"):
        assert parse_model_options([f"weights={name}"]) == {"weights": name}


def test_parsed_options_build_models() -> None:
    net = build_model("mlp", **parse_model_options(["widths=64", "input_shape=3,8,8"]))
    assert trainable_parameters(net) == 192 * 64 + 64 + 64 * 10 + 10
    cnn = build_model("vgg11", **parse_model_options(["batch_norm=false", "input_shape=1,28,28"]))
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in cnn.modules())


@pytest.mark.parametrize("item", ["hidden", "=3", "hidden=", "two words=1", "-x=1"])
def test_parse_model_options_rejects_malformed_items(item: str) -> None:
    with pytest.raises(ValueError, match=f"'{item}' is not KEY=VALUE"):
        parse_model_options(["dropout=0.1", item])


def test_parse_model_options_rejects_repeated_keys() -> None:
    with pytest.raises(ValueError, match="hidden given twice"):
        parse_model_options(["hidden=1", "hidden=2"])
