"""The models the reference studies train, built by name with validated options.

Imports no distributed code. Every model takes ``input_shape=(C, H, W)`` so it fits the dataset it
is fed; the rest of its options live in a frozen dataclass per model family, so a bad or unknown
option fails at build time with a ``ValueError`` that names it.

Study 000 (frozen torchvision backbones, trained head) fixes the trainable parameter counts:
resnet18 5130, squeezenet1_0 5130, alexnet 54,575,114, densenet121 21,020,682, vgg16 119,586,826
(hidden=2048: 55,599,114; hidden=1024: 26,750,986). Those numbers pin down the feature sizes the
head sees (alexnet 256x6x6, vgg16 512x7x7, densenet121 1024, resnet18 and squeezenet1_0 512) and
the head itself: three linear layers of width ``hidden`` for the three large backbones, one linear
layer (``hidden=0``) for the two small ones.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Shape = tuple[int, int, int]


# ----------------------------------------------------------------------------- option checking


def _check_int(option: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"option {option} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_shape(value: Any) -> Shape:
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 3:
        raise ValueError(f"option input_shape must be three integers (C, H, W), got {value!r}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"option input_shape must be three integers >= 1 (C, H, W), got {value!r}")
    return (value[0], value[1], value[2])


def _check_dropout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"option dropout must be a probability in [0, 1], got {value!r}")
    return float(value)


def _check_bool(option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"option {option} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class _Options:
    """Options every model accepts: the (C, H, W) shape of one input sample."""

    input_shape: Shape = (1, 28, 28)

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_shape", _check_shape(self.input_shape))


@dataclass(frozen=True, kw_only=True)
class BackboneOptions(_Options):
    """A frozen torchvision backbone with a trained head.

    ``hidden``: head width, ``None`` for the study's default (4096 for alexnet, vgg16 and
    densenet121; 0, a single linear layer, for resnet18 and squeezenet1_0). ``image_size``: side
    the input is resized to. ``weights``: a local state-dict file of the whole torchvision model;
    ``None`` keeps the random initialisation (nothing is ever downloaded).
    """

    hidden: int | None = None
    dropout: float = 0.5
    image_size: int = 224
    weights: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.input_shape[0] not in (1, 3):
            raise ValueError(
                f"option input_shape: a torchvision backbone takes 1 or 3 channels, got {self.input_shape}"
            )
        if self.hidden is not None:
            _check_int("hidden", self.hidden, 0)
        object.__setattr__(self, "dropout", _check_dropout(self.dropout))
        _check_int("image_size", self.image_size, 1)
        if self.weights is not None:
            if not isinstance(self.weights, str | os.PathLike):
                raise ValueError(f"option weights must be a file path, got {self.weights!r}")
            object.__setattr__(self, "weights", os.fspath(self.weights))


@dataclass(frozen=True, kw_only=True)
class MnistCnnOptions(_Options):
    """The 21.8K-parameter CNN of study 002; ``dropout`` is used after conv2 and after fc1."""

    dropout: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "dropout", _check_dropout(self.dropout))
        _, h, w = self.input_shape
        if h < 16 or w < 16:
            raise ValueError(f"option input_shape: mnist_cnn needs H and W >= 16, got {self.input_shape}")


@dataclass(frozen=True, kw_only=True)
class Vgg11Options(_Options):
    """VGG-11 for CIFAR; ``batch_norm`` puts a BatchNorm2d after every convolution."""

    input_shape: Shape = (3, 32, 32)
    batch_norm: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_bool("batch_norm", self.batch_norm)


@dataclass(frozen=True, kw_only=True)
class ResNet18CifarOptions(_Options):
    """ResNet-18 for CIFAR: no options beyond the input shape."""

    input_shape: Shape = (3, 32, 32)


@dataclass(frozen=True, kw_only=True)
class MlpOptions(_Options):
    """Fully connected network; ``widths`` are the hidden layer widths, at least one on the command
    line (an empty tuple, from Python alone, makes it logistic regression)."""

    widths: tuple[int, ...] = (512, 512)

    def __post_init__(self) -> None:
        super().__post_init__()
        widths = self.widths
        if isinstance(widths, int) and not isinstance(widths, bool):
            widths = (widths,)
        if isinstance(widths, str) or not isinstance(widths, Sequence):
            raise ValueError(f"option widths must be a list of integers, got {self.widths!r}")
        object.__setattr__(self, "widths", tuple(_check_int("widths", w, 1) for w in widths))


# ----------------------------------------------------------------------------- backbones


class InputAdapter(nn.Module):
    """Makes 1- or 3-channel images of any size fit an ImageNet backbone (no parameters).

    A single channel is repeated to three; the image is resized (bilinear) to ``size`` x ``size``.
    """

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        elif x.shape[1] != 3:
            raise ValueError(f"expected 1 or 3 input channels, got input of shape {tuple(x.shape)}")
        if tuple(x.shape[-2:]) != (self.size, self.size):
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        return x

    def extra_repr(self) -> str:
        return f"size={self.size}"


class FrozenBackboneClassifier(nn.Module):
    """A fixed feature extractor (``requires_grad=False``) under a trained classifier head.

    The extractor stays in eval mode even when the model is trained, so its batch-norm
    statistics are fixed too, as a fixed feature extractor's should be.
    """

    def __init__(self, adapter: nn.Module, features: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.adapter = adapter
        self.features = features
        self.head = head
        self.features.requires_grad_(False)
        self.features.eval()

    def train(self, mode: bool = True) -> FrozenBackboneClassifier:
        super().train(mode)
        self.features.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(self.adapter(x)))


def classifier_head(in_features: int, hidden: int, num_classes: int, dropout: float = 0.5) -> nn.Sequential:
    """Study 000's head: Linear-ReLU-Dropout twice at width ``hidden``, then Linear to the classes.

    ``hidden=0`` gives a single Linear(in_features, num_classes).
    """
    if hidden == 0:
        return nn.Sequential(nn.Linear(in_features, num_classes))
    return nn.Sequential(
        nn.Linear(in_features, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden, num_classes),
    )


def _resnet18_features(m: nn.Module) -> nn.Module:
    return nn.Sequential(*list(m.children())[:-1], nn.Flatten())


def _pooled_features(m: nn.Module) -> nn.Module:
    return nn.Sequential(m.features, m.avgpool, nn.Flatten())


def _densenet_features(m: nn.Module) -> nn.Module:
    return nn.Sequential(m.features, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _squeezenet_features(m: nn.Module) -> nn.Module:
    return nn.Sequential(m.features, nn.AdaptiveAvgPool2d(1), nn.Flatten())


@dataclass(frozen=True, kw_only=True)
class _Backbone:
    """How to cut a torchvision classifier down to its feature extractor."""

    features: Callable[[nn.Module], nn.Module]
    feature_dim: int
    default_hidden: int
    min_image_size: int  # smallest side the torchvision forward pass accepts


_BACKBONES: dict[str, _Backbone] = {
    "resnet18": _Backbone(features=_resnet18_features, feature_dim=512, default_hidden=0, min_image_size=1),
    "alexnet": _Backbone(
        features=_pooled_features, feature_dim=256 * 6 * 6, default_hidden=4096, min_image_size=63
    ),
    "vgg16": _Backbone(
        features=_pooled_features, feature_dim=512 * 7 * 7, default_hidden=4096, min_image_size=32
    ),
    "densenet121": _Backbone(
        features=_densenet_features, feature_dim=1024, default_hidden=4096, min_image_size=29
    ),
    "squeezenet1_0": _Backbone(
        features=_squeezenet_features, feature_dim=512, default_hidden=0, min_image_size=21
    ),
}

MIN_IMAGE_SIZE: Mapping[str, int] = {name: b.min_image_size for name, b in _BACKBONES.items()}


def _load_weights(model: nn.Module, name: str, path: str) -> None:
    """Load a local state dict of the whole torchvision model into ``model``."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{name} weights: no file at {file}")
    # torch's warnings on a file it then refuses (a sparse tensor's invariants, an old pickle) were
    # printed by every rank above the one-line refusal
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(
                f"{name} weights: {file} is not a readable state dict ({type(e).__name__})"
            ) from e
    if not isinstance(state, Mapping):
        raise ValueError(f"{name} weights: {file} holds a {type(state).__name__}, not a state dict")
    for key, value in state.items():  # an int key failed in torch as "'int' object has no attribute ..."
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            what = (
                f"a value of type {type(value).__name__} at {key}"
                if isinstance(key, str)
                else f"a key {key!r}"
            )
            raise ValueError(f"{name} weights: {file} holds {what}, not a state dict of named tensors")
        if value.is_complex() or value.layout != torch.strided:  # cast to real with a warning, or refused
            kind = "complex" if value.is_complex() else "sparse"
            raise ValueError(
                f"{name} weights: {file} holds a {kind} tensor at {key}; a model's are dense and real"
            )
    mismatch = _state_mismatch(model.state_dict(), state)
    if mismatch:  # torch's message lists every key, hundreds of characters for another model's file
        raise ValueError(f"{name} weights: {file} does not fit torchvision's {name}: {mismatch}")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        detail = str(e).strip().splitlines()
        raise ValueError(
            f"{name} weights: {file} does not fit torchvision's {name}: {detail[1] if len(detail) > 1 else e}"
        ) from e


