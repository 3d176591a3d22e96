"""MLflow glue: one training run is one MLflow run, resumable, with each metric step logged once.

    tracker = open_run(settings, uid=uid, experiment="digits", run_dir=run_dir)
    tracker.log_params(spec_dict)
    tracker.log_metrics({"train/loss": 0.3}, step=120)   # non-blocking
    tracker.close("FINISHED")

Nothing imported here imports mlflow; that happens on first use (it costs ~2 s).
"""

from visionloop.track.environment import environment_tags
from visionloop.track.metrics_logger import MetricWriter, StepFilter, WriterStats
from visionloop.track.naming import flatten_params, metric_key, sanitize_key
from visionloop.track.resume import open_run
from visionloop.track.run import CloseSummary, RunTracker
from visionloop.track.store import ui_command
from visionloop.track.system import SystemSampler

__all__ = [
    "CloseSummary",
    "MetricWriter",
    "RunTracker",
    "StepFilter",
    "SystemSampler",
    "WriterStats",
    "environment_tags",
    "flatten_params",
    "metric_key",
    "open_run",
    "sanitize_key",
    "ui_command",
]
