"""The MLflow tracking store: the one place that imports mlflow and talks to it directly.

mlflow takes ~2 s to import, so nothing here imports it at module level; `visionloop --help`
and commands that never touch the store stay fast.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from visionloop.core.errors import TrackingError
from visionloop.core.migration_lock import MIGRATION_LOCK
from visionloop.core.settings import Settings

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

UID_TAG = "visionloop.uid"
RUN_DIR_TAG = "visionloop.run_dir"
DATASET_VERSION_TAG = "visionloop.dataset_version"
ATTEMPTS_TAG = "visionloop.attempts"
DROPPED_TAG = "visionloop.metrics_dropped"
GIT_COMMIT_TAG = "visionloop.git.commit"
PARENT_RUN_TAG = "mlflow.parentRunId"  # MLflow's own nesting tag: its UI lists the run under it

_SERVER_SCHEMES = ("http", "https", "databricks", "databricks-uc")
_quieted = False


def _quiet_mlflow() -> None:
    """Keep MLflow's routine INFO lines (database migrations...) out of the user's terminal.

    Importing mlflow resets its logger to INFO with its own handler, which undoes any level the
    CLI set before the import, so the level is set again right after the first import. With
    `visionloop -v` (root logger at DEBUG) or an explicit MLFLOW_LOGGING_LEVEL it is left alone.
    """
    global _quieted
    if _quieted:
        return
    # MLflow 3 sends usage telemetry over the internet by default; a self-hosted tool makes no
    # network calls its user did not ask for. A user who wants it can set the variable.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow  # noqa: F401  (the import configures mlflow's loggers; override them after)

    _quieted = True
    if os.environ.get("MLFLOW_LOGGING_LEVEL") or logging.getLogger().isEnabledFor(logging.DEBUG):
        return
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


def is_server_uri(uri: str) -> bool:
    """True for a tracking *server* (it chooses where artifacts go); False for a database or
    local path that this process writes itself."""
    return urlsplit(uri).scheme in _SERVER_SCHEMES


def redact_uri(uri: str) -> str:
    """The URI without a password, for messages: `postgresql://u:secret@h/db` -> `postgresql://u:***@h/db`."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI; None for other stores and in-memory databases."""
    if not uri.startswith("sqlite:///"):
        return None
    rest = uri[len("sqlite:///") :].split("?", 1)[0]
    if rest in ("", ":memory:"):
        return None
    return Path(rest) if rest.startswith("/") else Path.cwd() / rest


def store_exists(settings: Settings) -> bool:
    """False only when the store is a SQLite file that was never created (no runs, certainly)."""
    path = sqlite_path(settings.tracking_uri)
    return path is None or path.is_file()


def ui_command(tracking_uri: str, port: int = 5000) -> str:
    """How to look at this store in the MLflow UI.

    A shell command for a database or local store; for a tracking server, which *is* the UI,
    its address.
    """
    if is_server_uri(tracking_uri):
        return redact_uri(tracking_uri)
    return f"mlflow ui --backend-store-uri {shlex.quote(tracking_uri)} --port {port}"


def client(settings: Settings) -> MlflowClient:
    """An MlflowClient on `settings.tracking_uri` (creating the home for a local store)."""
    _quiet_mlflow()
    from mlflow import MlflowClient

    if not is_server_uri(settings.tracking_uri):
        settings.ensure()
    try:
        # For a database URI this connects, and creates or migrates the schema, right here.
        with _schema_lock(settings.tracking_uri):
            _create_whole(settings.tracking_uri)
            return MlflowClient(tracking_uri=settings.tracking_uri)
    except Exception as e:
        raise store_error("connect", settings, e) from e