def _state_mismatch(expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor]) -> str:
    """How ``given`` departs from a model's state dict ``expected``, a few names of each kind; ''
    where every entry is there, in its shape, and nothing else is."""

    def some(keys: list[str]) -> str:
        return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")

    missing = [k for k in expected if k not in given]
    extra = [k for k in given if k not in expected]
    reshaped = [k for k in expected if k in given and given[k].shape != expected[k].shape]
    parts = []
    if missing:
        parts.append(f"{len(missing)} of its {len(expected)} entries missing ({some(missing)})")
    if extra:
        parts.append(f"{len(extra)} entries not its own ({some(extra)})")
    if reshaped:
        k = reshaped[0]
        shapes = f"{tuple(given[k].shape)} where the model has {tuple(expected[k].shape)}"
        parts.append(f"{len(reshaped)} of another shape ({k}: {shapes})")
    return "; ".join(parts)


def _torchvision_models() -> Any:
    """``torchvision.models``, imported on first use: the import costs seconds of start-up that
    every command which builds no torchvision model (sweep, report, ``--help``) would pay."""
    import torchvision.models

    return torchvision.models


def _build_backbone(name: str, opts: BackboneOptions, num_classes: int) -> nn.Module:
    spec = _BACKBONES[name]  # its image size checked with its options (_options)
    full = getattr(_torchvision_models(), name)(weights=None)
    if opts.weights is not None:
        _load_weights(full, name, opts.weights)
    hidden = spec.default_hidden if opts.hidden is None else opts.hidden
    return FrozenBackboneClassifier(
        InputAdapter(opts.image_size),
        spec.features(full),
        classifier_head(spec.feature_dim, hidden, num_classes, opts.dropout),
    )


