"""`visionloop monitor` end to end: the reference built from the served export on the
validation split, a real server logging per-request statistics and outputs, windows of clean
and of darkened traffic judged from its prediction log, the window log, the Prometheus gauges
over real HTTP, and the command as a user runs it."""

from __future__ import annotations

import io
import json
import os
import socket
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

import _warmcli
from _modelkit import ModelKit, onnx_model
from visionloop.data.manifest import read_manifest, shard_dir_of
from visionloop.data.shards import ShardReader
from visionloop.eval.corruptions import corrupt, image_seed
from visionloop.monitor.history import read_windows
from visionloop.monitor.reference import build_reference, load_reference
from visionloop.monitor.service import Gauges, MonitorOptions, new_windows
from visionloop.monitor.windows import WindowSpec
from visionloop.serve.config import ServeConfig
from visionloop.serve.record import ReadStats, read_records
from visionloop.serve.server import BackgroundServer
from visionloop.serve.source import RegistrySource

__all__ = ["onnx_model"]

WINDOW = 120


def _val_images(kit: ModelKit) -> list[bytes]:
    manifest = read_manifest(kit.dataset)
    reader = ShardReader(shard_dir_of(kit.dataset, manifest.splits["val"]))
    return [r["image"] for r in reader.read_many(list(range(len(reader))))]


def _night(data: bytes, i: int) -> bytes:
    rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    dark = corrupt(rgb, "night", 4, image_seed(0, i))
    buf = io.BytesIO()
    Image.fromarray(dark).save(buf, format="PNG")
    return buf.getvalue()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(onnx_model: ModelKit, tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelKit, Path]:
    """A private home with the reference built, and a prediction log holding one window of
    clean validation images, then one of the same images at night (severity 4)."""
    kit = onnx_model.copy_home(tmp_path_factory.mktemp("monitor") / "home")
    build_reference(kit.ref, settings=kit.settings)
    logs = kit.home / "serve" / "predictions"
    images = _val_images(kit)[:WINDOW]
    cfg = ServeConfig(model=kit.name, port=0, max_batch_size=8, max_queue_delay_ms=1.0)
    with BackgroundServer(cfg, RegistrySource(kit.settings), logs / "test-0.jsonl") as server:
        url = f"{server.url}/v2/models/{kit.name}/classify"
        for batch in (
            [(i, d) for i, d in enumerate(images)],
            [(i, _night(d, i)) for i, d in enumerate(images)],
        ):
            for _, data in batch:
                r = httpx.post(url, content=data, headers={"Content-Type": "image/png"}, timeout=30)
                assert r.status_code == 200, r.text
        server.app.state.server.predlog.flush()
    return kit, logs


def test_the_reference_is_what_the_served_model_does_on_the_validation_split(
    onnx_model: ModelKit, tmp_path: Path
) -> None:
    kit = onnx_model.copy_home(tmp_path / "home")
    ref, where = build_reference(kit.ref, settings=kit.settings)
    n = len(_val_images(kit))
    assert ref.images == n and ref.split == "val" and ref.task == "classification"
    assert ref.outputs is not None and ref.outputs.shape == (n, 10)
    np.testing.assert_allclose(ref.outputs.sum(axis=1), 1.0, atol=1e-5)  # probabilities
    assert ref.class_counts is not None and int(ref.class_counts.sum()) == n
    assert ref.accuracy is not None and ref.accuracy > 0.9
    # ATC's threshold: the share of reference confidences at or over it is the accuracy.
    assert ref.confidence is not None and ref.atc_threshold is not None
    assert abs(float(np.mean(ref.confidence >= ref.atc_threshold)) - ref.accuracy) <= 1.0 / n
    assert set(ref.image) == {
        "brightness",
        "contrast",
        "sharpness",
        "saturation",
        "width",
        "height",
        "aspect",
    }
    assert set(np.unique(ref.image["width"])) == {16.0}
    assert float(ref.image["saturation"].max()) == 0.0  # the digits are grey
    # The export's embedding output (16 PCA components of the penultimate layer), per image.
    assert ref.embeddings is not None and ref.embeddings.shape == (n, 16)
    assert float(ref.embeddings.std(axis=0).min()) > 0.0  # every component varies
    back = load_reference(kit.info().dir)
    assert back.meta() == ref.meta() and where == kit.info().dir / "monitor"
    np.testing.assert_array_equal(back.embeddings, ref.embeddings)
    np.testing.assert_array_equal(back.outputs, ref.outputs)
    np.testing.assert_array_equal(back.image["brightness"], ref.image["brightness"])


