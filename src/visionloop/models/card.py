"""The model card: everything needed to use a trained model, saved beside its weights.

Serving, export and benchmarking rebuild the model and its eval preprocessing from the card
alone (`card.create_model`, `card.eval_preprocess()`), never from their own defaults, so
they can never disagree with how the model was trained and evaluated (timm's habit of
weights carrying their preprocessing).
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from visionloop import __version__
from visionloop.core.errors import NotFoundError, VisionloopError
from visionloop.core.fsutil import TooLargeError, atomic_write_text, read_capped
from visionloop.data.manifest import DatasetManifest
from visionloop.models import registry
from visionloop.models.registry import Interpolation, ModelDefaults, model_defaults

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

MODEL_CARD_NAME = "model_card.json"
CARD_FORMAT_VERSION = 1
# A card is a few kB (class names are most of it); a dataset manifest, which also lists the
# classes, is capped at the same size.
MAX_CARD_BYTES = 4 * 2**20


class ModelCardError(VisionloopError):
    """A model card is unreadable or inconsistent."""


# Letterbox padding, as uint8 grey (0.5 after scaling to [0, 1]): the detection datasets,
# the served preprocessing and the native detector all pad with it.
LETTERBOX_FILL = 128


class EvalPreprocess(BaseModel):
    """Eval-time preprocessing, as data: resize, centre-crop (or letterbox), scale to [0, 1],
    normalise.

    `resize="crop"` (classification): the short side is resized to `floor(crop / crop_pct)`
    (both sides, for a non-square crop), then the centre `crop_size` is cut out — timm's and
    torchvision's eval recipe. `resize="letterbox"` (detection: nothing may be cut off): the
    image is scaled so its longer side fits `crop_size` (`letterbox_scale`), placed at the top
    left and padded bottom and right with `LETTERBOX_FILL`; a box in the input maps back to the
    image by dividing by that scale.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    channels: int
    resize_size: tuple[int, int] | int = Field(description="an int resizes the short side, keeping aspect")
    crop_size: tuple[int, int]
    interpolation: Interpolation
    mean: tuple[float, ...]
    std: tuple[float, ...]
    alpha_background: tuple[int, int, int] = (255, 255, 255)
    resize: Literal["crop", "letterbox"] = "crop"

    def to_transform(self) -> Callable[[Any], torch.Tensor]:
        """PIL image or uint8 tensor (C, H, W) → normalised float: what the model was evaluated on.

        PIL images are first brought to RGB exactly as ingest stored them (EXIF orientation
        applied, transparency composited onto `alpha_background`), so a served image meets
        the same pixels a training image did. Plain torch (`data.imageops`), bitwise what
        torchvision's v2 transforms give, without importing torchvision in the server,
        eval, export and labelling processes.
        """
        return _EvalTransform(self)


class _EvalTransform:
    """`EvalPreprocess.to_transform`: colour, geometry, scale to [0, 1], normalise."""

    def __init__(self, pre: EvalPreprocess) -> None:
        self.pre = pre
        self.ingest_rgb = _IngestRGB(pre.alpha_background)
        self.letterbox = Letterbox(pre.crop_size, pre.interpolation) if pre.resize == "letterbox" else None

    def __call__(self, img: Any) -> torch.Tensor:
        import torch

        from visionloop.data import imageops

        x = self.ingest_rgb(img)
        x = imageops.rgb(x) if self.pre.channels == 3 else imageops.grayscale(x, self.pre.channels)
        if self.letterbox is not None:
            x = self.letterbox(x)
        else:
            size = self.pre.resize_size
            x = imageops.resize(x, [size] if isinstance(size, int) else list(size), self.pre.interpolation)
            x = imageops.center_crop(x, list(self.pre.crop_size))
        x = x.to(torch.float32).mul_(1.0 / 255) if not x.is_floating_point() else x.to(torch.float32)
        mean = torch.as_tensor(self.pre.mean, dtype=torch.float32).view(-1, 1, 1)
        std = torch.as_tensor(self.pre.std, dtype=torch.float32).view(-1, 1, 1)
        out: torch.Tensor = x.sub(mean).div_(std)
        return out


def letterbox_scale(height: int, width: int, crop_size: tuple[int, int]) -> float:
    """Input pixels per image pixel when an image of `height` x `width` is letterboxed into
    `crop_size` (H, W): the largest scale at which the whole image fits."""
    return min(crop_size[0] / height, crop_size[1] / width)


def letterbox_shape(height: int, width: int, crop_size: tuple[int, int]) -> tuple[int, int]:
    """The (H, W) the image is resized to before padding (never past `crop_size`)."""
    s = letterbox_scale(height, width, crop_size)
    return min(crop_size[0], max(1, round(height * s))), min(crop_size[1], max(1, round(width * s)))


