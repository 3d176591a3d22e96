"""The detection task's training half: box-consistent seeded augmentation, letterboxing,
datasets and record targets, the evaluator adapter, the export comparison, the model card."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from visionloop.core.errors import SpecError
from visionloop.data.shards import ShardReader, ShardWriter, make_record, record_field
from visionloop.models.card import LETTERBOX_FILL
from visionloop.models.native_detector import build_native_detector
from visionloop.specs import AugmentSpec
from visionloop.tasks import get_task
from visionloop.tasks.detection.boxes import encode_boxes
from visionloop.tasks.detection.data import ShardDetectionDataset, record_target
from visionloop.tasks.detection.evaluate import DetectionComparison, DetectionTaskEvaluator, MapScorer
from visionloop.tasks.detection.metrics import DetectionEvaluator
from visionloop.tasks.detection.task import DetectionTask
from visionloop.tasks.detection.transforms import DetectionEvalTransform, DetectionTrainTransform

CLASSES = ["a", "b", "c"]
RED = (250, 10, 10)


def _scene(h: int, w: int, boxes: list[list[int]]) -> torch.Tensor:
    """A dark uint8 (3, H, W) image with a red rectangle filling each box exactly."""
    img = torch.full((3, h, w), 20, dtype=torch.uint8)
    for x1, y1, x2, y2 in boxes:
        img[:, y1:y2, x1:x2] = torch.tensor(RED, dtype=torch.uint8)[:, None, None]
    return img


def _is_red(img: torch.Tensor, x: float, y: float) -> bool:
    px = img[:, int(y), int(x)].tolist()
    return px[0] > 200 and px[1] < 60 and px[2] < 60


def _is_object(img: torch.Tensor, x: float, y: float) -> bool:
    """Red, or red after photometric distortion (which may permute channels): one bright
    channel, unlike the dark background and the grey padding."""
    px = img[:, int(y), int(x)]
    return int(px.max()) > 150 and int(px.max()) - int(px.min()) > 100


def _png(img: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, format="PNG")
    return buf.getvalue()


def _shards(
    tmp: Path,
    scenes: list[tuple[int, int, list[list[int]], list[int]]],
    flags: list[list[bool]] | None = None,
) -> ShardReader:
    writer = ShardWriter(tmp / "shards")
    for i, (h, w, boxes, labels) in enumerate(scenes):
        ignore = flags[i] if flags is not None else None
        record = make_record(
            _png(_scene(h, w, boxes)),
            len(boxes),
            100 + i,
            boxes=encode_boxes(np.asarray(boxes, dtype=np.float32).reshape(-1, 4), labels, ignore),
        )
        writer.add(record)
    writer.close()
    return ShardReader(tmp / "shards")


# ---------------------------------------------------------------------- registration


def test_registered_with_its_contract_and_import_light() -> None:
    task = get_task("detection")
    assert isinstance(task, DetectionTask)
    assert (task.primary_metric, task.primary_mode, task.metric_label) == ("mAP", "max", "mAP")
    assert task.output_names == ("boxes", "scores", "labels")
    assert task.image_endpoint == "detect" and task.model_normalizes is True
    # The server imports the task without torch.
    code = (
        "import sys; from visionloop.tasks import get_task; get_task('detection'); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------- transforms


def test_a_flip_moves_the_box_with_the_pixels() -> None:
    img = _scene(50, 100, [[10, 10, 30, 40]])
    t = DetectionTrainTransform(64, AugmentSpec(hflip=1.0, random_resized_crop=False), seed=0)
    out, boxes, labels, scale = t(img, torch.tensor([[10.0, 10, 30, 40]]), torch.tensor([2]), 0, 7)
    assert scale == pytest.approx(0.64)
    # Flipped in a 100-wide image: x1 = 100 - 30, x2 = 100 - 10; then scaled by 0.64.
    assert torch.allclose(boxes, torch.tensor([[70 * 0.64, 10 * 0.64, 90 * 0.64, 40 * 0.64]]))
    assert labels.tolist() == [2]
    cx, cy = (boxes[0, 0] + boxes[0, 2]) / 2, (boxes[0, 1] + boxes[0, 3]) / 2
    assert _is_red(out, float(cx), float(cy)) and not _is_red(out, 20 * 0.64, float(cy))
    # Below the letterboxed image (32 rows of 64): grey padding.
    assert out[:, 40:, :].eq(LETTERBOX_FILL).all()


@pytest.mark.parametrize(
    "augment",
    [
        AugmentSpec(),
        AugmentSpec(scale=(0.2, 0.5), hflip=0.5),
        AugmentSpec(iou_crop=True, zoom_out=1.0, color_jitter=0.2),
    ],
    ids=["rrc", "small-crops", "iou-crop-zoom-out-photometric"],
)
def test_random_geometry_keeps_boxes_on_their_objects(augment: AugmentSpec) -> None:
    gt = [[8, 8, 40, 40], [60, 20, 96, 52]]
    img = _scene(64, 112, gt)
    t = DetectionTrainTransform(96, augment, seed=3)
    checked = 0
    for index in range(40):
        out, boxes, labels, _ = t(img, torch.tensor(gt, dtype=torch.float32), torch.tensor([0, 1]), 0, index)
        assert out.shape == (3, 96, 96) and out.dtype == torch.uint8
        assert boxes.dtype == torch.float32 and labels.dtype == torch.int64
        assert len(boxes) == len(labels)
        assert ((boxes >= 0) & (boxes <= 96)).all() and (boxes[:, 2:] > boxes[:, :2]).all()
        for x1, y1, x2, y2 in boxes.tolist():
            if x2 - x1 >= 4 and y2 - y1 >= 4:
                assert _is_object(out, (x1 + x2) / 2, (y1 + y2) / 2), (index, boxes)
                checked += 1
    assert checked > 20


def test_same_seed_epoch_and_index_give_the_same_sample_and_leave_the_global_rng() -> None:
    img = _scene(64, 80, [[8, 8, 40, 40]])
    boxes, labels = torch.tensor([[8.0, 8, 40, 40]]), torch.tensor([1])
    t = DetectionTrainTransform(64, AugmentSpec(zoom_out=0.5, color_jitter=0.3), seed=11)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    a = t(img, boxes, labels, 2, 5)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = t(img, boxes, labels, 2, 5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[3] == b[3]
    others = [
        t(img, boxes, labels, 3, 5),
        t(img, boxes, labels, 2, 6),
        DetectionTrainTransform(64, AugmentSpec(zoom_out=0.5, color_jitter=0.3), seed=12)(
            img, boxes, labels, 2, 5
        ),
    ]
    assert all(not torch.equal(a[0], o[0]) for o in others)


def test_eval_letterbox_scales_boxes_and_pads_grey() -> None:
    img = _scene(40, 80, [[20, 10, 60, 30]])
    out, boxes, _, scale = DetectionEvalTransform(160)(
        img, torch.tensor([[20.0, 10, 60, 30]]), torch.tensor([0])
    )
    assert scale == 2.0 and out.shape == (3, 160, 160)
    assert torch.equal(boxes, torch.tensor([[40.0, 20, 120, 60]]))
    assert _is_red(out, 80, 40) and not _is_red(out, 30, 40)
    assert out[:, 80:, :].eq(LETTERBOX_FILL).all()


# ---------------------------------------------------------------------- datasets and targets


def test_eval_dataset_and_record_targets_agree(tmp_path: Path) -> None:
    reader = _shards(
        tmp_path,
        [
            (40, 80, [[20, 10, 60, 30]], [1]),
            (64, 32, [], []),
            (50, 50, [[1, 2, 3, 4], [5, 5, 45, 45]], [0, 2]),
        ],
    )
    ds = ShardDetectionDataset(reader, DetectionEvalTransform(64), CLASSES)
    samples = [ds[(i, 0)] for i in range(3)]
    task = get_task("detection")
    images, targets = task.collate(samples)
    assert images.shape == (3, 3, 64, 64) and images.dtype == torch.uint8
    assert targets[0]["image_id"] == 100 and targets[0]["orig_size"] == (40, 80)
    assert targets[0]["scale"] == pytest.approx(0.8)
    assert torch.allclose(targets[0]["boxes"], torch.tensor([[16.0, 8, 48, 24]]))
    assert targets[1]["boxes"].shape == (0, 4) and targets[1]["labels"].dtype == torch.int64
    assert targets[2]["labels"].tolist() == [0, 2]
    from_records = task.record_targets(reader.read_many([0, 1, 2]), image_size=64)
    for a, b in zip(targets, from_records, strict=True):
        assert torch.equal(a["boxes"], b["boxes"]) and torch.equal(a["labels"], b["labels"])
        assert (a["scale"], a["image_id"], a["orig_size"]) == (b["scale"], b["image_id"], b["orig_size"])
    with pytest.raises(SpecError, match="image_size"):
        task.record_targets(reader.read_many([0]))
    moved = task.targets_to(targets, torch.device("cpu"))
    assert torch.equal(moved[2]["boxes"], targets[2]["boxes"]) and moved[2]["scale"] == targets[2]["scale"]


def test_ignored_boxes_leave_training_targets_and_stay_flagged_in_evaluation(tmp_path: Path) -> None:
    scenes = [
        (40, 80, [[20, 10, 60, 30], [2, 2, 12, 12]], [1, 0]),
        (50, 50, [[1, 2, 3, 4], [5, 5, 45, 45], [10, 10, 20, 20]], [0, 2, 1]),
        (32, 32, [[4, 4, 20, 20]], [2]),
    ]
    flags = [[False, True], [True, False, True], [False]]
    reader = _shards(tmp_path, scenes, flags)
    # Unflagged: the old layout.
    assert record_field(reader[2], "boxes") == encode_boxes([[4, 4, 20, 20]], [2])
    ev = ShardDetectionDataset(reader, DetectionEvalTransform(64), CLASSES)
    _, targets = get_task("detection").collate([ev[(i, 0)] for i in range(3)])
    assert [t["iscrowd"].tolist() for t in targets] == flags
    assert [t["labels"].tolist() for t in targets] == [[1, 0], [0, 2, 1], [2]]
    assert targets[0]["iscrowd"].dtype == torch.bool
    assert torch.allclose(targets[0]["boxes"], torch.tensor([[16.0, 8, 48, 24], [1.6, 1.6, 9.6, 9.6]]))
    # The export gate and bench score through the contract's record_targets: same flags.
    contract = get_task("detection").record_targets(reader.read_many([0, 1, 2]), image_size=64)
    assert [t["iscrowd"].tolist() for t in contract] == flags
    for i, target in enumerate(targets):
        again = record_target(reader[i], 64, len(CLASSES))
        for key in ("boxes", "labels", "iscrowd"):
            assert torch.equal(again[key], target[key]), key
        assert (again["scale"], again["image_id"], again["orig_size"]) == (
            target["scale"],
            target["image_id"],
            target["orig_size"],
        )
    # No augmentation to move the boxes: training sees exactly the unflagged ones.
    still = DetectionTrainTransform(64, AugmentSpec(hflip=0.0, random_resized_crop=False), seed=0)
    train = ShardDetectionDataset(reader, still, CLASSES)
    samples = [train[(i, 0)] for i in range(3)]
    assert [t["labels"].tolist() for _, t in samples] == [[1], [2], [2]]
    assert [t["iscrowd"].tolist() for _, t in samples] == [[False], [False], [False]]
    assert torch.allclose(samples[1][1]["boxes"], torch.tensor([[5.0, 5, 45, 45]]) * 64 / 50)
    assert torch.allclose(samples[0][1]["boxes"], targets[0]["boxes"][:1])


# ---------------------------------------------------------------------- model half


def test_train_loss_shifts_labels_and_eval_forward_shifts_them_back() -> None:
    torch.manual_seed(0)
    task = get_task("detection")
    # Every peak kept (an untrained model scores ~0.01): eval outputs are not empty.
    model = build_native_detector(len(CLASSES) + 1, input_size=32, score_thresh=0.0)
    images = torch.rand(2, 3, 32, 32)
    targets = [
        {"boxes": torch.tensor([[2.0, 2, 20, 20]]), "labels": torch.tensor([2])},
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)},
    ]
    loss = task.train_loss(model, images, targets, task.loss_fn(None))  # type: ignore[arg-type]
    parts = model(list(images), [{"boxes": t["boxes"], "labels": t["labels"] + 1} for t in targets])
    assert isinstance(parts, dict)
    assert torch.allclose(loss, sum(parts.values()))  # type: ignore[arg-type]
    model.eval()
    with torch.no_grad():
        outs, loss_sum = task.eval_forward(model, images, targets, task.loss_fn(None))  # type: ignore[arg-type]
        raw = model(list(images))
    assert loss_sum == 0.0 and len(outs) == 2
    assert torch.equal(outs[0]["labels"], raw[0]["labels"] - 1) and len(outs[0]["labels"]) > 0
    assert outs[0]["labels"].min() >= 0 and outs[0]["labels"].max() < len(CLASSES)
    assert task.check_output(raw[:1], CLASSES) is None
    assert "list of one dict" in (task.check_output(raw, CLASSES) or "")
    assert "expected (K, 4)" in (
        task.check_output(
            [{"boxes": torch.zeros(3), "scores": torch.zeros(3), "labels": torch.zeros(3)}], CLASSES
        )
        or ""
    )


def test_build_model_needs_the_image_size() -> None:
    task = get_task("detection")
    model = task.build_model("native_detector", CLASSES, kwargs={"image_size": 64})
    assert model.input_size == 64
    model = task.build_model("native_detector", CLASSES, kwargs={}, image_size=48)
    assert model.input_size == 48
    with pytest.raises(SpecError, match="image_size"):
        task.build_model("native_detector", CLASSES, kwargs={})
    with pytest.raises(SpecError, match="image_size"):
        task.build_model("native_detector", CLASSES, kwargs={"image_size": 32}, image_size=48)


# ---------------------------------------------------------------------- evaluation


def _predictions(rng: np.random.Generator, targets: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    preds = []
    for t in targets:
        gt = t["boxes"]
        assert isinstance(gt, torch.Tensor)
        jitter = torch.from_numpy(rng.normal(0, 2.0, size=(len(gt), 4)).astype(np.float32))
        extra = torch.tensor([[5.0, 5, 30, 30]])
        preds.append(
            {
                "boxes": torch.cat([gt + jitter, extra]).clamp(min=0),
                "scores": torch.from_numpy(rng.uniform(0.1, 1.0, len(gt) + 1).astype(np.float32)),
                "labels": torch.from_numpy(rng.integers(0, 3, len(gt) + 1)),
            }
        )
    return preds


def _targets(rng: np.random.Generator, n: int, *, apart: bool = False) -> list[dict[str, Any]]:
    """Random targets in input pixels with their scale; `apart`: no two boxes overlap (NMS
    keeps every one of perfect predictions)."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        k = int(rng.integers(0, 4))
        xy = rng.uniform(0, 60, size=(k, 2))
        if apart:
            xy[:, 0] = 70.0 * np.arange(k)
        wh = rng.uniform(4, 60, size=(k, 2))
        scale = float(rng.uniform(0.3, 2.0))
        out.append(
            {
                "boxes": torch.from_numpy(np.concatenate([xy, xy + wh], 1).astype(np.float32)) * scale,
                "labels": torch.from_numpy(rng.integers(0, 3, k)),
                "scale": scale,
                "image_id": 10 + i,
                "orig_size": (128, 128),
            }
        )
    return out


