"""Detection metrics agree with pycocotools, stream and restore exactly, and plot.

pycocotools is the reference: the COCO protocol's own implementation. The helper below builds
its inputs independently of `DetectionEvaluator` (its own xyxy → xywh conversion) so that a
conversion bug in ours shows up as a disagreement.
"""

from __future__ import annotations

import contextlib
import io
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from visionloop.core.errors import DataError
from visionloop.tasks.detection.metrics import (
    COCO_STAT_NAMES,
    DetectionEvaluator,
    gather_state,
    slot_state_for_sum,
)
from visionloop.tasks.detection.plots import (
    plot_detection_confusion_matrix,
    plot_detection_grid,
    plot_pr_curves,
    write_plots,
)

pycocotools = pytest.importorskip("pycocotools", reason="pycocotools is the reference (dev extra)")

Sample = tuple[list[dict[str, Any]], list[dict[str, Any]]]


def _random_split(n_images: int, n_classes: int, seed: int, *, crowd: bool = False) -> Sample:
    """Seeded images with small, medium and large boxes (areas from 4² to 400² px), jittered
    true positives, wrong-class and background false positives, background images, and a
    last class that has predictions but no ground truth. `crowd`: besides, about a fifth of
    the boxes are flagged iscrowd, and every other image gets a large crowd region with a few
    predictions inside it and across its edge (targets then carry "iscrowd")."""
    rng = np.random.default_rng(seed)
    preds: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    gt_classes = n_classes - 1
    for i in range(n_images):
        boxes, labels, p_boxes, p_labels = [], [], [], []
        n_obj = 0 if i % 7 == 3 else int(rng.integers(1, 8))  # every 7th image is background
        for _ in range(n_obj):
            w, h = np.exp(rng.uniform(np.log(4), np.log(400), 2))
            x, y = rng.uniform(0, 640 - w), rng.uniform(0, 640 - h)
            k = int(rng.integers(0, gt_classes))
            boxes.append([x, y, x + w, y + h])
            labels.append(k)
            for _ in range(int(rng.integers(0, 3))):
                j = rng.normal(0, 0.15, 4) * [w, h, w, h]
                x1, y1 = x + j[0], y + j[1]
                p_boxes.append([x1, y1, x1 + max(1.0, w + j[2]), y1 + max(1.0, h + j[3])])
                p_labels.append(k if rng.random() < 0.8 else int(rng.integers(0, n_classes)))
        for _ in range(int(rng.integers(0, 6))):
            w, h = np.exp(rng.uniform(np.log(4), np.log(300), 2))
            x, y = rng.uniform(0, 640 - w), rng.uniform(0, 640 - h)
            p_boxes.append([x, y, x + w, y + h])
            p_labels.append(int(rng.integers(0, n_classes)))
        target: dict[str, Any] = {"image_id": 1000 + i, "size": (640, 640)}
        if crowd:
            flags = [bool(rng.random() < 0.2) for _ in boxes]
            if i % 2 == 0:
                w, h = rng.uniform(100, 300, 2)
                x, y = rng.uniform(0, 640 - w), rng.uniform(0, 640 - h)
                k = int(rng.integers(0, gt_classes))
                boxes.append([x, y, x + w, y + h])
                labels.append(k)
                flags.append(True)
                for _ in range(int(rng.integers(1, 5))):
                    # inside the region, or straddling its right edge
                    bw, bh = rng.uniform(10, 0.5 * w), rng.uniform(10, 0.5 * h)
                    bx, by = rng.uniform(x, x + w - bw / 2), rng.uniform(y, y + h - bh)
                    p_boxes.append([bx, by, bx + bw, by + bh])
                    p_labels.append(k)
            target["iscrowd"] = torch.tensor(flags, dtype=torch.bool)
        target["boxes"] = torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        target["labels"] = torch.tensor(labels, dtype=torch.int64)
        targets.append(target)
        preds.append(
            {
                "boxes": torch.tensor(p_boxes, dtype=torch.float32).reshape(-1, 4),
                "scores": torch.from_numpy(rng.random(len(p_boxes)).astype(np.float32)),
                "labels": torch.tensor(p_labels, dtype=torch.int64),
            }
        )
    return preds, targets


