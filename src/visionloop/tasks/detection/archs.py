"""Detection architectures by name: build them, load local weights into them.

    model = build_detector("fasterrcnn_mobilenet_v3_large_fpn", num_classes=3, image_size=320)
    model.train(); losses = model(images, targets)    # targets: 1-based labels, boxes in input pixels
    model.eval();  dets = model(images)                # [{"boxes", "scores", "labels" (1-based)}]

Every arch speaks torchvision's detection API. `num_classes` counts the dataset's classes
(no background); the models are built with one more (torchvision's background 0), so the
labels they take and return are dataset label + 1. The fixed-shape module that ONNX export
writes, 0-based again, is `tasks.detection.export.export_module`.

Images reach every detector letterboxed to `image_size`² (the model card's `Letterbox`), as
float [0, 1]; each model normalises its own input. The torchvision models' internal
`GeneralizedRCNNTransform` is set to `min_size = max_size = image_size`, so an S×S input is
not rescaled (scale 1: boxes come back in input pixels) and only normalised, with
torchvision's own mean/std for that model (ImageNet for the R-CNN, RetinaNet and FCOS
families; 0.5/0.5 for SSDlite, as its builder sets).

Weights are never downloaded: torchvision builders get `weights=None, weights_backbone=None`.
- `pretrained=PATH` loads a whole detector's state dict (safetensors or weights-only .pt).
  When the file's classification head was trained for another number of classes (COCO's 91,
  say), the head keeps its fresh init, everything else is loaded and a log line says so: that
  is fine-tuning from COCO weights. Any other disagreement is an error naming the keys.
- `weights_backbone=PATH` loads an ImageNet classifier's state dict (torchvision's
  `mobilenet_v3_large` or `resnet50` keys) into the backbone's body, strictly: the classifier
  head (`fc.*`, `classifier.*`) is dropped and every other key must match. Unlike
  torchvision's own `weights_backbone=`, the body keeps ordinary, trainable BatchNorm (a
  FrozenBatchNorm2d body would change the state dict's keys between training and serving).
  SSDlite takes none (see `load_backbone`).

Labels: RetinaNet and FCOS score the background class like any other, so untrained they
predict label 0; here they are built as `RetinaNetNoBackground` / `FCOSNoBackground` (same
modules and state dict), which never do, as every torchvision detector's API promises.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torchvision.models.detection import FCOS, RetinaNet

from visionloop.core.errors import SpecError
from visionloop.models.native_detector import build_native_detector

log = logging.getLogger(__name__)

DETECTIONS_PER_IMG = 100


@dataclass(frozen=True)
class DetectorArch:
    """One registered detector: how to build it and where its class-dependent head lives."""

    name: str
    # (num_classes incl. background, image_size, kwargs) → model
    build: Callable[[int, int, dict[str, Any]], nn.Module]
    # State-dict prefix of the layers whose shapes depend on the number of classes.
    head: str
    # How an ImageNet classifier's keys map onto the backbone body's, or None if unsupported.
    backbone: str | None
    # Image sizes must be a multiple of this.
    size_multiple: int = 1
    min_size: int = 32
    # Whether the ONNX graph of `export_module` takes any batch size (see `check_exportable`).
    dynamic_batch: bool = True


# --------------------------------------------------------------------------- builders


def _native(num_classes: int, image_size: int, kwargs: dict[str, Any]) -> nn.Module:
    return build_native_detector(num_classes, input_size=image_size, **kwargs)


def _mask_background(head_outputs: dict[str, list[Tensor]]) -> dict[str, list[Tensor]]:
    """Class 0's logits set to -1e4 (score 0), so it never passes the score threshold. RetinaNet
    and FCOS score every class with its own sigmoid, background included, and so predict
    label 0 (mostly before training, rarely after): torchvision's API says it never does."""
    logits = [
        torch.cat([torch.full_like(x[..., :1], -1e4), x[..., 1:]], dim=-1) for x in head_outputs["cls_logits"]
    ]
    return {**head_outputs, "cls_logits": logits}


class RetinaNetNoBackground(RetinaNet):  # type: ignore[misc]  # torchvision is untyped
    """torchvision's RetinaNet whose post-processing never predicts the background class."""

    def postprocess_detections(  # type: ignore[no-untyped-def]
        self, head_outputs, anchors, image_shapes
    ):  # the untyped signature of the method it overrides
        return super().postprocess_detections(_mask_background(head_outputs), anchors, image_shapes)


