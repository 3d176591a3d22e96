"""The tuner through the real control plane (SQLite, the local executor with fake GPUs, the
real trainer on digits): trials become jobs that pause at the pruner's rungs, their
evaluations become intermediate values, asha promotes the best paused trial (it resumes from
its checkpoint as the same job) and the others are pruned through the queue, a budget stops
new trials, and a tuner that died between ask and submit, or between submit and recording the
job, continues without a lost or duplicated trial. A tuner SIGKILLed mid-study (and the
control plane with it) is test_tune_chaos.py's, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

from _cpkit import CP, TEAMS, cluster_config, control_plane, job_roots
from _cpkit import train_doc as _train
from _dbkit import fresh_database
from visionloop.api.client import Client
from visionloop.tune.spec import TuneSpec, validate_tune_spec
from visionloop.tune.study import create_or_load, load
from visionloop.tune.tracking import PARENT_RUN_ATTR
from visionloop.tune.tuner import JOB_ATTR, STOPPED_ATTR, Tuner, idempotency_key

TWO_GPUS = [{"node": "local", "type": "fake", "count": 2, "price_class": "owned"}]
GOOD_LR, BAD_LR = 0.003, 1e-4  # the space's low end: barely moves in one epoch


@pytest.fixture
def cp_url(tmp_path: Path) -> Iterator[tuple[CP, str]]:
    cfg = cluster_config(inventory=TWO_GPUS, teams=TEAMS)
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg) as plane:
        yield plane, url


def tune_doc(dataset: Path, **fields: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "digits-lr",
        "train": _train(dataset, epochs=2),
        "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
        "sampler": {"name": "random", "seed": 0},
        "pruner": {"name": "asha", "min_epochs": 1, "reduction_factor": 2},
        "trials": 3,
        "concurrency": 2,
        "job": {"team": "vision"},
    }
    doc.update(fields)
    return doc


def _within(seconds: float) -> Callable[[], bool]:
    """A tuner's should_stop: a study that hangs fails its test (by _check_finished's count)
    instead of holding CI until its global timeout."""
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() > deadline


def _jobs(cp: CP) -> list[dict[str, Any]]:
    with cp.client() as c:
        return list(c.get("/v1/jobs", params={"limit": 100}).json())


def _check_finished(cp: CP, url: str, spec: TuneSpec) -> list[Any]:
    """Exactly `trials` finished trials, one job each (named after its trial), and every
    completed trial's value is its last epoch's."""
    trials = load(spec.name, url).get_trials()
    assert len(trials) == spec.trials
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials), trials
    jobs = _jobs(cp)
    assert len(jobs) == spec.trials
    names = Counter(j["name"] for j in jobs)
    assert names == Counter(f"{spec.name}-t{t.number}" for t in trials)
    assert sorted(t.user_attrs[JOB_ATTR] for t in trials) == sorted(j["id"] for j in jobs)
    for t in trials:
        if t.state == TrialState.COMPLETE:
            assert sorted(t.intermediate_values) == [1, 2]
            assert t.value == t.intermediate_values[2]
            assert 0.0 <= t.value <= 1.0
    return trials


def _show(cp: CP, job_id: int) -> dict[str, Any]:
    with cp.client() as c:
        return dict(c.get(f"/v1/jobs/{job_id}").json())


def _entered(show: dict[str, Any], state: str) -> list[float]:
    return [t["at"] for t in show["transitions"] if t["to_state"] == state]


@pytest.mark.parametrize("promotion", [True, False], ids=["promotion", "stop-only"])
def test_trials_pause_at_the_rung_the_best_goes_on_and_the_other_is_pruned(
    cp_url: tuple[CP, str], digits_dataset: Path, promotion: bool
) -> None:
    cp, url = cp_url
    # One at a time, a good learning rate first. Both pause after epoch 1 (the rung); the
    # good one goes on from its checkpoint, the bad one is pruned there.
    pruner = {"name": "asha", "min_epochs": 1, "reduction_factor": 2, "promotion": promotion}
    spec = validate_tune_spec(tune_doc(digits_dataset, concurrency=1, trials=2, pruner=pruner), "tune.yaml")
    study = create_or_load(spec, url)
    study.enqueue_trial({"optimizer.lr": GOOD_LR})
    study.enqueue_trial({"optimizer.lr": BAD_LR})
    with Client(cp.url, cp.admin_token) as client:
        progress = Tuner(spec, study, client).run(poll_s=0.2, should_stop=_within(300))
    assert progress.done and (progress.finished, progress.running, progress.paused) == (2, 0, 0)
    good, bad = _check_finished(cp, url, spec)
    assert good.state == TrialState.COMPLETE and good.params["optimizer.lr"] == GOOD_LR
    assert good.value > 0.5
    assert bad.state == TrialState.PRUNED, bad
    assert sorted(bad.intermediate_values) == [1]
    assert bad.intermediate_values[1] < good.intermediate_values[1]

    # The good trial is one job run twice: paused at the rung (exit 76), then resumed from
    # that checkpoint to the end, never from scratch.
    good_job = _show(cp, good.user_attrs[JOB_ATTR])
    assert good_job["job"]["state"] == "succeeded"
    assert [(a["outcome"], a["exit_code"]) for a in good_job["attempts"]] == [
        ("paused", 76),
        ("succeeded", 0),
    ]
    assert good_job["job"]["workload_doc"] == {
        "kind": "trial",
        "study": spec.name,
        "number": good.number,
        "until_epoch": None,
    }
    log = (Path(good_job["job"]["run_dir"]) / "train.log").read_text()
    assert re.search(r"resumed from \S+ at step [1-9]", log), log[-2000:]
    # The trials are untracked (tracking.enabled: false in the base train spec): the study has
    # no parent MLflow run, and the trial's run none of its own.
    assert PARENT_RUN_ATTR not in load(spec.name, url).user_attrs
    meta = json.loads((Path(good_job["job"]["run_dir"]) / "run.json").read_text())
    assert meta["status"] == "succeeded" and meta.get("mlflow_run_id") is None, meta
    # The bad trial ended at its rung: job pruned, its one attempt's outcome pruned.
    bad_job = _show(cp, bad.user_attrs[JOB_ATTR])
    assert bad_job["job"]["state"] == "pruned"
    assert [(a["outcome"], a["exit_code"]) for a in bad_job["attempts"]] == [("pruned", 76)]
    assert "pruned by" in bad_job["transitions"][-1]["reason"]
    # Promotion waits for the rung to be judged against the later trial; stop-only judges the
    # good trial alone on arrival and sends it on before the bad one even starts.
    good_resumed = _entered(good_job, "queued")[1]
    bad_paused = _entered(bad_job, "paused")[0]
    assert (good_resumed > bad_paused) is promotion


def test_a_budget_stops_new_trials_and_ends_the_study(cp_url: tuple[CP, str], digits_dataset: Path) -> None:
    cp, url = cp_url
    # The first trial's rung alone spends more than this (its fake GPU's hours count).
    spec = validate_tune_spec(
        tune_doc(digits_dataset, concurrency=1, trials=3, budget={"gpu_hours": 1e-4}), "tune.yaml"
    )
    study = create_or_load(spec, url)
    with Client(cp.url, cp.admin_token) as client:
        progress = Tuner(spec, study, client).run(poll_s=0.2, should_stop=_within(300))
    assert progress.done and progress.stopped is not None and "GPU-hours" in progress.stopped
    assert progress.gpu_hours >= 1e-4
    trials = load(spec.name, url).get_trials()
    assert len(trials) == 1 and len(_jobs(cp)) == 1  # no second trial started
    assert trials[0].state == TrialState.PRUNED  # paused at its rung, never promoted
    assert "budget" in trials[0].user_attrs["end"]
    assert trials[0].user_attrs["cost"]["gpu_hours"] == pytest.approx(progress.gpu_hours)
    assert "budget of 0.0001 GPU-hours is spent" in load(spec.name, url).user_attrs[STOPPED_ATTR]


def test_a_tuner_that_died_between_ask_submit_and_record_neither_loses_nor_repeats(
    cp_url: tuple[CP, str], digits_dataset: Path
) -> None:
    cp, url = cp_url
    spec = validate_tune_spec(tune_doc(digits_dataset, trials=3, concurrency=2), "tune.yaml")
    study = create_or_load(spec, url)
    with Client(cp.url, cp.admin_token) as client:
        tuner = Tuner(spec, study, client)
        # Died after ask (parameters stored), before submitting: trial 0 has no job.
        tuner.job_doc(study.ask())
        # Died after submitting, before recording the job on the trial: trial 1.
        second = study.ask()
        first_id = client.submit(tuner.job_doc(second), idempotency_key=idempotency_key(study, 1))["id"]
        tuner = Tuner(spec, create_or_load(spec, url), client)
        progress = tuner.step()
        assert (progress.running, progress.asked) == (2, 2)  # no third trial while two run
        assert load(spec.name, url).trials[1].user_attrs[JOB_ATTR] == first_id
        assert len(_jobs(cp)) == 2
        tuner.run(poll_s=0.2, should_stop=_within(300))
    _check_finished(cp, url, spec)


def test_a_trial_refused_for_a_full_queue_is_submitted_later_as_the_same_trial(
    tmp_path: Path, digits_dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The team may queue 2 jobs and already has one waiting (no scheduler here: nothing
    starts). The study's first trial fills the queue; its second is refused with a 429. The
    tuner says so, waits, and once the other job is cancelled submits that trial: one job for
    each trial, none lost, none twice."""
    import visionloop.tune.tuner as tuner_module

    monkeypatch.setattr(tuner_module, "QUEUE_FULL_WAIT_S", 0.2)
    jobs = {"allowed_roots": job_roots(), "max_queued_per_team": 2}
    cfg = cluster_config(inventory=TWO_GPUS, teams=TEAMS, jobs=jobs)
    spec = validate_tune_spec(tune_doc(digits_dataset, trials=2, concurrency=2), "tune.yaml")
    said: list[str] = []
    with (
        fresh_database("sqlite", tmp_path) as url,
        control_plane(url, cfg, run_scheduler=False) as cp,
        Client(cp.url, cp.admin_token) as client,
    ):
        blocker = client.submit({"train": _train(digits_dataset), "team": "vision"})
        study = create_or_load(spec, url)

        def full(why: str) -> None:
            said.append(why)
            client.cancel(int(blocker["id"]))  # room for one more

        def both_submitted() -> bool:
            trials = load(spec.name, url).get_trials()
            return len(trials) == 2 and all(JOB_ATTR in t.user_attrs for t in trials)

        deadline = time.monotonic() + 120
        Tuner(spec, study, client).run(
            poll_s=0.1,
            on_queue_full=full,
            should_stop=lambda: both_submitted() or time.monotonic() > deadline,
        )
        assert both_submitted()
        made = [j for j in _jobs(cp) if j["id"] != blocker["id"]]
    assert len(said) == 1 and "team 'vision' already has 2 jobs waiting" in said[0], said
    trials = load(spec.name, url).get_trials()
    assert sorted(t.user_attrs[JOB_ATTR] for t in trials) == sorted(j["id"] for j in made)
    assert Counter(j["name"] for j in made) == Counter(f"{spec.name}-t{t.number}" for t in trials)