def _pycocotools(preds: list[dict[str, Any]], targets: list[dict[str, Any]], n_classes: int) -> Any:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def xywh(box: list[float]) -> list[float]:
        x1, y1, x2, y2 = box
        return [x1, y1, x2 - x1, y2 - y1]

    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for i, (p, t) in enumerate(zip(preds, targets, strict=True)):
        images.append({"id": i, "height": 640, "width": 640})
        crowd = t["iscrowd"].tolist() if "iscrowd" in t else [False] * len(t["labels"])
        for box, k, c in zip(t["boxes"].double().tolist(), t["labels"].tolist(), crowd, strict=True):
            b = xywh(box)
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": i,
                    "category_id": k,
                    "bbox": b,
                    "area": b[2] * b[3],
                    "iscrowd": int(c),
                }
            )
        for box, s, k in zip(
            p["boxes"].double().tolist(), p["scores"].double().tolist(), p["labels"].tolist(), strict=True
        ):
            results.append({"image_id": i, "category_id": k, "bbox": xywh(box), "score": s})
    gt = COCO()
    gt.dataset = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": k, "name": str(k)} for k in range(n_classes)],
    }
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
        coco = COCOeval(gt, gt.loadRes(results), "bbox")
        coco.evaluate()
        coco.accumulate()
        coco.summarize()
    return coco


def _evaluate(
    preds: list[dict[str, Any]], targets: list[dict[str, Any]], names: list[str]
) -> DetectionEvaluator:
    ev = DetectionEvaluator(names)
    ev.update(preds, targets)
    return ev


def _one(box: list[float], label: int = 0, score: float | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"boxes": torch.tensor([box]), "labels": torch.tensor([label])}
    if score is not None:
        d["scores"] = torch.tensor([score])
    return d


def _none(scores: bool = True) -> dict[str, Any]:
    d: dict[str, Any] = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}
    if scores:
        d["scores"] = torch.zeros(0)
    return d


# --------------------------------------------------------------------------- against pycocotools


@pytest.mark.parametrize(("seed", "crowd"), [(0, False), (1, False), (2, False), (0, True), (3, True)])
def test_every_statistic_matches_pycocotools(seed: int, crowd: bool) -> None:
    n_classes = 5
    names = [f"c{k}" for k in range(n_classes)]
    preds, targets = _random_split(50, n_classes, seed, crowd=crowd)
    ref = _pycocotools(preds, targets, n_classes)
    report = _evaluate(preds, targets, names).report()

    # Every one of the 12 COCO statistics; the ones pycocotools marks undefined (-1) are absent.
    assert len(ref.stats) == len(COCO_STAT_NAMES)
    for name, expected in zip(COCO_STAT_NAMES, ref.stats, strict=True):
        if expected < 0:
            assert name not in report.metrics
        else:
            assert report.metrics[name] == pytest.approx(expected, rel=0, abs=1e-12), name
    assert {"mAP_small", "mAP_medium", "mAP_large"} <= report.metrics.keys(), "all three sizes occur"

    # Per class: the mean of the class's defined precision entries, as detectron2 reads it.
    precision = ref.eval["precision"]  # [T, R, K, A, M]
    for k, name in enumerate(names):
        p = precision[:, :, k, 0, -1]
        p50 = precision[0, :, k, 0, -1]
        if (p > -1).any():
            assert report.metrics[f"AP/{name}"] == pytest.approx(float(np.mean(p[p > -1])), abs=1e-12)
            assert report.per_class[k]["AP50"] == pytest.approx(float(np.mean(p50[p50 > -1])), abs=1e-12)
            np.testing.assert_allclose(report.precision50[k], p50, rtol=0, atol=1e-12)
        else:
            assert f"AP/{name}" not in report.metrics
            assert np.isnan(report.precision50[k]).all()
    # The last class has predictions but no ground truth: absent, not 0.
    assert report.per_class[-1]["num_gt"] == 0 and report.per_class[-1]["num_pred"] > 0
    assert report.per_class[-1]["AP"] is None and "AP/c4" not in report.metrics
    assert 0.05 < report.metrics["mAP"] < 0.95, "a split that exercises the ranking, not a trivial one"
    if crowd:
        # The crowd boxes matter: read as ordinary objects they give other numbers.
        plain = [{k: v for k, v in t.items() if k != "iscrowd"} for t in targets]
        assert _evaluate(preds, plain, names).compute()["mAP"] != pytest.approx(
            report.metrics["mAP"], abs=1e-3
        )
        flagged = sum(int(t["iscrowd"].sum()) for t in targets)
        assert sum(row["num_ignored"] for row in report.per_class) == flagged > 20
        assert (
            sum(row["num_gt"] for row in report.per_class) == sum(len(t["labels"]) for t in targets) - flagged
        )


