"""The `collect:` section and `serve.collect` without a server: the config's checks, format
sniffing, the keeping rules, the store on disk (one copy per image, sightings, the size cap,
retention, two writers on one store) and the reader's refusals."""

from __future__ import annotations

import fcntl
import hashlib
import io
import logging
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from PIL import Image

import visionloop.serve.config as serve_config
from visionloop.core.errors import SpecError
from visionloop.serve.collect import (
    MAX_SIDECAR_BYTES,
    MAX_SIGHTINGS,
    CollectedImage,
    Collector,
    answer_confidence,
    image_extension,
    read_collected,
    store_dir,
)
from visionloop.serve.config import CollectConfig, ServeConfig, load_serve_config, validate_serve_config
from visionloop.serve.metrics import ServeMetrics
from visionloop.serve.record import MonitorFields, PredictionRecord, ReadStats

DAY = 86400.0


def _png(value: int, size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (size, size), value).save(buf, format="PNG")
    return buf.getvalue()


def _record(t: float = 0.0, confidence: float = 0.9, **answer: Any) -> PredictionRecord:
    return PredictionRecord(
        time=t or time.time(),
        model="digits",
        version=1,
        role="primary",
        latency_ms=1.5,
        answer={"top_class": "7", "confidence": confidence, **answer},
        monitor=MonitorFields(
            outputs=[0.1, confidence], predicted=1, confidence=confidence, embedding=[0.25, -1.0]
        ),
    )


def _collector(tmp_path: Path, **config: Any) -> Collector:
    cfg = CollectConfig(**{"enabled": True, "sample_rate": 1.0, **config})
    return Collector(cfg, tmp_path / "store", metrics=ServeMetrics(), seed=0)


