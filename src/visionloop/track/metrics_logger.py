"""Getting metrics to the store exactly once, without the training loop ever waiting on it.

Two parts:

- `StepFilter` decides which `(key, step)` pairs are new. Per key, steps must increase: a step
  at or below the last one logged (in this process, or by an earlier attempt of the same run
  before a crash) is dropped. That one rule gives "each step exactly once" across SIGKILL,
  because the writer stores each key's steps in order, so after a crash the store holds a
  prefix of every key's series and its maximum step says exactly what is already there.
- `MetricWriter` is a background thread that drains a bounded queue in batches through a
  `write_batch` callable (for MLflow, `MlflowClient.log_batch`). It retries failures with
  backoff, drops the oldest items when the queue is full, and counts everything it drops.

Neither part imports mlflow; the writer is generic over the item it carries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_BATCH = 1000  # MLflow's limit on metrics per log_batch call
WARN_EVERY_S = 60.0  # repeated warnings of one kind are summarised at most this often


class StepFilter:
    """Accepts a `(key, step)` once, and only if `step` is above the key's last step."""

    def __init__(self, last_steps: Mapping[str, int] | None = None) -> None:
        # Seeded with the store's max step per key when a run is resumed.
        self._last: dict[str, int] = dict(last_steps or {})
        self.dropped = 0

    def accept(self, key: str, step: int) -> bool:
        last = self._last.get(key)
        if last is not None and step <= last:
            self.dropped += 1
            return False
        self._last[key] = step
        return True

    def last_step(self, key: str) -> int | None:
        return self._last.get(key)


@dataclass(frozen=True)
class WriterStats:
    written: int
    dropped_queue_full: int
    dropped_write_failed: int
    pending: int
    last_error: str | None

    @property
    def dropped(self) -> int:
        return self.dropped_queue_full + self.dropped_write_failed


class _RateLimitedWarning:
    """Warn on the first occurrence, then at most once per WARN_EVERY_S with a count."""

    def __init__(self) -> None:
        self._last = -float("inf")
        self._suppressed = 0

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last < WARN_EVERY_S:
            self._suppressed += 1
            return
        extra = f" ({self._suppressed} similar warnings suppressed)" if self._suppressed else ""
        log.warning("%s%s", message, extra)
        self._last, self._suppressed = now, 0