# --------------------------------------------------------------------------- hand-computed


def test_one_perfect_prediction_is_map_one() -> None:
    # Away from the origin, so that xyxy and xywh read differently: 20x20 px is "small".
    m = _evaluate([_one([200, 300, 220, 320], score=0.9)], [_one([200, 300, 220, 320])], ["a"]).compute()
    assert m["mAP"] == m["mAP50"] == m["mAP75"] == m["AR100"] == m["AP/a"] == 1.0
    assert m["mAP_small"] == 1.0 and "mAP_medium" not in m and "mAP_large" not in m


def test_a_prediction_at_iou_062_counts_at_050_to_060_only() -> None:
    # Ground truth 10x10, prediction its top 62%: IoU 0.62, a hit at thresholds .50, .55, .60.
    m = _evaluate([_one([100, 200, 110, 206.2], score=0.9)], [_one([100, 200, 110, 210])], ["a"]).compute()
    assert m["mAP50"] == 1.0
    assert m["mAP75"] == 0.0
    assert m["mAP"] == pytest.approx(0.3, abs=1e-12)
    assert m["AR100"] == pytest.approx(0.3, abs=1e-12)


def test_a_crowd_region_is_neither_found_nor_missed_nor_a_false_alarm() -> None:
    a = [200.0, 300, 220, 320]
    crowd = [0.0, 0, 100, 100]
    preds = [
        {  # the object found (0.9); a detection inside the crowd, ranked first (0.95)
            "boxes": torch.tensor([a, [10.0, 10, 30, 30]]),
            "scores": torch.tensor([0.9, 0.95]),
            "labels": torch.tensor([0, 0]),
        }
    ]
    targets = [{"boxes": torch.tensor([a, crowd]), "labels": torch.tensor([0, 0])}]
    # Read as an object, the crowd is missed (recall 1/2) and its detection (IoU 0.04) a false
    # alarm ranked first (precision 1/2): precision 1/2 at 51 of COCO's 101 recall thresholds.
    assert _evaluate(preds, targets, ["a"]).compute()["mAP"] == pytest.approx(0.5 * 51 / 101, abs=1e-12)
    targets[0]["iscrowd"] = torch.tensor([False, True])
    ev = _evaluate(preds, targets, ["a"])
    m = ev.compute()
    assert m["mAP"] == m["AR100"] == m["AP/a"] == 1.0
    assert ev.report().per_class[0]["num_gt"] == 1 and ev.report().per_class[0]["num_ignored"] == 1
    # A class whose only boxes are crowds has nothing to find: no AP, as in COCO.
    only = _evaluate(
        [_one([10, 10, 30, 30], label=1, score=0.9)],
        [{"boxes": torch.tensor([crowd]), "labels": torch.tensor([1]), "iscrowd": [1]}],
        ["a", "b"],
    )
    assert only.compute() == {} and only.report().per_class[1]["num_ignored"] == 1
    with pytest.raises(DataError, match="iscrowd must be 0 or 1"):
        DetectionEvaluator(["a"]).update([_none()], [{**_one(a), "iscrowd": [2]}])
    with pytest.raises(DataError, match="iscrowd has 2 values for 1 boxes"):
        DetectionEvaluator(["a"]).update([_none()], [{**_one(a), "iscrowd": [0, 1]}])


