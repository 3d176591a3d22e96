"""A bounded log of every prediction (`serve.record.PredictionRecord`: time, model, version,
role, latency and the task's answer fields), as size-capped, rotated JSONL files, for drift
analysis. Records are turned into JSON in the writer thread, off the event loop.

Records go into a bounded in-memory queue and a background thread writes them, so a slow
disk never slows an answer: when the writer falls behind, records are dropped and counted
(`dropped`), never waited for. Files rotate like logrotate: `X.jsonl` → `X.jsonl.1` → … up to
`backups` old files; the oldest is deleted.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from visionloop.serve.record import PredictionRecord

log = logging.getLogger(__name__)

_STOP = object()


def predictions_dir(home: Path) -> Path:
    """Where the servers of a visionloop home write their prediction logs (one file each)."""
    return Path(home) / "serve" / "predictions"


class PredictionLog:
    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int,
        backups: int,
        capacity: int = 65536,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.dropped = 0
        self.written = 0
        self._on_drop = on_drop
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="prediction-log", daemon=True)
        self._thread.start()

    def put(self, record: PredictionRecord) -> None:
        """Queue a record; never blocks."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self._on_drop is not None:
                self._on_drop()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop the writer."""
        stuck = "prediction log: writer stuck; %s records not written"
        stop_writer(self._queue, self._thread, _STOP, timeout, stuck)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every record queued so far is written (tests, shutdown)."""
        flush_writer(self._queue, timeout)

    def _rotate(self) -> None:
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
            return
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))

    def _run(self) -> None:
        f = open(self.path, "ab")  # noqa: SIM115 - reopened on every rotation
        size = f.tell()
        try:
            while True:
                item = self._queue.get()
                control = None if isinstance(item, PredictionRecord) else item
                # Write what else is queued in one go: one syscall per burst, not per record.
                lines = [] if control is not None else [orjson.dumps(item.to_json()) + b"\n"]
                while control is None and len(lines) < 1024:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(nxt, PredictionRecord):
                        lines.append(orjson.dumps(nxt.to_json()) + b"\n")
                    else:
                        control = nxt
                if lines:
                    data = b"".join(lines)
                    if size and size + len(data) > self.max_bytes:
                        f.close()
                        self._rotate()
                        f = open(self.path, "ab")  # noqa: SIM115
                        size = 0
                    f.write(data)
                    size += len(data)
                    self.written += len(lines)
                if control is _STOP:
                    return
                if isinstance(control, threading.Event) or self._queue.empty():
                    f.flush()
                if isinstance(control, threading.Event):
                    control.set()
        except OSError as e:
            # A full or read-only disk must not take the server down; the log stops, answers go on.
            log.error("prediction log %s: %s; no more predictions will be logged", self.path, e)
        finally:
            f.close()


def flush_writer(q: queue.Queue[Any], timeout: float) -> None:
    """Wait until a writer thread has handled everything queued on `q` so far: it sets each
    `threading.Event` it takes off the queue (the prediction log's and the collector's)."""
    done = threading.Event()
    try:
        q.put(done, timeout=timeout)
    except queue.Full:
        return
    done.wait(timeout)


def stop_writer(
    q: queue.Queue[Any], thread: threading.Thread, stop: object, timeout: float, stuck: str
) -> None:
    """Queue `stop` behind what is queued and join the writer; `stuck` (a format with the
    queue's size) is logged when the queue stays full for `timeout`."""
    try:
        q.put(stop, timeout=timeout)
    except queue.Full:
        log.warning(stuck, q.qsize())
        return
    thread.join(timeout)
