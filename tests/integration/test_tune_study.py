"""The Optuna study lives in the control plane's own database (SQLite and PostgreSQL) next to
the job store's tables, without either side's schema version getting in the other's way, and
a study name reused with another search is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from sqlalchemy import create_engine, inspect

from _dbkit import BACKENDS, fresh_database
from visionloop.core.errors import NotFoundError, SpecError
from visionloop.sched import db
from visionloop.sched.store import Store
from visionloop.tune.spec import validate_tune_spec
from visionloop.tune.study import SPEC_ATTR, UID_ATTR, create_or_load, load

TRAIN: dict[str, Any] = {
    "data": {"dataset": "/ds", "batch_size": 32, "image_size": 16},
    "model": {"arch": "small_cnn"},
    "epochs": 4,
}


def tune(**fields: Any) -> Any:
    doc: dict[str, Any] = {
        "name": "lr-study",
        "train": dict(TRAIN),
        "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-1]}},
        "trials": 4,
    }
    doc.update(fields)
    return validate_tune_spec(doc, "tune.yaml", Path("/"))


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with fresh_database(request.param, tmp_path) as url:
        yield url


def _revision(url: str) -> str | None:
    engine = db.make_engine(db.parse_url(url))
    try:
        with engine.connect() as conn:
            return db.current_revision(conn)
    finally:
        engine.dispose()


def test_the_study_shares_the_job_stores_database_and_both_reopen(db_url: str) -> None:
    # A study made first on an empty database: the queue's schema is made under it.
    study = create_or_load(tune(), db_url)
    trial = study.ask()
    trial.suggest_float("optimizer.lr", 1e-4, 1e-1, log=True)
    study.tell(trial, 0.5)
    assert _revision(db_url) == db.head_revision()  # the queue's revision, in its own table
    engine = create_engine(db.parse_url(db_url))
    try:
        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert {"jobs", "attempts", "studies", "trials", "trial_values"} <= tables
    # The job store opens (no "newer revision" refusal) and works; the study loads again.
    with Store.open(db_url, runs_dir=Path("/runs")) as store:
        assert store.list_jobs() == []
    again = create_or_load(tune(trials=8, concurrency=2), db_url)  # trials may change
    assert [t.value for t in again.trials] == [0.5]
    assert again.user_attrs[UID_ATTR] == study.user_attrs[UID_ATTR]
    assert set(again.user_attrs[SPEC_ATTR]) == {"train", "space", "objective", "pruner"}
    assert load("lr-study", db_url).trials[0].params["optimizer.lr"] == trial.params["optimizer.lr"]


def test_a_study_name_reused_for_another_search_is_refused(db_url: str) -> None:
    create_or_load(tune(), db_url)
    with pytest.raises(SpecError, match=r"different space.*new name"):
        create_or_load(tune(space={"optimizer.lr": {"loguniform": [1e-3, 1e-1]}}), db_url)
    with pytest.raises(SpecError, match=r"different objective"):
        create_or_load(tune(objective={"metric": "val/loss"}), db_url)
    with pytest.raises(SpecError, match=r"different train"):
        create_or_load(tune(train={**TRAIN, "epochs": 3}), db_url)
    with pytest.raises(NotFoundError, match=r"studies: lr-study"):
        load("nope", db_url)
    # A study that visionloop did not make is not taken over. Plain Optuna, with its own
    # compatibility check, opens the shared database: the queue keeps its revision elsewhere.
    url = db.parse_url(db_url).render_as_string(hide_password=False)
    storage = optuna.storages.RDBStorage(url)
    assert storage.get_current_version() == storage.get_head_version()
    foreign = optuna.create_study(storage=storage, study_name="foreign")
    foreign.tell(foreign.ask(), 1.0)
    with pytest.raises(SpecError, match="not made by `visionloop tune`"):
        create_or_load(tune(name="foreign"), db_url)


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_a_reopened_study_does_not_draw_the_first_points_again(db_url: str, sampler: str) -> None:
    from visionloop.tune.space import suggest

    spec = tune(sampler={"name": sampler, "seed": 0})

    def draw(study: optuna.Study, n: int) -> list[float]:
        out = []
        for _ in range(n):
            trial = study.ask()
            out.append(suggest(trial, spec.space)["optimizer.lr"])
            study.tell(trial, 0.5)
        return out

    first = draw(create_or_load(spec, db_url), 2)
    # A tuner restarted mid-study (a new process, the same seeded spec) goes on with new points.
    later = draw(create_or_load(spec, db_url), 2)
    assert not set(later) & set(first), (first, later)
    # And the same seed still gives the same search from scratch.
    spec2 = tune(name="lr-study-2", sampler={"name": sampler, "seed": 0})
    assert draw(create_or_load(spec2, db_url), 2) == first
