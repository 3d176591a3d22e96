"""The native detector: torchvision's detection API (losses in train mode, per-image dicts in
eval mode), targets that encode and decode back to the same boxes in each input image's
pixels, gradients everywhere, determinism, and a loss that falls when it optimises."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from visionloop.models.native_detector import STRIDE, NativeDetector, build_native_detector

NUM_CLASSES = 4  # three classes + background, as torchvision counts
SMALL = {"input_size": 64, "widths": (8, 16, 24, 32), "neck": 16}


@pytest.fixture(autouse=True)
def _deterministic() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _batch(seed: int = 0) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    images = [torch.rand(3, 64, 64, generator=g) for _ in range(4)] + [torch.rand(3, 48, 80, generator=g)]
    targets = [
        {
            "boxes": torch.tensor([[4.0, 6.0, 30.0, 40.0], [36.0, 30.0, 60.0, 58.0]]),
            "labels": torch.tensor([1, 3]),
        },
        {"boxes": torch.tensor([[10.0, 10.0, 22.0, 30.0]]), "labels": torch.tensor([2])},
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)},  # background image
        {"boxes": torch.tensor([[0.0, 0.0, 64.0, 64.0]]), "labels": torch.tensor([1])},
        {"boxes": torch.tensor([[50.0, 5.0, 78.0, 40.0]]), "labels": torch.tensor([3])},
    ]
    # Paint each object so that there is something to learn.
    for image, target in zip(images, targets, strict=True):
        for (x1, y1, x2, y2), label in zip(target["boxes"].tolist(), target["labels"].tolist(), strict=True):
            image[label - 1, int(y1) : int(y2), int(x1) : int(x2)] = 1.0
    return images, targets


def _model(seed: int = 0, **kwargs: object) -> NativeDetector:
    torch.manual_seed(seed)
    return build_native_detector(NUM_CLASSES, **{**SMALL, **kwargs})


def test_eval_mode_returns_torchvision_dicts_in_each_input_images_pixels() -> None:
    model = _model(score_thresh=0.0, detections_per_img=40).eval()
    # Boxes of ~e^2.5 * 4 = 49 px around every cell: many cross the image's edges.
    assert model.box.out.bias is not None
    with torch.no_grad():
        model.box.out.bias.copy_(torch.tensor([0.0, 0.0, 2.5, 2.5]))
    images, _ = _batch()
    with torch.no_grad():
        out = model(images)
    assert isinstance(out, list) and len(out) == len(images)
    for image, det in zip(images, out, strict=True):
        assert set(det) == {"boxes", "scores", "labels"}
        n = det["boxes"].shape[0]
        assert 10 < n <= 40
        assert det["boxes"].shape == (n, 4) and det["boxes"].dtype == torch.float32
        assert det["scores"].shape == (n,) and det["labels"].shape == (n,)
        assert det["labels"].dtype == torch.int64
        # torchvision's labels: 1..num_classes-1, every class among this many detections, no 0.
        assert set(det["labels"].tolist()) == set(range(1, NUM_CLASSES))
        assert ((det["scores"] >= 0) & (det["scores"] <= 1)).all()
        assert (det["scores"][:-1] >= det["scores"][1:]).all()
        h, w = image.shape[1:]
        b = det["boxes"]
        assert (b[:, 0] >= 0).all() and (b[:, 2] <= w).all() and (b[:, 1] >= 0).all() and (b[:, 3] <= h).all()
        assert (b[:, 2] > b[:, 0]).all() and (b[:, 3] > b[:, 1]).all()
        assert bool((b[:, 0] == 0).any()) and bool((b[:, 2] == w).any())  # clipped, not dropped


def test_raw_forward_and_decode_have_fixed_shapes() -> None:
    model = _model(topk=20).eval()
    x = torch.randn(2, 3, 64, 64)
    heat, reg = model.forward_raw(x)
    assert heat.shape == (2, NUM_CLASSES - 1, 64 // STRIDE, 64 // STRIDE)
    assert reg.shape == (2, 4, 64 // STRIDE, 64 // STRIDE)
    boxes, scores, labels = model.decode(heat, reg)
    assert boxes.shape == (2, 20, 4) and scores.shape == (2, 20) and labels.shape == (2, 20)
    assert ((labels >= 0) & (labels < NUM_CLASSES - 1)).all()  # decode's labels are 0-based


def test_train_mode_returns_finite_positive_losses_also_for_background_only_batches() -> None:
    model = _model().train()
    images, targets = _batch()
    losses = model(images, targets)
    assert isinstance(losses, dict) and set(losses) == {"loss_heatmap", "loss_box"}
    for value in losses.values():
        assert value.ndim == 0 and math.isfinite(float(value)) and float(value) > 0
    empty = [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}] * 2
    background = model(images[:2], empty)
    assert isinstance(background, dict)
    assert float(background["loss_box"]) == 0.0 and float(background["loss_heatmap"]) > 0
    sum(background.values(), torch.zeros(())).backward()  # the graph stays whole


def test_every_parameter_gets_a_gradient() -> None:
    model = _model().train()
    images, targets = _batch()
    losses = model(images, targets)
    assert isinstance(losses, dict)
    sum(losses.values(), torch.zeros(())).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert missing == []


def _ideal_head(
    model: NativeDetector, targets: list[dict[str, torch.Tensor]], scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head output a perfect network would give: logits of the encoded heatmap, and the
    regression that `_boxes_from_reg` turns into the encoded box targets."""
    heat_t, box_t, weight = model.encode(targets, scales)
    logits = torch.logit(heat_t.clamp(1e-4, 0.999))
    s = heat_t.shape[-1]
    centres = (torch.arange(s, dtype=torch.float32) + 0.5) * STRIDE
    cx = (box_t[..., 0] + box_t[..., 2]) / 2
    cy = (box_t[..., 1] + box_t[..., 3]) / 2
    reg = torch.stack(
        [
            (cx - centres.view(1, 1, s)) / STRIDE,
            (cy - centres.view(1, s, 1)) / STRIDE,
            torch.log((box_t[..., 2] - box_t[..., 0]).clamp(min=1e-3) / STRIDE),
            torch.log((box_t[..., 3] - box_t[..., 1]).clamp(min=1e-3) / STRIDE),
        ],
        dim=1,
    )
    return logits, reg * (weight > 0)[:, None]


