"""The monitor's pieces without a server: record fields, windows, ATC, the window log."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import orjson
import pytest

from _refkit import three_class_reference
from visionloop.monitor.history import WindowRecord, WindowRecordError, append_window, read_windows
from visionloop.monitor.reference import Reference, atc_threshold
from visionloop.monitor.windows import WindowSpec, cut, judge
from visionloop.serve.record import MonitorFields, PredictionRecord, RecordError


def _rec(t: float, outputs: list[float] | None = None, predicted: int | None = None) -> PredictionRecord:
    monitor = (
        None
        if outputs is None
        else MonitorFields(outputs=outputs, predicted=predicted, confidence=max(outputs))
    )
    return PredictionRecord(time=t, model="m", version=1, role="primary", latency_ms=1.0, monitor=monitor)


def test_monitor_fields_round_trip_from_a_numpy_row() -> None:
    row = np.array([0.25, 0.75], dtype=np.float32)
    rec = PredictionRecord(
        time=1.0,
        model="m",
        version=2,
        role="primary",
        latency_ms=3.0,
        answer={"top_class": "b"},
        monitor=MonitorFields(outputs=row, predicted=1, confidence=0.75, image={"brightness": 0.5}),  # type: ignore[arg-type]
    )
    doc = orjson.loads(orjson.dumps(rec.to_json()))
    assert doc["monitor"] == {
        "outputs": [0.25, 0.75],
        "predicted": 1,
        "confidence": 0.75,
        "image": {"brightness": 0.5},
    }
    back = PredictionRecord.from_json(doc)
    assert back.monitor == MonitorFields((0.25, 0.75), 1, 0.75, {"brightness": 0.5})
    assert back.answer == {"top_class": "b"}  # "monitor" is not taken for a task field
    old = {k: v for k, v in doc.items() if k != "monitor"} | {"schema": 2}
    assert PredictionRecord.from_json(old).monitor is None  # schema 2 still reads


@pytest.mark.parametrize(
    ("monitor", "says"),
    [
        ([1, 2], "monitor must be a JSON object"),
        ({"outputs": "0.5"}, "monitor.outputs must be a list"),
        ({"outputs": [0.1] * 1001}, "at most 1000"),
        ({"outputs": [0.1, None]}, "must be a finite number"),
        ({"outputs": [float("nan")]}, "must be a finite number"),
        ({"predicted": -1}, "class index"),
        ({"predicted": True}, "class index"),
        ({"confidence": "high"}, "monitor.confidence must be a finite number"),
        ({"image": {"k" + str(i): 1.0 for i in range(40)}}, "at most 32"),
        ({"image": {"brightness": "dark"}}, "monitor.image.brightness"),
    ],
)
def test_hostile_monitor_fields_are_refused_by_name(monitor: object, says: str) -> None:
    doc = {"schema": 3, "time": 1.0, "model": "m", "version": 1, "role": "primary", "latency_ms": 1.0}
    with pytest.raises(RecordError, match=says):
        PredictionRecord.from_json({**doc, "monitor": monitor})


def test_request_windows_are_complete_chunks_and_time_windows_close_with_the_clock() -> None:
    records = [_rec(float(t)) for t in range(250)]
    chunks = list(cut(records, WindowSpec(requests=100), now=1e9))
    assert [len(c) for c in chunks] == [100, 100]  # the last 50 wait for their window to fill
    assert chunks[1][0].time == 100.0
    upto = records[:240]
    timed = list(cut(upto, WindowSpec(seconds=60), now=239.0))
    # [0,60) [60,120) [120,180) [180,240): the last is open until the clock passes 240.
    assert [len(c) for c in timed] == [60, 60, 60]
    assert [len(c) for c in cut(upto, WindowSpec(seconds=60), now=240.0)] == [60, 60, 60, 60]
    # A request of the next window closes the one before it, whatever the clock says.
    assert [len(c) for c in cut(records, WindowSpec(seconds=60), now=245.0)] == [60, 60, 60, 60]
    with pytest.raises(ValueError, match="either a duration or a number"):
        WindowSpec()


def test_atc_threshold_makes_the_share_over_it_the_accuracy() -> None:
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.3, 1.0, 1000)
    correct = rng.uniform(size=1000) < conf  # calibrated
    t = atc_threshold(conf, correct)
    assert float(np.mean(conf >= t)) == pytest.approx(float(correct.mean()), abs=1e-3)
    assert float(np.mean(conf >= atc_threshold(conf, np.ones(1000, bool)))) == 1.0
    assert float(np.mean(conf >= atc_threshold(conf, np.zeros(1000, bool)))) == 0.0


def _reference(n: int, rng: np.random.Generator) -> Reference:
    logits = rng.normal(size=(n, 3)) + np.array([2.0, 0.0, 0.0])
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return three_class_reference(probs, atc_threshold=0.6)


def test_judge_flags_a_prior_shift_and_passes_the_same_distribution() -> None:
    rng = np.random.default_rng(1)
    ref = _reference(2000, rng)
    same = _reference(300, rng)
    moved = _reference(300, rng)
    assert same.outputs is not None and moved.outputs is not None
    window = [_rec(float(i), same.outputs[i].tolist(), int(same.outputs[i].argmax())) for i in range(300)]
    w = judge(ref, window, thin=1)
    assert not w.drift and w.p_value is not None and w.p_value > 0.05 and w.tested == 300
    # Class "c" made the most likely one for a third of the requests.
    shifted = moved.outputs.copy()
    shifted[:100] = shifted[:100][:, [2, 1, 0]]
    window = [_rec(float(i), shifted[i].tolist(), int(shifted[i].argmax())) for i in range(300)]
    w = judge(ref, window, thin=1)
    assert w.drift and "label_shift" in w.flagged and "ks_bbsd" in w.flagged
    assert w.estimated_accuracy == pytest.approx(float(np.mean(shifted.max(axis=1) >= 0.6)))


def test_auto_thinning_keeps_independent_traffic_and_thins_a_slow_stream() -> None:
    rng = np.random.default_rng(2)
    ref = _reference(2000, rng)
    iid = _reference(400, rng)
    assert iid.outputs is not None
    window = [_rec(float(i), iid.outputs[i].tolist(), int(iid.outputs[i].argmax())) for i in range(400)]
    assert judge(ref, window).tested == 400
    # A slowly panning camera: each request repeats the last one's outputs 20 times.
    slow = np.repeat(iid.outputs[:20], 20, axis=0)
    window = [_rec(float(i), slow[i].tolist(), int(slow[i].argmax())) for i in range(400)]
    assert judge(ref, window).tested <= 40


def test_the_window_log_round_trips_and_skips_what_it_cannot_read(tmp_path: Path) -> None:
    w = WindowRecord(
        "m",
        1,
        0.0,
        10.0,
        100,
        50,
        "ok",
        True,
        0.001,
        0.05,
        ("ks_bbsd",),
        ("ks_bbsd: p(a)",),
        0.8,
        {"ks_bbsd": 0.001},
    )
    path = append_window(tmp_path, w)
    with open(path, "ab") as f:
        f.write(b'{"schema": 1, "model": "m"}\n')  # torn
        f.write(b"not json\n")
        f.write(b"\0" * (8 << 20) + b"\n")  # a crash's NULs: skipped a block at a time, never held
    append_window(tmp_path, w)
    tracemalloc.start()
    try:
        assert list(read_windows(tmp_path, "m")) == [w, w]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes held"
    assert list(read_windows(tmp_path, "other")) == []
    with pytest.raises(WindowRecordError, match="newer visionloop"):
        WindowRecord.from_json({**w.to_json(), "schema": 99})


def test_a_detector_gives_box_counts_and_scores_and_a_classifier_its_probabilities() -> None:
    from visionloop.tasks import get_task

    scores = np.array([[0.9, 0.3, 0.1, 0.0], [0.2, 0.0, 0.0, 0.0]], dtype=np.float32)
    outputs: dict[str, np.ndarray] = {
        "boxes": np.tile(
            np.array([[0, 0, 4, 4], [10, 10, 14, 14], [20, 0, 24, 4], [0, 20, 4, 24]], np.float32), (2, 1, 1)
        ),
        "scores": scores,
        "labels": np.zeros((2, 4), dtype=np.int64),
    }
    d = get_task("detection").drift_outputs(outputs, ["a"])
    assert d is not None and d.names == ("detections", "max_score", "mean_score")
    # Over the default threshold 0.25: two boxes (0.9, 0.3) in image 0, none in image 1.
    np.testing.assert_allclose(d.columns, [[2, 0.9, 0.6], [0, 0.2, 0.0]], atol=1e-6)
    assert d.classes is None and d.confidence is None
    c = get_task("classification").drift_outputs(
        {"logits": np.array([[0.0, np.log(3.0)]], np.float32)}, ["x", "y"]
    )
    assert c is not None and c.names == ("p(x)", "p(y)")
    np.testing.assert_allclose(c.columns, [[0.25, 0.75]], atol=1e-6)
    assert c.classes is not None and c.classes.tolist() == [1]
    assert c.confidence is not None and c.confidence.tolist() == pytest.approx([0.75])
    many = get_task("classification").drift_outputs({"logits": np.zeros((1, 200), np.float32)}, [])
    assert many is not None and many.names == ("confidence", "margin", "entropy")
    np.testing.assert_allclose(many.columns, [[1 / 200, 0.0, np.log(200)]], rtol=1e-5)


def test_a_confident_model_is_not_flagged_for_the_logs_rounding() -> None:
    # Probabilities under 5e-7 are logged as 0 (6 decimals): compared with the unrounded
    # reference they would all sit below it, and KS flags every window of this model.
    rng = np.random.default_rng(3)
    ref = _reference(2000, rng)
    same = _reference(2000, rng)
    assert ref.outputs is not None and same.outputs is not None
    sharpen = lambda p: (p**8 / (p**8).sum(axis=1, keepdims=True)).astype(np.float32)  # noqa: E731
    ref.outputs, window_probs = sharpen(ref.outputs), sharpen(same.outputs)
    assert float(np.mean(ref.outputs < 5e-7)) > 0.2
    logged = [
        PredictionRecord.from_json(
            orjson.loads(orjson.dumps(_rec(float(i), window_probs[i].tolist(), 0).to_json()))
        )
        for i in range(2000)
    ]
    w = judge(ref, logged, thin=1)
    assert "ks_bbsd" not in w.flagged, w.p_values
