"""Reading runs back: list them, find one from what a user types, describe it.

The `visionloop runs` commands are thin renderings of these functions.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from visionloop.core.errors import NotFoundError, SpecError, TrackingError, VisionloopError
from visionloop.core.settings import Settings
from visionloop.track import store

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

STATUSES = ("RUNNING", "SCHEDULED", "FINISHED", "FAILED", "KILLED")
MIN_PREFIX = 6
MAX_ARTIFACTS = 500  # a run with a huge artifact tree is summarised, not printed in full
_HEX = re.compile(r"^[0-9a-f]+$")
_HOW_TO_LIST = "List runs with `visionloop runs list`."
# MLflow refuses max_results above 50000 with an error that reads like a broken store.
MAX_LIMIT = 50_000
# A run id is 32 characters, a name or a run directory a few hundred at most; anything far
# longer is a mistake (a pasted file), and must not be echoed back whole in an error.
MAX_REF_CHARS = 4096
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _shown(value: str, limit: int = 80) -> str:
    """`value` as an error message quotes it: repr'd (control characters visible), cut short."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"... ({len(value):,} characters)"


def _time(ms: int | None) -> datetime | None:
    return None if not ms else datetime.fromtimestamp(ms / 1000, tz=UTC)


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    name: str
    experiment: str
    status: str
    start_time: datetime | None
    end_time: datetime | None
    duration_s: float | None
    last_step: int | None
    val_accuracy: float | None
    dataset_version: str | None
    run_dir: str | None
    # The run's task (its `visionloop.task` tag), the task's primary metric and its latest
    # value (val/<primary_metric>): what "how good is this run" means whatever the task.
    task: str | None = None
    primary_metric: str | None = None
    primary_value: float | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("start_time", "end_time"):
            d[k] = d[k].isoformat() if d[k] is not None else None
        return d


@dataclass(frozen=True)
class MetricValue:
    key: str
    value: float
    step: int
    timestamp: datetime | None


@dataclass(frozen=True)
class ArtifactEntry:
    path: str
    size: int | None


@dataclass(frozen=True)
class RunDetail:
    summary: RunSummary
    experiment_id: str
    artifact_uri: str
    git_commit: str | None
    tags: dict[str, str]
    params: dict[str, str]
    metrics: list[MetricValue]
    artifacts: list[ArtifactEntry]
    artifacts_truncated: bool
    ui_command: str
    attempts: int | None = None
    metrics_dropped: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            **self.summary.to_json(),
            "experiment_id": self.experiment_id,
            "artifact_uri": self.artifact_uri,
            "git_commit": self.git_commit,
            "attempts": self.attempts,
            "metrics_dropped": self.metrics_dropped,
            "tags": self.tags,
            "params": self.params,
            "metrics": {
                m.key: {
                    "value": m.value,
                    "step": m.step,
                    "timestamp": m.timestamp.isoformat() if m.timestamp else None,
                }
                for m in self.metrics
            },
            "artifacts": [{"path": a.path, "size": a.size} for a in self.artifacts],
            "artifacts_truncated": self.artifacts_truncated,
            "ui_command": self.ui_command,
        }


TASK_TAG = "visionloop.task"  # set by the trainer (train.api) on every run


def _int_tag(tags: dict[str, str], key: str) -> int | None:
    try:
        return int(tags[key])
    except (KeyError, ValueError):
        return None


def summarize(run: Run, experiment_names: dict[str, str], now: datetime | None = None) -> RunSummary:
    info = run.info
    latest = store.latest_metrics(run)
    start, end = _time(info.start_time), _time(info.end_time)
    if start is not None and info.status == "RUNNING":
        # A resumed run keeps its old end_time; while RUNNING the clock is still going.
        end_for_duration: datetime | None = now or datetime.now(tz=UTC)
    else:
        end_for_duration = end
    duration = (end_for_duration - start).total_seconds() if start and end_for_duration else None
    acc = latest.get("val/accuracy")
    tags = run.data.tags
    task = tags.get(TASK_TAG)
    primary = _primary_metric(task)
    value = latest.get(f"val/{primary}") if primary is not None else None
    return RunSummary(
        run_id=info.run_id,
        name=info.run_name or "",
        experiment=experiment_names.get(str(info.experiment_id), str(info.experiment_id)),
        status=str(info.status),
        start_time=start,
        end_time=end,
        duration_s=duration,
        last_step=max((step for _v, step, _t in latest.values()), default=None),
        val_accuracy=acc[0] if acc else None,
        dataset_version=tags.get(store.DATASET_VERSION_TAG),
        run_dir=tags.get(store.RUN_DIR_TAG),
        task=task,
        primary_metric=primary,
        primary_value=value[0] if value else None,
    )


