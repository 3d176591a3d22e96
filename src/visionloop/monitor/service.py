"""`visionloop monitor`'s work: find the version's reference (building it when missing), read
the prediction logs, judge each new complete window, record it (`monitor.history`) and publish
it as Prometheus gauges.

A window is judged once: its record in `<home>/monitor/<model>/windows.jsonl` marks the traffic
up to its last request as seen, so a rerun, or `--follow` after a restart, goes on from there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from visionloop.core.errors import DataError, NotFoundError
from visionloop.core.settings import Settings
from visionloop.monitor.history import WindowRecord, append_window, read_windows
from visionloop.monitor.reference import DEFAULT_MAX_IMAGES, Reference, build_reference, load_reference
from visionloop.monitor.windows import WindowSpec, cut, judge, log_files, version_records
from visionloop.serve.predlog import predictions_dir
from visionloop.serve.record import ReadStats


@dataclass
class MonitorOptions:
    window: WindowSpec
    alpha: float = 0.05
    thin: int | str = "auto"
    logs: Path | None = None  # default: <home>/serve/predictions
    rebuild_reference: bool = False
    dataset: Path | None = None  # for building the reference
    split: str | None = None
    reference_images: int = DEFAULT_MAX_IMAGES
    precision: str = "fp32"
    seed: int = 0


def reference_for(
    ref: str,
    options: MonitorOptions,
    settings: Settings,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Reference, bool]:
    """The version's reference and whether it was just built."""
    from visionloop.registry import get_version

    info = get_version(ref, settings)
    if not options.rebuild_reference:
        try:
            return load_reference(info.dir), False
        except NotFoundError:
            pass
    built, _ = build_reference(
        info.ref,
        settings=settings,
        dataset=options.dataset,
        split=options.split,
        max_images=options.reference_images,
        precision=options.precision,
        progress=progress,
    )
    return built, True


def new_windows(
    reference: Reference, options: MonitorOptions, settings: Settings, now: float | None = None
) -> tuple[list[WindowRecord], ReadStats, int]:
    """Judge and record the complete windows not judged before; returns them, what reading
    the logs skipped, and how many requests wait in the window still open."""
    now = time.time() if now is None else now
    seen = [w for w in read_windows(settings.home, reference.model) if w.version == reference.version]
    after = max((w.end for w in seen), default=-math.inf)
    stats = ReadStats()
    files = log_files(options.logs or predictions_dir(settings.home))
    records = version_records(files, reference.model, reference.version, after=after, stats=stats)
    judged: list[WindowRecord] = []
    used = 0
    for window in cut(records, options.window, now):
        record = judge(reference, window, alpha=options.alpha, thin=options.thin, seed=options.seed)
        append_window(settings.home, record)
        judged.append(record)
        used += len(window)
    return judged, stats, len(records) - used


class Gauges:
    """The monitor's Prometheus metrics, per model and version (a registry of their own, so
    several monitors in one process, as in tests, do not collide)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.registry = CollectorRegistry()
        labels = ["model", "version"]
        self.p_value = Gauge(
            "visionloop_drift_p_value",
            "p-value of a drift test on the last judged window (Bonferroni-corrected within the test)",
            [*labels, "test"],
            registry=self.registry,
        )
        self.verdict_p = Gauge(
            "visionloop_drift_verdict_p_value",
            "p-value of the last window's verdict (Bonferroni over its tests)",
            labels,
            registry=self.registry,
        )
        self.drift = Gauge(
            "visionloop_drift",
            "1 when the last judged window drifted, else 0",
            labels,
            registry=self.registry,
        )
        self.accuracy = Gauge(
            "visionloop_estimated_accuracy",
            "accuracy estimated without labels (ATC) on the last judged window",
            labels,
            registry=self.registry,
        )
        self.requests = Gauge(
            "visionloop_drift_window_requests",
            "requests in the last judged window",
            labels,
            registry=self.registry,
        )
        self.window_end = Gauge(
            "visionloop_drift_window_end_seconds",
            "time of the last request of the last judged window",
            labels,
            registry=self.registry,
        )

    def publish(self, w: WindowRecord) -> None:
        lv = (w.model, str(w.version))
        for test, p in w.p_values.items():
            if p is not None:
                self.p_value.labels(*lv, test).set(p)
        if w.p_value is not None:
            self.verdict_p.labels(*lv).set(w.p_value)
        self.drift.labels(*lv).set(1 if w.drift else 0)
        if w.estimated_accuracy is not None:
            self.accuracy.labels(*lv).set(w.estimated_accuracy)
        self.requests.labels(*lv).set(w.requests)
        self.window_end.labels(*lv).set(w.end)

    def serve(self, port: int, host: str = "127.0.0.1") -> Any:
        from prometheus_client import start_http_server

        try:
            return start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise DataError(
                f"cannot serve the monitor's metrics on {host}:{port} ({e}); pick another --metrics-port."
            ) from e


def check_options(options: MonitorOptions) -> None:
    if not 0.0 < options.alpha < 1.0:
        raise DataError(f"--alpha must be in (0, 1), got {options.alpha} (e.g. 0.05).")
    w = options.window
    if w.requests is not None and w.requests < 20:
        raise DataError(
            f"--window-requests must be at least 20 (the tests need 20 samples), got {w.requests}."
        )
    if w.seconds is not None and w.seconds < 1:
        raise DataError(f"--window must be at least 1s, got {w.seconds}s.")
    if isinstance(options.thin, int) and options.thin < 1:
        raise DataError(f"--thin must be auto or an integer >= 1, got {options.thin}.")
