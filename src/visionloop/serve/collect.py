"""Keep a sample of what the server sees, for labelling (the serving config's `collect:`).

For a request to the image endpoint that was answered, `Collector.offer` decides on the event
loop whether to keep it (a draw of the collector's own seeded generator against
`sample_rate`, or the answer's confidence below `below_confidence`; which rule kept it is
recorded) and queues the image file with its prediction record. One writer thread stores it,
so a slow disk never slows an answer; when the writer falls behind, images are dropped and
counted, never waited for (as in the prediction log). The store:

    <dir>/ab/ab12…ef.png    the image file exactly as it was sent (extension from its first bytes)
    <dir>/ab/ab12…ef.json   its sidecar: each sighting, the rule that kept it and the typed
                            `PredictionRecord` (time, model, version, role, answer, monitor fields)

The same image kept again adds a sighting to its sidecar, never a second copy. Files are
written atomically (temporary name, fsync, rename) under an advisory lock on `<dir>/.lock`,
so servers sharing a store never lose each other's sightings. The store never grows past
`max_bytes`: what would pass it is not kept but counted, and a warning says what to do, once
a minute. At start-up and every hour the writer deletes the images whose newest sighting is
older than `retention_days`, read from the sidecars' times (copying a store changes its
files' times).

Only the image endpoint is collected: a KServe v2 tensor request has no image file to keep.
`read_collected` reads a store back, skipping and counting the sidecars it cannot trust.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import queue
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import orjson

from visionloop.core.fsutil import atomic_write_bytes, ensure_private_dir, open_regular
from visionloop.serve.config import CollectConfig
from visionloop.serve.metrics import ServeMetrics
from visionloop.serve.predlog import flush_writer, stop_writer
from visionloop.serve.record import PredictionRecord, ReadStats, RecordError

log = logging.getLogger(__name__)

KeptBy = Literal["sample", "confidence"]
KEPT_BY: tuple[KeptBy, ...] = ("sample", "confidence")
DropReason = Literal["full", "queue", "error"]
SIDECAR_SCHEMA = 1
# A sighting is at most ~13 KB of JSON (1000 output columns, a 256-number embedding): 64 of
# them stay under the reader's 1 MiB bound. Older sightings are dropped from the list
# (`seen` still counts them); retention reads the newest.
MAX_SIGHTINGS = 64
MAX_SIDECAR_BYTES = 2**20
# The answer fields that say how sure an answer is, in the order they are looked for, when
# the record's monitor fields carry no confidence: a classifier logs "confidence", a detector
# "max_score" (its best box's score). A field name, never a task name.
CONFIDENCE_FIELDS = ("confidence", "max_score")
EXTENSIONS = ("png", "jpg", "webp", "gif", "tiff", "bmp", "ppm", "bin")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHARD = re.compile(r"[0-9a-f]{2}")
_DAY_S = 86400.0
_WARN_EVERY_S = 60.0

_STOP: Any = object()
_SWEEP: Any = object()


def collected_dir(home: Path) -> Path:
    """Where the servers of a visionloop home keep their collected images, by default."""
    return Path(home) / "serve" / "collected"


def store_dir(config: CollectConfig, home: Path) -> Path:
    """The store a server with this `collect:` section writes: its `dir`, else the home's."""
    return config.dir if config.dir is not None else collected_dir(home)


def image_extension(data: bytes) -> str:
    """The file extension of an image file's format, from its magic bytes; "bin" if unknown."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if data.startswith((b"II*\x00", b"MM\x00*")):
        return "tiff"
    if data.startswith(b"BM"):
        return "bmp"
    if len(data) > 2 and data[:1] == b"P" and data[1:2] in b"123456" and data[2:3].isspace():
        return "ppm"
    return "bin"


def answer_confidence(record: PredictionRecord) -> float | None:
    """How sure the answer recorded in `record` was: its monitor fields' confidence, else the
    first of `CONFIDENCE_FIELDS` among the task's answer fields; None when it has neither."""
    if record.monitor is not None and record.monitor.confidence is not None:
        return float(record.monitor.confidence)
    for name in CONFIDENCE_FIELDS:
        value = record.answer.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None


