"""Calibration: exact values on a hand-worked example, ECE that tells an over-confident model
from a calibrated one, temperature scaling that finds the over-confidence, and a real PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from visionloop.core.errors import DataError, SpecError
from visionloop.eval.calibration import (
    Calibration,
    ReliabilityBin,
    calibration,
    fit_temperature,
    reliability_diagram,
    softmax,
)

N, C = 20_000, 10


def draw_labels(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One label per row, drawn from that row's distribution."""
    u = rng.random((probs.shape[0], 1))
    return np.minimum((np.cumsum(probs, axis=1) < u).sum(axis=1), probs.shape[1] - 1)


@pytest.fixture(scope="module")
def overconfident() -> tuple[np.ndarray, np.ndarray]:
    """Logits 3x too sharp: labels follow softmax(z), the model reports softmax(3 z)."""
    rng = np.random.default_rng(0)
    z = rng.normal(0.0, 1.5, size=(N, C))
    return 3.0 * z, draw_labels(softmax(z), rng)


# -- a tiny example, worked by hand --------------------------------------------------------------
# 5 bins: (0, .2] (.2, .4] (.4, .6] (.6, .8] (.8, 1]
#   row  probs         label  top-1 conf  correct  bin
#   0    [.9,  .1 ]    0      .9          yes      (.8, 1]
#   1    [.3,  .7 ]    0      .7          no       (.6, .8]
#   2    [.65, .35]    0      .65         yes      (.6, .8]
#   3    [.25, .75]    1      .75         yes      (.6, .8]
# bin (.6, .8]: mean conf .7, accuracy 2/3, gap 1/30;  bin (.8, 1]: conf .9, accuracy 1, gap .1
# ECE = 3/4 · 1/30 + 1/4 · .1 = .05      (unweighted over bins it would be 1/15 ≈ .0667)
# MCE = .1
# Brier = (.02 + .98 + .245 + .125) / 4 = .3425
# NLL = -(ln .9 + ln .3 + ln .65 + ln .75) / 4
TINY_PROBS = np.array([[0.9, 0.1], [0.3, 0.7], [0.65, 0.35], [0.25, 0.75]])
TINY_LABELS = np.array([0, 0, 0, 1])


def test_hand_worked_example() -> None:
    cal = calibration(TINY_PROBS, TINY_LABELS, n_bins=5)
    assert cal.ece == pytest.approx(0.05, abs=1e-12)
    assert cal.mce == pytest.approx(0.1, abs=1e-12)
    assert cal.brier == pytest.approx(0.3425, abs=1e-12)
    assert cal.nll == pytest.approx(-(math.log(0.9) + math.log(0.3) + math.log(0.65) + math.log(0.75)) / 4)
    assert cal.accuracy == 0.75 and cal.samples == 4
    assert [b.count for b in cal.bins] == [0, 0, 0, 3, 1]
    assert cal.bins[0] == ReliabilityBin(0.0, 0.2, 0, None, None)
    assert cal.bins[3].confidence == pytest.approx(0.7)
    assert cal.bins[3].accuracy == pytest.approx(2 / 3)
    assert cal.bins[3].gap == pytest.approx(2 / 3 - 0.7)
    assert cal.bins[4].gap == pytest.approx(0.1)
    assert cal.bins[0].gap is None
    assert [(b.lower, b.upper) for b in cal.bins][4] == pytest.approx((0.8, 1.0))