def _create_whole(uri: str) -> None:
    """Make a fresh local SQLite store whole or not at all (call under _schema_lock). MLflow
    creates its schema in dozens of Alembic steps committed one by one, so a process killed
    among them (Ctrl-C on a first `train`, the OOM killer, a SIGKILLed tuner) leaves a store
    that no later open can migrate ("table ... already exists"). Built beside it, renamed in."""
    from mlflow import MlflowClient

    db = sqlite_path(uri)
    if db is None or db.exists():
        return
    tmp = db.with_name(f".{db.name}.creating")
    for leftover in (tmp, tmp.with_name(tmp.name + "-journal"), tmp.with_name(tmp.name + "-wal")):
        leftover.unlink(missing_ok=True)  # a killed attempt's; the lock says no one is at it now
    made = MlflowClient(tracking_uri=f"sqlite:///{tmp}")
    made._tracking_client.store.engine.dispose()
    tmp.replace(db)
    fd = os.open(db.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _schema_lock(uri: str) -> Iterator[None]:
    """Serialise opening a local SQLite store between processes. MLflow creates and migrates
    the schema on first connect without a lock of its own, so two trainers starting at once
    on a fresh store (a queue launching two jobs) both run `ALTER TABLE ...` and one fails
    with "duplicate column". Server databases and tracking servers migrate once, by an admin.

    Within this process, MIGRATION_LOCK keeps MLflow's Alembic run apart from any other
    (the job store's), whatever the URI: see core/migration_lock.py."""
    db = sqlite_path(uri)
    with MIGRATION_LOCK:
        if db is None:
            yield
            return
        db.parent.mkdir(parents=True, exist_ok=True)
        with open(db.with_name(db.name + ".init-lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def store_error(action: str, settings: Settings, error: BaseException) -> TrackingError:
    return TrackingError(
        f"tracking store {redact_uri(settings.tracking_uri)}: could not {action}: {str(error).strip()}. "
        "Check that the store is reachable and writable (set it with VISIONLOOP_TRACKING_URI or "
        "tracking_uri in visionloop.toml)."
    )


def is_permanent_error(error: BaseException) -> bool:
    """True when retrying cannot help: MLflow answered with a client error (4xx), e.g. an
    invalid value or a deleted run. Connection failures, locks and 5xx are worth retrying."""
    from mlflow.exceptions import MlflowException

    if not isinstance(error, MlflowException):
        return False
    untyped: Any = error  # mlflow leaves this method unannotated
    status = int(untyped.get_http_status_code())
    return 400 <= status < 500 and status != 429


def _artifact_dir_name(experiment: str) -> str:
    return re.sub(r"[^\w.-]", "_", experiment) or "_"


def ensure_experiment(mlflow: MlflowClient, settings: Settings, name: str) -> str:
    """The id of experiment `name`, creating it if needed.

    For a database or local store the artifacts go under `<home>/artifacts/<experiment>`;
    MLflow's own default would be `./mlruns` relative to whatever directory the first run
    happened to start in. A tracking server keeps its own artifact root.
    """
    from mlflow.exceptions import MlflowException

    exp = mlflow.get_experiment_by_name(name)
    if exp is None:
        location = None
        if not is_server_uri(settings.tracking_uri):
            location = (settings.artifacts_dir / _artifact_dir_name(name)).resolve().as_uri()
        try:
            return str(mlflow.create_experiment(name, artifact_location=location))
        except MlflowException:
            # Another process created it between our lookup and create: use theirs.
            exp = mlflow.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        raise TrackingError(
            f"experiment {name!r} was deleted in MLflow (id {exp.experiment_id}). Restore it with "
            f"`mlflow experiments restore --experiment-id {exp.experiment_id}` or use another "
            "experiment name."
        )
    return str(exp.experiment_id)


def all_experiment_ids(mlflow: MlflowClient) -> list[str]:
    from mlflow.entities import ViewType

    ids: list[str] = []
    token: str | None = None
    while True:
        page = mlflow.search_experiments(view_type=ViewType.ALL, max_results=1000, page_token=token)
        ids.extend(str(e.experiment_id) for e in page)
        token = page.token
        if not token:
            return ids


def quote_filter_value(value: str) -> str:
    """Quote `value` for an MLflow filter string (which has no escape sequences)."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise TrackingError(
        f"cannot search the tracking store for {value!r}: it contains both kinds of quotes. "
        "Use the run id instead (`visionloop runs list` shows it)."
    )


def search_all(mlflow: MlflowClient, filter_string: str, *, max_results: int = 1000) -> list[Run]:
    """Runs matching `filter_string` in every experiment (deleted runs included), newest first."""
    from mlflow.entities import ViewType

    ids = all_experiment_ids(mlflow)
    if not ids:
        return []
    return list(
        mlflow.search_runs(
            ids,
            filter_string=filter_string,
            run_view_type=ViewType.ALL,
            max_results=max_results,
            order_by=["attributes.start_time DESC"],
        )
    )


def find_run_by_uid(mlflow: MlflowClient, uid: str) -> Run | None:
    """The run tagged `visionloop.uid == uid`, in any experiment; None if there is none."""
    runs = search_all(mlflow, f"tags.`{UID_TAG}` = {quote_filter_value(uid)}", max_results=10)
    if not runs:
        return None
    if len(runs) > 1:
        # Cannot happen through open_run (the uid is persisted before the run is created), but
        # a copied run directory could do it: continue the oldest, say so.
        runs.sort(key=lambda r: r.info.start_time or 0)
        logging.getLogger(__name__).warning(
            "%d runs carry %s=%s (%s); continuing the oldest",
            len(runs),
            UID_TAG,
            uid,
            ", ".join(r.info.run_id for r in runs),
        )
    return runs[0]


def latest_metrics(run: Run) -> dict[str, tuple[float, int, int]]:
    """`key -> (value, step, timestamp)` of each metric's latest entry, i.e. its highest step.

    MLflow keeps, per key, the entry with the largest (step, timestamp, value) as the run's
    "latest" metric; `RunData.metrics` drops the step, its proto form keeps it. Reading it
    costs one row per key, where the full history would cost one per logged step.
    """
    out: dict[str, tuple[float, int, int]] = {}
    proto: Any = run.data.to_proto()
    for m in proto.metrics:
        out[str(m.key)] = (float(m.value), int(m.step), int(m.timestamp))
    return out
