"""From what a user types as RUN to a finished run's files: a run directory path, a run name
under <home>/runs, or an MLflow run (id, id prefix or name; see `track.query.find_run`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from visionloop.core.errors import NotFoundError, VisionloopError
from visionloop.core.fsutil import TooLargeError, open_regular, read_capped
from visionloop.core.safeyaml import load_untrusted
from visionloop.core.settings import Settings
from visionloop.models.card import ModelCard
from visionloop.registry.files import UnreadableFileError, read_json
from visionloop.registry.layout import CARD_FILE, SPEC_FILE, SPEC_RESOLVED_FILE, WEIGHTS_FILE
from visionloop.spec_files import MAX_SPEC_BYTES


class UnfinishedRunError(VisionloopError):
    """The run has no final model (still running, stopped, or failed)."""


class RunFolderError(VisionloopError):
    """A file of the run folder cannot be registered as it is (a link out of the folder, a
    FIFO, a damaged run.json); the message names it and says what to do."""


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
    missing = [f for f in (WEIGHTS_FILE, CARD_FILE) if own_file(run_dir, f) is None]
    if missing:
        raise UnfinishedRunError(
            f"{run_dir} has no final model ({', '.join(missing)} missing; "
            f"run status: {status or 'unknown'}): "
            "only a finished run can be registered. Finish it with `visionloop train SPEC --run-dir "
            f"{run_dir}` (it resumes from its last checkpoint), then register again."
        )
    card = ModelCard.load(run_dir / CARD_FILE)
    # Checked before anything is copied: a spec that is a link out of the folder or a FIFO.
    resolved_path = own_file(run_dir, SPEC_RESOLVED_FILE)
    own_file(run_dir, SPEC_FILE)
    resolved = _read_yaml(resolved_path) if resolved_path is not None else {}
    data = resolved.get("data") if isinstance(resolved.get("data"), dict) else {}
    dataset = data.get("dataset") if isinstance(data, dict) else None
    metrics_raw = meta.get("final_metrics")
    metrics = (
        {
            str(k): float(v)
            for k, v in metrics_raw.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if isinstance(metrics_raw, dict)
        else {}
    )
    run_id = meta.get("mlflow_run_id")
    return RunSource(
        run_dir=run_dir,
        card=card,
        mlflow_run_id=run_id if isinstance(run_id, str) and run_id else None,
        status=status,
        # Only a path: a hand-edited mapping or list here would be recorded as its repr.
        dataset_path=dataset if isinstance(dataset, str) and dataset else None,
        final_metrics=metrics,
    )


def spec_files(run_dir: Path) -> list[Path]:
    return [p for p in (own_file(run_dir, SPEC_FILE), own_file(run_dir, SPEC_RESOLVED_FILE)) if p is not None]


def own_file(run_dir: Path, name: str) -> Path | None:
    """`run_dir/name` if it is a regular file of the run folder; None if there is none.

    Registering copies these files into the models folder, readable by the team: a link to a
    file outside the run folder (a run folder is often made by someone else) would publish
    whatever it points at (~/.ssh/id_rsa as spec.yaml), and a FIFO would hang the reader, so
    both are refused by name. `run_dir` is resolved (`resolve_run_dir`).
    """
    path = run_dir / name
    if not os.path.lexists(path):
        return None
    real = path.resolve()
    if not real.is_relative_to(run_dir):
        raise RunFolderError(
            f"{path} is a link to {real}, outside the run folder; registering copies only the run's "
            "own files. Replace the link with a copy of the file if it is the run's, then register again."
        )
    try:
        with open_regular(path):
            pass
    except FileNotFoundError:
        return None  # a link, inside the folder, to nothing
    except OSError as e:
        raise RunFolderError(f"{e}; then register again.") from e
    return path


def _read_json_dict(path: Path) -> dict[str, Any]:
    """run.json; {} when there is none. A damaged one is refused, not taken for empty: it holds
    the MLflow run id, without which the version would silently lose its lineage."""
    try:
        raw = read_json(path)
    except FileNotFoundError:
        return {}
    except UnreadableFileError as e:
        raise RunFolderError(
            f"{e}: it is the run's record (status, MLflow run id). Restore it, or move it aside "
            "to register the run without its MLflow lineage."
        ) from e
    return raw if isinstance(raw, dict) else {}


def _read_yaml(path: Path) -> dict[str, Any]:
    """spec.resolved.yaml, read like every user YAML (size limit, no aliases: core.safeyaml);
    {} when there is none."""
    try:
        raw = load_untrusted(read_capped(path, MAX_SPEC_BYTES, what="a spec").decode("utf-8"))
    except FileNotFoundError:
        return {}
    except TooLargeError as e:
        raise RunFolderError(
            f"{path} is over {MAX_SPEC_BYTES // 2**20} MiB, far more than a spec holds. "
            "Restore the run's spec.resolved.yaml, then register again."
        ) from e
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise RunFolderError(
            f"{path} cannot be read as the run's resolved spec ({e}). Restore it, or move it aside "
            "to register the run without it, then register again."
        ) from e
    return raw if isinstance(raw, dict) else {}