def test_encoded_targets_decode_back_to_the_boxes_in_input_image_pixels() -> None:
    model = _model().eval()
    # Images of other sizes than the network's 64: letterboxed by 64/80 and 64/128.
    images = [torch.zeros(3, 48, 80), torch.zeros(3, 128, 96)]
    targets = [
        {
            "boxes": torch.tensor([[3.0, 5.0, 27.5, 40.0], [44.0, 8.0, 76.0, 30.0]]),
            "labels": torch.tensor([2, 3]),
        },
        {"boxes": torch.tensor([[10.0, 70.0, 50.0, 120.0]]), "labels": torch.tensor([1])},
    ]
    _, scales = model.transform(images)
    assert torch.allclose(scales, torch.tensor([64 / 80, 64 / 128]))
    logits, reg = _ideal_head(model, targets, scales)
    boxes, scores, labels = model.decode(logits, reg)
    out = model.postprocess(boxes, scores, labels, scales, [(48, 80), (128, 96)])
    for det, target in zip(out, targets, strict=True):
        order = torch.argsort(det["boxes"][:, 0])
        assert torch.equal(det["labels"][order], target["labels"])
        assert torch.allclose(det["boxes"][order], target["boxes"], atol=1e-3)
        assert torch.allclose(det["scores"], torch.full_like(det["scores"], 0.999))


def test_letterbox_scales_the_longer_side_and_pads_with_what_normalises_to_zero() -> None:
    model = _model()
    x, scales = model.transform(
        [torch.full((3, 40, 80), 0.7), torch.full((3, 64, 64), 200, dtype=torch.uint8)]
    )
    assert x.shape == (2, 3, 64, 64)
    assert torch.allclose(scales, torch.tensor([0.8, 1.0]))
    content = (0.7 - 0.5) / 0.25
    assert torch.allclose(x[0, :, :32, :], torch.full((3, 32, 64), content))
    assert torch.equal(x[0, :, 32:, :], torch.zeros(3, 32, 64))  # padding: the mean, 0 once normalised
    assert torch.allclose(x[1], torch.full((3, 64, 64), (200 / 255 - 0.5) / 0.25))  # uint8 → [0, 1]


def test_labels_must_be_torchvision_one_based() -> None:
    model = _model().train()
    images, _ = _batch()
    zero = [{"boxes": torch.tensor([[1.0, 1.0, 9.0, 9.0]]), "labels": torch.tensor([0])}]
    with pytest.raises(ValueError, match="1-based"):
        model(images[:1], zero)
    with pytest.raises(ValueError, match="counts the background"):
        build_native_detector(1)


def _train(model: NativeDetector, steps: int) -> list[float]:
    images, targets = _batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(steps):
        out = model(images, targets)
        assert isinstance(out, dict)
        loss = sum(out.values(), torch.zeros(()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def test_same_seed_same_weights_after_three_steps() -> None:
    a, b, c = _model(seed=5), _model(seed=5), _model(seed=6)
    _train(a, 3)
    _train(b, 3)
    _train(c, 3)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_optimising_one_batch_reduces_the_loss() -> None:
    losses = _train(_model(), 25)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0]


def test_forward_fixed_exports_to_onnx_and_runs_the_same_in_onnxruntime(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime", reason="export extra")
    model = _model(topk=30).eval()
    # Noise, and a heatmap head spread wider than at init (where every score is ~0.01): no
    # near-tied scores for TopK to order differently in ONNX Runtime.
    x = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.heatmap.out.weight.normal_(0.0, 1.0)
        model.box.out.weight.normal_(0.0, 0.3)
        ref = model.forward_fixed(x)
    path = tmp_path / "det.onnx"

    class Fixed(torch.nn.Module):  # what an export wrapper holds
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.model.forward_fixed(x)

    torch.onnx.export(
        Fixed(),
        (x[:2],),
        str(path),
        input_names=["images"],
        output_names=["boxes", "scores", "labels"],
        dynamic_axes={name: {0: "batch"} for name in ("images", "boxes", "scores", "labels")},
        dynamo=False,
    )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    boxes, scores, labels = session.run(None, {"images": x.numpy()})  # another batch size than traced
    assert boxes.shape == (3, 30, 4)
    assert np.allclose(scores, ref[1].numpy(), atol=1e-5)
    assert np.array_equal(labels, ref[2].numpy())
    assert np.allclose(boxes, ref[0].numpy(), atol=1e-3)