# ----------------------------------------------------------------------------- small models


class MnistCnn(nn.Module):
    """Two 5x5 convolutions (10 and 20 channels) with max-pooling, then fully connected 320-50-10.

    21,840 parameters for 1x28x28 input and 10 classes (study 002's 21.8K). For other input
    shapes the flatten size is ``20 * h * w`` with ``h = ((H - 4) // 2 - 4) // 2`` (same for w).
    """

    def __init__(self, input_shape: Shape, num_classes: int, dropout: float = 0.5) -> None:
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d(dropout)
        self.fc1 = nn.Linear(20 * (((h - 4) // 2 - 4) // 2) * (((w - 4) // 2 - 4) // 2), 50)
        self.fc_drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(50, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = self.fc_drop(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


VGG11_LAYOUT: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class Vgg11(nn.Module):
    """VGG-11 for 32x32 colour images, the CIFAR form study 001 trains.

    The study names the model but not its layers; this is the usual CIFAR VGG-11: eight 3x3
    convolutions (64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M), each followed by
    BatchNorm2d and ReLU, and a single Linear(512, classes) head, since five poolings leave a
    1x1x512 map. 9,231,114 parameters for 10 classes (9,225,610 with ``batch_norm=False``).
    Pooling rounds up (ceil mode), so 32x32 is unchanged and smaller inputs such as 28x28 work;
    the head then sees ``512 * ceil(H / 32) * ceil(W / 32)`` features.
    """

    def __init__(self, input_shape: Shape, num_classes: int, batch_norm: bool = True) -> None:
        super().__init__()
        c, h, w = input_shape
        layers: list[nn.Module] = []
        for item in VGG11_LAYOUT:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2, ceil_mode=True))
                h, w = math.ceil(h / 2), math.ceil(w / 2)
                continue
            assert isinstance(item, int)
            layers.append(nn.Conv2d(c, item, kernel_size=3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(item))
            layers.append(nn.ReLU(inplace=True))
            c = item
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(c * h * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def resnet18_cifar(input_shape: Shape, num_classes: int) -> nn.Module:
    """ResNet-18 for 32x32 input: 3x3 stride-1 stem and no max-pool (11,173,962 parameters).

    torchvision's ResNet-18 with its ImageNet stem (7x7 stride 2 plus max-pool) swapped for the
    CIFAR one; the global average pool makes it accept any input size.
    """
    model = _torchvision_models().resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    return model


def mlp(input_shape: Shape, num_classes: int, widths: Sequence[int] = (512, 512)) -> nn.Sequential:
    """Flatten, then Linear layers of the given hidden widths with ReLU between, then the classes."""
    layers: list[nn.Module] = [nn.Flatten()]
    previous = math.prod(input_shape)
    for width in widths:
        layers += [nn.Linear(previous, width), nn.ReLU(inplace=True)]
        previous = width
    layers.append(nn.Linear(previous, num_classes))
    return nn.Sequential(*layers)


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True, kw_only=True)
class _Entry:
    options: type[_Options]
    build: Callable[[Any, int], nn.Module]


def _backbone_entry(name: str) -> _Entry:
    return _Entry(options=BackboneOptions, build=lambda o, k: _build_backbone(name, o, k))


_REGISTRY: dict[str, _Entry] = {
    "mnist_cnn": _Entry(options=MnistCnnOptions, build=lambda o, k: MnistCnn(o.input_shape, k, o.dropout)),
    "mlp": _Entry(options=MlpOptions, build=lambda o, k: mlp(o.input_shape, k, o.widths)),
    "vgg11": _Entry(options=Vgg11Options, build=lambda o, k: Vgg11(o.input_shape, k, o.batch_norm)),
    "resnet18_cifar": _Entry(
        options=ResNet18CifarOptions, build=lambda o, k: resnet18_cifar(o.input_shape, k)
    ),
    **{name: _backbone_entry(name) for name in _BACKBONES},
}

MODELS: tuple[str, ...] = tuple(_REGISTRY)


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return _REGISTRY[name]


def model_options(name: str) -> tuple[str, ...]:
    """The option names ``build_model(name, ...)`` accepts."""
    return tuple(f.name for f in fields(_entry(name).options))


def default_input_shape(name: str) -> Shape:
    """The (C, H, W) a model expects when ``input_shape`` is not given."""
    (shape_field,) = (f for f in fields(_entry(name).options) if f.name == "input_shape")
    assert shape_field.default is not MISSING
    return shape_field.default


def check_model_options(name: str, **options: Any) -> None:
    """Raise ValueError, as ``build_model`` would, for an unknown model or a bad option; builds nothing."""
    _options(name, options)


def _options(name: str, options: dict[str, Any]) -> Any:
    entry = _entry(name)
    accepted = model_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for model {name}; it accepts {', '.join(accepted)}"
        )
    opts = entry.options(**options)
    spec = _BACKBONES.get(name)
    if spec is not None and opts.image_size < spec.min_image_size:  # said by the ranks, once started
        raise ValueError(
            f"option image_size: {name} needs at least {spec.min_image_size}, got {opts.image_size}"
        )
    return opts


def build_model(name: str, num_classes: int = 10, **options: Any) -> nn.Module:
    """Build a model by name, on the CPU, with freshly initialised (or locally loaded) weights.

    Args:
        name: one of ``MODELS``.
        num_classes: size of the output layer.
        **options: model options (see the ``*Options`` dataclasses); ``input_shape`` for all.

    Raises:
        ValueError: unknown model, unknown option, or a bad option value (named in the message).
    """
    _check_int("num_classes", num_classes, 1)
    return _entry(name).build(_options(name, options), num_classes)


def trainable_parameters(model: nn.Module) -> int:
    """Number of parameter elements that receive gradients (what data parallelism synchronises)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- CLI options


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(number):
            return number
    if "," in text:
        try:
            return [int(part) for part in text.split(",")]
        except ValueError:
            pass
    return text


PATH_OPTIONS = frozenset({"weights"})  # weights=1.5 names a file called 1.5


def parse_model_options(items: Sequence[str]) -> dict[str, Any]:
    """Turn CLI ``KEY=VALUE`` strings into ``build_model`` keyword arguments.

    Values become bools (true/false), ints, floats, int lists (``widths=2048,2048``) or strings,
    in that order of preference; a file path (``weights``) stays as given, whatever it looks like.

    Raises:
        ValueError: an item without ``=``, with an empty key or value, or a repeated key.
    """
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        value = value.strip()
        if not sep or not key.isidentifier() or not value:
            raise ValueError(f"model option {item!r} is not KEY=VALUE")
        if key in options:
            raise ValueError(f"model option {key} given twice ({item!r})")
        options[key] = value if key in PATH_OPTIONS else _parse_value(value)
    return options