def test_the_wrong_class_is_a_miss() -> None:
    m = _evaluate([_one([0, 0, 10, 10], label=1, score=0.9)], [_one([0, 0, 10, 10], label=0)], ["a", "b"])
    out = m.compute()
    assert out["mAP"] == 0.0 and out["AP/a"] == 0.0 and "AP/b" not in out


@pytest.mark.parametrize(("background_score", "expected"), [(0.95, 0.5), (0.5, 1.0)])
def test_a_background_image_adds_false_positives(background_score: float, expected: float) -> None:
    # Ranked above the true positive, the false alarm on the background image halves precision
    # at every recall; ranked below it, it comes after full recall and costs nothing.
    preds = [_one([0, 0, 50, 50], score=0.9), _one([5, 5, 40, 40], score=background_score)]
    targets = [_one([0, 0, 50, 50]), _none(scores=False)]
    m = _evaluate(preds, targets, ["a"]).compute()
    assert m["mAP"] == pytest.approx(expected, abs=1e-12)


def test_classes_without_ground_truth_are_absent_and_without_predictions_are_zero() -> None:
    preds = [
        {
            "boxes": torch.tensor([[0.0, 0, 10, 10], [50, 50, 60, 60]]),
            "scores": torch.tensor([0.9, 0.8]),
            "labels": torch.tensor([0, 2]),
        },
    ]
    targets = [{"boxes": torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 30]]), "labels": torch.tensor([0, 1])}]
    report = _evaluate(preds, targets, ["a", "b", "c"]).report()
    assert report.metrics["AP/a"] == 1.0
    assert report.metrics["AP/b"] == 0.0  # ground truth, never found
    assert "AP/c" not in report.metrics  # predicted, never true: undefined, not 0
    assert report.metrics["mAP"] == 0.5  # mean over a and b only
    assert [row["AP"] for row in report.per_class] == [1.0, 0.0, None]
    assert report.to_dict()["per_class"][2] == {
        "name": "c",
        "AP": None,
        "AP50": None,
        "AP75": None,
        "num_gt": 0,
        "num_ignored": 0,
        "num_pred": 1,
    }


def test_no_ground_truth_or_no_images_gives_no_metrics() -> None:
    assert DetectionEvaluator(["a"]).compute() == {}
    only_background = _evaluate([_one([0, 0, 5, 5], score=0.5)], [_none(scores=False)], ["a"])
    assert only_background.compute() == {}
    assert only_background.report().per_class[0]["num_pred"] == 1


def test_no_predictions_at_all_is_zero() -> None:
    m = _evaluate([_none(), _none()], [_one([0, 0, 40, 40]), _one([1, 1, 9, 9])], ["a"]).compute()
    assert m["mAP"] == 0.0 and m["AR100"] == 0.0 and m["AP/a"] == 0.0


def test_a_slash_in_a_class_name_does_not_nest_the_metric() -> None:
    m = _evaluate([_one([0, 0, 5, 5], score=0.5)], [_one([0, 0, 5, 5])], ["person/adult"]).compute()
    assert m["AP/person_adult"] == 1.0


# --------------------------------------------------------------------------- streaming and state


def test_streaming_updates_equal_one_update_and_inputs_of_any_kind() -> None:
    names = ["a", "b", "c", "d"]
    preds, targets = _random_split(40, 4, seed=7)
    whole = _evaluate(preds, targets, names)
    streamed = DetectionEvaluator(names)
    for start in range(0, 40, 7):
        streamed.update(preds[start : start + 7], targets[start : start + 7])
        streamed.update([], [])
    assert streamed.num_images == 40
    assert streamed.compute() == whole.compute()
    # numpy arrays and lists give the same numbers as tensors
    as_numpy = [{k: np.asarray(v) for k, v in p.items()} for p in preds]
    as_lists = [
        {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in t.items()} for t in targets
    ]
    assert _evaluate(as_numpy, as_lists, names).compute() == whole.compute()
    np.testing.assert_array_equal(streamed.confusion_matrix(), whole.confusion_matrix())


