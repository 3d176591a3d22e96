"""The step filter and the background metric writer, driven by in-process stores.

The "stores" here are plain callables with real behaviour (blocking, failing, recording),
standing in for MLflow so that timing and failure can be controlled exactly.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from visionloop.track.metrics_logger import MetricWriter, StepFilter


def test_step_filter_accepts_each_step_once_and_only_increasing() -> None:
    f = StepFilter({"train/loss": 10})  # as after a resume: steps <= 10 are stored already
    assert [f.accept("train/loss", s) for s in (5, 10, 11, 11, 12)] == [False, False, True, False, True]
    assert f.accept("val/accuracy", 0)  # a key the store never saw starts fresh
    assert not f.accept("val/accuracy", 0)
    assert f.last_step("train/loss") == 12
    assert f.dropped == 4


class RecordingStore:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __call__(self, batch: list[int]) -> None:
        self.batches.append(list(batch))

    @property
    def items(self) -> list[int]:
        return [i for b in self.batches for i in b]


def test_writes_everything_in_order_in_batches_of_at_most_batch_size() -> None:
    store = RecordingStore()
    w: MetricWriter[int] = MetricWriter(store, batch_size=1000, interval_s=60.0)
    w.submit(range(2500))
    assert w.flush(timeout=10)
    stats = w.close()
    assert store.items == list(range(2500))
    assert max(len(b) for b in store.batches) <= 1000
    assert (stats.written, stats.dropped, stats.pending) == (2500, 0, 0)


def test_small_submissions_are_batched_by_the_interval() -> None:
    arrivals: list[float] = []
    store = RecordingStore()

    def timed_store(batch: list[int]) -> None:
        arrivals.append(time.monotonic())
        store(batch)

    w: MetricWriter[int] = MetricWriter(timed_store, interval_s=0.3)
    w.submit([0])  # the first write goes out at once...
    for i in range(1, 50):  # ...later ones wait for the interval and go out together
        w.submit([i])
        time.sleep(0.001)
    deadline = time.monotonic() + 5
    while len(store.items) < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    w.close()
    assert store.items == list(range(50))
    assert len(store.batches) <= 3  # not 50 writes
    assert arrivals[-1] - arrivals[0] >= 0.25


def test_full_queue_drops_the_oldest_and_counts_them(caplog: pytest.LogCaptureFixture) -> None:
    entered, release = threading.Event(), threading.Event()
    store = RecordingStore()

    def slow_store(batch: list[int]) -> None:
        entered.set()
        assert release.wait(10)
        store(batch)

    w: MetricWriter[int] = MetricWriter(slow_store, max_queue=10, interval_s=0.0)
    w.submit([0])
    assert entered.wait(5)  # item 0 is in flight; the store hangs
    with caplog.at_level(logging.WARNING, logger="visionloop.track.metrics_logger"):
        w.submit(range(1, 26))  # 25 more into a queue of 10
    assert w.stats().dropped_queue_full == 15
    assert "queue full" in caplog.text
    release.set()
    assert w.flush(timeout=10)
    stats = w.close()
    assert store.items == [0, *range(16, 26)]  # the newest ten survived
    assert (stats.written, stats.dropped_queue_full, stats.pending) == (11, 15, 0)


def test_failed_writes_are_retried_with_backoff_until_the_store_recovers() -> None:
    store = RecordingStore()
    calls: list[float] = []

    def flaky_store(batch: list[int]) -> None:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise ConnectionError("store unreachable")
        store(batch)

    w: MetricWriter[int] = MetricWriter(flaky_store, backoff_s=0.05, interval_s=0.0)
    w.submit(range(5))
    assert w.flush(timeout=10)
    stats = w.close()
    assert store.items == list(range(5))
    assert len(calls) == 3
    assert calls[2] - calls[1] >= calls[1] - calls[0] >= 0.05  # the wait doubles
    assert stats.dropped == 0
    assert stats.last_error == "ConnectionError: store unreachable"


def test_permanent_errors_drop_the_batch_and_the_writer_carries_on() -> None:
    store = RecordingStore()

    def picky_store(batch: list[int]) -> None:
        if -1 in batch:
            raise ValueError("rejected")
        store(batch)

    w: MetricWriter[int] = MetricWriter(
        picky_store, interval_s=0.0, is_permanent=lambda e: isinstance(e, ValueError)
    )
    w.submit([-1, -1])
    assert w.flush(timeout=5)
    w.submit([1, 2])
    assert w.flush(timeout=5)
    stats = w.close()
    assert store.items == [1, 2]
    assert (stats.written, stats.dropped_write_failed) == (2, 2)


def test_close_gives_up_on_a_dead_store_after_its_timeout() -> None:
    def dead_store(batch: list[int]) -> None:
        raise ConnectionError("down")

    w: MetricWriter[int] = MetricWriter(dead_store, backoff_s=0.05, interval_s=0.0)
    w.submit(range(100))
    assert not w.flush(timeout=0.3)  # flush reports that it could not finish
    t0 = time.monotonic()
    stats = w.close(timeout=0.5)
    assert time.monotonic() - t0 < 3
    assert (stats.written, stats.dropped, stats.pending) == (0, 100, 0)
    with pytest.raises(RuntimeError):
        w.submit([1])
