"""The detection architecture registry (build, weights) and the fixed-shape export module,
exported to ONNX and run in onnxruntime."""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
import torchvision
from torch import nn
from torchvision.models.detection import FCOS, FasterRCNN
from torchvision.models.detection.ssd import SSD

from visionloop.core.errors import SpecError
from visionloop.export.convert import export_fp32
from visionloop.export.report import ExportError
from visionloop.models.native_detector import NativeDetector
from visionloop.models.weights import WeightsError, save_weights
from visionloop.tasks.detection.archs import build_detector, list_detectors
from visionloop.tasks.detection.export import check_exportable, export_module

TORCHVISION_ARCHS = [
    "fasterrcnn_mobilenet_v3_large_320_fpn",
    "fasterrcnn_mobilenet_v3_large_fpn",
    "ssdlite320_mobilenet_v3_large",
    "retinanet_resnet50_fpn_v2",
    "fcos_resnet50_fpn",
]
# Small inputs keep the ResNet-50 archs to a few seconds on two cores.
SIZES = {"native_detector": 64, "retinanet_resnet50_fpn_v2": 64, "fcos_resnet50_fpn": 64}
OUTPUTS = ("boxes", "scores", "labels")


def _size(arch: str) -> int:
    return SIZES.get(arch, 96)


def _targets(s: int) -> list[dict[str, torch.Tensor]]:
    return [
        {"boxes": torch.tensor([[4.0, 6.0, 0.5 * s, 0.6 * s]]), "labels": torch.tensor([1])},
        {
            "boxes": torch.tensor([[2.0, 2.0, 0.3 * s, 0.25 * s], [0.4 * s, 0.4 * s, 0.9 * s, 0.95 * s]]),
            "labels": torch.tensor([3, 2]),
        },
    ]


def _spread_scores(model: nn.Module) -> None:
    """Untrained detectors score every box alike (their class priors: ~0.01), so nearly all
    scores tie or fall under the 0.05 threshold. Spread the class logits, so that parity
    tests compare many distinct detections."""
    with torch.no_grad():
        if isinstance(model, NativeDetector):
            assert model.heatmap.out.bias is not None
            model.heatmap.out.bias.fill_(-1.0)
            model.heatmap.out.weight.normal_(0.0, 1.0)
            model.box.out.weight.normal_(0.0, 0.3)
            return
        head = getattr(getattr(model, "head", None), "classification_head", None)
        logits = getattr(head, "cls_logits", None)
        if isinstance(logits, nn.Conv2d) and logits.bias is not None:  # RetinaNet, FCOS
            logits.bias.zero_()
            logits.weight.normal_(0.0, 0.05)
        if hasattr(head, "module_list"):
            # SSDlite's init (N(0, 0.03) weights) fades the features to ~0 through its many
            # layers, leaving a softmax over equal logits: every score 1/4. He init keeps them.
            for m in model.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight)


def test_list_detectors_and_unknown_arch() -> None:
    assert list_detectors() == sorted(["native_detector", *TORCHVISION_ARCHS])
    with pytest.raises(SpecError) as e:
        build_detector("fasterrcnn_mobilenet", 3, image_size=96)
    for name in list_detectors():
        assert name in str(e.value)


def test_bad_sizes_and_reserved_kwargs_are_spec_errors() -> None:
    with pytest.raises(SpecError, match=r"multiple of 16.*use 96 or 112"):
        build_detector("native_detector", 3, image_size=100)
    with pytest.raises(SpecError, match="num_classes"):
        build_detector("native_detector", 0, image_size=64)
    with pytest.raises(SpecError, match=r"\['min_size'\]"):
        build_detector("fcos_resnet50_fpn", 3, image_size=64, min_size=800)
    with pytest.raises(SpecError, match="cannot be built"):
        build_detector("native_detector", 3, image_size=64, no_such_kwarg=1)