def test_state_round_trips_exactly_and_concatenated_states_merge(tmp_path: Path) -> None:
    names = ["a", "b", "c", "d"]
    preds, targets = _random_split(30, 4, seed=3)
    whole = _evaluate(preds, targets, names)
    first, second = DetectionEvaluator(names), DetectionEvaluator(names)
    first.update(preds[:12], targets[:12])
    second.update(preds[12:], targets[12:])

    # Through a checkpoint file, as a trainer would keep it.
    torch.save({"eval": first.state()}, tmp_path / "ckpt.pt")
    restored = DetectionEvaluator(names)
    restored.load_state(torch.load(tmp_path / "ckpt.pt", weights_only=True)["eval"])
    assert torch.equal(restored.state(), first.state())
    restored.update(preds[12:], targets[12:])  # resume the pass where it stopped
    assert restored.compute() == whole.compute()

    merged = DetectionEvaluator(names)
    merged.load_state(torch.cat([first.state(), second.state()]))
    assert merged.compute() == whole.compute()
    assert torch.equal(merged.state(), whole.state())

    with pytest.raises(DataError, match="in two merged states"):
        merged.merge_state(first.state())
    with pytest.raises(DataError, match="3-class evaluator"):
        DetectionEvaluator(["a", "b", "c"]).load_state(first.state())
    with pytest.raises(DataError, match="truncated"):
        DetectionEvaluator(names).load_state(first.state()[:-3])
    with pytest.raises(DataError, match="not a detection evaluator state"):
        DetectionEvaluator(names).load_state(torch.ones(8, dtype=torch.float64))
    empty = DetectionEvaluator(names)
    empty.load_state(DetectionEvaluator(names).state())
    assert empty.num_images == 0 and empty.compute() == {}


def test_crowd_flags_survive_the_state_and_a_version_1_state_still_loads() -> None:
    names = ["a", "b", "c", "d"]
    preds, targets = _random_split(20, 4, seed=4, crowd=True)
    whole = _evaluate(preds, targets, names)
    restored = DetectionEvaluator(names)
    restored.load_state(whole.state())
    assert restored.compute() == whole.compute()
    np.testing.assert_array_equal(restored.confusion_matrix(), whole.confusion_matrix())
    # A state written before iscrowd (version 1: six ground-truth columns) reads as no crowd.
    plain = [{k: v for k, v in t.items() if k != "iscrowd"} for t in targets]
    expected = _evaluate(preds, plain, names)
    flat = expected.state().numpy().copy()
    n_img, n_gt = int(flat[3]), int(flat[4])
    start = 6 + 3 * n_img
    gt = flat[start : start + 7 * n_gt].reshape(-1, 7)
    v1 = np.concatenate([flat[:start], gt[:, :6].ravel(), flat[start + 7 * n_gt :]])
    v1[1] = 1.0
    old = DetectionEvaluator(names)
    old.load_state(torch.from_numpy(v1))
    assert old.compute() == expected.compute() != whole.compute()
    bad = whole.state().clone()
    start = 6 + 3 * int(bad[3])
    bad[start + 6] = 0.5  # the first box's iscrowd
    with pytest.raises(DataError, match="neither 0 nor 1"):
        DetectionEvaluator(names).load_state(bad)