class Letterbox:
    """uint8 tensor (C, H, W) → (C, *crop_size): resized to fit, top left, padded with
    `LETTERBOX_FILL` bottom and right."""

    def __init__(self, crop_size: tuple[int, int], interpolation: Any) -> None:
        self.crop_size = (int(crop_size[0]), int(crop_size[1]))
        self.interpolation = interpolation

    def __call__(self, img: Any) -> Any:
        import torch

        from visionloop.data import imageops

        h, w = int(img.shape[-2]), int(img.shape[-1])
        nh, nw = letterbox_shape(h, w, self.crop_size)
        if (nh, nw) != (h, w):
            # `interpolation` is a name ("bilinear") or torchvision's InterpolationMode (its value).
            mode = str(getattr(self.interpolation, "value", self.interpolation))
            img = imageops.resize(img, [nh, nw], mode)
        out = torch.full((img.shape[0], *self.crop_size), LETTERBOX_FILL, dtype=img.dtype)
        out[:, :nh, :nw] = img
        return out


class _IngestRGB:
    """PIL image → uint8 tensor (3, H, W) via ingest's own conversion; tensors pass through."""

    def __init__(self, background: tuple[int, int, int]) -> None:
        self.background = background

    def __call__(self, img: Any) -> Any:
        from PIL import Image, ImageOps

        if not isinstance(img, Image.Image):
            return img
        import torch

        from visionloop.data.imageio import to_rgb

        rgb = to_rgb(ImageOps.exif_transpose(img), self.background)
        # One copy into CHW; it is also writable (PIL's arrays are not, and torch warns on those).
        return torch.from_numpy(rgb.transpose(2, 0, 1).copy())


def eval_preprocess(
    defaults: ModelDefaults,
    alpha_background: tuple[int, int, int] = (255, 255, 255),
    resize_mode: Literal["crop", "letterbox"] = "crop",
) -> EvalPreprocess:
    """The eval recipe for an input size, crop_pct, interpolation and mean/std."""
    c, h, w = defaults.input_size
    resize: tuple[int, int] | int
    if resize_mode == "letterbox":
        # The longer side is what the letterbox fits; a decoder never needs more than that.
        resize = max(h, w)
    elif h == w:
        resize = math.floor(h / defaults.crop_pct)
    else:
        resize = (math.floor(h / defaults.crop_pct), math.floor(w / defaults.crop_pct))
    return EvalPreprocess(
        channels=c,
        resize_size=resize,
        crop_size=(h, w),
        interpolation=defaults.interpolation,
        mean=defaults.mean,
        std=defaults.std,
        alpha_background=alpha_background,
        resize=resize_mode,
    )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# The largest input a card may declare (`input_size`): the train spec's image_size limit, and
# more channels than any camera gives.
MAX_INPUT_SIDE = 4096
MAX_INPUT_CHANNELS = 16