def test_the_log_carries_what_the_reference_holds_for_the_same_image(served: tuple[ModelKit, Path]) -> None:
    kit, logs = served
    ref = load_reference(kit.info().dir)
    stats = ReadStats()
    records = [r for p in sorted(logs.iterdir()) for r in read_records(p, stats)]
    assert stats.bad == 0 and len(records) == 2 * WINDOW
    # The first clean request is validation image 0, the reference's first row: the same numbers.
    first = records[0].monitor
    assert first is not None and first.outputs is not None and first.image is not None
    assert ref.outputs is not None and ref.confidence is not None and ref.class_counts is not None
    np.testing.assert_allclose(first.outputs, ref.outputs[0], atol=2e-6)
    assert first.confidence == pytest.approx(float(ref.confidence[0]), abs=2e-6)
    assert first.predicted == int(np.argmax(ref.outputs[0]))
    for key, values in ref.image.items():
        assert first.image[key] == pytest.approx(float(values[0]), abs=2e-6), key
    assert ref.embeddings is not None and first.embedding is not None
    np.testing.assert_allclose(first.embedding, ref.embeddings[0], atol=1e-5)
    night = records[WINDOW].monitor
    assert night is not None and night.image is not None
    assert night.image["brightness"] < 0.5 * first.image["brightness"]


def test_clean_traffic_passes_and_night_traffic_is_flagged_with_what_moved(
    served: tuple[ModelKit, Path],
) -> None:
    kit, logs = served
    ref = load_reference(kit.info().dir)
    options = MonitorOptions(window=WindowSpec(requests=WINDOW), logs=logs)
    judged, stats, waiting = new_windows(ref, options, kit.settings)
    assert stats.bad == 0 and waiting == 0 and len(judged) == 2
    clean, night = judged
    assert (clean.requests, night.requests) == (WINDOW, WINDOW)
    assert not clean.drift and clean.status == "ok" and clean.p_value is not None and clean.p_value > 0.05
    assert night.drift and night.p_value is not None and night.p_value < 1e-6
    assert "image_stats" in night.flagged
    assert any("brightness" in m for m in night.moved), night.moved
    assert set(night.p_values) == {"ks_bbsd", "mmd_embeddings", "label_shift", "image_stats"}
    assert "mmd_embeddings" in night.flagged  # the penultimate layer sees the night too
    # The label-free estimate: near the reference accuracy on clean traffic, lower at night.
    assert clean.estimated_accuracy is not None and night.estimated_accuracy is not None
    assert ref.accuracy is not None and abs(clean.estimated_accuracy - ref.accuracy) < 0.1
    assert night.estimated_accuracy < clean.estimated_accuracy
    # Recorded once: the window log has both, and a second pass judges nothing new.
    assert [w.drift for w in read_windows(kit.home, kit.name)] == [False, True]
    again, _, _ = new_windows(ref, options, kit.settings)
    assert again == []
    # Prometheus gauges, over real HTTP.
    gauges = Gauges()
    for w in judged:
        gauges.publish(w)
    port = _free_port()
    server, _thread = gauges.serve(port)
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        server.shutdown()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    mv = (("model", kit.name), ("version", str(kit.version)))
    assert samples[("visionloop_drift", mv)] == 1.0
    assert samples[("visionloop_drift_window_requests", mv)] == WINDOW
    assert samples[("visionloop_estimated_accuracy", mv)] == pytest.approx(night.estimated_accuracy)
    for test, p in night.p_values.items():
        key = ("visionloop_drift_p_value", tuple(sorted((*mv, ("test", test)))))
        assert samples[key] == pytest.approx(p), test


def test_the_command_as_a_user_runs_it(served: tuple[ModelKit, Path], tmp_path: Path) -> None:
    kit, logs = served
    home = kit.copy_home(tmp_path / "home")  # no window judged yet in this copy
    for p in (home.home / "monitor").glob("*/windows.jsonl"):
        p.unlink()
    env = {**os.environ, **home.env()}
    cmd = ["monitor", kit.name, "--window-requests", str(WINDOW), "--logs", str(logs)]
    r = _warmcli.run([*cmd, "--json"], env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [w["drift"] for w in lines] == [False, True]
    assert lines[1]["model"] == kit.name and lines[1]["requests"] == WINDOW
    r = _warmcli.run(cmd, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "no complete window" in r.stdout and "0 requests in the open one" in r.stdout
    # Bad input: a clear error, exit 2, nothing written.
    for bad, says in (
        (["--window-requests", "5"], "at least 20"),
        (["--window", "soon"], "not a duration"),
        (["--window", "1h", "--window-requests", "50"], "not both"),
        (["--thin", "some"], "auto or a whole number"),
    ):
        r = _warmcli.run([*cmd[:2], *bad], env=env, timeout=120)
        assert r.returncode != 0 and says in (r.stderr + r.stdout), (bad, r.stderr, r.stdout)