def _gather_worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        preds, targets = _random_split(21, 3, seed=5)
        ev = DetectionEvaluator(["a", "b", "c"])
        ev.update(preds[rank::world], targets[rank::world])  # a strided split, uneven lengths
        gathered = DetectionEvaluator(["a", "b", "c"])
        gathered.load_state(gather_state(ev.state()))
        # The trainer's way: sum-reduce every rank's slot; the sum is the concatenation.
        summed = DetectionEvaluator(["a", "b", "c"])
        slots = slot_state_for_sum(ev.state())
        dist.all_reduce(slots, op=dist.ReduceOp.SUM)
        summed.load_state(slots)
        torch.save(
            {
                "gathered": torch.tensor(list(gathered.compute().values()), dtype=torch.float64),
                "summed": torch.tensor(list(summed.compute().values()), dtype=torch.float64),
            },
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_gathered_or_summed_states_across_two_ranks_give_every_rank_the_whole(tmp_path: Path) -> None:
    spawn(_gather_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    preds, targets = _random_split(21, 3, seed=5)
    expected = torch.tensor(
        list(_evaluate(preds, targets, ["a", "b", "c"]).compute().values()), dtype=torch.float64
    )
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert torch.equal(got["gathered"], expected)
        assert torch.equal(got["summed"], expected)
    state = DetectionEvaluator(["a"]).state()
    assert gather_state(state) is state  # no process group: the state itself
    assert slot_state_for_sum(state) is state


def test_reset_forgets_everything() -> None:
    ev = _evaluate([_one([0, 0, 5, 5], score=0.5)], [{**_one([0, 0, 5, 5]), "image_id": 4}], ["a"])
    ev.reset()
    assert ev.num_images == 0 and ev.compute() == {}
    ev.update([_none()], [{**_none(scores=False), "image_id": 4}])  # the same id is fine again


# --------------------------------------------------------------------------- bad inputs


def test_bad_inputs_are_refused_with_the_fix() -> None:
    ev = DetectionEvaluator(["a", "b"])
    with pytest.raises(DataError, match=r"x2 < x1.*convert xywh"):
        ev.update([_none()], [_one([50, 50, 10, 10])])  # xywh given as xyxy
    with pytest.raises(DataError, match=r"outside the class indices \[0, 2\)"):
        ev.update([_one([0, 0, 5, 5], label=2, score=0.5)], [_none(scores=False)])
    with pytest.raises(DataError, match="shape \\(N, 4\\)"):
        ev.update([_none()], [{"boxes": torch.zeros(2, 5), "labels": torch.zeros(2)}])
    with pytest.raises(DataError, match="2 values for 1 boxes"):
        ev.update([{**_one([0, 0, 5, 5]), "scores": torch.tensor([0.1, 0.2])}], [_none(scores=False)])
    with pytest.raises(DataError, match="NaN"):
        ev.update([_one([0, 0, float("nan"), 5], score=0.5)], [_none(scores=False)])
    with pytest.raises(DataError, match="one dict per image"):
        ev.update([_none()], [])
    ev.update([_none()], [{**_none(scores=False), "image_id": torch.tensor(7)}])
    with pytest.raises(DataError, match="image_id 7 evaluated twice"):
        ev.update([_none()], [{**_none(scores=False), "image_id": 7}])
    assert ev.num_images == 1, "a refused batch adds nothing"
    with pytest.raises(ValueError, match="at least one class"):
        DetectionEvaluator([])


# --------------------------------------------------------------------------- confusion matrix


def test_confusion_matrix_counts_a_hand_built_case() -> None:
    # classes a=0, b=1, background=2 (last row and column)
    preds = [
        {  # image 0: a found; b found as a; a duplicate of the a; a low-score alarm (dropped)
            "boxes": torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 30], [1, 1, 10, 10], [60, 60, 70, 70]]),
            "scores": torch.tensor([0.9, 0.8, 0.7, 0.1]),
            "labels": torch.tensor([0, 0, 0, 1]),
        },
        {  # image 1: b missed (the prediction overlaps it at IoU 0.25); a b alarm
            "boxes": torch.tensor([[0.0, 0, 10, 5], [40, 40, 50, 50]]),
            "scores": torch.tensor([0.9, 0.6]),
            "labels": torch.tensor([1, 1]),
        },
        _none(),  # image 2: background, nothing predicted
    ]
    targets = [
        {"boxes": torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 30]]), "labels": torch.tensor([0, 1])},
        {"boxes": torch.tensor([[0.0, 0, 10, 10], [0, 0, 20, 10]]), "labels": torch.tensor([1, 0])},
        _none(scores=False),
    ]
    # image 1: the [0,0,10,5] box has IoU 0.5 with the b box [0,0,10,10] and 0.25 with the a box:
    # it matches b (right class). The a box [0,0,20,10] is missed.
    m = _evaluate(preds, targets, ["a", "b"]).confusion_matrix(iou_threshold=0.5, score_threshold=0.25)
    assert m.tolist() == [
        [1, 0, 1],  # a: found once, missed once
        [1, 1, 0],  # b: once taken for an a, once found
        [1, 1, 0],  # background: the duplicate a, the b alarm
    ]
    # A stricter IoU turns the 0.5 match into a miss and a false alarm.
    m = _evaluate(preds, targets, ["a", "b"]).confusion_matrix(iou_threshold=0.6, score_threshold=0.25)
    assert m.tolist() == [[1, 0, 1], [1, 0, 1], [1, 2, 0]]
    # No threshold keeps the 0.1 alarm.
    m = _evaluate(preds, targets, ["a", "b"]).confusion_matrix(score_threshold=0.0)
    assert m[2].tolist() == [1, 2, 0]