@pytest.mark.parametrize("arch", ["native_detector", *TORCHVISION_ARCHS])
def test_every_arch_trains_and_detects_at_its_image_size(arch: str) -> None:
    torch.manual_seed(0)
    s = _size(arch)
    model = build_detector(arch, 3, image_size=s)
    images = torch.rand(2, 3, s, s)
    model.train()
    losses = model(list(images), _targets(s))
    assert isinstance(losses, dict) and len(losses) >= 2
    assert all(v.ndim == 0 and math.isfinite(float(v.detach())) for v in losses.values())
    torch.stack(list(losses.values())).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert any(g is not None and float(g.abs().sum()) > 0 for g in grads)

    model.eval()
    _spread_scores(model)
    with torch.no_grad():
        dets = model(images)  # a batched tensor is accepted as well as a list
    assert len(dets) == 2
    for d in dets:
        n = d["boxes"].shape[0]
        assert d["boxes"].shape == (n, 4) and d["scores"].shape == (n,) and d["labels"].shape == (n,)
        assert n <= 100
        # 1-based labels (background 0 never predicted), boxes in the S×S input's pixels.
        assert bool(((d["labels"] >= 1) & (d["labels"] <= 3)).all())
        assert bool((d["boxes"] >= 0).all() and (d["boxes"] <= s).all())
    assert sum(int(d["boxes"].shape[0]) for d in dets) > 0


def test_torchvision_transform_does_not_rescale_the_letterboxed_input() -> None:
    """The S×S input is only normalised (torchvision's mean/std for the model), never resized."""
    imagenet = (torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225]))
    half = (torch.full((3,), 0.5), torch.full((3,), 0.5))
    for arch, s, (mean, std) in [
        ("fasterrcnn_mobilenet_v3_large_fpn", 96, imagenet),
        ("fcos_resnet50_fpn", 64, imagenet),
        ("ssdlite320_mobilenet_v3_large", 128, half),
    ]:
        model = build_detector(arch, 3, image_size=s).eval()
        assert isinstance(model, (FasterRCNN, FCOS, SSD))
        x = torch.rand(3, s, s)
        batch, _ = model.transform([x])
        assert batch.image_sizes == [(s, s)] and batch.tensors.shape == (1, 3, s, s)
        expected = (x - mean[:, None, None]) / std[:, None, None]
        assert torch.allclose(batch.tensors[0], expected, atol=1e-5)
        # At most 100 detections an image, every arch (Faster R-CNN keeps the count on its ROI head).
        head = model.roi_heads if isinstance(model, FasterRCNN) else model
        assert head.detections_per_img == 100, arch
    frcnn = build_detector("fasterrcnn_mobilenet_v3_large_320_fpn", 3, image_size=96)
    assert isinstance(frcnn, FasterRCNN)
    assert frcnn.roi_heads.detections_per_img == 100


@pytest.mark.parametrize(
    ("arch", "suffix"),
    [("native_detector", ".safetensors"), ("fasterrcnn_mobilenet_v3_large_320_fpn", ".pt")],
)
def test_pretrained_round_trip_gives_identical_outputs(arch: str, suffix: str, tmp_path: Path) -> None:
    s = _size(arch)
    torch.manual_seed(1)
    a = build_detector(arch, 3, image_size=s).eval()
    _spread_scores(a)
    path = tmp_path / f"w{suffix}"
    if suffix == ".safetensors":
        save_weights(a, path)
    else:
        torch.save(a.state_dict(), path)
    torch.manual_seed(2)
    b = build_detector(arch, 3, image_size=s, pretrained=path).eval()
    x = torch.rand(2, 3, s, s)
    with torch.no_grad():
        out_a, out_b = export_module(a)(x), export_module(b)(x)
    assert float(out_a[1].max()) > 0.05
    for ta, tb in zip(out_a, out_b, strict=True):
        assert torch.equal(ta, tb)


