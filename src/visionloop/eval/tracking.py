"""An evaluation as an MLflow run, linked to the model version it evaluated.

The run lives in the `visionloop-eval` experiment, tagged with the model, version, dataset
version and split; its metrics are the report's headline figures and its artifacts the report
and plots. The model version gets a tag naming its newest evaluation run, so MLflow's UI leads
from a version to how it was evaluated, and the run back to the version.
"""

from __future__ import annotations

import math
from pathlib import Path

from visionloop.core.settings import Settings
from visionloop.eval.report import EvalReport
from visionloop.registry import ModelVersionInfo
from visionloop.track import store as track_store

EXPERIMENT = "visionloop-eval"
VERSION_TAG = "visionloop.eval.last_run_id"


def headline_metrics(report: EvalReport) -> dict[str, float]:
    """What the run logs as metrics: the clean metrics, the stress summary and calibration."""
    out = {f"clean/{k}": v for k, v in report.clean_metrics.items()}
    if report.stress_mean is not None:
        out[f"stress/{report.metric}_mean"] = report.stress_mean
    if report.mean_relative_error is not None:
        out["stress/mean_relative_error"] = report.mean_relative_error
    for s in report.corruptions:
        out[f"stress/{s.corruption}/{report.metric}_mean"] = s.mean
    cal = report.calibration or {}
    for key in ("ece", "mce", "brier", "nll", "ece_after", "temperature"):
        value = cal.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[f"calibration/{key}"] = float(value)
    return {k: v for k, v in out.items() if math.isfinite(v)}


def log_eval_run(info: ModelVersionInfo, report: EvalReport, files: list[Path], settings: Settings) -> str:
    """Record `report` (already written to disk) as a finished MLflow run; return its id."""
    client = track_store.client(settings)
    try:
        experiment = track_store.ensure_experiment(client, settings, EXPERIMENT)
        run = client.create_run(
            experiment,
            run_name=f"eval {info.ref} {report.split}",
            tags={
                "visionloop.model": info.name,
                "visionloop.model_version": str(info.version),
                "visionloop.task": report.task,
                "visionloop.dataset_version": report.dataset_version,
                "visionloop.split": report.split,
                "visionloop.stress": str(bool(report.stress)).lower(),
                **({"visionloop.source_run_id": info.run_id} if info.run_id else {}),
            },
        )
        run_id = str(run.info.run_id)
        client.log_param(run_id, "images", report.images)
        client.log_param(run_id, "seed", report.seed)
        client.log_param(run_id, "dataset", report.dataset)
        for key, value in headline_metrics(report).items():
            client.log_metric(run_id, key, value)
        for path in files:
            client.log_artifact(run_id, str(path))
        client.set_terminated(run_id, "FINISHED")
        client.set_model_version_tag(info.name, str(info.version), VERSION_TAG, run_id)
    except Exception as e:
        raise track_store.store_error(f"record the evaluation of {info.ref}", settings, e) from e
    return run_id
