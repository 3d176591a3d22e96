"""The architecture registry: one name → one factory `(num_classes, **kwargs) -> nn.Module`.

Two kinds of entry share one contract (the module maps a float batch (N, C, H, W) to logits
(N, num_classes), in train and eval mode alike):

- native models (`visionloop.models.native`), registered with `@register_model("name")`;
- every torchvision classification model, by its torchvision name, always built with
  `weights=None` — visionloop never downloads weights; `pretrained=PATH` loads a local file.

Registration is lazy: importing this module imports neither torch nor torchvision (the CLI
imports it to print help). The first query imports the native models and lists torchvision's
builders; no model is constructed until `create_model`.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from visionloop.core.errors import SpecError

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

Interpolation = Literal["nearest", "bilinear", "bicubic"]
ModelFactory = Callable[..., "nn.Module"]
_FactoryT = TypeVar("_FactoryT", bound=ModelFactory)

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ModelDefaults:
    """The preprocessing a model expects (timm's `pretrained_cfg`, reduced to what eval needs).

    Eval resizes the short side to `floor(input_size / crop_pct)` and centre-crops `input_size`.
    """

    input_size: tuple[int, int, int]  # (C, H, W)
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    crop_pct: float = 0.875
    interpolation: Interpolation = "bilinear"

    def __post_init__(self) -> None:
        c, h, w = self.input_size
        # Programming errors in a registration, so plain ValueError: no user input reaches here.
        if min(c, h, w) < 1:
            raise ValueError(f"input_size must be positive (C, H, W), got {self.input_size}")
        if len(self.mean) != c or len(self.std) != c:
            raise ValueError(f"mean and std need {c} values (one per channel), got {self.mean}, {self.std}")
        if not 0.0 < self.crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct}")


@dataclass(frozen=True)
class _Entry:
    name: str
    factory: ModelFactory
    source: Literal["native", "torchvision"]
    # A callable for torchvision entries: reading their weight metadata imports torchvision.
    defaults: ModelDefaults | Callable[[], ModelDefaults]


_REGISTRY: dict[str, _Entry] = {}
_loaded = False


def register_model(name: str, *, defaults: ModelDefaults | None = None) -> Callable[[_FactoryT], _FactoryT]:
    """Register a factory `(num_classes: int, **kwargs) -> nn.Module` under `name`.

    >>> @register_model("my_net", defaults=ModelDefaults(input_size=(3, 64, 64)))
    ... def my_net(num_classes: int, width: int = 32) -> nn.Module: ...
    """

    def decorate(factory: _FactoryT) -> _FactoryT:
        existing = _REGISTRY.get(name)
        # Re-registering the same function (a module reloaded in a notebook) is harmless;
        # two different factories under one name is a bug that would silently pick one.
        if existing is not None and getattr(existing.factory, "__qualname__", None) != factory.__qualname__:
            raise ValueError(f"model {name!r} is already registered ({existing.source}); pick another name")
        _REGISTRY[name] = _Entry(
            name=name,
            factory=factory,
            source="native",
            defaults=defaults or ModelDefaults(input_size=(3, 224, 224)),
        )
        return factory

    return decorate


def list_models(pattern: str = "*") -> list[str]:
    """Sorted names matching an fnmatch pattern, e.g. `list_models("resnet*")`."""
    _ensure_loaded()
    return sorted(n for n in _REGISTRY if fnmatch.fnmatchcase(n, pattern))


def is_model(name: str) -> bool:
    _ensure_loaded()
    return name in _REGISTRY


def model_source(name: str) -> Literal["native", "torchvision"]:
    return _entry(name).source


def model_defaults(name: str) -> ModelDefaults:
    """Input size, mean/std, crop_pct and interpolation the named model expects."""
    d = _entry(name).defaults
    return d if isinstance(d, ModelDefaults) else d()


def create_model(
    name: str, num_classes: int, *, pretrained: Path | bytes | None = None, **kwargs: Any
) -> nn.Module:
    """Build `name` with a `num_classes`-way head; optionally load local weights.

    `pretrained` is a `.safetensors`, `.pt` or `.pth` file (a state dict), or safetensors
    bytes already read (a registered version's checked weights). When its head was
    trained for a different number of classes, the head keeps its fresh initialisation and
    everything else is loaded; any other disagreement is an error that names the keys.
    """
    entry = _entry(name)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise SpecError(f"num_classes must be a positive integer, got {num_classes!r} (e.g. num_classes=10).")
    if "weights" in kwargs:
        raise SpecError(
            "model kwarg 'weights' is not accepted: visionloop never downloads weights. "
            "Pass pretrained=PATH to a local .safetensors or .pt state dict instead."
        )
    try:
        model = entry.factory(num_classes, **kwargs)
    except (TypeError, ValueError) as e:
        # Almost always a misspelt, unsupported or out-of-range kwarg from a spec's `model.kwargs`.
        raise SpecError(
            f"model {name!r} cannot be built with kwargs {kwargs}: {e}. "
            f"Check `model.kwargs` against the {entry.source} constructor of {name!r}."
        ) from e
    if pretrained is not None:
        from visionloop.models.weights import load_pretrained

        load_pretrained(model, pretrained if isinstance(pretrained, bytes) else Path(pretrained))
    return model


# --------------------------------------------------------------------------- lookup


def _entry(name: str) -> _Entry:
    _ensure_native()
    if name in _REGISTRY:
        # A native model needs no torchvision: its import pulls in torch._dynamo, seconds of
        # start-up for every process that trains, evaluates or exports a small_cnn.
        return _REGISTRY[name]
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        pass
    close = difflib.get_close_matches(name, list(_REGISTRY), n=5, cutoff=0.6)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise SpecError(
        f"unknown model {name!r}.{hint} List them all with `visionloop archs`, or by pattern, "
        f"e.g. `visionloop archs 'resnet*'` (in Python: visionloop.models.list_models('resnet*'))."
    )


def _ensure_native() -> None:
    import visionloop.models.native  # noqa: F401  (registers on import)


def _ensure_loaded() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    # Native models first, so that a native name wins over a torchvision one.
    _ensure_native()
    _register_torchvision()


# --------------------------------------------------------------------------- torchvision

# Builders whose weights=None defaults break the one-tensor contract or warn on every call:
# googlenet/inception_v3 return (logits, aux...) tuples in train mode when aux_logits=True,
# and warn that their default init will change unless init_weights is given.
_TV_KWARGS: dict[str, dict[str, Any]] = {
    "googlenet": {"aux_logits": False, "init_weights": True},
    "inception_v3": {"aux_logits": False, "init_weights": True},
}


def _register_torchvision() -> None:
    import torchvision

    for name in torchvision.models.list_models(module=torchvision.models):
        if name in _REGISTRY:
            continue
        _REGISTRY[name] = _Entry(
            name=name,
            factory=functools.partial(_build_torchvision, name),
            source="torchvision",
            defaults=functools.partial(_torchvision_defaults, name),
        )


def _build_torchvision(name: str, num_classes: int, **kwargs: Any) -> nn.Module:
    import torchvision

    builder = torchvision.models.get_model_builder(name)
    model: nn.Module = builder(
        weights=None, num_classes=num_classes, **{**_TV_KWARGS.get(name, {}), **kwargs}
    )
    return model


@functools.cache
def _torchvision_defaults(name: str) -> ModelDefaults:
    """Read preprocessing from torchvision's weight metadata (no download: metadata only)."""
    import torchvision

    weights_enum = torchvision.models.get_model_weights(name)
    candidates = [weights_enum.DEFAULT, *weights_enum]
    if name.startswith("vit_"):
        # A ViT built with weights=None has image_size=224 (only weights override it), so the
        # 518/384-pixel SWAG recipes would describe a model we do not build.
        candidates = [w for w in candidates if w.transforms().crop_size[0] == 224]
    t = candidates[0].transforms()
    crop, resize = int(t.crop_size[0]), int(t.resize_size[0])
    return ModelDefaults(
        input_size=(3, crop, crop),
        mean=tuple(float(x) for x in t.mean),
        std=tuple(float(x) for x in t.std),
        # torchvision stores resize and crop sizes; timm's crop_pct is their ratio, rounded down
        # so that floor(crop / crop_pct) gives back torchvision's resize size.
        crop_pct=math.floor(crop / resize * 1000) / 1000,
        interpolation=t.interpolation.value,
    )