class ModelCard(BaseModel):
    # protected_namespaces=(): `model_kwargs` is our field, not pydantic's `model_` API.
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    format_version: int = CARD_FORMAT_VERSION
    # The registered task whose contract serves, exports and benchmarks this model.
    task: str = Field("classification", pattern=r"^[a-z][a-z0-9_]{0,63}$")
    arch: str = Field(description="registry name, e.g. resnet18 or small_cnn")
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    num_classes: int = Field(ge=1)
    class_names: list[str]
    input_size: tuple[int, int, int] = Field(description="(C, H, W) the model was trained and evaluated at")
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_pct: float = Field(gt=0.0, le=1.0)
    interpolation: Interpolation = "bilinear"
    alpha_background: tuple[int, int, int] = Field(
        (255, 255, 255), description="ingest composited transparent pixels onto this colour"
    )
    resize: Literal["crop", "letterbox"] = Field(
        "crop",
        description="crop: resize and centre-crop (classification); letterbox: fit and pad (detection)",
    )
    dataset_version: str | None = None
    # The versions the dataset came from (`visionloop data add`), its parent first, back to the
    # first version; None for a dataset ingested directly.
    dataset_lineage: list[str] | None = None
    created_at: str = Field(default_factory=_now)
    visionloop_version: str = __version__
    # None stands for a non-finite value (a diverged run's NaN loss): JSON has no NaN.
    metrics: dict[str, float | None] | None = None
    run_uid: str | None = None

    @field_validator("metrics")
    @classmethod
    def _finite_or_none(cls, v: dict[str, float | None] | None) -> dict[str, float | None] | None:
        if v is None:
            return None
        return {k: x if x is not None and math.isfinite(x) else None for k, x in v.items()}

    @field_validator("model_kwargs")
    @classmethod
    def _json_safe(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"must be JSON-serialisable (numbers, strings, lists, dicts): {e}") from e
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ModelCard:
        if len(self.class_names) != self.num_classes:
            raise ValueError(
                f"class_names has {len(self.class_names)} names but num_classes is {self.num_classes}"
            )
        if len(set(self.class_names)) != len(self.class_names):
            dupes = sorted({n for n in self.class_names if self.class_names.count(n) > 1})
            raise ValueError(f"class_names must be unique; repeated: {dupes}")
        c = self.input_size[0]
        if min(self.input_size) < 1:
            raise ValueError(f"input_size must be positive (C, H, W), got {self.input_size}")
        # The export, bench and server allocate batches of this size: a hand-edited card with
        # a million pixels a side asked for terabytes. A train spec's image_size is at most 4096.
        if c > MAX_INPUT_CHANNELS or max(self.input_size[1:]) > MAX_INPUT_SIDE:
            raise ValueError(
                f"input_size must be at most ({MAX_INPUT_CHANNELS}, {MAX_INPUT_SIDE}, {MAX_INPUT_SIDE}) "
                f"(C, H, W), got {self.input_size}"
            )
        if len(self.mean) != c or len(self.std) != c:
            raise ValueError(
                f"mean and std need {c} values (one per input channel), got {self.mean} and {self.std}"
            )
        # NaN passes `s <= 0` (every comparison with NaN is false) and JSON readers accept NaN
        # and Infinity: a hand-edited card would normalise every image to NaN.
        if not all(math.isfinite(x) for x in (*self.mean, *self.std)):
            raise ValueError(f"mean and std must be finite numbers, got {self.mean} and {self.std}")
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std values must be > 0, got {self.std}")
        return self

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_manifest(
        cls,
        manifest: DatasetManifest,
        *,
        arch: str,
        model_kwargs: dict[str, Any] | None = None,
        input_size: tuple[int, int, int] | None = None,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        crop_pct: float | None = None,
        interpolation: Interpolation | None = None,
        metrics: dict[str, float | None] | None = None,
        run_uid: str | None = None,
    ) -> ModelCard:
        """A card for `arch` trained on `manifest`'s dataset; unset preprocessing comes from
        the registry's `model_defaults(arch)`."""
        d = model_defaults(arch)
        return cls(
            arch=arch,
            model_kwargs=dict(model_kwargs or {}),
            num_classes=manifest.num_classes,
            class_names=list(manifest.classes),
            input_size=input_size or d.input_size,
            mean=mean or d.mean,
            std=std or d.std,
            crop_pct=crop_pct if crop_pct is not None else d.crop_pct,
            interpolation=interpolation or d.interpolation,
            alpha_background=manifest.image_policy.alpha_background,
            dataset_version=manifest.version,
            dataset_lineage=manifest.ancestry or None,
            metrics=metrics,
            run_uid=run_uid,
        )

    # ----------------------------------------------------------------- use

    @property
    def defaults(self) -> ModelDefaults:
        return ModelDefaults(
            input_size=self.input_size,
            mean=self.mean,
            std=self.std,
            crop_pct=self.crop_pct,
            interpolation=self.interpolation,
        )

    def eval_preprocess(self) -> EvalPreprocess:
        return eval_preprocess(self.defaults, self.alpha_background, self.resize)

    def create_model(self, weights: Path | bytes | None = None) -> nn.Module:
        """The architecture this card describes, with `weights` (a state dict file, or
        safetensors bytes) loaded."""
        return registry.create_model(self.arch, self.num_classes, pretrained=weights, **self.model_kwargs)

    # ----------------------------------------------------------------- files

    def save(self, path: Path) -> Path:
        """Write the card as JSON, atomically. A directory gets `model_card.json` inside."""
        path = _card_path(path)
        atomic_write_text(path, self.model_dump_json(indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> ModelCard:
        """Read and validate a card (a file, or a directory holding `model_card.json`)."""
        path = _card_path(path)
        if not path.exists():  # a FIFO or folder exists, and read_capped names it below
            raise NotFoundError(
                f"no model card at {path}. A model folder holds {MODEL_CARD_NAME} beside its weights; "
                "point at the folder of a trained model (train writes one with every model)."
            )
        try:
            # read_capped: a FIFO in the card's place must not hang the reader; the size cap
            # and the errors below cover what a hand-edited card can do to json.loads.
            raw = json.loads(read_capped(path, MAX_CARD_BYTES, what="a model card").decode("utf-8"))
        except TooLargeError as e:
            raise ModelCardError(
                f"{path} is over {MAX_CARD_BYTES // 2**20} MiB, far more than a model card holds; "
                "restore it from the run's artifacts."
            ) from e
        except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON, a 5000-digit number
            why = str(e).split("; use sys.set_int_max_str_digits")[0]  # advice for programmers only
            raise ModelCardError(
                f"{path} cannot be read as JSON ({why}); restore it from the run's artifacts."
            ) from e
        except RecursionError as e:
            raise ModelCardError(
                f"{path} cannot be read as JSON (it nests too deeply); restore it from the run's artifacts."
            ) from e
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if isinstance(version, int) and version > CARD_FORMAT_VERSION:
            raise ModelCardError(
                f"{path} has format_version {version}, newer than this visionloop "
                f"understands ({CARD_FORMAT_VERSION}); upgrade visionloop."
            )
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise ModelCardError(
                f"{path} is not a valid model card:\n{e}\nRestore it from the run's artifacts."
            ) from e


def _card_path(path: Path) -> Path:
    path = Path(path)
    return path / MODEL_CARD_NAME if path.is_dir() else path