def _primary_metric(task: str | None) -> str | None:
    """The primary metric of `task`; None for a task this visionloop does not know (a listing
    must not fail on one foreign run). A run without the tag is a classification run: every
    run from before tasks were tagged was one."""
    from visionloop.tasks import get_task

    task = task or "classification"

    try:
        return get_task(task).primary_metric
    except SpecError:
        return None


def _experiment_names(client: MlflowClient) -> dict[str, str]:
    from mlflow.entities import ViewType

    names: dict[str, str] = {}
    token: str | None = None
    while True:
        page = client.search_experiments(view_type=ViewType.ALL, max_results=1000, page_token=token)
        names.update({str(e.experiment_id): str(e.name) for e in page})
        token = page.token
        if not token:
            return names


def _wrap(action: str, settings: Settings, e: Exception) -> VisionloopError:
    return e if isinstance(e, VisionloopError) else store.store_error(action, settings, e)


def list_runs(
    settings: Settings, *, experiment: str | None = None, status: str | None = None, limit: int = 50
) -> list[RunSummary]:
    """Runs in the store, newest first. An experiment or status that does not exist is an error
    naming the ones that do; a store that was never created simply has no runs."""
    if status is not None:
        status = status.upper()
        if status not in STATUSES:
            raise NotFoundError(f"unknown status {_shown(status)}; use one of {', '.join(STATUSES)}.")
    if limit < 1:
        raise TrackingError(f"--limit must be at least 1, got {limit}.")
    if limit > MAX_LIMIT:  # else MLflow's refusal is reported as a tracking store failure
        raise TrackingError(f"--limit must be at most {MAX_LIMIT}, got {limit}; e.g. --limit 100.")
    if not store.store_exists(settings):
        return []
    client = store.client(settings)
    try:
        from mlflow.entities import ViewType

        names = _experiment_names(client)
        if experiment is not None:
            ids = [i for i, n in names.items() if n == experiment]
            if not ids:
                known = ", ".join(sorted(names.values())) or "none"
                raise NotFoundError(
                    f"no experiment named {_shown(experiment)}; experiments in the store: {known}."
                )
        else:
            ids = list(names)
        if not ids:
            return []
        runs = client.search_runs(
            ids,
            filter_string=f"attributes.status = '{status}'" if status else "",
            run_view_type=ViewType.ACTIVE_ONLY,
            max_results=limit,
            order_by=["attributes.start_time DESC"],
        )
        now = datetime.now(tz=UTC)
        return [summarize(r, names, now) for r in runs]
    except Exception as e:
        raise _wrap("list runs", settings, e) from e


def _candidates(runs: list[Run]) -> str:
    lines = [
        f"  {r.info.run_id[:12]}  {r.info.run_name or '-'}  {r.info.status}  "
        f"{r.data.tags.get(store.RUN_DIR_TAG, '')}".rstrip()
        for r in runs[:10]
    ]
    more = f"\n  ... and {len(runs) - 10} more" if len(runs) > 10 else ""
    return "\n".join(lines) + more


