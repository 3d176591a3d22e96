"""`RunTracker`: what a trainer logs through once a run is open (see `resume.open_run`).

Metrics go through a background writer and a per-key step filter (exactly once per step, even
across a crash and resume); params, tags and artifacts are written before the call returns.
"""

from __future__ import annotations

import atexit
import functools
import logging
import operator
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from visionloop.core.errors import TrackingError
from visionloop.core.settings import Settings
from visionloop.track import store
from visionloop.track.metrics_logger import MetricWriter, StepFilter
from visionloop.track.naming import flatten_params, sanitize_key, tag_value
from visionloop.track.system import SystemSampler

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Run

log = logging.getLogger(__name__)

END_STATUSES = ("FINISHED", "FAILED", "KILLED")
MAX_PARAMS_TAGS_PER_BATCH = 100  # MLflow's limit per log_batch call
R = TypeVar("R")


@dataclass(frozen=True)
class CloseSummary:
    """What `RunTracker.close` did. `metrics_dropped` counts values that never reached the store
    (queue full, store failing, close timed out); `duplicates_skipped` counts values skipped
    because their step was already logged (the normal case after a resume)."""

    status: str
    metrics_written: int
    metrics_dropped: int
    duplicates_skipped: int
    ended: bool
    error: str | None = None