class FCOSNoBackground(FCOS):  # type: ignore[misc]
    """torchvision's FCOS whose post-processing never predicts the background class."""

    def postprocess_detections(
        self,
        head_outputs: dict[str, list[Tensor]],
        anchors: list[list[Tensor]],
        image_shapes: list[tuple[int, int]],
    ) -> list[dict[str, Tensor]]:
        out: list[dict[str, Tensor]] = super().postprocess_detections(
            _mask_background(head_outputs), anchors, image_shapes
        )
        return out


def _torchvision(name: str) -> Callable[[int, int, dict[str, Any]], nn.Module]:
    def build(num_classes: int, image_size: int, kwargs: dict[str, Any]) -> nn.Module:
        import torchvision

        builder = torchvision.models.get_model_builder(name)
        limit = "box_detections_per_img" if name.startswith("fasterrcnn") else "detections_per_img"
        sized: dict[str, Any] = (
            {} if name.startswith("ssdlite") else {"min_size": image_size, "max_size": image_size}
        )
        model: nn.Module = builder(
            weights=None,
            weights_backbone=None,
            num_classes=num_classes,
            **{limit: DETECTIONS_PER_IMG, **sized, **kwargs},
        )
        if name.startswith(("retinanet", "fcos")):
            # The same modules and state dict: only the post-processing method changes.
            model.__class__ = RetinaNetNoBackground if isinstance(model, RetinaNet) else FCOSNoBackground
        if name.startswith("ssdlite"):
            # SSDlite's builder fixes its input at 320²; its anchors are relative to the input,
            # so another size only needs another transform (same mean/std as the builder's).
            from torchvision.models.detection.transform import GeneralizedRCNNTransform

            t = model.transform
            assert isinstance(t, GeneralizedRCNNTransform)
            model.transform = GeneralizedRCNNTransform(
                image_size,
                image_size,
                t.image_mean,
                t.image_std,
                size_divisible=1,
                fixed_size=(image_size, image_size),
            )
        return model

    return build


DETECTION_ARCHS: dict[str, DetectorArch] = {
    a.name: a
    for a in (
        DetectorArch("native_detector", _native, head="heatmap.out", backbone=None, size_multiple=16),
        DetectorArch(
            "fasterrcnn_mobilenet_v3_large_320_fpn",
            _torchvision("fasterrcnn_mobilenet_v3_large_320_fpn"),
            head="roi_heads.box_predictor",
            backbone="mobilenet",
            min_size=64,
        ),
        DetectorArch(
            "fasterrcnn_mobilenet_v3_large_fpn",
            _torchvision("fasterrcnn_mobilenet_v3_large_fpn"),
            head="roi_heads.box_predictor",
            backbone="mobilenet",
            min_size=64,
        ),
        DetectorArch(
            "ssdlite320_mobilenet_v3_large",
            _torchvision("ssdlite320_mobilenet_v3_large"),
            head="head.classification_head",
            # torchvision builds SSDlite's MobileNetV3 with a reduced tail when it is given no
            # backbone weights, so an ImageNet mobilenet_v3_large state dict cannot fit it.
            backbone=None,
            min_size=64,
        ),
        DetectorArch(
            "retinanet_resnet50_fpn_v2",
            _torchvision("retinanet_resnet50_fpn_v2"),
            head="head.classification_head.cls_logits",
            backbone="resnet",
            min_size=64,
        ),
        DetectorArch(
            "fcos_resnet50_fpn",
            _torchvision("fcos_resnet50_fpn"),
            head="head.classification_head.cls_logits",
            backbone="resnet",
            min_size=64,
        ),
    )
}

# Set by the model, never by `kwargs`: image_size, num_classes and the no-download rule own them.
_RESERVED = ("weights", "weights_backbone", "num_classes", "min_size", "max_size", "size", "input_size")


def list_detectors() -> list[str]:
    """The detector names `build_detector` accepts, sorted."""
    return sorted(DETECTION_ARCHS)


