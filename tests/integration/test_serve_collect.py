"""The server keeps a sample of what it sees (`collect:` in the serving config), over real
HTTP on loopback with the session's trained and exported digits model: nothing by default,
each distinct image once with a sighting per keep (the record the client's answer came
from), the low-confidence rule, the size cap counted in /metrics, retention at start-up,
and the configuration errors a user sees."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from PIL import Image

from _modelkit import ModelKit, onnx_model
from _servekit import infer_body, metric
from _trainkit import cli
from visionloop.core.errors import SpecError
from visionloop.data.manifest import read_manifest, shard_dir_of
from visionloop.data.shards import ShardReader
from visionloop.serve.collect import CollectedImage, read_collected
from visionloop.serve.config import ServeConfig, load_serve_config
from visionloop.serve.record import ReadStats, read_records
from visionloop.serve.server import BackgroundServer
from visionloop.serve.source import RegistrySource

__all__ = ["onnx_model"]

DAY = 86400.0


@pytest.fixture(scope="module")
def kit(onnx_model: ModelKit, tmp_path_factory: pytest.TempPathFactory) -> ModelKit:
    return onnx_model.copy_home(tmp_path_factory.mktemp("collect") / "home")


@pytest.fixture(scope="module")
def digits(kit: ModelKit) -> list[bytes]:
    """Validation digits as the PNG files ingest stored (16x16 greyscale)."""
    manifest = read_manifest(kit.dataset)
    reader = ShardReader(shard_dir_of(kit.dataset, manifest.splits["val"]))
    return [r["image"] for r in reader.read_many(list(range(12)))]


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _unlike_digits() -> list[bytes]:
    """Images unlike any digit: uniform fields, noise, stripes."""
    rng = np.random.default_rng(0)
    out = [_png(np.full((16, 16), v, dtype=np.uint8)) for v in (0, 128, 255)]
    out += [_png(rng.integers(0, 256, (16, 16), dtype=np.uint8)) for _ in range(3)]
    stripes = np.zeros((16, 16), dtype=np.uint8)
    stripes[:, ::2] = 255
    out += [_png(stripes), _png(stripes.T.copy())]
    return out


@contextmanager
def _server(kit: ModelKit, tmp: Path, log: bool = True, **collect: Any) -> Iterator[BackgroundServer]:
    cfg = ServeConfig(model=kit.name, port=0, max_queue_delay_ms=1.0, prediction_log=log, collect=collect)
    with BackgroundServer(
        cfg, RegistrySource(kit.settings), tmp / "predictions.jsonl", collected=tmp / "home-store"
    ) as server:
        yield server


def _classify(server: BackgroundServer, data: bytes, form: bool = False) -> dict[str, Any]:
    url = f"{server.url}/v2/models/digits/classify"
    if form:
        r = httpx.post(url, files={"file": ("x.png", data, "image/png")}, timeout=30)
    else:
        r = httpx.post(url, content=data, headers={"Content-Type": "image/png"}, timeout=30)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def _flush(server: BackgroundServer) -> None:
    state = server.app.state.server
    if state.predlog is not None:
        state.predlog.flush()
    state.collector.flush()


def _metrics(server: BackgroundServer) -> str:
    r = httpx.get(f"{server.url}/metrics", timeout=30)
    assert r.status_code == 200
    return r.text


def _store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != ".lock")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_nothing_is_kept_by_default(kit: ModelKit, digits: list[bytes], tmp_path: Path) -> None:
    with _server(kit, tmp_path) as server:
        for data in digits[:3]:
            _classify(server, data)
        assert server.app.state.server.collector is None
        text = _metrics(server)
    assert metric(text, "visionloop_collect_kept_total") == 0.0
    assert not (tmp_path / "home-store").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["predictions.jsonl"]


def test_every_image_is_kept_once_with_the_answer_the_client_got(
    kit: ModelKit, digits: list[bytes], tmp_path: Path
) -> None:
    a, b, c = digits[:3]
    store = tmp_path / "store"
    with _server(kit, tmp_path, enabled=True, sample_rate=1.0, dir=str(store)) as server:
        answers = [_classify(server, a), _classify(server, b), _classify(server, a)]
        answers.append(_classify(server, c, form=True))  # a multipart form: its file part is kept
        meta = httpx.get(f"{server.url}/v2/models/digits", timeout=30).json()
        x = np.zeros((1, *meta["inputs"][0]["shape"][1:]), dtype=np.float32)
        r = httpx.post(f"{server.url}/v2/models/digits/infer", json=infer_body(x), timeout=30)
        assert r.status_code == 200, r.text  # a tensor request: no image file, never kept
        _flush(server)
        text = _metrics(server)
    assert not (tmp_path / "home-store").exists()  # the config's dir wins
    stats = ReadStats()
    images = {i.sha256: i for i in read_collected(store, stats)}
    assert stats.bad == 0 and set(images) == {_sha(a), _sha(b), _sha(c)}
    for data in (a, b, c):
        img = images[_sha(data)]
        assert img.path.read_bytes() == data and img.path.name == f"{_sha(data)}.png"
        assert img.path.parent.name == _sha(data)[:2]
    assert [images[_sha(d)].seen for d in (a, b, c)] == [2, 1, 1]
    sightings = [*images[_sha(a)].sightings[:1], *images[_sha(b)].sightings, images[_sha(a)].sightings[1]]
    sightings.append(images[_sha(c)].sightings[0])
    for answer, record in zip(answers, sightings, strict=True):
        top = answer["predictions"][0]
        assert record.model == "digits" and record.version == kit.version and record.role == "primary"
        assert record.answer["top_class"] == top["label"]
        assert record.answer["confidence"] == pytest.approx(top["score"], abs=1e-6)
        assert record.monitor is not None and record.monitor.confidence == pytest.approx(
            top["score"], abs=1e-6
        )
        assert record.monitor.embedding is not None and len(record.monitor.embedding) == 16
        assert record.monitor.image is not None and record.monitor.image["width"] == 16.0
    assert all(i.kept_by == ["sample"] * i.seen for i in images.values())
    # The sidecar holds the prediction log's own records for those requests.
    logged = [orjson.dumps(r.to_json()) for r in read_records(tmp_path / "predictions.jsonl")]
    assert len(logged) == 5  # the tensor request is logged, not collected
    assert all(orjson.dumps(s.to_json()) in logged for s in sightings)
    assert metric(text, "visionloop_collect_kept_total") == 4.0
    assert metric(text, "visionloop_collect_bytes") == _store_bytes(store)
    assert metric(text, "visionloop_collect_dropped_total") == 0.0


def test_below_confidence_keeps_exactly_the_unsure_answers(
    kit: ModelKit, digits: list[bytes], tmp_path: Path
) -> None:
    threshold = 0.9
    sent = [*digits, *_unlike_digits()]
    store = tmp_path / "store"
    # Without a prediction log: collecting does not depend on it.
    collect = {"enabled": True, "below_confidence": threshold, "dir": str(store)}
    with _server(kit, tmp_path, log=False, **collect) as server:
        scores = [_classify(server, data)["predictions"][0]["score"] for data in sent]
        _flush(server)
    assert not (tmp_path / "predictions.jsonl").exists()
    unsure = {_sha(d) for d, s in zip(sent, scores, strict=True) if s < threshold}
    # Both kinds were sent: the rule had something to keep and something to leave.
    assert unsure and len(unsure) < len(sent), scores
    kept = list(read_collected(store))
    assert {i.sha256 for i in kept} == unsure
    assert all(i.kept_by == ["confidence"] for i in kept)
    for i in kept:
        (record,) = i.sightings
        assert record.answer["confidence"] < threshold
        assert record.monitor is not None and record.monitor.image is not None  # as the log has them


def test_the_cap_stops_keeping_and_counts_what_it_left(
    kit: ModelKit, digits: list[bytes], tmp_path: Path
) -> None:
    rng = np.random.default_rng(1)
    large = [_png(rng.integers(0, 256, (160, 160, 3), dtype=np.uint8)) for _ in range(3)]
    assert all(len(d) > 60_000 for d in large)
    store = tmp_path / "store"
    with _server(kit, tmp_path, enabled=True, sample_rate=1.0, max_bytes=50_000, dir=str(store)) as server:
        _classify(server, digits[0])  # a 16x16 PNG and its sidecar: a few KB
        for data in large:
            _classify(server, data)
        _classify(server, digits[1])
        _flush(server)
        text = _metrics(server)
    assert {i.sha256 for i in read_collected(store)} == {_sha(digits[0]), _sha(digits[1])}
    assert metric(text, "visionloop_collect_dropped_total", reason="full") == 3.0
    assert metric(text, "visionloop_collect_dropped_total", reason="queue") == 0.0
    assert metric(text, "visionloop_collect_kept_total") == 2.0
    assert metric(text, "visionloop_collect_bytes") == _store_bytes(store) <= 50_000


def _age(image: CollectedImage, days: float) -> None:
    doc = orjson.loads(image.sidecar.read_bytes())
    for s in doc["sightings"]:
        s["record"]["time"] -= days * DAY
    image.sidecar.write_bytes(orjson.dumps(doc))


def test_retention_deletes_what_was_last_seen_too_long_ago(
    kit: ModelKit, digits: list[bytes], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    collect: dict[str, Any] = {"enabled": True, "sample_rate": 1.0, "retention_days": 30, "dir": str(store)}
    with _server(kit, tmp_path, **collect) as server:
        for data in digits[:3]:
            _classify(server, data)
        _flush(server)
    old, recent, damaged = (next(i for i in read_collected(store) if i.sha256 == _sha(d)) for d in digits[:3])
    _age(old, 31)
    _age(recent, 29)
    damaged.sidecar.write_bytes(b'{"schema": 1, "sha256": "torn')
    # The next server's start-up sweep deletes the expired image (by its sidecar's times: the
    # files were all written a moment ago); the reader skips the damaged sidecar and counts it.
    with _server(kit, tmp_path, **collect) as server:
        _flush(server)
        text = _metrics(server)
    assert not old.path.exists() and not old.sidecar.exists()
    stats = ReadStats()
    assert [i.sha256 for i in read_collected(store, stats)] == [recent.sha256]
    assert stats.read == 1 and stats.bad == 1 and stats.first_error is not None
    assert str(damaged.sidecar) in stats.first_error and damaged.path.exists()
    assert metric(text, "visionloop_collect_bytes") == _store_bytes(store)


def test_a_bad_collect_section_is_a_clear_error(tmp_path: Path) -> None:
    def write(section: str) -> Path:
        path = tmp_path / "serving.yaml"
        path.write_text(f"model: digits\ncollect:\n{section}")
        return path

    with pytest.raises(SpecError, match=r"collect\.sample_rate: Input should be less than or equal to 1"):
        load_serve_config(write("  enabled: true\n  sample_rate: 2\n"))
    with pytest.raises(SpecError, match=r"collect\.keep_below: unknown field"):
        load_serve_config(write("  enabled: true\n  keep_below: 0.5\n"))
    # As a user meets it: one line per problem, no traceback, a non-zero exit.
    r = cli("serve", "--config", str(write("  enabled: true\n")))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    said = " ".join((r.stdout + r.stderr).split())
    assert "collect.enabled is true but no rule keeps anything" in said, said
    assert "collect.sample_rate (e.g. 0.01)" in said and "collect.below_confidence (e.g. 0.5)" in said