def retry(fn: Callable[[], R], attempts: int = 3, delay_s: float = 0.5) -> R:
    """Call `fn`, retrying a store blip (lock, timeout, 5xx) twice; a refusal (4xx) at once."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as e:
            if i == attempts - 1 or store.is_permanent_error(e):
                raise
            time.sleep(delay_s * 2**i)
    raise AssertionError("unreachable")  # pragma: no cover


class RunTracker:
    """The handle a trainer logs through. Create it with `open_run`.

    `log_metrics` only enqueues (a background thread writes); everything else writes through
    before returning and raises `TrackingError` when the store refuses. Thread-safe: the
    system-metrics thread logs through the same tracker as the training loop.
    """

    def __init__(
        self,
        client: MlflowClient,
        settings: Settings,
        run: Run,
        *,
        resumed: bool,
        flush_interval_s: float = 1.0,
        max_queue: int = 100_000,
    ) -> None:
        from mlflow.entities import Metric

        self._metric_cls = Metric
        self._client = client
        self.settings = settings
        self.run_id: str = run.info.run_id
        self.experiment_id: str = str(run.info.experiment_id)
        self.artifact_uri: str = str(run.info.artifact_uri)
        self.resumed = resumed
        self._params: dict[str, str] = dict(run.data.params)
        latest = store.latest_metrics(run)
        self._steps = StepFilter({key: step for key, (_v, step, _t) in latest.items()})
        self._keys: dict[str, str] = {}
        try:
            self._dropped_before = int(run.data.tags.get(store.DROPPED_TAG, "0"))
        except ValueError:
            self._dropped_before = 0
        self._lock = threading.Lock()
        self._writer: MetricWriter[Metric] = MetricWriter(
            self._write_metrics,
            max_queue=max_queue,
            interval_s=flush_interval_s,
            is_permanent=store.is_permanent_error,
            name=f"visionloop-metrics-{self.run_id[:8]}",
        )
        self._sampler: SystemSampler | None = None
        self._summary: CloseSummary | None = None
        # A process that exits without close() (an exception the trainer did not catch) still
        # gets its queued metrics written; the run's status is left for the next attempt.
        atexit.register(self._flush_at_exit)

    # ------------------------------------------------------------------ metrics
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Queue `metrics` at `step`; returns at once.

        Per key, steps must increase: a step at or below the key's last logged step (in this
        process, or before a crash of an earlier attempt) is skipped silently, which is what
        makes a resumed trainer's replayed steps harmless. Keys are sanitised (`sanitize_key`).
        """
        step = operator.index(step)
        timestamp = int(time.time() * 1000)
        with self._lock:
            self._check_open()
            batch: list[Metric] = []
            for raw_key, raw_value in metrics.items():
                key = self._keys.get(raw_key)
                if key is None:
                    key = self._keys[raw_key] = sanitize_key(raw_key)
                try:
                    value = float(raw_value)
                except (TypeError, ValueError):
                    raise TrackingError(
                        f"metric {raw_key!r} at step {step} has value {raw_value!r} "
                        f"({type(raw_value).__name__}); metrics must be numbers."
                    ) from None
                if self._steps.accept(key, step):
                    batch.append(self._metric_cls(key, value, timestamp, step))
            if batch:
                # Submitted under the lock so that each key's steps reach the queue in order.
                self._writer.submit(batch)

    def log_metric(self, key: str, value: float, step: int) -> None:
        self.log_metrics({key: value}, step)

    def _write_metrics(self, batch: list[Metric]) -> None:
        # synchronous=True: MLflow's own async logging (MLFLOW_ENABLE_ASYNC_LOGGING) would
        # acknowledge before storing, and flush() would then promise more than it knows.
        self._client.log_batch(self.run_id, metrics=batch, synchronous=True)

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every metric queued so far is stored (or dropped); False on timeout.

        While the store keeps failing, the writer keeps retrying and `timeout=None` keeps
        waiting: inside a training loop, pass a timeout.
        """
        return self._writer.flush(timeout)

    # ------------------------------------------------------------------ params and tags
    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params; nested mappings become dotted keys (`optimizer.lr`).

        Logging a param again with the same value is a no-op (a resumed run logs its spec
        again). A *different* value raises `TrackingError`: an MLflow run has one value per
        param, and silently keeping the old one would misdescribe the run.
        """
        from mlflow.entities import Param

        flat = flatten_params(params)
        with self._lock:
            self._check_open()
            conflicts = [(k, self._params[k], v) for k, v in flat.items() if self._params.get(k, v) != v]
            if conflicts:
                lines = "; ".join(f"{k!r} is {old!r}, now {new!r}" for k, old, new in conflicts)
                raise TrackingError(
                    f"run {self.run_id} already has different values for {len(conflicts)} param(s): "
                    f"{lines}. A run keeps the settings it started with: resume it with the same spec, "
                    f"or start a new run directory to train with the new settings."
                )
            new = {k: v for k, v in flat.items() if k not in self._params}
            items = [Param(k, v) for k, v in new.items()]
            self._write_sync(
                "log params", lambda chunk: self._client.log_batch(self.run_id, params=chunk), items
            )
            self._params.update(new)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set (or overwrite) tags; keys are sanitised and values stringified and truncated."""
        from mlflow.entities import RunTag

        with self._lock:
            self._check_open()
            items = [RunTag(sanitize_key(k), tag_value(v)) for k, v in tags.items()]
            self._write_sync("set tags", lambda chunk: self._client.log_batch(self.run_id, tags=chunk), items)

    def set_tag(self, key: str, value: Any) -> None:
        self.set_tags({key: value})

    def _write_sync(self, action: str, write: Callable[[list[Any]], Any], items: list[Any]) -> None:
        try:
            for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
                chunk = items[i : i + MAX_PARAMS_TAGS_PER_BATCH]
                retry(functools.partial(write, chunk))
        except Exception as e:
            raise store.store_error(f"{action} for run {self.run_id}", self.settings, e) from e

    # ------------------------------------------------------------------ artifacts
    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        """Upload a file, or a directory's contents, to the run's artifacts.

        A file lands at `<artifact_path>/<file name>`; a directory's files land under
        `artifact_path`, or under the directory's own name when `artifact_path` is None
        (`log_artifact("out/model")` -> `model/...`).
        """
        p = Path(path)
        if not p.exists():
            raise TrackingError(f"cannot log artifact {p}: no such file or directory.")
        self._check_open()
        try:
            if p.is_dir():
                dest = artifact_path if artifact_path is not None else p.name
                retry(lambda: self._client.log_artifacts(self.run_id, str(p), artifact_path=dest))
            else:
                retry(lambda: self._client.log_artifact(self.run_id, str(p), artifact_path=artifact_path))
        except Exception as e:
            raise store.store_error(f"upload {p} for run {self.run_id}", self.settings, e) from e

    def log_text(self, text: str, artifact_file: str) -> None:
        self._check_open()
        try:
            retry(lambda: self._client.log_text(self.run_id, text, artifact_file))
        except Exception as e:
            raise store.store_error(f"upload {artifact_file} for run {self.run_id}", self.settings, e) from e

    def log_dict(self, obj: Mapping[str, Any], artifact_file: str) -> None:
        """Store `obj` as JSON, or as YAML when `artifact_file` ends in .yaml/.yml."""
        self._check_open()
        try:
            retry(lambda: self._client.log_dict(self.run_id, dict(obj), artifact_file))
        except Exception as e:
            raise store.store_error(f"upload {artifact_file} for run {self.run_id}", self.settings, e) from e

    # ------------------------------------------------------------------ system metrics
    def start_system_metrics(self, step_fn: Callable[[], int], every_s: float = 10.0) -> None:
        """Sample CPU/memory/GPU every `every_s` s and log under `system/...` at `step_fn()`.

        Calling it again replaces the running sampler.
        """
        self._check_open()
        self.stop_system_metrics()
        self._sampler = SystemSampler(self.log_metrics, step_fn, every_s)
        self._sampler.start()

    def stop_system_metrics(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None

    # ------------------------------------------------------------------ end
    def close(self, status: str = "FINISHED", timeout: float = 30.0) -> CloseSummary:
        """Stop the sampler, write queued metrics (up to `timeout` s), end the run with `status`.

        Never raises for a store failure: the training result must not be lost because the
        tracking store blipped at the very end. Problems are logged and returned. Closing
        twice returns the first summary.
        """
        status = status.upper()
        if status not in END_STATUSES:
            raise ValueError(f"status must be one of {END_STATUSES}, got {status!r}")
        if self._summary is not None:
            return self._summary
        self.stop_system_metrics()
        stats = self._writer.close(timeout)
        atexit.unregister(self._flush_at_exit)
        dropped = stats.dropped + stats.pending
        error: str | None = None
        if dropped:
            log.warning(
                "run %s: %d metric values were not stored (%d queue full, %d failed writes, %d still "
                "pending at close); last error: %s",
                self.run_id,
                dropped,
                stats.dropped_queue_full,
                stats.dropped_write_failed,
                stats.pending,
                stats.last_error,
            )
            try:
                tag = str(self._dropped_before + dropped)
                retry(lambda: self._client.set_tag(self.run_id, store.DROPPED_TAG, tag))
            except Exception as e:
                log.warning("could not record the dropped-metrics count on run %s: %s", self.run_id, e)
        ended = True
        if dropped:
            error = stats.last_error
        try:
            retry(lambda: self._client.set_terminated(self.run_id, status))
        except Exception as e:
            ended = False
            error = f"{type(e).__name__}: {e}"
            log.warning(
                "could not mark run %s as %s in the tracking store (%s); it stays RUNNING there. "
                "Metrics and artifacts already stored are unaffected.",
                self.run_id,
                status,
                e,
            )
        self._summary = CloseSummary(
            status=status,
            metrics_written=stats.written,
            metrics_dropped=dropped,
            duplicates_skipped=self._steps.dropped,
            ended=ended,
            error=error,
        )
        return self._summary

    @property
    def closed(self) -> bool:
        return self._summary is not None

    def ui_command(self) -> str:
        """The shell command that opens the MLflow UI on this store (or the server's address)."""
        return store.ui_command(self.settings.tracking_uri)

    def _check_open(self) -> None:
        if self._summary is not None:
            raise TrackingError(f"run {self.run_id} is closed; open it again with open_run(...) to log more.")

    def _flush_at_exit(self) -> None:
        if self._summary is None:
            self._writer.flush(timeout=10.0)

    def __enter__(self) -> RunTracker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("KILLED")
        else:
            self.close("FAILED")
