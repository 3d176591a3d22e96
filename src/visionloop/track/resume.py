"""Open a run: continue the MLflow run of this training run, or create it.

The trainer persists a run uid in its run directory *before* calling `open_run`, and the uid is
written as a tag in the same insert that creates the MLflow run. So whatever moment a process
is killed at, the next attempt finds that run by its uid and continues it: one training run is
always one MLflow run, however many times it was interrupted.
"""

from __future__ import annotations

import getpass
import logging
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from visionloop.core.errors import TrackingError, VisionloopError
from visionloop.core.settings import Settings
from visionloop.track import store
from visionloop.track.environment import environment_tags
from visionloop.track.naming import sanitize_key, tag_value
from visionloop.track.run import MAX_PARAMS_TAGS_PER_BATCH, RunTracker

log = logging.getLogger(__name__)

_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _user() -> str | None:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return None


def _deleted_run_error(settings: Settings, run_id: str) -> TrackingError:
    uri = shlex.quote(store.redact_uri(settings.tracking_uri))
    return TrackingError(
        f"the tracking run of this run directory (MLflow run {run_id}) was deleted. Restore it with "
        f"`MLFLOW_TRACKING_URI={uri} mlflow runs restore --run-id {run_id}` to continue it, "
        "or start a new run directory."
    )


def open_run(
    settings: Settings,
    *,
    uid: str,
    experiment: str | None = None,
    run_name: str | None = None,
    run_dir: Path | None = None,
    tags: Mapping[str, Any] | None = None,
    parent_run_id: str | None = None,
    spec_tags: Mapping[str, str] | None = None,
    environment: bool = True,
    code_dir: Path | None = None,
    flush_interval_s: float = 1.0,
    max_queue: int = 100_000,
) -> RunTracker:
    """Continue the run tagged `visionloop.uid == uid`, or create it.

    `experiment` defaults to `settings.experiment`; a continued run stays in the experiment it
    was created in. `run_dir` is recorded as tag `visionloop.run_dir` (so `visionloop runs show
    <dir>` finds the run). With `environment`, git state of `code_dir` (default: the working
    directory), library versions, host and GPUs are tagged, refreshed on every resume: after a
    spot interruption the run may continue elsewhere. `visionloop.attempts` counts the starts.

    `parent_run_id` nests the run under that MLflow run (MLflow's `mlflow.parentRunId` tag, set
    in the insert that creates the run). `spec_tags` are the train spec's own
    (`tracking.tags`); `tags` (the trainer's) win over them.
    """
    if not _UID.match(uid):
        raise TrackingError(
            f"run uid {uid!r} is not usable: use 1-128 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit (e.g. a uuid4 hex)."
        )
    run_tags: dict[str, str] = environment_tags(code_dir) if environment else {}
    user = _user()
    if user:
        run_tags["mlflow.user"] = user
    run_tags.update({sanitize_key(k): tag_value(v) for k, v in (spec_tags or {}).items()})
    run_tags.update({sanitize_key(k): tag_value(v) for k, v in (tags or {}).items()})
    if parent_run_id is not None:
        run_tags[store.PARENT_RUN_TAG] = parent_run_id
    # Set last, so that a caller's tags cannot change what finding the run again relies on.
    run_tags[store.UID_TAG] = uid
    if run_dir is not None:
        run_tags[store.RUN_DIR_TAG] = str(Path(run_dir).resolve())
    exp_name = experiment or settings.experiment

    client = store.client(settings)
    try:
        run = store.find_run_by_uid(client, uid)
        if run is None:
            exp_id = store.ensure_experiment(client, settings, exp_name)
            run_tags[store.ATTEMPTS_TAG] = "1"
            # The uid tag goes in with the run, in one insert: there is no moment at which the
            # run exists but cannot be found by its uid.
            created = client.create_run(exp_id, run_name=run_name, tags=run_tags)
            run = client.get_run(created.info.run_id)
            resumed = False
        else:
            run_id = run.info.run_id
            if run.info.lifecycle_stage == "deleted":
                raise _deleted_run_error(settings, run_id)
            try:
                attempts = int(run.data.tags.get(store.ATTEMPTS_TAG, "1")) + 1
            except ValueError:
                attempts = 2
            run_tags[store.ATTEMPTS_TAG] = str(attempts)
            from mlflow.entities import RunTag

            client.update_run(run_id, status="RUNNING")
            items = [RunTag(k, v) for k, v in run_tags.items()]
            for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
                client.log_batch(run_id, tags=items[i : i + MAX_PARAMS_TAGS_PER_BATCH], synchronous=True)
            run = client.get_run(run_id)
            resumed = True
            exp = client.get_experiment(run.info.experiment_id)
            if experiment is not None and exp.name != experiment:
                log.warning(
                    "run %s is in experiment %r; continuing it there, not in %r", run_id, exp.name, experiment
                )
    except VisionloopError:
        raise
    except Exception as e:
        raise store.store_error(f"open the run with uid {uid}", settings, e) from e
    tracker = RunTracker(
        client, settings, run, resumed=resumed, flush_interval_s=flush_interval_s, max_queue=max_queue
    )
    log.info("%s tracking run %s (%s)", "continuing" if resumed else "started", tracker.run_id, exp_name)
    return tracker