def test_the_evaluator_measures_in_stored_image_pixels() -> None:
    rng = np.random.default_rng(0)
    targets = _targets(rng, 24)
    preds = _predictions(rng, targets)
    adapter = DetectionTaskEvaluator(CLASSES)
    adapter.update(preds[:10], targets[:10], 0.0)
    adapter.update(preds[10:], targets[10:], 0.0)
    reference = DetectionEvaluator(CLASSES)
    reference.update(
        [
            {"boxes": p["boxes"] / t["scale"], "scores": p["scores"], "labels": p["labels"]}
            for p, t in zip(preds, targets, strict=True)
        ],
        [
            {"boxes": t["boxes"] / t["scale"], "labels": t["labels"], "image_id": t["image_id"]}
            for t in targets
        ],
    )
    expected = reference.compute()
    result = adapter.compute()
    for key in ("mAP", "mAP50", "mAP75", "mAP_small", "mAP_medium", "AR100", "AP/a", "AP/b", "AP/c"):
        assert result.metrics[key] == pytest.approx(expected[key], abs=1e-9), key
    assert 0.05 < result.metrics["mAP"] < 0.95
    assert result.summary.startswith(f"mAP {expected['mAP']:.3f}")
    assert result.report["num_images"] == 24
    # Measured in input pixels instead, the size buckets would differ.
    unscaled = DetectionEvaluator(CLASSES)
    unscaled.update(preds, [{"boxes": t["boxes"], "labels": t["labels"]} for t in targets])
    assert unscaled.compute()["mAP_small"] != pytest.approx(expected["mAP_small"])
    # The state round-trips (what the trainer all-reduces).
    again = DetectionTaskEvaluator(CLASSES)
    again.load_state(adapter.state())
    assert again.compute().metrics == result.metrics