def test_confusion_matrix_neither_misses_a_crowd_nor_counts_a_detection_on_it() -> None:
    preds = [
        {  # the a found; two detections inside the crowd (one of another class); one beside it
            "boxes": torch.tensor(
                [[200.0, 200, 220, 220], [10, 10, 30, 30], [50, 50, 90, 90], [95, 0, 125, 20]]
            ),
            "scores": torch.tensor([0.9, 0.8, 0.7, 0.6]),
            "labels": torch.tensor([0, 0, 1, 0]),
        }
    ]
    targets = [
        {
            "boxes": torch.tensor([[200.0, 200, 220, 220], [0, 0, 100, 100]]),
            "labels": torch.tensor([0, 0]),
            "iscrowd": torch.tensor([False, True]),
        }
    ]
    # [95, 0, 125, 20] has 5 / 30 of its area in the crowd: a false alarm still.
    m = _evaluate(preds, targets, ["a", "b"]).confusion_matrix(iou_threshold=0.5, score_threshold=0.25)
    assert m.tolist() == [[1, 0, 0], [0, 0, 0], [1, 0, 0]]
    targets[0]["iscrowd"] = torch.tensor([False, False])  # read as an object: one more story
    m = _evaluate(preds, targets, ["a", "b"]).confusion_matrix(iou_threshold=0.5, score_threshold=0.25)
    assert m.tolist() == [[1, 0, 1], [0, 0, 0], [2, 1, 0]]


def test_confusion_matrix_prefers_the_highest_iou() -> None:
    # One true box, two predictions of different classes: the better overlap wins the match.
    preds = [
        {
            "boxes": torch.tensor([[0.0, 0, 10, 8], [0, 0, 10, 10]]),
            "scores": torch.tensor([0.9, 0.5]),
            "labels": torch.tensor([1, 0]),
        }
    ]
    m = _evaluate(preds, [_one([0, 0, 10, 10])], ["a", "b"]).confusion_matrix()
    assert m.tolist() == [[1, 0, 0], [0, 0, 0], [0, 1, 0]]