class MetricWriter(Generic[T]):
    """Writes submitted items in batches from a daemon thread.

    `submit` never blocks on the store. At most `max_queue` items wait; beyond that the oldest
    are dropped, because a tracking outage must cost metrics, not the training run's memory.
    A failed batch is retried with exponential backoff (`backoff_s` doubling up to
    `max_backoff_s`) for as long as the writer is open, unless `is_permanent(error)` says that
    retrying cannot help (for MLflow: a 4xx answer, e.g. the run was deleted); then the batch
    is dropped. `close(timeout)` gives pending items until the timeout, then drops the rest.
    """

    def __init__(
        self,
        write_batch: Callable[[list[T]], None],
        *,
        max_queue: int = 100_000,
        batch_size: int = MAX_BATCH,
        interval_s: float = 1.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        is_permanent: Callable[[BaseException], bool] = lambda _e: False,
        name: str = "visionloop-metrics",
    ) -> None:
        if max_queue < 1 or not 1 <= batch_size <= MAX_BATCH:
            raise ValueError(f"need max_queue >= 1 and 1 <= batch_size <= {MAX_BATCH}")
        self._write_batch = write_batch
        self._max_queue = max_queue
        self._batch_size = batch_size
        self._interval_s = interval_s
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._is_permanent = is_permanent
        self._queue: deque[T] = deque()
        self._cond = threading.Condition()
        # Every submitted item is eventually "settled": written or dropped. flush() waits for
        # the settled count to reach the submitted count it saw when called.
        self._submitted = 0
        self._settled = 0
        self._written = 0
        self._dropped_full = 0
        self._dropped_failed = 0
        self._in_flight = 0
        self._last_error: str | None = None
        self._flush_waiters = 0
        self._closing = False
        self._close_deadline = float("inf")
        self._warn_full = _RateLimitedWarning()
        self._warn_failed = _RateLimitedWarning()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer side
    def submit(self, items: Iterable[T]) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("MetricWriter.submit() after close()")
            before = len(self._queue)
            for item in items:
                self._queue.append(item)
                self._submitted += 1
            overflow = len(self._queue) - self._max_queue
            if overflow > 0:
                for _ in range(overflow):
                    self._queue.popleft()
                self._dropped_full += overflow
                self._settled += overflow
                self._warn_full(
                    f"metrics queue full ({self._max_queue} waiting; the tracking store is slow or "
                    f"unreachable): dropped the oldest, {self._dropped_full} dropped so far"
                )
                self._cond.notify_all()
            # Wake the writer when it sleeps on an empty queue, or when a full batch is ready.
            if before == 0 or len(self._queue) >= self._batch_size > before:
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Block until everything submitted before this call is written (or dropped).

        Returns False if `timeout` ran out first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._submitted
            self._flush_waiters += 1
            self._cond.notify_all()
            try:
                while self._settled < target:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    if not self._thread.is_alive():
                        return False
                    self._cond.wait(remaining if remaining is not None else 1.0)
                return True
            finally:
                self._flush_waiters -= 1

    def close(self, timeout: float = 30.0) -> WriterStats:
        """Write what is pending for up to `timeout` seconds, drop the rest, stop the thread."""
        with self._cond:
            if not self._closing:
                self._closing = True
                self._close_deadline = time.monotonic() + timeout
            self._cond.notify_all()
        self._thread.join(timeout + 5.0)
        if self._thread.is_alive():
            # Stuck inside write_batch (a hung connection): the daemon thread is abandoned and
            # its items are reported as pending.
            log.warning("metrics writer did not stop within %.0f s; abandoning it", timeout + 5.0)
        return self.stats()

    def stats(self) -> WriterStats:
        with self._cond:
            return WriterStats(
                written=self._written,
                dropped_queue_full=self._dropped_full,
                dropped_write_failed=self._dropped_failed,
                pending=len(self._queue) + self._in_flight,
                last_error=self._last_error,
            )

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        next_write = time.monotonic()
        while True:
            with self._cond:
                batch = self._next_batch(next_write)
                if batch is None:
                    return
                self._in_flight = len(batch)
            written = self._write_with_retry(batch)
            next_write = time.monotonic() + self._interval_s
            with self._cond:
                self._in_flight = 0
                self._settled += len(batch)
                if written:
                    self._written += len(batch)
                else:
                    self._dropped_failed += len(batch)
                self._cond.notify_all()

    def _next_batch(self, not_before: float) -> list[T] | None:
        """Wait (holding the condition) until a batch is due; None when closed and drained."""
        while True:
            q = self._queue
            if self._closing and time.monotonic() >= self._close_deadline and q:
                self._drop_failed_locked(len(q), "close() timed out before they were written")
                q.clear()
            if not q and self._closing:
                return None
            urgent = self._closing or self._flush_waiters > 0 or len(q) >= self._batch_size
            if q and (urgent or time.monotonic() >= not_before):
                return [q.popleft() for _ in range(min(self._batch_size, len(q)))]
            # An empty queue sleeps until submit/flush/close wakes it; a small one until the
            # interval is up, so the store sees one write per interval, not one per step.
            self._cond.wait(None if not q else max(0.0, not_before - time.monotonic()))

    def _drop_failed_locked(self, n: int, why: str) -> None:
        self._dropped_failed += n
        self._settled += n
        log.warning("dropped %d metrics: %s", n, why)

    def _write_with_retry(self, batch: list[T]) -> bool:
        delay = self._backoff_s
        attempt = 0
        while True:
            attempt += 1
            try:
                # The same item objects are retried, so a retry after a write that actually
                # reached the store (a timeout on the reply) repeats identical rows, which
                # MLflow deduplicates; nothing is stored twice.
                self._write_batch(batch)
                return True
            except Exception as e:  # the writer must survive any store failure
                self._last_error = f"{type(e).__name__}: {e}"
                if self._is_permanent(e):
                    log.warning("dropped %d metrics: the store rejected them (%s)", len(batch), e)
                    return False
                with self._cond:
                    if self._closing and time.monotonic() + delay >= self._close_deadline:
                        log.warning("dropped %d metrics: the store still fails at close (%s)", len(batch), e)
                        return False
                    self._warn_failed(
                        f"writing {len(batch)} metrics failed (attempt {attempt}; retrying in "
                        f"{delay:.1f} s; training continues): {e}"
                    )
                    self._sleep_locked(delay)
                delay = min(delay * 2, self._max_backoff_s)

    def _sleep_locked(self, delay: float) -> None:
        """Back off for `delay` s; close() arriving meanwhile ends the wait (retry right away).

        Other wake-ups (submit, flush) do not: they would turn the backoff into a busy retry.
        """
        until = time.monotonic() + delay
        closing_at_start = self._closing
        while (left := until - time.monotonic()) > 0:
            if self._closing and not closing_at_start:
                return
            self._cond.wait(left)