def detector_arch(arch: str) -> DetectorArch:
    """The registry entry of `arch`; SpecError listing the known names if there is none."""
    try:
        return DETECTION_ARCHS[arch]
    except KeyError:
        pass
    close = difflib.get_close_matches(arch, list(DETECTION_ARCHS), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise SpecError(
        f"unknown detection arch {arch!r}.{hint} Known detection archs: {', '.join(list_detectors())} "
        "(set `model.arch` to one of them)."
    )


def build_detector(
    arch: str,
    num_classes: int,
    *,
    image_size: int,
    pretrained: Path | bytes | None = None,
    weights_backbone: Path | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Build detector `arch` for `num_classes` dataset classes (background is added here) that
    takes `image_size`² letterboxed inputs; optionally load local weights (module docstring).
    `kwargs` go to the arch's constructor (e.g. `score_thresh`, `nms_thresh`, `widths`)."""
    entry = detector_arch(arch)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise SpecError(
            f"num_classes must be a positive integer (dataset classes, no background), got {num_classes!r}"
        )
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < entry.min_size:
        raise SpecError(f"image_size must be an integer >= {entry.min_size} for {arch}, got {image_size!r}")
    if image_size % entry.size_multiple:
        below = image_size - image_size % entry.size_multiple
        raise SpecError(
            f"{arch} needs an image_size that is a multiple of {entry.size_multiple} (its backbone's "
            "stride); "
            f"got {image_size}, use {below} or {below + entry.size_multiple}"
        )
    reserved = sorted(k for k in kwargs if k in _RESERVED)
    if reserved:
        raise SpecError(
            f"model kwargs {reserved} are not accepted for {arch}: the input size comes from image_size, the "
            "classes from the dataset, and weights only from local files (pretrained=, weights_backbone=)"
        )
    try:
        model = entry.build(num_classes + 1, image_size, dict(kwargs))
    except (TypeError, ValueError) as e:
        raise SpecError(f"{arch} cannot be built with kwargs {kwargs}: {e}. Check `model.kwargs`.") from e
    if weights_backbone is not None:
        load_backbone(model, arch, Path(weights_backbone))
    if pretrained is not None:
        from visionloop.models.weights import describe_weights, load_pretrained

        weights = pretrained if isinstance(pretrained, bytes) else Path(pretrained)
        report = load_pretrained(model, weights, head=entry.head)
        if report.skipped:
            log.warning(
                "%s: %s was trained for another number of classes; loaded all but the class head (%s), "
                "which starts fresh: fine-tuning",
                arch,
                describe_weights(weights),
                ", ".join(report.skipped),
            )
    return model


# --------------------------------------------------------------------------- backbone weights


def _backbone_body(model: nn.Module) -> nn.Module:
    body = getattr(getattr(model, "backbone", None), "body", None)
    if not isinstance(body, nn.Module):
        raise SpecError(f"{type(model).__name__} has no backbone.body to load backbone weights into")
    return body


def _map_classifier_keys(kind: str, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """An ImageNet classifier's keys → the detector body's: drop the classifier head; for
    MobileNetV3 the body holds `features` itself. A body's own keys (or `backbone.body.`-prefixed
    ones, from a detector checkpoint) pass through."""
    if any(k.startswith("backbone.body.") for k in state):
        return {k[len("backbone.body.") :]: v for k, v in state.items() if k.startswith("backbone.body.")}
    if kind == "resnet":
        return {k: v for k, v in state.items() if not k.startswith("fc.")}
    if any(k.startswith("features.") for k in state):
        return {k[len("features.") :]: v for k, v in state.items() if k.startswith("features.")}
    return dict(state)


def load_backbone(model: nn.Module, arch: str, path: Path) -> None:
    """Load ImageNet classifier weights from `path` into `model.backbone.body`, strictly."""
    from visionloop.models.weights import WeightsError, load_weights

    entry = detector_arch(arch)
    if entry.backbone is None:
        raise SpecError(
            f"{arch} does not take weights_backbone: "
            + (
                "torchvision builds SSDlite's MobileNetV3 with a reduced tail when no backbone weights are "
                "given, so ImageNet mobilenet_v3_large weights cannot fit; pass pretrained= a whole SSDlite "
                "state dict, or use fasterrcnn_mobilenet_v3_large_fpn with weights_backbone"
                if arch.startswith("ssdlite")
                else "it has no pretrained backbone: train from scratch or pass pretrained= its own weights"
            )
        )
    body = _backbone_body(model)
    state = _map_classifier_keys(entry.backbone, load_weights(path))
    own = body.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = sorted(k for k in state if k not in own)
    mismatched = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or mismatched:
        expected = {"resnet": "torchvision resnet50", "mobilenet": "torchvision mobilenet_v3_large"}[
            entry.backbone
        ]
        parts = [
            f"{len(missing)} missing from the file {missing[:5]}" if missing else "",
            f"{len(unexpected)} unexpected in the file {unexpected[:5]}" if unexpected else "",
            f"{len(mismatched)} with other shapes {mismatched[:5]}" if mismatched else "",
        ]
        raise WeightsError(
            f"{path} does not fit the backbone of {arch}: {', '.join(p for p in parts if p)}. "
            f"weights_backbone takes an ImageNet {expected} state dict (its classifier head is dropped). "
            "Nothing was loaded."
        )
    body.load_state_dict(state, strict=True)
    log.info("%s: loaded %d backbone tensors from %s", arch, len(state), path)