@dataclass(frozen=True)
class CollectedImage:
    """One stored image and what the server answered each time it kept it."""

    path: Path  # the image file, as it was sent
    sidecar: Path
    sha256: str
    sightings: list[PredictionRecord]  # oldest first; at most MAX_SIGHTINGS, the newest
    kept_by: list[KeptBy]  # per sighting, the rule that kept it
    seen: int  # sightings ever stored (`sightings` keeps the newest)

    @property
    def last_seen(self) -> float:
        return max(s.time for s in self.sightings)


class SidecarError(RecordError):
    """A sidecar that is not one the collector writes."""


def _parse_sidecar(raw: bytes, path: Path) -> tuple[dict[str, Any], CollectedImage]:
    """(the JSON document, the typed image) of one sidecar's bytes; SidecarError if it is not
    a sidecar this release writes. Names are checked: a sidecar points at its own image only."""
    if len(raw) > MAX_SIDECAR_BYTES:
        raise SidecarError(f"{len(raw)} bytes or more (a sidecar has at most {MAX_SIDECAR_BYTES})")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise SidecarError(f"not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise SidecarError(f"a sidecar is a JSON object, not {type(doc).__name__}")
    schema = doc.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool) or not 1 <= schema <= SIDECAR_SCHEMA:
        raise SidecarError(f"schema must be 1 to {SIDECAR_SCHEMA}, got {schema!r}")
    sha = path.stem
    if doc.get("sha256") != sha or not _SHA256.fullmatch(sha):
        raise SidecarError(f"sha256 {doc.get('sha256')!r} is not the sidecar's name {sha!r}")
    file = doc.get("file")
    if not isinstance(file, str) or file not in {f"{sha}.{ext}" for ext in EXTENSIONS}:
        raise SidecarError(f"file must be {sha}.<one of {', '.join(EXTENSIONS)}>, got {file!r}")
    items = doc.get("sightings")
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_SIGHTINGS:
        raise SidecarError(f"sightings must be a list of 1 to {MAX_SIGHTINGS} sightings")
    records: list[PredictionRecord] = []
    kept_by: list[KeptBy] = []
    for item in items:
        if not isinstance(item, dict) or item.get("kept_by") not in KEPT_BY:
            raise SidecarError(f"a sighting is {{'kept_by': one of {KEPT_BY}, 'record': {{...}}}}")
        kept_by.append(cast(KeptBy, item["kept_by"]))
        records.append(PredictionRecord.from_json(item.get("record")))
    seen = doc.get("seen")
    if not isinstance(seen, int) or isinstance(seen, bool) or seen < len(items):
        raise SidecarError(f"seen must be a count of at least {len(items)}, got {seen!r}")
    return doc, CollectedImage(path.with_name(file), path, sha, records, kept_by, seen)


def _read_sidecar(path: Path) -> tuple[dict[str, Any], CollectedImage]:
    with open_regular(path) as f:  # a FIFO refused, not waited on: a store is read, not trusted
        raw = f.read(MAX_SIDECAR_BYTES + 1)  # bounded
    return _parse_sidecar(raw, path)


def _sidecars(directory: Path) -> Iterator[Path]:
    for shard in sorted(directory.iterdir()):
        if _SHARD.fullmatch(shard.name) and shard.is_dir():
            yield from sorted(p for p in shard.iterdir() if p.suffix == ".json" and _SHA256.fullmatch(p.stem))


def read_collected(directory: Path, stats: ReadStats | None = None) -> Iterator[CollectedImage]:
    """The images of a store (see the module docstring), in hash order. A sidecar that is
    damaged, too large, not the collector's, or whose image is gone is skipped and counted in
    `stats`, never fatal. A folder that does not exist holds nothing."""
    stats = stats if stats is not None else ReadStats()
    directory = Path(directory)
    if not directory.is_dir():
        return
    for path in _sidecars(directory):
        try:
            _, image = _read_sidecar(path)
            if not image.path.is_file():
                raise SidecarError(f"its image {image.path.name} is missing")
        except (OSError, RecordError) as e:
            stats.skip(f"{path}: {e}")
            continue
        stats.read += 1
        yield image


@dataclass(frozen=True, slots=True)
class _Item:
    data: bytes
    record: PredictionRecord
    kept_by: KeptBy


