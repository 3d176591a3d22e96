"""A study in MLflow: one parent run per study, every trial's run nested under it.

    parent = study_parent_run(study, settings)           # once per tuner start; idempotent
    doc = nest(train_doc, parent, study.study_name, n)    # the trial's train document

The parent run is found again rather than made twice: its id is kept as a study user
attribute, and the run carries the study's uid as a tag (`STUDY_UID_TAG`) from the insert
that creates it, so a tuner killed between creating the run and storing its id finds that
run on restart instead of leaving an orphan beside a second one.

A trial's run is nested through its own train spec (`tracking.parent_run_id`, which the
trainer turns into MLflow's `mlflow.parentRunId` tag) and tagged with the study and trial
(`tracking.tags`), so the nesting survives any queue, executor or machine the job runs on.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import optuna

from visionloop.core.errors import VisionloopError
from visionloop.core.settings import Settings, load_settings
from visionloop.tune.study import TUNE_ATTR, UID_ATTR

log = logging.getLogger(__name__)

PARENT_RUN_ATTR = "visionloop_parent_run"  # study user attribute: the parent run's id
STUDY_TAG = "visionloop.study"
TRIAL_TAG = "visionloop.trial"
STUDY_UID_TAG = "visionloop.study_uid"  # on the parent run only: how a restart finds it
KIND_TAG = "visionloop.kind"


def _settings(tracking: Settings | str) -> Settings:
    if isinstance(tracking, Settings):
        return tracking
    return dataclasses.replace(load_settings(), tracking_uri=tracking)


def _experiment(study: optuna.Study, settings: Settings) -> str:
    """The base train spec's experiment (where the trials' runs go), else the default one."""
    tune = study.user_attrs.get(TUNE_ATTR) or {}
    tracking = (tune.get("train") or {}).get("tracking") or {}
    name = tracking.get("experiment")
    return name if isinstance(name, str) and name else settings.experiment


def _study_params(study: optuna.Study) -> dict[str, str]:
    """What the study searches, as the parent run's params: only the parts a study may not
    change between tuner runs (MLflow params are write-once)."""
    from visionloop.track.naming import flatten_params

    tune = study.user_attrs.get(TUNE_ATTR) or {}
    picked = {k: tune[k] for k in ("space", "objective", "pruner") if k in tune}
    return flatten_params(picked)


def study_parent_run(study: optuna.Study, tracking: Settings | str) -> str:
    """The id of `study`'s parent MLflow run, creating it on first use (in the base train spec's
    experiment, named after the study). `tracking`: the settings (or just the tracking URI)
    of the store the trials' trainers write to."""
    known = study.user_attrs.get(PARENT_RUN_ATTR)
    if isinstance(known, str) and known:
        return known
    uid = study.user_attrs.get(UID_ATTR)
    if not isinstance(uid, str) or not uid:
        raise VisionloopError(
            f"study {study.study_name!r} was not made by `visionloop tune` (it has no uid); "
            "run it with `visionloop tune run TUNE.yaml`."
        )
    settings = _settings(tracking)
    from mlflow.entities import Param

    from visionloop.track import store

    client = store.client(settings)
    try:
        found = store.search_all(
            client, f"tags.`{STUDY_UID_TAG}` = {store.quote_filter_value(uid)}", max_results=10
        )
        active = sorted(
            (r for r in found if r.info.lifecycle_stage != "deleted"), key=lambda r: r.info.start_time or 0
        )
        if active:
            run_id = str(active[0].info.run_id)  # the oldest: what every earlier trial points at
        else:
            exp_id = store.ensure_experiment(client, settings, _experiment(study, settings))
            tags = {STUDY_UID_TAG: uid, STUDY_TAG: study.study_name, KIND_TAG: "study"}
            run = client.create_run(exp_id, run_name=study.study_name, tags=tags)
            run_id = str(run.info.run_id)
            params = [Param(k, v) for k, v in _study_params(study).items()]
            for i in range(0, len(params), 100):  # MLflow's limit per batch
                client.log_batch(run_id, params=params[i : i + 100], synchronous=True)
            log.info("study %s: parent MLflow run %s", study.study_name, run_id)
    except VisionloopError:
        raise
    except Exception as e:
        raise store.store_error(f"create the parent run of study {study.study_name!r}", settings, e) from e
    study.set_user_attr(PARENT_RUN_ATTR, run_id)
    return run_id


def nest(train_doc: dict[str, Any], parent_run_id: str, study_name: str, trial_number: int) -> dict[str, Any]:
    """The trial's train document: `train_doc` (unchanged) with its run nested under
    `parent_run_id`, tagged with the study and trial, and named like the trial's job."""
    doc = copy.deepcopy(train_doc)
    tracking = dict(doc.get("tracking") or {})
    tracking["parent_run_id"] = parent_run_id
    tracking["tags"] = {
        **(tracking.get("tags") or {}),
        STUDY_TAG: study_name,
        TRIAL_TAG: str(trial_number),
    }
    # Every trial's run would otherwise carry the base spec's one run name.
    tracking["run_name"] = f"{study_name}-t{trial_number}"
    doc["tracking"] = tracking
    return doc


__all__ = ["PARENT_RUN_ATTR", "STUDY_TAG", "TRIAL_TAG", "nest", "study_parent_run"]