# --------------------------------------------------------------------------- plots


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plots_are_written(tmp_path: Path) -> None:
    names = ["a", "b", "c", "d", "e"]
    preds, targets = _random_split(12, 5, seed=1)
    ev = _evaluate(preds, targets, names)
    report = ev.report()
    written = write_plots(ev, report, tmp_path / "eval")
    assert [p.name for p in written] == ["pr_curves.png", "confusion_matrix.png"]
    for path in written:
        width, height = _png_size(path)
        assert width > 300 and height > 300 and path.stat().st_size > 10_000
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["confusion_matrix.png", "pr_curves.png"]

    images = [torch.randint(0, 256, (3, 640, 640), dtype=torch.uint8) for _ in range(5)]
    images.append(torch.rand(3, 640, 640))  # float [0, 1] as well
    grid = plot_detection_grid(images, preds[:6], targets[:6], names, tmp_path / "grid.png")
    assert _png_size(grid)[0] > 600 and grid.stat().st_size > 50_000

    # Crowd boxes are drawn, differently (dotted, "ignored"): another picture, same size.
    crowd_preds, crowd_targets = _random_split(4, 5, seed=1, crowd=True)
    flat = [torch.full((3, 640, 640), 40, dtype=torch.uint8) for _ in range(4)]
    dotted = plot_detection_grid(flat, crowd_preds, crowd_targets, names, tmp_path / "crowd.png")
    plain = [{k: v for k, v in t.items() if k != "iscrowd"} for t in crowd_targets]
    solid = plot_detection_grid(flat, crowd_preds, plain, names, tmp_path / "solid.png")
    assert _png_size(dotted) == _png_size(solid) and dotted.read_bytes() != solid.read_bytes()

    # A split without boxes still gives readable files, not an exception.
    empty = DetectionEvaluator(["a"])
    assert _png_size(plot_pr_curves(empty.report(), tmp_path / "empty_pr.png"))[0] > 0
    cm = plot_detection_confusion_matrix(empty.confusion_matrix(), ["a"], tmp_path / "empty_cm.png")
    assert _png_size(cm)[0] > 0


def test_error_kinds_count_each_kind_of_mistake_once() -> None:
    # classes a=0, b=1. Image 0 holds an a at [0,0,10,10] and a b at [20,20,30,30]; image 1 an
    # a at [50,50,60,60] that nothing finds; image 2 a crowd of a's at [0,0,100,100].
    preds = [
        {
            "boxes": torch.tensor(
                [
                    [0.0, 0, 10, 10],  # a on the a: true positive
                    [0.0, 0, 10, 9],  # a on the a again: duplicate (IoU 0.9, the a already found)
                    [20.0, 20, 30, 30],  # a on the b: classification
                    [0.0, 0, 10, 3],  # a, loose on the a (IoU 0.3): localisation... but see below
                    [20.0, 20, 30, 23],  # b, loose on the b (IoU 0.3): localisation
                    [22.0, 22, 30, 24],  # a, loose on the b (IoU 0.16): both
                    [80.0, 80, 90, 90],  # b where there is nothing: background
                    [85.0, 85, 95, 95],  # b below the score threshold: not counted
                ]
            ),
            "scores": torch.tensor([0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.1]),
            "labels": torch.tensor([0, 0, 0, 0, 1, 0, 1, 1]),
        },
        _none(),
        {
            "boxes": torch.tensor([[10.0, 10, 30, 30]]),  # inside the crowd: neither right nor wrong
            "scores": torch.tensor([0.9]),
            "labels": torch.tensor([1]),
        },
    ]
    targets = [
        {"boxes": torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 30]]), "labels": torch.tensor([0, 1])},
        {"boxes": torch.tensor([[50.0, 50, 60, 60]]), "labels": torch.tensor([0])},
        {
            "boxes": torch.tensor([[0.0, 0, 100, 100]]),
            "labels": torch.tensor([0]),
            "iscrowd": torch.tensor([True]),
        },
    ]
    kinds = _evaluate(preds, targets, ["a", "b"]).error_kinds(score_threshold=0.25)
    # The loose a on the found a is a localisation error (same class, 0.1 <= IoU < 0.5): the
    # kind goes by the best overlaps, whether or not the box was found by another detection.
    assert kinds == {
        "true_positive": 1,
        "classification": 1,
        "localisation": 2,
        "both": 1,
        "duplicate": 1,
        "background": 1,
        # The b is explained by the classification and localisation errors pointing at it; the
        # a of image 1 is missed; the crowd is never missed.
        "missed": 1,
    }
    # Everything below a high threshold drops out: what is left of the a's are one true
    # positive and the duplicate; the b and image 1's a are missed.
    kinds = _evaluate(preds, targets, ["a", "b"]).error_kinds(score_threshold=0.88)
    assert kinds == {
        "true_positive": 1,
        "classification": 0,
        "localisation": 0,
        "both": 0,
        "duplicate": 1,
        "background": 0,
        "missed": 2,
    }