def _store_bytes(root: Path) -> int:
    """What the store's images and sidecars take on disk."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != ".lock")


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != ".lock")


# --------------------------------------------------------------------------- config


def test_collect_is_off_by_default_with_the_documented_defaults() -> None:
    c = ServeConfig(model="digits").collect
    assert (c.enabled, c.sample_rate, c.below_confidence, c.dir) == (False, 0.0, None, None)
    assert c.max_bytes == 2**30 and c.retention_days == 30.0
    assert store_dir(c, Path("/h")) == Path("/h/serve/collected")
    assert store_dir(CollectConfig(dir=Path("/d")), Path("/h")) == Path("/d")


@pytest.mark.parametrize(
    ("section", "says"),
    [
        (
            {"enabled": True, "sampel_rate": 0.1},
            "collect.sampel_rate: unknown field. Did you mean `sample_rate`?",
        ),
        ({"enabled": True, "sample_rate": 2}, "collect.sample_rate: Input should be less than or equal to 1"),
        (
            {"enabled": True, "below_confidence": 0},
            "collect.below_confidence: Input should be greater than 0",
        ),
        ({"enabled": True, "below_confidence": 1.5}, "collect.below_confidence: Input should be less than"),
        (
            {"enabled": True, "sample_rate": 0.1, "retention_days": 0},
            "collect.retention_days: Input should be",
        ),
        ({"enabled": True, "sample_rate": 0.1, "max_bytes": "lots"}, "collect.max_bytes: Input should be"),
        ({"enabled": True}, "no rule keeps anything: set collect.sample_rate (e.g. 0.01) and/or "),
        ({"enabled": True, "sample_rate": 0.0}, "collect.below_confidence (e.g. 0.5)"),
    ],
)
def test_a_bad_collect_section_is_refused_naming_the_field(section: dict[str, Any], says: str) -> None:
    with pytest.raises(SpecError) as e:
        validate_serve_config({"model": "digits", "collect": section}, "serving.yaml")
    assert "serving.yaml is not a valid ServeConfig" in str(e.value)
    assert says in str(e.value)


def test_either_rule_alone_is_enough_and_off_needs_none() -> None:
    assert validate_serve_config({"model": "d", "collect": {"enabled": True, "sample_rate": 0.01}})
    assert validate_serve_config({"model": "d", "collect": {"enabled": True, "below_confidence": 0.5}})
    assert not validate_serve_config({"model": "d", "collect": {"below_confidence": 0.5}}).collect.enabled
    home = validate_serve_config({"model": "d", "collect": {"dir": "~/kept"}}).collect.dir
    assert home == Path("~/kept").expanduser()


def test_the_documented_example_is_a_valid_serving_config(tmp_path: Path) -> None:
    doc = serve_config.__doc__ or ""
    block = doc.split("\n\n")[1]  # the indented example after the first paragraph
    (tmp_path / "serving.yaml").write_text("\n".join(line[4:] for line in block.splitlines()))
    cfg = load_serve_config(tmp_path / "serving.yaml")
    c = cfg.collect
    assert (c.enabled, c.sample_rate, c.below_confidence, c.max_bytes, c.retention_days, c.dir) == (
        True,
        0.01,
        0.5,
        2**30,
        30.0,
        None,
    )
    assert yaml.safe_load(serve_config.dump_serve_config(cfg))["collect"]["sample_rate"] == 0.01


def test_the_readme_example_is_a_valid_collect_section() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, flags=re.S) if b.startswith("collect:")]
    c = validate_serve_config({"model": "digits", **yaml.safe_load(block)}, "README").collect
    assert (c.enabled, c.sample_rate, c.below_confidence, c.max_bytes, c.retention_days) == (
        True,
        0.01,
        0.5,
        CollectConfig().max_bytes,  # the documented default
        CollectConfig().retention_days,
    )


def test_the_server_collects_only_when_enabled_and_where_told(tmp_path: Path) -> None:
    from visionloop.core.errors import ConfigError
    from visionloop.serve.source import StaticSource
    from visionloop.serve.state import Server

    def server(collected: Path | None, **collect: Any) -> Server:
        return Server(ServeConfig(model="digits", collect=collect), StaticSource(), None, collected)

    assert server(tmp_path / "home-store").collector is None
    assert not (tmp_path / "home-store").exists()
    on = {"enabled": True, "sample_rate": 0.5}
    s = server(tmp_path / "home-store", **on)
    assert s.collector is not None and s.collector.dir == tmp_path / "home-store"
    s.collector.close()
    s = server(tmp_path / "home-store", **on, dir=str(tmp_path / "mine"))
    assert s.collector is not None and s.collector.dir == tmp_path / "mine"  # the config's dir wins
    s.collector.close()
    with pytest.raises(ConfigError, match=r"set collect\.dir in the serving config"):
        server(None, **on)
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"cannot keep collected images in .*file.*set collect.dir"):
        server(None, **on, dir=str(tmp_path / "file" / "store"))


# --------------------------------------------------------------------------- rules


@pytest.mark.parametrize(
    ("fmt", "ext"),
    [
        ("PNG", "png"),
        ("JPEG", "jpg"),
        ("WEBP", "webp"),
        ("GIF", "gif"),
        ("TIFF", "tiff"),
        ("BMP", "bmp"),
        ("PPM", "ppm"),
    ],
)
def test_the_extension_is_the_format_the_bytes_are(fmt: str, ext: str) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (10, 20, 30)).save(buf, format=fmt)
    assert image_extension(buf.getvalue()) == ext
    assert image_extension(b"%PDF-1.4 not an image") == "bin"
    assert image_extension(b"") == "bin"


def test_confidence_is_read_from_the_monitor_fields_else_the_answer_fields() -> None:
    assert answer_confidence(_record(confidence=0.3)) == pytest.approx(0.3)
    bare = PredictionRecord(time=1.0, model="m", version=1, role="primary", latency_ms=1.0, answer={})
    assert answer_confidence(bare) is None
    # A detector logs its best score, with no monitor confidence.
    det = PredictionRecord(1.0, "m", 1, "primary", 1.0, {"detections": 0, "counts": {}, "max_score": 0.12})
    assert answer_confidence(det) == pytest.approx(0.12)
    no_monitor = PredictionRecord(1.0, "m", 1, "primary", 1.0, {"top_class": "a", "confidence": 0.7})
    assert answer_confidence(no_monitor) == pytest.approx(0.7)


def test_the_sample_rate_draws_from_the_collectors_own_seeded_generator(tmp_path: Path) -> None:
    cfg = CollectConfig(enabled=True, sample_rate=0.3)
    a = Collector(cfg, tmp_path / "a", seed=7)
    b = Collector(cfg, tmp_path / "b", seed=7)
    try:
        random.seed(123)  # the global generator plays no part
        kept_a = [a.offer(b"x", _record()) for _ in range(200)]
        random.seed(456)
        kept_b = [b.offer(b"x", _record()) for _ in range(200)]
        expected = random.Random(7)
        assert kept_a == kept_b == ["sample" if expected.random() < 0.3 else None for _ in range(200)]
        assert 40 <= sum(k is not None for k in kept_a) <= 80
    finally:
        a.close()
        b.close()


def test_below_confidence_keeps_the_unsure_answers_and_says_so(tmp_path: Path) -> None:
    c = _collector(tmp_path, sample_rate=0.0, below_confidence=0.5)
    try:
        assert c.offer(_png(1), _record(confidence=0.49)) == "confidence"
        assert c.offer(_png(2), _record(confidence=0.5)) is None  # below, not at
        assert c.offer(_png(3), _record(confidence=0.99)) is None
        c.flush()
        (only,) = read_collected(c.dir)
        assert only.path.read_bytes() == _png(1) and only.kept_by == ["confidence"]
    finally:
        c.close()


# --------------------------------------------------------------------------- the store


def test_an_image_is_stored_once_by_hash_with_one_sighting_per_keep(tmp_path: Path) -> None:
    c = _collector(tmp_path)
    first, again, other = _record(confidence=0.8), _record(confidence=0.6), _record(confidence=0.7)
    try:
        c.offer(_png(10), first)
        c.offer(_png(10), again)
        c.offer(_png(200), other)
        c.flush()
    finally:
        c.close()
    sha = hashlib.sha256(_png(10)).hexdigest()
    sha2 = hashlib.sha256(_png(200)).hexdigest()
    assert _files(c.dir) == sorted(
        [f"{sha[:2]}/{sha}.png", f"{sha[:2]}/{sha}.json", f"{sha2[:2]}/{sha2}.png", f"{sha2[:2]}/{sha2}.json"]
    )
    stats = ReadStats()
    images = {i.sha256: i for i in read_collected(c.dir, stats)}
    assert stats.read == 2 and stats.bad == 0
    img = images[sha]
    assert isinstance(img, CollectedImage) and img.path == c.dir / sha[:2] / f"{sha}.png"
    assert img.path.read_bytes() == _png(10) and img.seen == 2
    # The sightings are the records as the prediction log writes them, in order.
    assert [s.to_json() for s in img.sightings] == [first.to_json(), again.to_json()]
    assert img.sightings[0].monitor is not None and img.sightings[0].monitor.embedding == (0.25, -1.0)
    assert img.kept_by == ["sample", "sample"] and img.last_seen == again.time
    assert images[sha2].seen == 1
    assert c.kept == 3 and c.bytes == _store_bytes(c.dir)
    assert (c.dir.stat().st_mode & 0o777) == 0o700  # images may show people


def test_a_sidecar_keeps_the_newest_sightings_and_counts_them_all(tmp_path: Path) -> None:
    c = _collector(tmp_path)
    try:
        records = [_record(t=1e9 + i) for i in range(MAX_SIGHTINGS + 6)]
        for r in records:
            c.offer(_png(5), r)
        c.flush()
    finally:
        c.close()
    (img,) = read_collected(c.dir)
    assert img.seen == MAX_SIGHTINGS + 6 and len(img.sightings) == MAX_SIGHTINGS
    assert [s.time for s in img.sightings] == [r.time for r in records[6:]]


def test_the_cap_stops_keeping_counts_and_warns_once_a_minute(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    one = _collector(tmp_path / "probe")
    one.offer(_png(0), _record())
    one.flush()
    one.close()
    per_image = one.bytes  # an image and its sidecar
    metrics = ServeMetrics()
    cfg = CollectConfig(enabled=True, sample_rate=1.0, max_bytes=per_image + 10)
    c = Collector(cfg, tmp_path / "store", metrics=metrics)
    try:
        with caplog.at_level(logging.WARNING, "visionloop.serve.collect"):
            for v in range(5):
                c.offer(_png(v), _record())
            c.flush()
    finally:
        c.close()
    assert c.kept == 1 and c.dropped == {"full": 4, "queue": 0, "error": 0}
    assert len(list(read_collected(c.dir))) == 1 and c.bytes <= per_image + 10
    warnings = [r.getMessage() for r in caplog.records if "collect.max_bytes" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert (
        "Raise collect.max_bytes, lower collect.sample_rate, or run `visionloop label select" in warnings[0]
    )
    text = metrics.render().decode()
    assert 'visionloop_collect_dropped_total{reason="full"} 4.0' in text
    assert "visionloop_collect_kept_total 1.0" in text


def test_a_writer_that_is_behind_drops_and_counts_never_blocks(tmp_path: Path) -> None:
    cfg = CollectConfig(enabled=True, sample_rate=1.0)
    c = Collector(cfg, tmp_path / "store", max_pending_bytes=1)
    c.flush()  # the start-up sweep is done
    # Another server holds the store (the writer waits on the lock): the queue cannot drain.
    with open(c.dir / ".lock", "a+b") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        started = time.perf_counter()
        assert c.offer(_png(1), _record()) == "sample"
        assert c.offer(_png(2), _record()) is None  # past max_pending_bytes: dropped
        assert c.offer(_png(3), _record()) is None
        assert time.perf_counter() - started < 0.5
        fcntl.flock(other.fileno(), fcntl.LOCK_UN)
    c.flush()
    c.close()
    assert c.dropped["queue"] == 2 and c.kept == 1


def test_two_servers_sharing_a_store_lose_no_sighting(tmp_path: Path) -> None:
    cfg = CollectConfig(enabled=True, sample_rate=1.0)
    a, b = Collector(cfg, tmp_path / "store"), Collector(cfg, tmp_path / "store")
    # Sightings of now: ones from long ago would be past the retention, and the start-up sweep
    # of the second writer would rightly delete them while the first is still writing.
    t0 = time.time()
    try:
        for i in range(20):
            (a if i % 2 else b).offer(_png(9), _record(t=t0 + i))
        a.flush()
        b.flush()
    finally:
        a.close()
        b.close()
    (img,) = read_collected(tmp_path / "store")
    assert img.seen == 20 and sorted(s.time for s in img.sightings) == [t0 + i for i in range(20)]


# --------------------------------------------------------------------------- retention


def test_retention_deletes_by_the_newest_sighting_not_the_file_time(tmp_path: Path) -> None:
    now = [1_000_000_000.0]
    cfg = CollectConfig(enabled=True, sample_rate=1.0, retention_days=30)
    c = Collector(cfg, tmp_path / "store", clock=lambda: now[0])
    try:
        c.offer(_png(1), _record(t=now[0] - 40 * DAY))  # last seen 40 days ago
        c.offer(_png(2), _record(t=now[0] - 40 * DAY))
        c.offer(_png(2), _record(t=now[0] - 10 * DAY))  # seen again 10 days ago
        c.offer(_png(3), _record(t=now[0] - 29 * DAY))
        c.flush()
        assert len(list(read_collected(c.dir))) == 3  # files written just now: mtime says young
        c.sweep()
        c.flush()
        kept = {i.path.read_bytes(): i.seen for i in read_collected(c.dir)}
        assert kept == {_png(2): 2, _png(3): 1}
        assert c.deleted == 1
        now[0] += 2 * DAY  # image 3 is now 31 days old
        c.sweep()
        c.flush()
        assert [i.path.read_bytes() for i in read_collected(c.dir)] == [_png(2)]
        assert c.bytes == _store_bytes(c.dir)
    finally:
        c.close()


def test_the_start_up_sweep_removes_expired_images_and_crash_leftovers(tmp_path: Path) -> None:
    cfg = CollectConfig(enabled=True, sample_rate=1.0, retention_days=1)
    c = Collector(cfg, tmp_path / "store")
    c.offer(_png(1), _record(t=time.time() - 2 * DAY))
    c.offer(_png(2), _record())
    c.offer(_png(3), _record())
    c.flush()
    c.close()
    shard = next(p for p in c.dir.iterdir() if p.is_dir())
    (shard / ".x.json.123.tmp").write_bytes(b"half")  # a write cut short
    orphan = c.dir / "ee" / ("e" * 64 + ".png")  # an image whose sidecar was never written
    orphan.parent.mkdir()
    orphan.write_bytes(_png(4))
    damaged = next(i for i in read_collected(c.dir) if i.path.read_bytes() == _png(3)).sidecar
    damaged.write_bytes(b"{not json")
    os.utime(damaged, (time.time() - 3 * DAY,) * 2)  # unreadable times: its file's time decides
    again = Collector(cfg, tmp_path / "store")
    again.flush()
    again.close()
    assert [i.path.read_bytes() for i in read_collected(c.dir)] == [_png(2)]
    assert not orphan.exists() and not damaged.exists() and not list(c.dir.rglob("*.tmp"))
    assert again.bytes == _store_bytes(c.dir)


# --------------------------------------------------------------------------- the reader


def test_the_reader_skips_and_counts_what_it_cannot_trust(tmp_path: Path) -> None:
    c = _collector(tmp_path)
    for v in range(6):
        c.offer(_png(v), _record())
    c.flush()
    c.close()
    sidecars = sorted(c.dir.rglob("*.json"))
    sidecars[0].write_bytes(b"\x00garbage")  # damaged
    # Valid, but too large to be ours (the writer keeps a sidecar under the bound).
    sidecars[1].write_bytes(sidecars[1].read_bytes() + b" " * MAX_SIDECAR_BYTES)
    doc = orjson.loads(sidecars[2].read_bytes())
    doc["file"] = "../../../etc/passwd"  # points outside its own image
    sidecars[2].write_bytes(orjson.dumps(doc))
    doc = orjson.loads(sidecars[3].read_bytes())
    doc["sightings"][0]["record"]["version"] = "one"
    sidecars[3].write_bytes(orjson.dumps(doc))
    sidecars[4].with_suffix(".png").unlink()  # its image is gone
    stats = ReadStats()
    (good,) = read_collected(c.dir, stats)
    assert good.sidecar == sidecars[5]
    assert stats.read == 1 and stats.bad == 5
    assert stats.first_error is not None and stats.first_error.startswith(str(sidecars[0]))
    assert list(read_collected(tmp_path / "nothing-here")) == []


def test_every_sighting_reads_back_as_a_prediction_record(tmp_path: Path) -> None:
    c = _collector(tmp_path)
    det = PredictionRecord(
        time.time(), "boxes", 3, "challenger", 2.0, {"detections": 1, "counts": {"cat": 1}}
    )
    c.offer(_png(1), det)
    c.flush()
    c.close()
    (img,) = read_collected(c.dir)
    (back,) = img.sightings
    assert back == det
    assert re.fullmatch(r"[0-9a-f]{64}", img.sha256) and img.sha256 == hashlib.sha256(_png(1)).hexdigest()


def test_a_fifo_for_a_sidecar_is_skipped_by_the_reader_and_replaced_by_the_writer(tmp_path: Path) -> None:
    """The store is read, not trusted: a FIFO where a sidecar goes blocked `read_collected` (and
    `label select --from-collected`) until a writer came, and blocked the server's collecting
    thread for ever when the same image was kept again."""
    from _hangkit import in_thread

    c = _collector(tmp_path)
    try:
        c.offer(_png(10), _record(confidence=0.8))
        c.offer(_png(200), _record(confidence=0.7))
        c.flush()
        sha = hashlib.sha256(_png(10)).hexdigest()
        sidecar = c.dir / sha[:2] / f"{sha}.json"
        sidecar.unlink()
        os.mkfifo(sidecar)
        stats = ReadStats()
        got = in_thread(lambda: [i.sha256 for i in read_collected(c.dir, stats)])
        assert got == [hashlib.sha256(_png(200)).hexdigest()]
        assert stats.bad == 1 and str(sidecar) in str(stats.first_error) and "FIFO" in str(stats.first_error)
        # Kept again: the writer starts that sidecar over (as for a damaged one), never waits.
        again = _record(confidence=0.6)
        c.offer(_png(10), again)
        assert in_thread(lambda: c.flush()) is None
    finally:
        c.close()
    images = {i.sha256: i for i in read_collected(c.dir)}
    assert [s.to_json() for s in images[sha].sightings] == [again.to_json()]
