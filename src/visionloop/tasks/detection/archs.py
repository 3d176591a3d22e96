"""Detection architectures by name, and the fixed-shape module that export writes to ONNX.

    model = build_detector("fasterrcnn_mobilenet_v3_large_fpn", num_classes=3, image_size=320)
    model.train(); losses = model(images, targets)    # targets: 1-based labels, boxes in input pixels
    model.eval();  dets = model(images)                # [{"boxes", "scores", "labels" (1-based)}]
    fixed = export_module(model)                       # (B,3,S,S) → boxes, scores, labels (0-based)

Every arch speaks torchvision's detection API. `num_classes` counts the dataset's classes
(no background); the models are built with one more (torchvision's background 0), so the
labels they take and return are dataset label + 1. `export_module` shifts back to 0-based.

Images reach every detector letterboxed to `image_size`² (the model card's `Letterbox`), as
float [0, 1]; each model normalises its own input. The torchvision models' internal
`GeneralizedRCNNTransform` is set to `min_size = max_size = image_size`, so an S×S input is
not rescaled (scale 1: boxes come back in input pixels) and only normalised, with
torchvision's own mean/std for that model (ImageNet for the R-CNN, RetinaNet and FCOS
families; 0.5/0.5 for SSDlite, as its builder sets).

Export (`export_module`, then `visionloop.export.convert.export_fp32`), checked on CPU with
onnxruntime 1.32 against the eager module, 3 classes at 128², batches 1 and 3:

| arch | TorchScript exporter (default) | dynamo exporter |
|---|---|---|
| native_detector | dynamic batch | dynamic batch |
| the five torchvision archs | dynamic batch (an ONNX Loop over the images) | fails: data-dependent shapes |

TorchScript parity: same boxes within 1e-3 px, same labels and scores within 1e-5
(tests/unit/test_detection_archs.py). `check_exportable(arch, exporter)` raises ExportError
for the combinations that fail, saying what to use instead.

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
from visionloop.models.native_detector import NativeDetector, build_native_detector

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
    pretrained: Path | None = None,
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
        from visionloop.models.weights import load_pretrained

        report = load_pretrained(model, Path(pretrained), head=entry.head)
        if report.skipped:
            log.warning(
                "%s: %s was trained for another number of classes; loaded all but the class head (%s), "
                "which starts fresh: fine-tuning",
                arch,
                pretrained,
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


# --------------------------------------------------------------------------- export


def _fit(t: Tensor, k: int) -> Tensor:
    """First `k` rows of `t` along dim 1, zero-padded when it has fewer. Written as
    cat-then-slice, not as an index with a data-dependent length, so that a trace records
    fixed shapes."""
    pad = t.new_zeros((t.shape[0], k, *t.shape[2:]))
    return torch.cat([t, pad], dim=1)[:, :k]


class NativeExport(nn.Module):
    """The native detector's `forward_fixed`, padded or cut to `max_detections`.

    There is no NMS in this graph, on purpose: `decode` already keeps only the heatmap's local
    maxima (a 3×3 max pool, CenterNet's NMS) and its top K, all with fixed shapes, so the graph
    is one static dataflow for every runtime (ORT CPU/CUDA, TensorRT: no NonMaxSuppression op,
    no data-dependent shapes, any batch size). What stays variable — the score threshold, NMS
    per class, mapping boxes back through the letterbox — is cheap on ≤ K boxes and is done by
    the server in numpy after the graph, the same way for every runtime and precision.
    """

    def __init__(self, model: NativeDetector, max_detections: int) -> None:
        super().__init__()
        self.model = model
        self.max_detections = max_detections

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        boxes, scores, labels = self.model.forward_fixed(x)
        k = self.max_detections
        return _fit(boxes.float(), k), _fit(scores.float(), k), _fit(labels.long(), k)


class TorchvisionExport(nn.Module):
    """A torchvision detector run in eval mode on each image of the batch (NMS and the score
    threshold inside its graph), each image's detections padded with zeros (score 0, label 0,
    box 0) or cut to `max_detections`; labels shifted to 0-based. Eager only: a trace of it
    unrolls the loop over images, so its graph would only take the traced batch size;
    `export_module` wraps a batch-1 trace of it in `BatchLoop` instead."""

    def __init__(self, model: nn.Module, max_detections: int) -> None:
        super().__init__()
        self.model = model
        self.max_detections = max_detections

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        dets = self.model(list(x.unbind(0)))
        k = self.max_detections
        boxes = torch.cat([_fit(d["boxes"].float()[None], k) for d in dets])
        scores = torch.cat([_fit(d["scores"].float()[None], k) for d in dets])
        # 1-based with background 0 → 0-based; padding is label 0 with score 0.
        labels = torch.cat([_fit((d["labels"].long() - 1)[None], k) for d in dets])
        return boxes, scores, labels


class BatchLoop(nn.Module):
    """Runs a per-image module (a batch-1 trace) over the batch in a scripted loop, which the
    TorchScript ONNX exporter writes as an ONNX `Loop`: a graph that takes any batch size.
    (Tracing the batch directly unrolls torchvision's per-image post-processing into as many
    copies as the example had images: ORT then refuses every other batch size.) The images
    run one after another inside the graph, so a batch saves calls, not compute."""

    def __init__(self, per_image: nn.Module) -> None:
        super().__init__()
        self.per_image = per_image

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        boxes: list[Tensor] = []
        scores: list[Tensor] = []
        labels: list[Tensor] = []
        for i in range(x.shape[0]):
            b, s, lb = self.per_image(x[i : i + 1])
            boxes.append(b)
            scores.append(s)
            labels.append(lb)
        return torch.cat(boxes), torch.cat(scores), torch.cat(labels)


def detector_image_size(model: nn.Module) -> int:
    """The S of the S×S letterboxed input `model` was built for."""
    if isinstance(model, NativeDetector):
        return int(model.input_size)
    min_size = getattr(getattr(model, "transform", None), "min_size", None)
    if not min_size:
        raise SpecError(f"{type(model).__name__} is not a detector from build_detector: it has no input size")
    return int(min_size[0])


def export_module(model: nn.Module, *, max_detections: int = DETECTIONS_PER_IMG) -> nn.Module:
    """A module mapping a letterboxed (B, 3, S, S) float batch in [0, 1] to exactly
    `(boxes (B, K, 4) float32 xyxy in input pixels, scores (B, K) float32, labels (B, K) int64
    0-based)` with K = `max_detections`, padded with zeros: what ONNX export writes (with a
    dynamic batch) and what the server post-processes. Put in eval mode; `model` too.

    The native detector gives `NativeExport` (no NMS in the graph, see there). A torchvision
    detector gives a scripted `BatchLoop` over a batch-1 trace of `TorchvisionExport` (NMS
    inside): it is traced here, on the model's device, at the model's S, so export it as it is
    (TorchScript exporter; the dynamo exporter cannot take it) and make a new one if the
    model's weights or settings change.
    """
    import warnings

    if max_detections < 1:
        raise SpecError(f"max_detections must be >= 1, got {max_detections}")
    model.eval()
    if isinstance(model, NativeDetector):
        return NativeExport(model, max_detections).eval()
    size = detector_image_size(model)
    device = next(model.parameters()).device
    per_image = TorchvisionExport(model, max_detections).eval()
    # Any image will do: torchvision's detectors trace their data-dependent parts (how many
    # boxes survive each stage) as shape computations, not as constants.
    example = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings about Python ints, handled by torchvision
        traced = torch.jit.trace(per_image, example, check_trace=False)  # type: ignore[no-untyped-call]
        scripted: nn.Module = torch.jit.script(BatchLoop(traced))
    return scripted.eval()


def check_exportable(arch: str, exporter: str = "torchscript") -> None:
    """Raise ExportError if `export_module` of `arch` cannot be exported to ONNX with
    `exporter` ("torchscript" or "dynamo"); see the module docstring's export table."""
    from visionloop.export.report import ExportError

    detector_arch(arch)
    if exporter not in ("torchscript", "dynamo"):
        raise ExportError(f"unknown ONNX exporter {exporter!r}: use 'torchscript' (default) or 'dynamo'")
    if exporter == "dynamo" and arch != "native_detector":
        # torch.export needs every shape expressible from the input's; the number of boxes
        # that pass torchvision's score thresholds and NMS is data-dependent (unbacked
        # symbols), and its post-processing branches on it, so export stops at step 1.
        raise ExportError(
            f"{arch} cannot be exported with the dynamo exporter: torchvision's detection post-processing "
            "has data-dependent shapes (how many boxes pass the score threshold and NMS) that torch.export "
            "cannot trace. Use the TorchScript exporter (exporter='torchscript', the default), which writes "
            "a graph with a dynamic batch for it."
        )
