"""A detector's confidence calibration through the task contract: which detections are right,
the two-class logits, the temperature fitted on an over-confident synthetic detector, and the
served scores it maps."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from visionloop.eval import calibration as cal
from visionloop.tasks import get_task
from visionloop.tasks.detection.calibration import right_or_wrong, scaled_scores


def _t(rows: Sequence[Sequence[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, 4)


def test_detections_are_matched_greedily_in_score_order_and_crowds_are_ignored() -> None:
    target = {
        "boxes": _t([[0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 60, 60]]),
        "labels": torch.tensor([0, 1, 0]),
        "iscrowd": torch.tensor([0, 0, 1]),
    }
    pred = {
        "boxes": _t(
            [
                [0, 0, 10, 10],  # 0.9: class 0 on box 0: right
                [1, 0, 10, 10],  # 0.8: class 0 on box 0 again: a duplicate, wrong
                [20, 20, 30, 30],  # 0.7: class 0 on a class-1 box: wrong class, wrong
                [40, 40, 60, 60],  # 0.6: class 0 on the crowd region: left out
                [70, 70, 80, 80],  # 0.5: background: wrong
                [20, 21, 30, 30],  # 0.4: class 1 on box 1 (IoU 0.9): right
            ]
        ),
        "scores": torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4]),
        "labels": torch.tensor([0, 0, 0, 0, 0, 1]),
    }
    scores, right = right_or_wrong([pred], [target])
    assert dict(zip(np.round(scores, 3).tolist(), right.tolist(), strict=True)) == {
        0.9: 1,
        0.8: 0,
        0.7: 0,
        0.5: 0,
        0.4: 1,
    }


def test_the_task_gives_two_class_logits_and_a_fitted_temperature_softens_an_overconfident_detector() -> None:
    task = get_task("detection")
    rng = np.random.default_rng(0)
    outputs: list[dict[str, torch.Tensor]] = []
    targets: list[dict[str, torch.Tensor]] = []
    for _ in range(300):
        # Each image: one object; the detector puts one box on it or beside it, scoring it
        # far more confidently than it is right (true probability of being right: 0.6).
        hit = rng.uniform() < 0.6
        box = [10, 10, 30, 30] if hit else [50, 50, 70, 70]
        outputs.append({"boxes": _t([box]), "scores": torch.tensor([0.95]), "labels": torch.tensor([0])})
        targets.append({"boxes": _t([[10, 10, 30, 30]]), "labels": torch.tensor([0])})
    pair = task.calibration_logits(outputs, targets)
    assert pair is not None
    logits, labels = pair
    assert logits.shape == (300, 2) and torch.all(logits[:, 0] == 0)
    np.testing.assert_allclose(torch.sigmoid(logits[:, 1]).numpy(), 0.95, atol=1e-5)
    before = cal.calibration(cal.softmax(logits.numpy()), labels.numpy())
    t = cal.fit_temperature(logits.numpy(), labels.numpy())
    after = cal.calibration(cal.softmax(logits.numpy(), t), labels.numpy())
    assert t > 1.0 and after.ece < 0.05 < before.ece
    # Served: the same map on the "scores" output; the ranking stays, padding stays 0.
    served: dict[str, np.ndarray] = {
        "scores": np.array([[0.95, 0.5, 0.2, 0.0]], np.float32),
        "labels": np.zeros((1, 4), np.int64),
    }
    out = task.calibrate(served, t)
    assert out["scores"][0, 0] == pytest.approx(float(labels.float().mean()), abs=0.03)
    assert out["scores"][0, 1] == pytest.approx(0.5) and out["scores"][0, 3] == 0.0
    assert list(np.argsort(-out["scores"][0])) == list(np.argsort(-served["scores"][0]))
    assert task.calibration_logits([{k: v[:0] for k, v in outputs[0].items()}], targets[:1]) is None


def test_scaled_scores_leave_non_finite_and_zero_scores_alone() -> None:
    s = np.array([0.0, np.nan, 1.0, 0.7], np.float32)
    out = scaled_scores(s, 2.0)
    assert out[0] == 0.0 and np.isnan(out[1]) and out[2] == pytest.approx(1.0, abs=1e-3)
    assert out[3] == pytest.approx(1 / (1 + np.exp(-np.log(0.7 / 0.3) / 2)), abs=1e-6)
