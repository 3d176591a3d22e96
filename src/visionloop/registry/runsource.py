"""From what a user types as RUN to a finished run's files: a run directory path, a run name
under <home>/runs, or an MLflow run (id, id prefix or name; see `track.query.find_run`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from visionloop.core.errors import NotFoundError, VisionloopError
from visionloop.core.settings import Settings
from visionloop.models.card import ModelCard
from visionloop.registry.layout import CARD_FILE, SPEC_FILE, SPEC_RESOLVED_FILE, WEIGHTS_FILE


class UnfinishedRunError(VisionloopError):
    """The run has no final model (still running, stopped, or failed)."""


@dataclass(frozen=True)
class RunSource:
    run_dir: Path
    card: ModelCard
    mlflow_run_id: str | None
    status: str | None
    dataset_path: str | None
    final_metrics: dict[str, float]

    @property
    def weights(self) -> Path:
        return self.run_dir / WEIGHTS_FILE


def resolve_run_dir(run: str | Path, settings: Settings) -> Path:
    text = str(run).strip()
    if not text:
        raise NotFoundError("no run given: pass a run directory, a run name or an MLflow run id.")
    path = Path(text).expanduser()
    if path.is_dir():
        return path.resolve()
    under_home = settings.runs_dir / text
    if "/" not in text and under_home.is_dir():
        return under_home.resolve()
    from visionloop.track import query, store

    try:
        found = query.find_run(settings, text)
    except NotFoundError as e:
        raise NotFoundError(
            f"no run {text!r}: it is not a directory, not a run under {settings.runs_dir}, and the "
            f"tracking store says: {e}"
        ) from e
    tagged = found.data.tags.get(store.RUN_DIR_TAG)
    if not tagged or not Path(tagged).is_dir():
        raise NotFoundError(
            f"MLflow run {found.info.run_id} has no run directory on this machine "
            f"(tag {store.RUN_DIR_TAG} = {tagged!r}). Register it from the machine that trained it, "
            "or pass the run directory's path."
        )
    return Path(tagged).resolve()


def load_run(run: str | Path, settings: Settings) -> RunSource:
    """The finished run `run` names; a clear error for unfinished or damaged ones."""
    run_dir = resolve_run_dir(run, settings)
    meta = _read_json_dict(run_dir / "run.json")
    status = meta.get("status") if isinstance(meta.get("status"), str) else None
    missing = [f for f in (WEIGHTS_FILE, CARD_FILE) if not (run_dir / f).is_file()]
    if missing:
        raise UnfinishedRunError(
            f"{run_dir} has no final model ({', '.join(missing)} missing; "
            f"run status: {status or 'unknown'}): "
            "only a finished run can be registered. Finish it with `visionloop train SPEC --run-dir "
            f"{run_dir}` (it resumes from its last checkpoint), then register again."
        )
    card = ModelCard.load(run_dir / CARD_FILE)
    resolved = _read_yaml(run_dir / SPEC_RESOLVED_FILE)
    data = resolved.get("data") if isinstance(resolved.get("data"), dict) else {}
    dataset = data.get("dataset") if isinstance(data, dict) else None
    metrics_raw = meta.get("final_metrics")
    metrics = (
        {str(k): float(v) for k, v in metrics_raw.items() if isinstance(v, int | float)}
        if isinstance(metrics_raw, dict)
        else {}
    )
    run_id = meta.get("mlflow_run_id")
    return RunSource(
        run_dir=run_dir,
        card=card,
        mlflow_run_id=run_id if isinstance(run_id, str) and run_id else None,
        status=status,
        dataset_path=str(dataset) if dataset else None,
        final_metrics=metrics,
    )


def spec_files(run_dir: Path) -> list[Path]:
    return [p for p in (run_dir / SPEC_FILE, run_dir / SPEC_RESOLVED_FILE) if p.is_file()]


def _read_json_dict(path: Path) -> dict[str, Any]:
    import json

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return raw if isinstance(raw, dict) else {}