def test_artifacts_include_the_image_grid(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    targets = _targets(rng, 5)
    preds = _predictions(rng, targets)
    for p in preds:
        p["image"] = torch.rand(3, 64, 64)
    ev = DetectionTaskEvaluator(CLASSES)
    ev.update(preds, targets, 0.0)
    written = ev.write_artifacts(ev.compute(), tmp_path)
    assert sorted(p.name for p in written) == ["confusion_matrix.png", "pr_curves.png", "predictions.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def _raw(targets: list[dict[str, Any]], k: int = 8) -> list[torch.Tensor]:
    """Fixed-shape raw outputs that find every target box (score 0.9), padded with zeros."""
    boxes = torch.zeros(len(targets), k, 4)
    scores = torch.zeros(len(targets), k)
    labels = torch.zeros(len(targets), k, dtype=torch.int64)
    for i, t in enumerate(targets):
        gt, lab = t["boxes"], t["labels"]
        assert isinstance(gt, torch.Tensor) and isinstance(lab, torch.Tensor)
        boxes[i, : len(gt)] = gt
        scores[i, : len(gt)] = 0.9
        labels[i, : len(gt)] = lab
    return [boxes, scores, labels]


def test_export_comparison_identical_and_perturbed() -> None:
    rng = np.random.default_rng(2)
    targets = _targets(rng, 12, apart=True)
    ref = _raw(targets)
    same = DetectionComparison()
    same.update(ref, [t.clone() for t in ref], targets)
    m = same.result()
    assert (m.metric, m.samples, m.agreement, m.max_abs_diff, m.drop_points) == ("mAP", 12, 1.0, 0.0, 0.0)
    assert m.reference_score == pytest.approx(1.0)

    moved = [ref[0] + 4.0, ref[1].clone(), ref[2].clone()]
    worse = DetectionComparison(CLASSES)
    worse.update(ref, moved, targets)
    w = worse.result()
    with_boxes = sum(1 for t in targets if len(t["labels"]))
    assert w.agreement == pytest.approx((12 - with_boxes) / 12)
    assert w.max_abs_diff == pytest.approx(4.0)
    assert w.reference_score == pytest.approx(1.0) and w.score < 0.9 and w.drop_points > 10

    # Rows of (nearly) tied scores may come out of two runtimes' top-K in either order: the
    # same detections, no difference.
    order = torch.arange(8).flip(0)
    shuffled = [ref[0][:, order], ref[1][:, order], ref[2][:, order]]
    tied = DetectionComparison()
    tied.update(ref, shuffled, targets)
    t = tied.result()
    assert (t.max_abs_diff, t.agreement, t.drop_points) == (0.0, 1.0, 0.0)

    scorer = MapScorer()
    scorer.update([t.numpy() for t in moved], targets)
    assert scorer.compute() == pytest.approx(w.score)


def test_export_comparison_scorer_and_evaluator_ignore_crowd_boxes() -> None:
    rng = np.random.default_rng(5)
    targets = [t for t in _targets(rng, 16, apart=True) if len(t["labels"]) >= 2]
    assert len(targets) >= 4
    for t in targets:  # the first box of each image is a crowd region
        t["iscrowd"] = torch.zeros(len(t["labels"]), dtype=torch.bool)
        t["iscrowd"][0] = True
    found = [{**t, "boxes": t["boxes"][1:], "labels": t["labels"][1:]} for t in targets]
    raw = _raw(found)  # every object found, every crowd region left alone
    # plus, ranked first, a detection inside each crowd region (half its width and height)
    for i, t in enumerate(targets):
        x1, y1, x2, y2 = t["boxes"][0].tolist()
        raw[0][i, -1] = torch.tensor([x1, y1, (x1 + x2) / 2, (y1 + y2) / 2])
        raw[1][i, -1] = 0.95
        raw[2][i, -1] = t["labels"][0]
    comparison = DetectionComparison(CLASSES)
    comparison.update(raw, [r.clone() for r in raw], targets)
    scorer = MapScorer(CLASSES)
    scorer.update([r.numpy() for r in raw], targets)
    assert comparison.result().score == pytest.approx(1.0) and scorer.compute() == pytest.approx(1.0)
    plain = [{k: v for k, v in t.items() if k != "iscrowd"} for t in targets]
    as_objects = MapScorer(CLASSES)
    as_objects.update([r.numpy() for r in raw], plain)
    assert as_objects.compute() < 0.8  # read as objects, the crowds are missed and hit wrongly
    # The trainer's evaluator: the same semantics, through its dataset targets.
    preds = [
        {k: v[i] for k, v in zip(("boxes", "scores", "labels"), raw, strict=True)} for i in range(len(raw[0]))
    ]
    for p in preds:
        keep = p["scores"] > 0
        for k in ("boxes", "scores", "labels"):
            p[k] = p[k][keep]
    adapter = DetectionTaskEvaluator(CLASSES)
    adapter.update(preds, targets, 0.0)
    assert adapter.compute().metrics["mAP"] == pytest.approx(1.0)
    assert sum(row["num_ignored"] for row in adapter.compute().report["per_class"]) == len(targets)


# ---------------------------------------------------------------------- model card


def test_model_card_describes_letterboxed_unnormalised_input(tmp_path: Path) -> None:
    from visionloop.data.manifest import (
        ChannelStats,
        DatasetManifest,
        ImagePolicy,
        SizeStats,
        SourceInfo,
        SplitInfo,
        SplitPolicy,
    )
    from visionloop.specs import validate_train_spec

    manifest = DatasetManifest(
        version="ds-1",
        task="detection",
        classes=CLASSES,
        splits={
            "train": SplitInfo(
                count=1, per_class=dict.fromkeys(CLASSES, 1), shard_dir="shards/train", bytes=1
            )
        },
        image_policy=ImagePolicy(),
        source=SourceInfo(kind="coco", path="/x", files_seen=1),
        split_policy=SplitPolicy(seed=0, val_fraction=0.0, test_fraction=0.0, from_source=False),
        channel_stats=ChannelStats(mean=(0.4, 0.4, 0.4), std=(0.2, 0.2, 0.2)),
        size_stats=SizeStats(min=(32, 32), median=(32, 32), max=(32, 32)),
        created_at="2025-01-01T00:00:00+00:00",
        visionloop_version="0.1.0",
    )
    spec = validate_train_spec(
        {
            "task": "detection",
            "epochs": 1,
            "data": {"dataset": str(tmp_path), "image_size": 64},
            "model": {"arch": "native_detector", "kwargs": {"image_size": 64, "widths": [8, 8, 16, 16]}},
        }
    )
    card = get_task("detection").model_card(
        manifest,
        spec,
        mean=(0, 0, 0),
        std=(1, 1, 1),
        metrics={"mAP": 0.5, "AP/a": 0.4, "loss": 0.0},
        run_uid="r1",
    )
    assert (card.task, card.arch, card.input_size, card.resize, card.crop_pct) == (
        "detection",
        "native_detector",
        (3, 64, 64),
        "letterbox",
        1.0,
    )
    assert card.mean == (0.0, 0.0, 0.0) and card.std == (1.0, 1.0, 1.0) and card.class_names == CLASSES
    assert card.model_kwargs == {"widths": [8, 8, 16, 16]}
    assert card.metrics == {"mAP": 0.5, "loss": 0.0} and card.dataset_version == "ds-1"
    model = get_task("detection").load_model(card, None)
    assert model.input_size == 64 and not model.training