def test_default_is_fifteen_bins_right_closed() -> None:
    # Confidence exactly 1.0 lands in the last bin; exactly 0.6 (= 9/15) closes bin 8.
    probs = np.array([[1.0, 0.0], [0.6, 0.4], [0.4, 0.6]])
    cal = calibration(probs, np.array([0, 1, 1]))
    assert len(cal.bins) == 15
    assert cal.bins[14].count == 1 and cal.bins[14].accuracy == 1.0
    assert cal.bins[8].count == 2 and cal.bins[8].accuracy == 0.5
    assert cal.bins[8].lower == pytest.approx(8 / 15) and cal.bins[8].upper == pytest.approx(9 / 15)
    assert sum(b.count for b in cal.bins) == 3
    # ECE: 2/3 · |0.5 - 0.6| + 1/3 · 0; MCE 0.1
    assert cal.ece == pytest.approx(2 / 3 * 0.1)
    assert cal.mce == pytest.approx(0.1)
    # A zero probability on the true class costs a large but finite NLL.
    hard = calibration(np.array([[1.0, 0.0]]), np.array([1]))
    assert hard.nll == pytest.approx(-math.log(1e-12)) and hard.brier == 2.0


def test_to_dict_is_json_safe() -> None:
    cal = calibration(TINY_PROBS, TINY_LABELS, n_bins=5)
    d = json.loads(json.dumps(cal.to_dict(), allow_nan=False))
    assert d["ece"] == pytest.approx(0.05) and d["samples"] == 4
    assert d["bins"][3] == {
        "lower": pytest.approx(0.6),
        "upper": pytest.approx(0.8),
        "count": 3,
        "confidence": pytest.approx(0.7),
        "accuracy": pytest.approx(2 / 3),
    }
    assert d["bins"][0]["confidence"] is None


def test_overconfident_model_has_large_ece_calibrated_one_small(
    overconfident: tuple[np.ndarray, np.ndarray],
) -> None:
    logits, labels = overconfident
    bad = calibration(softmax(logits), labels)

    # A calibrated model: labels drawn from the very probabilities it reports.
    rng = np.random.default_rng(1)
    probs = softmax(rng.normal(0.0, 1.5, size=(N, C)))
    good = calibration(probs, draw_labels(probs, rng))
    # Sampling noise alone: bin b's accuracy is off by ~sqrt(1/(4 n_b)), so
    # E[ECE] <= sum_b n_b/N · 1/(2 sqrt(n_b)) <= sqrt(B/N)/2 (Cauchy-Schwarz); allow twice that.
    bound = math.sqrt(15 / N)
    assert good.ece < bound
    assert bad.ece > 0.15 > 5 * bound
    assert bad.mce > bad.ece
    # Over-confident: every populated bin's accuracy falls short of its confidence.
    assert all(b.gap is not None and b.gap < 0 for b in bad.bins if b.count >= 100)
    assert bad.nll > good.nll


def test_fit_temperature_recovers_the_sharpening(overconfident: tuple[np.ndarray, np.ndarray]) -> None:
    logits, labels = overconfident
    t = fit_temperature(logits, labels)
    assert t == pytest.approx(3.0, rel=0.10)
    before = calibration(softmax(logits), labels)
    after = calibration(softmax(logits, t), labels)
    assert after.ece < before.ece / 8
    assert after.ece < math.sqrt(15 / N)  # as good as a calibrated model, up to sampling noise
    assert after.nll < before.nll
    assert after.accuracy == before.accuracy  # scaling never changes the argmax
    # The found T is a minimum of the NLL: nudging it either way costs.
    for nudged in (0.9 * t, 1.1 * t):
        assert calibration(softmax(logits, nudged), labels).nll > after.nll


def test_fit_temperature_sharpens_an_underconfident_model() -> None:
    rng = np.random.default_rng(2)
    z = rng.normal(0.0, 2.0, size=(5_000, 4))
    t = fit_temperature(z / 2.0, draw_labels(softmax(z), rng))
    assert t == pytest.approx(0.5, rel=0.10)


def test_softmax_is_stable_and_tempered() -> None:
    p = softmax(np.array([[1000.0, 0.0, -1000.0], [1.0, 2.0, 3.0]]))
    assert np.all(np.isfinite(p))
    assert p[0].tolist() == [1.0, 0.0, 0.0]
    e = np.exp([1.0, 2.0, 3.0])
    assert p[1] == pytest.approx(e / e.sum())
    hot = softmax(np.array([1.0, 2.0, 3.0]), temperature=2.0)
    e2 = np.exp([0.5, 1.0, 1.5])
    assert hot == pytest.approx(e2 / e2.sum())
    assert softmax(np.array([5.0, 5.0]), temperature=0.01).tolist() == [0.5, 0.5]


