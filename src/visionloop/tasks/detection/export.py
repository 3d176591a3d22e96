"""The fixed-shape module that ONNX export writes for a detector, and which archs export how.

    fixed = export_module(model)    # (B, 3, S, S) in [0, 1] → boxes, scores, labels (0-based)

`model` is one from `archs.build_detector` (torchvision's detection API, 1-based labels with
background 0); `export_module` returns exactly `(boxes (B, K, 4) float32 xyxy in input
pixels, scores (B, K) float32, labels (B, K) int64 0-based)`, padded with zeros to K: what
`visionloop.export` writes to ONNX with a dynamic batch and what the server post-processes.

Export (`export_module`, then `visionloop.export.convert.export_fp32`), checked on CPU with
onnxruntime 1.32 against the eager module, 3 classes at 128², batches 1 and 3:

| arch | TorchScript exporter (default) | dynamo exporter |
|---|---|---|
| native_detector | dynamic batch | dynamic batch |
| the five torchvision archs | dynamic batch (an ONNX Loop over the images) | fails: data-dependent shapes |

TorchScript parity: same boxes within 1e-3 px, same labels and scores within 1e-5
(tests/unit/test_detection_archs.py). `check_exportable(arch, exporter)` raises ExportError
for the combinations that fail, saying what to use instead.

fp16 and int8 (`visionloop.export.convert`) convert the network and leave everything after its
last convolution in fp32: for the native detector, the decode of `NativeExport` (sigmoid,
peaks, TopK, boxes). The demo's detector: fp16 0.03 mAP points under fp32, int8 none; with the
decode quantized as well, int8 lost 1.21 points. The torchvision archs' graphs run the network
inside an ONNX Loop, which ONNX Runtime's float16 converter does not convert correctly (ORT
refuses the result) and its quantizer does not enter (the "int8" file would be fp32): both are
refused for them, saying so; they export fp32.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from visionloop.core.errors import SpecError
from visionloop.models.native_detector import NativeDetector
from visionloop.tasks.detection.archs import DETECTIONS_PER_IMG, detector_arch

__all__ = [
    "BatchLoop",
    "NativeExport",
    "TorchvisionExport",
    "check_exportable",
    "detector_image_size",
    "export_module",
]


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