class Collector:
    """The keeping side of a store: `offer` on the event loop, a writer thread for the files.

    `seed` seeds this collector's own generator for `sample_rate` (one per server), `clock`
    is the wall clock retention compares sightings with (tests move it). The queue holds at
    most `capacity` images and, past the first, `max_pending_bytes` of image data."""

    def __init__(
        self,
        config: CollectConfig,
        directory: Path,
        *,
        metrics: ServeMetrics | None = None,
        seed: int | None = None,
        clock: Callable[[], float] = time.time,
        capacity: int = 1024,
        max_pending_bytes: int = 64 * 2**20,
        sweep_every_s: float = 3600.0,
    ) -> None:
        self.config = config
        self.dir = ensure_private_dir(Path(directory))  # images may show people: owner-only
        self.kept = 0
        self.deleted = 0
        self.dropped: dict[DropReason, int] = {"full": 0, "queue": 0, "error": 0}
        self.bytes = 0  # of the store: images and sidecars
        self._metrics = metrics
        self._rng = random.Random(seed)
        self._clock = clock
        self._sweep_every_s = sweep_every_s
        self._max_pending = max_pending_bytes
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._warned: dict[str, float] = {}
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._lock_file = open(self.dir / ".lock", "a+b")  # noqa: SIM115 - held for the writer's life
        self._thread = threading.Thread(target=self._run, name="collect", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ event loop side

    def offer(self, data: bytes, record: PredictionRecord) -> KeptBy | None:
        """Queue an answered image request's file and record if a rule keeps it; never
        blocks. The rule that kept it, or None (not kept, or dropped: the writer is behind)."""
        cfg = self.config
        drawn = cfg.sample_rate > 0.0 and self._rng.random() < cfg.sample_rate
        kept_by: KeptBy | None = "sample" if drawn else None
        if cfg.below_confidence is not None:
            confidence = answer_confidence(record)
            if confidence is not None and confidence < cfg.below_confidence:
                kept_by = "confidence"
        if kept_by is None:
            return None
        size = len(data)
        with self._pending_lock:
            # The first queued image always fits, whatever its size (max_body_bytes bounds it).
            if self._pending and self._pending + size > self._max_pending:
                self._drop("queue")
                return None
            self._pending += size
        try:
            self._queue.put_nowait(_Item(data, record, kept_by))
        except queue.Full:
            self._release(size)
            self._drop("queue")
            return None
        return kept_by

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every image queued so far is stored (tests, shutdown)."""
        flush_writer(self._queue, timeout)

    def sweep(self) -> None:
        """Ask the writer for a retention sweep now (it also runs one every hour)."""
        self._queue.put(_SWEEP)

    def close(self, timeout: float = 10.0) -> None:
        """Store what is queued, then stop the writer."""
        stuck = "collect: writer stuck; %d queued images not kept"
        stop_writer(self._queue, self._thread, _STOP, timeout, stuck)
        if not self._thread.is_alive():
            self._lock_file.close()

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        self._safe_sweep()  # start-up: the store's size, and what expired while we were down
        next_sweep = time.monotonic() + self._sweep_every_s
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_sweep - time.monotonic()))
            except queue.Empty:
                item = _SWEEP
            if item is _STOP:
                return
            if item is _SWEEP:
                self._safe_sweep()
                next_sweep = time.monotonic() + self._sweep_every_s
            elif isinstance(item, threading.Event):
                item.set()
            else:
                try:
                    self._keep(item)
                except Exception as e:  # a full disk must not end the writer: later images may fit
                    self._drop("error")
                    self._warn("error", "collect: cannot store an image in %s: %s", self.dir, e)
                finally:
                    self._release(len(item.data))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The store to ourselves: another server writing it, or sweeping it, waits."""
        fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)

    def _keep(self, item: _Item) -> None:
        sha = hashlib.sha256(item.data).hexdigest()
        shard = self.dir / sha[:2]
        image = shard / f"{sha}.{image_extension(item.data)}"
        sidecar = shard / f"{sha}.json"
        sighting = {"kept_by": item.kept_by, "record": item.record.to_json()}
        with self._locked():
            doc: dict[str, Any] | None = None
            old_size = 0
            if sidecar.exists():
                old_size = sidecar.stat().st_size
                try:
                    doc, _ = _read_sidecar(sidecar)
                except (OSError, RecordError) as e:  # rewritten from this sighting on; its history is lost
                    log.warning("collect: %s was damaged (%s); starting it again", sidecar, e)
            if doc is None:
                doc = {
                    "schema": SIDECAR_SCHEMA,
                    "sha256": sha,
                    "file": image.name,
                    "seen": 0,
                    "sightings": [],
                }
            sightings: list[Any] = [*doc["sightings"], sighting][-MAX_SIGHTINGS:]
            doc.update(seen=doc["seen"] + 1, sightings=sightings)
            body = orjson.dumps(doc)
            while len(body) > MAX_SIDECAR_BYTES and len(sightings) > 1:
                del sightings[0]  # the oldest go first: retention reads the newest
                body = orjson.dumps(doc)
            new_image = not image.exists()
            grow = len(body) - old_size + (len(item.data) if new_image else 0)
            if self.bytes + grow > self.config.max_bytes:
                self._full()
                return
            ensure_private_dir(shard)
            if new_image:
                atomic_write_bytes(image, item.data)
            atomic_write_bytes(sidecar, body)
        self.bytes += grow
        self.kept += 1
        if self._metrics is not None:
            self._metrics.collect_kept.inc()
            self._metrics.collect_bytes.set(self.bytes)

    def _safe_sweep(self) -> None:
        try:
            self._sweep()
        except Exception:  # one failed sweep must not end the writer; the next one retries
            log.exception("collect: the retention sweep of %s failed", self.dir)

    def _sweep(self) -> None:
        """Delete what expired and crash leftovers; recount the store's size."""
        cutoff = self._clock() - self.config.retention_days * _DAY_S
        total = deleted = damaged = 0
        with self._locked():
            for shard in sorted(self.dir.iterdir()):
                if not (_SHARD.fullmatch(shard.name) and shard.is_dir()):
                    continue
                files: dict[str, list[Path]] = {}
                for p in shard.iterdir():
                    if p.name.startswith(".") and p.name.endswith(".tmp"):
                        p.unlink(missing_ok=True)  # a write cut short (we hold the lock: not one in progress)
                    elif _SHA256.fullmatch(p.name.split(".", 1)[0]) and p.is_file():
                        files.setdefault(p.name.split(".", 1)[0], []).append(p)
                for sha, paths in files.items():
                    sidecar = shard / f"{sha}.json"
                    if sidecar not in paths or len(paths) == 1:
                        # An image whose sidecar was never written (a crash between the two
                        # writes), or a sidecar whose image was deleted by hand: nothing to keep.
                        newest = -math.inf
                    else:
                        try:
                            newest = _read_sidecar(sidecar)[1].last_seen
                        except (OSError, RecordError):
                            # Unreadable times: the file's own, so that it still expires.
                            damaged += 1
                            newest = sidecar.stat().st_mtime
                    if newest < cutoff:
                        for p in paths:
                            p.unlink(missing_ok=True)
                        deleted += 1
                    else:
                        total += sum(p.stat().st_size for p in paths)
        self.bytes = total
        self.deleted += deleted
        if self._metrics is not None:
            self._metrics.collect_bytes.set(total)
        if deleted:
            log.info(
                "collect: deleted %d image(s) past their %g days' retention",
                deleted,
                self.config.retention_days,
            )
        if damaged:
            log.warning(
                "collect: %d damaged sidecar(s) in %s kept until their files' times expire", damaged, self.dir
            )

    # ------------------------------------------------------------------ counting

    def _release(self, size: int) -> None:
        with self._pending_lock:
            self._pending -= size

    def _drop(self, reason: DropReason) -> None:
        self.dropped[reason] += 1
        if self._metrics is not None:
            self._metrics.collect_dropped.labels(reason).inc()

    def _full(self) -> None:
        self._drop("full")
        self._warn(
            "full",
            "collect: the store %s holds %d bytes, its cap is %d (collect.max_bytes); %d image(s) "
            "not kept so far. Raise collect.max_bytes, lower collect.sample_rate, or run "
            "`visionloop label select --from collected` and clear the store",
            self.dir,
            self.bytes,
            self.config.max_bytes,
            self.dropped["full"],
        )

    def _warn(self, key: str, message: str, *args: Any) -> None:
        """`log.warning`, at most once a minute per `key`: a full store is hit by every image."""
        now = time.monotonic()
        if now - self._warned.get(key, -math.inf) >= _WARN_EVERY_S:
            self._warned[key] = now
            log.warning(message, *args)