def find_run(settings: Settings, ref: str) -> Run:
    """The one active run that `ref` names: a run id, a unique id prefix (>= 6 characters), a run
    name, or a run directory (matched through the `visionloop.run_dir` tag).

    Raises NotFoundError naming the candidates when `ref` is ambiguous, and how to list runs
    when nothing matches.
    """
    ref = ref.strip()
    if not ref:
        raise NotFoundError(f"no run given. {_HOW_TO_LIST}")
    # Checked before the store is touched: a 100 kB argument made Path.exists() fail with
    # ENAMETOOLONG (a NUL with ValueError), reported as a tracking store failure quoting it whole.
    if len(ref) > MAX_REF_CHARS:
        raise NotFoundError(
            f"run {_shown(ref)} is too long to be a run id, name or directory "
            f"(over {MAX_REF_CHARS} characters). {_HOW_TO_LIST}"
        )
    if _CONTROL.search(ref):
        raise NotFoundError(
            f"run {_shown(ref)} contains a control character (NUL, newline, ...), which no run id, "
            f"name or directory has. {_HOW_TO_LIST}"
        )
    if not store.store_exists(settings):
        raise NotFoundError(
            f"no run {_shown(ref)}: the tracking store {settings.tracking_uri} has no runs yet. "
            "Start one with `visionloop train SPEC.yaml`."
        )
    client = store.client(settings)
    try:
        matches = _match(client, ref)
    except Exception as e:
        raise _wrap(f"look up run {_shown(ref)}", settings, e) from e
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NotFoundError(
            f"no run matches {_shown(ref)} (tried run id, id prefix, run name and run directory) in "
            f"{store.redact_uri(settings.tracking_uri)}. {_HOW_TO_LIST}"
        )
    raise NotFoundError(
        f"{_shown(ref)} matches {len(matches)} runs; name one by its id (or a longer id prefix):\n"
        + _candidates(matches)
    )


def _match(client: MlflowClient, ref: str) -> list[Run]:
    found: dict[str, Run] = {}

    def add(runs: list[Run]) -> None:
        for r in runs:
            if r.info.lifecycle_stage == "active":
                found.setdefault(r.info.run_id, r)

    lowered = ref.lower()
    if _HEX.match(lowered) and len(lowered) >= MIN_PREFIX:
        if len(lowered) == 32:
            add(store.search_all(client, f"attributes.run_id = '{lowered}'"))
            if found:  # a full id is exact; do not also match names that look like ids
                return list(found.values())
        else:
            add(store.search_all(client, f"attributes.run_id LIKE '{lowered}%'"))
    add(store.search_all(client, f"attributes.run_name = {store.quote_filter_value(ref)}"))
    path = Path(ref).expanduser()
    try:
        exists = path.exists()
    except (OSError, ValueError):  # a name too long for the filesystem is not a run directory
        exists = False
    if "/" in ref or exists:
        resolved = str(path.resolve())
        add(store.search_all(client, f"tags.`{store.RUN_DIR_TAG}` = {store.quote_filter_value(resolved)}"))
    return sorted(found.values(), key=lambda r: r.info.start_time or 0, reverse=True)


def _list_artifacts(client: MlflowClient, run_id: str) -> tuple[list[ArtifactEntry], bool]:
    entries: list[ArtifactEntry] = []
    pending: list[str | None] = [None]
    while pending:
        for info in client.list_artifacts(run_id, pending.pop()):
            if info.is_dir:
                pending.append(info.path)
            else:
                entries.append(ArtifactEntry(str(info.path), info.file_size))
            if len(entries) >= MAX_ARTIFACTS:
                return sorted(entries, key=lambda a: a.path), True
    return sorted(entries, key=lambda a: a.path), False


def describe_run(settings: Settings, ref: str) -> RunDetail:
    """Everything `visionloop runs show` prints about the run `ref` names (see `find_run`)."""
    run = find_run(settings, ref)
    client = store.client(settings)
    try:
        names = _experiment_names(client)
        artifacts, truncated = _list_artifacts(client, run.info.run_id)
    except Exception as e:
        raise _wrap(f"read run {run.info.run_id}", settings, e) from e
    tags = dict(sorted(run.data.tags.items()))
    metrics = [
        MetricValue(key=k, value=v, step=step, timestamp=_time(ts))
        for k, (v, step, ts) in sorted(store.latest_metrics(run).items())
    ]
    return RunDetail(
        summary=summarize(run, names),
        experiment_id=str(run.info.experiment_id),
        artifact_uri=str(run.info.artifact_uri),
        git_commit=tags.get(store.GIT_COMMIT_TAG),
        tags=tags,
        params=dict(sorted(run.data.params.items())),
        metrics=metrics,
        artifacts=artifacts,
        artifacts_truncated=truncated,
        ui_command=store.ui_command(settings.tracking_uri),
        attempts=_int_tag(tags, store.ATTEMPTS_TAG),
        metrics_dropped=_int_tag(tags, store.DROPPED_TAG),
    )
