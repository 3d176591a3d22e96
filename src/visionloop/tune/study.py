"""The Optuna study of a tune spec, kept in the control plane's own database.

Optuna's RDB storage creates its tables (`studies`, `trials`, `trial_params`, ...) next to
the job store's (`jobs`, `attempts`, ...), and no name is shared: each Alembic history has
its own version table, Optuna's the default `alembic_version`, the queue's
`visionloop_alembic_version` (sched/db/migrate.py). Optuna therefore runs its own compatibility
check (a study written by an Optuna with another schema is refused with Optuna's advice,
`optuna storage upgrade`), and either side may open a fresh database first.

The job store is still opened (and migrated) before Optuna here, for databases made by
releases before the queue's revision 0002: those kept the queue's revision in
`alembic_version` (and skipped Optuna's check), which Optuna would read as a revision of its
own it does not know. The job store's migration moves it out and records Optuna's revision
there instead.

Optuna's own first use of a database (creating its tables, `version_info` and its revision)
is not made safe against a second process doing the same at that moment; the tuner is one
process per study.

SQLite: every Optuna transaction takes the write lock up front (BEGIN IMMEDIATE) and waits
for it, as the job store's do (sched/db/__init__.py says why): the control plane writes to the same
file every cycle, and a deferred transaction that reads and then writes would fail at once
with "database is locked" instead of waiting.

A study remembers what it searches (`SPEC_ATTR`: a hash of each part of the tune spec that
decides what its trials mean), so a tune spec reusing its name with another space,
objective, base train spec or pruner is refused rather than mixed into it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from pathlib import Path
from typing import Any

import optuna
from sqlalchemy import event
from sqlalchemy.engine import Connection

from visionloop.core.errors import ConfigError, NotFoundError, SpecError
from visionloop.core.settings import Settings, load_settings
from visionloop.sched import db
from visionloop.sched.store import Store, default_url
from visionloop.tune.space import direction_of, make_pruner, make_sampler
from visionloop.tune.spec import TuneSpec

log = logging.getLogger(__name__)

# Study user attributes.
SPEC_ATTR = "visionloop_spec"  # {part of the tune spec: its hash}
UID_ATTR = "visionloop_uid"  # random, per study: the trials' job idempotency keys carry it
METRIC_ATTR = "visionloop_metric"  # the objective's metric, e.g. val/accuracy
TUNE_ATTR = "visionloop_tune"  # the tune spec (JSON), as given when the study was made
# The parts of a tune spec that decide what a trial's value means. trials, concurrency,
# budget, sampler and the job fields may change between runs of the same study.
FINGERPRINTED = ("train", "space", "objective", "pruner")

SQLITE_BUSY_TIMEOUT_S = db.SQLITE_BUSY_TIMEOUT_S


def resolve_url(url: str | None, settings: Settings | None = None) -> str:
    """The control plane's database: `url`, else the job store's default (SQLite in the home)."""
    return url or default_url(settings or load_settings())


def fingerprint(spec: TuneSpec) -> dict[str, str]:
    """A hash of each part of `spec` that decides what its trials' values mean."""
    doc = spec.model_dump(mode="json", by_alias=True)
    out = {}
    for part in FINGERPRINTED:
        text = json.dumps(doc[part], sort_keys=True, separators=(",", ":"))
        out[part] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return out


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's storage in the control plane's database at `url`, after the job store's own
    migrations (see the module docstring for why in this order)."""
    parsed = db.parse_url(url)
    Store.open(url).close()  # creates or upgrades the queue's schema, and frees alembic_version
    sqlite = parsed.get_backend_name() == "sqlite"
    kwargs: dict[str, Any] = (
        {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S}}
        if sqlite
        else {"pool_pre_ping": True, "connect_args": {"connect_timeout": 10}}
    )
    try:
        storage = optuna.storages.RDBStorage(
            parsed.render_as_string(hide_password=False), engine_kwargs=kwargs
        )
    except RuntimeError as e:  # Optuna's compatibility check, which says what to run
        shown = parsed.render_as_string(hide_password=True)
        raise ConfigError(f"the studies in {shown} cannot be used by this Optuna: {e}") from e
    if sqlite:
        _immediate_writes(storage)
    return storage


def _immediate_writes(storage: optuna.storages.RDBStorage) -> None:
    engine = storage.engine

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy emits BEGIN (below), not sqlite3
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # the connections made while Optuna created its tables lack the above


def create_or_load(spec: TuneSpec, url: str | None = None) -> optuna.Study:
    """The study named `spec.name` in the control plane's database: created on first use,
    loaded afterwards (with this spec's sampler and pruner). A study of that name made from
    a tune spec with another train spec, space, objective or pruner is refused (SpecError):
    its trials would mean something else."""
    storage = open_storage(resolve_url(url))
    sampler, pruner = make_sampler(spec), make_pruner(spec)
    prints = fingerprint(spec)
    study = optuna.create_study(
        storage=storage,
        study_name=spec.name,
        direction=direction_of(spec),
        sampler=sampler,
        pruner=pruner,
        load_if_exists=True,
    )
    attrs = study.user_attrs
    if SPEC_ATTR not in attrs:
        if study.trials:
            raise SpecError(
                f"a study named {spec.name!r} already exists in the control plane's database and was not "
                "made by `visionloop tune`; give this tune spec another name."
            )
        study.set_user_attr(UID_ATTR, uuid.uuid4().hex)
        study.set_user_attr(METRIC_ATTR, spec.objective.metric)
        study.set_user_attr(TUNE_ATTR, spec.model_dump(mode="json", by_alias=True))
        study.set_user_attr(SPEC_ATTR, prints)  # last: a study without it is not yet claimed
        return study
    stored = attrs[SPEC_ATTR]
    changed = [part for part in FINGERPRINTED if stored.get(part) != prints[part]]
    if changed:
        raise SpecError(
            f"study {spec.name!r} already exists with a different {', '.join(changed)}: its trials would "
            f"not compare with this spec's. Give the tune spec a new name (e.g. name: {spec.name}-2), or "
            f"restore the {', '.join(changed)} it was started with."
        )
    if study.direction != direction_of(spec):  # covered by the objective's hash; kept as a guard
        raise SpecError(f"study {spec.name!r} optimises in the other direction; give the spec a new name.")
    asked = len(study.get_trials(deepcopy=False))
    if asked:
        study.sampler = make_sampler(spec, asked)  # a restart does not draw the same points again
    return study


def load(name: str, url: str | None = None) -> optuna.Study:
    """An existing study, by name (NotFoundError naming the studies there otherwise). Reads
    only: a SQLite database that does not exist is not created (a mistyped home or `--db`
    left an empty database behind)."""
    resolved = resolve_url(url)
    parsed = db.parse_url(resolved)
    on_file = parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:")
    if on_file and not Path(str(parsed.database)).is_file():
        raise NotFoundError(
            f"no study named {name!r}: the control plane's database {parsed.database} does not "
            "exist yet; `visionloop tune run TUNE.yaml` starts a study (check VISIONLOOP_HOME or --db)."
        )
    storage = open_storage(resolved)
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        names = sorted(s.study_name for s in storage.get_all_studies())
        known = ", ".join(names) if names else "none yet"
        raise NotFoundError(
            f"no study named {name!r} in the control plane's database (studies: {known}); "
            "`visionloop tune run TUNE.yaml` starts one."
        ) from None


__all__ = ["create_or_load", "fingerprint", "load", "open_storage", "resolve_url"]