@pytest.mark.parametrize(
    ("probs", "labels", "error", "match"),
    [
        (np.array([0.5, 0.5]), np.array([0]), DataError, r"N x C"),
        (np.array([[1.0]]), np.array([0]), DataError, r"C >= 2 classes.*\[1 - p, p\]"),
        (np.array([[2.0, -1.0]]), np.array([0]), DataError, "negative.*not logits"),
        (np.array([[0.5, 0.6]]), np.array([0]), DataError, r"row 0 sums to 1\.1.*softmax"),
        (np.array([[np.nan, 0.5]]), np.array([0]), DataError, "NaN or infinite.*row 0"),
        (TINY_PROBS, np.array([0, 1]), DataError, "1-D array of 4 class indices"),
        (TINY_PROBS, np.array([0, 1, 2, 0]), DataError, r"0\.\.1 \(2 classes\), got 0\.\.2"),
        (TINY_PROBS, np.array([0, -1, 1, 0]), DataError, r"0\.\.1"),
        (TINY_PROBS, np.array([0.0, 0.5, 1.0, 0.0]), DataError, "integer class indices"),
        (TINY_PROBS, np.array(["a", "b", "c", "d"]), DataError, "integer class indices"),
    ],
)
def test_bad_inputs_say_what_to_pass(
    probs: np.ndarray, labels: np.ndarray, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        calibration(probs, labels)


def test_integral_float_labels_are_accepted() -> None:
    a = calibration(TINY_PROBS, TINY_LABELS.astype(np.float32), n_bins=5)
    assert a == calibration(TINY_PROBS, TINY_LABELS, n_bins=5)


@pytest.mark.parametrize("n_bins", [0, -3, 2.5, True])
def test_bad_bin_count(n_bins: object) -> None:
    with pytest.raises(SpecError, match="n_bins must be a positive integer"):
        calibration(TINY_PROBS, TINY_LABELS, n_bins=n_bins)  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.inf, math.nan])
def test_bad_temperature(temperature: float) -> None:
    with pytest.raises(SpecError, match="temperature must be a positive finite number"):
        softmax(np.zeros((2, 3)), temperature)


def test_fit_temperature_validates() -> None:
    with pytest.raises(DataError, match="NaN or infinite"):
        fit_temperature(np.array([[np.inf, 0.0]]), np.array([0]))
    with pytest.raises(DataError, match=r"0\.\.2 \(3 classes\)"):
        fit_temperature(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(DataError, match="NaN or infinite"):
        softmax(np.array([np.nan, 1.0]))


def _png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG"
        im.load()
        assert len(np.unique(np.asarray(im.convert("L")))) > 5  # something was drawn
        return im.size


def test_reliability_diagram_writes_a_png(
    tmp_path: Path, overconfident: tuple[np.ndarray, np.ndarray]
) -> None:
    logits, labels = overconfident
    before = calibration(softmax(logits), labels)
    one = reliability_diagram(before, tmp_path / "sub" / "one.png", title="over-confident")
    assert one == tmp_path / "sub" / "one.png" and one.stat().st_size > 1000
    w1, h1 = _png(one)

    after = calibration(softmax(logits, fit_temperature(logits, labels)), labels)
    pair = reliability_diagram(before, tmp_path / "pair.png", "before and after", after=after)
    w2, h2 = _png(pair)
    assert w2 > 1.8 * w1 and h2 == h1  # two panels side by side
    # Written atomically: no temporary file is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pair.png", "sub"]


def test_reliability_diagram_of_a_single_bin(tmp_path: Path) -> None:
    cal = calibration(np.array([[0.5, 0.5]]), np.array([0]))
    _png(reliability_diagram(cal, tmp_path / "single.png"))
    assert isinstance(cal, Calibration)