def test_pretrained_for_other_classes_loads_all_but_the_head(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    coco_like = build_detector("fasterrcnn_mobilenet_v3_large_320_fpn", 7, image_size=96)
    assert isinstance(coco_like, FasterRCNN)
    save_weights(coco_like, tmp_path / "other.safetensors")
    with caplog.at_level(logging.WARNING, logger="visionloop.tasks.detection.archs"):
        model = build_detector(
            "fasterrcnn_mobilenet_v3_large_320_fpn",
            3,
            image_size=96,
            pretrained=tmp_path / "other.safetensors",
        )
    assert isinstance(model, FasterRCNN)
    assert "roi_heads.box_predictor.cls_score.weight" in caplog.text and "fine-tuning" in caplog.text
    assert model.roi_heads.box_predictor.cls_score.weight.shape[0] == 4  # 3 classes + background
    assert torch.equal(model.backbone.body["0"][0].weight, coco_like.backbone.body["0"][0].weight)
    assert torch.equal(model.rpn.head.cls_logits.weight, coco_like.rpn.head.cls_logits.weight)
    # Another architecture entirely is an error that names keys, and loads nothing.
    with pytest.raises(WeightsError, match="does not fit"):
        build_detector("native_detector", 3, image_size=64, pretrained=tmp_path / "other.safetensors")


def test_weights_backbone_loads_imagenet_mobilenet_into_the_body(tmp_path: Path) -> None:
    torch.manual_seed(3)
    classifier = torchvision.models.mobilenet_v3_large(weights=None)
    torch.save(classifier.state_dict(), tmp_path / "mnv3.pth")
    model = build_detector(
        "fasterrcnn_mobilenet_v3_large_fpn", 3, image_size=96, weights_backbone=tmp_path / "mnv3.pth"
    )
    assert isinstance(model, FasterRCNN)
    body = model.backbone.body.state_dict()
    features = classifier.features.state_dict()
    assert set(body) == set(features)
    assert all(torch.equal(body[k], features[k]) for k in features)


def test_weights_backbone_loads_imagenet_resnet50_and_refuses_other_files(tmp_path: Path) -> None:
    torch.manual_seed(4)
    resnet = torchvision.models.resnet50(weights=None)
    save_weights(resnet, tmp_path / "r50.safetensors")
    model = build_detector(
        "fcos_resnet50_fpn", 3, image_size=64, weights_backbone=tmp_path / "r50.safetensors"
    )
    assert isinstance(model, FCOS)
    assert torch.equal(model.backbone.body.layer4[2].conv3.weight, resnet.layer4[2].conv3.weight)
    assert torch.equal(model.backbone.body.bn1.running_var, resnet.bn1.running_var)

    save_weights(torchvision.models.resnet18(weights=None), tmp_path / "r18.safetensors")
    with pytest.raises(WeightsError) as e:
        build_detector("fcos_resnet50_fpn", 3, image_size=64, weights_backbone=tmp_path / "r18.safetensors")
    message = str(e.value)
    assert "missing from the file" in message and "layer1.0.conv3.weight" in message
    assert "other shapes" in message and "resnet50" in message and "Nothing was loaded" in message
    # A MobileNet file for a ResNet arch names the keys it did not expect.
    save_weights(torchvision.models.mobilenet_v3_large(weights=None), tmp_path / "mnv3.safetensors")
    with pytest.raises(WeightsError, match=r"unexpected in the file \['classifier"):
        build_detector(
            "retinanet_resnet50_fpn_v2", 3, image_size=64, weights_backbone=tmp_path / "mnv3.safetensors"
        )
    with pytest.raises(SpecError, match="reduced tail"):
        build_detector(
            "ssdlite320_mobilenet_v3_large", 3, image_size=96, weights_backbone=tmp_path / "mnv3.safetensors"
        )


@pytest.mark.parametrize("arch", ["native_detector", "fasterrcnn_mobilenet_v3_large_320_fpn"])
def test_export_module_shapes_dtypes_and_zero_padding(arch: str) -> None:
    torch.manual_seed(5)
    s = _size(arch)
    model = build_detector(arch, 3, image_size=s)
    _spread_scores(model)
    x = torch.rand(2, 3, s, s)
    with torch.no_grad():
        boxes, scores, labels = export_module(model, max_detections=150)(x)
        cut = export_module(model, max_detections=5)(x)
        eager = model.eval()(x)
    assert boxes.shape == (2, 150, 4) and scores.shape == (2, 150) and labels.shape == (2, 150)
    assert (boxes.dtype, scores.dtype, labels.dtype) == (torch.float32, torch.float32, torch.int64)
    assert torch.equal(cut[1], scores[:, :5]) and torch.equal(cut[2], labels[:, :5])
    assert torch.equal(scores[:, -1], torch.zeros(2)) and torch.equal(boxes[:, -1], torch.zeros(2, 4))
    assert int(labels.min()) >= 0 and int(labels.max()) <= 2
    if arch != "native_detector":
        # The torchvision detector's own detections, 0-based, then zeros.
        for i, d in enumerate(eager):
            n = d["boxes"].shape[0]
            assert 0 < n < 150
            assert torch.allclose(boxes[i, :n], d["boxes"], atol=1e-3)
            assert torch.equal(labels[i, :n], d["labels"] - 1) and torch.equal(scores[i, :n], d["scores"])
            assert not scores[i, n:].any() and not labels[i, n:].any() and not boxes[i, n:].any()
    else:
        # forward_fixed has no NMS: its top-K peaks, still ordered by score.
        assert bool((scores[:, :-1] >= scores[:, 1:]).all())


def _rows(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, i: int) -> np.ndarray:
    """Image i's detections over 0.05 as rows (score, label, box), best first."""
    keep = scores[i] > 0.05
    rows = np.concatenate([scores[i][keep, None], labels[i][keep, None], boxes[i][keep]], axis=1)
    return rows[np.argsort(-rows[:, 0], kind="stable")]


def _iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    lo, hi = np.maximum(box[:2], boxes[:, :2]), np.minimum(box[2:], boxes[:, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=1)
    area = np.prod(box[2:] - box[:2])
    areas = np.prod(boxes[:, 2:] - boxes[:, :2], axis=1)
    iou: np.ndarray = inter / np.maximum(area + areas - inter, 1e-9)
    return iou


def _assert_same_detections(want: np.ndarray, have: np.ndarray, nms: float) -> None:
    """Every reference detection has a partner with the same label, a score within 1e-4 and a
    box within 1e-3 pixels. Runtimes add in a different order, so a detection may go unpaired
    only where a rounding difference can flip a decision: its score sits on the 0.05 threshold
    or on the top-100 cut, or its overlap with a better box of its class sits on the NMS
    threshold (0.4999997 against 0.5 was seen)."""
    assert len(want) > 0
    free = np.ones(len(have), dtype=bool)
    unpaired = []
    for row in want:
        close = (
            free
            & (have[:, 1] == row[1])
            & (np.abs(have[:, 0] - row[0]) <= 1e-4)
            & (np.abs(have[:, 2:] - row[2:]).max(axis=1) < 1e-3)
        )
        if close.any():
            free[np.flatnonzero(close)[0]] = False
        else:
            unpaired.append(row)
    edges = [0.05, min(want[:, 0].min(), have[:, 0].min() if len(have) else 1.0)]
    both = np.concatenate([want, have])
    for row in [*unpaired, *have[free]]:
        on_edge = min(abs(row[0] - e) for e in edges) <= 1e-4
        better = both[(both[:, 1] == row[1]) & (both[:, 0] > row[0] + 1e-4)]
        on_nms = len(better) > 0 and bool((np.abs(_iou(row[2:], better[:, 2:]) - nms) < 1e-4).any())
        assert on_edge or on_nms, f"no partner for detection {row}"


def _onnx_parity(arch: str, tmp_path: Path, exporter: str = "torchscript") -> None:
    ort = pytest.importorskip("onnxruntime", reason="export extra")
    torch.manual_seed(6)
    s = _size(arch)
    model = build_detector(arch, 3, image_size=s).eval()
    _spread_scores(model)
    head = model.roi_heads if isinstance(model, FasterRCNN) else model  # Faster R-CNN: its ROI head
    nms = float(cast(float, head.nms_thresh))
    module = export_module(model)
    path = tmp_path / f"{arch}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_fp32(module, (3, s, s), path, exporter=exporter, output_names=OUTPUTS)  # type: ignore[arg-type]
    options = ort.SessionOptions()
    options.log_severity_level = 3  # ORT's notes on renaming shared initializers in the Loop body
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == list(OUTPUTS)
    x = torch.rand(3, 3, s, s, generator=torch.Generator().manual_seed(7))
    for batch in (1, 3):  # neither is the exporter's example batch (2)
        with torch.no_grad():
            ref = [t.numpy() for t in module(x[:batch])]
        got = session.run(None, {"input": x[:batch].numpy()})
        assert [g.shape for g in got] == [(batch, 100, 4), (batch, 100), (batch, 100)]
        assert [g.dtype for g in got] == [np.float32, np.float32, np.int64]
        for i in range(batch):
            _assert_same_detections(_rows(ref[0], ref[1], ref[2], i), _rows(got[0], got[1], got[2], i), nms)


def test_native_detector_exports_to_onnx_with_a_dynamic_batch(tmp_path: Path) -> None:
    _onnx_parity("native_detector", tmp_path)


@pytest.mark.parametrize("arch", TORCHVISION_ARCHS)
def test_torchvision_detectors_export_to_onnx_with_a_dynamic_batch(arch: str, tmp_path: Path) -> None:
    _onnx_parity(arch, tmp_path)


def test_native_detector_exports_with_dynamo_too(tmp_path: Path) -> None:
    check_exportable("native_detector", "dynamo")
    _onnx_parity("native_detector", tmp_path, exporter="dynamo")


def test_torchvision_detectors_refuse_the_dynamo_exporter_with_the_alternative() -> None:
    check_exportable("fcos_resnet50_fpn", "torchscript")
    for arch in TORCHVISION_ARCHS:
        with pytest.raises(ExportError, match="exporter='torchscript'"):
            check_exportable(arch, "dynamo")
