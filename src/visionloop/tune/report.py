"""What a study did, for `visionloop tune show` and `visionloop tune best`.

    report = study_report(study, client)          # trials, rungs, cost, best, importances
    written = write_plots(study, Path("plots"))   # optimization history, parallel coordinates, ...
    best = best_trial(study, client, settings)    # its params, value, job and run directory
    best, version = register_best(study, "digits-cnn", client, settings)

The study (Optuna, in the control plane's database) knows each trial's parameters, values and
job id; the control plane knows each job's run directory and its cost (`GET /v1/jobs/{id}`).
Without a control plane everything but cost is still reported, and says why cost is missing;
a run directory is then found through the trial's MLflow run (tagged with its study and trial
by `visionloop.tune.tracking.nest`).
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from visionloop.core.errors import NotFoundError, VisionloopError
from visionloop.core.settings import Settings
from visionloop.tune.space_checks import rung_epochs as spec_rung_epochs
from visionloop.tune.study import METRIC_ATTR, TUNE_ATTR
from visionloop.tune.tracking import PARENT_RUN_ATTR, STUDY_TAG, TRIAL_TAG
from visionloop.tune.tuner import END_ATTR, JOB_ATTR

if TYPE_CHECKING:
    from visionloop.registry import ModelVersionInfo

log = logging.getLogger(__name__)

MIN_TRIALS_FOR_IMPORTANCE = 2
PLOTS = ("optimization_history", "parallel_coordinate", "intermediate_values")


class JobLookup(Protocol):
    """What a report needs of the control plane (visionloop.api.client.Client has it)."""

    def job(self, job_id: int) -> dict[str, Any]: ...


@dataclass(frozen=True)
class TrialRow:
    number: int
    state: str  # complete, pruned, fail, running, waiting
    params: dict[str, Any]
    intermediate: dict[int, float]  # the objective by step (epochs completed)
    rungs: dict[int, float]  # the objective at each rung (epoch) of the pruner it reached
    value: float | None
    job_id: int | None
    end: str | None  # how it ended, as the tuner recorded it
    job_state: str | None = None
    run_dir: str | None = None
    gpu_hours: float | None = None  # None: the control plane was not asked or did not answer
    cost: float | None = None


@dataclass(frozen=True)
class StudyReport:
    study: str
    metric: str
    direction: str  # maximize or minimize
    trials: list[TrialRow]
    best: TrialRow | None
    importances: dict[str, float]  # parameter -> share of the objective's variation, summing to 1
    importances_note: str | None  # why there are none
    cost_note: str | None  # why cost is missing (control plane not reachable, ...)
    currency: str | None
    gpu_hours: float | None  # over the trials whose cost is known
    cost: float | None
    unpriced: list[str] = field(default_factory=list)  # GPU types the price catalog lacks
    parent_run_id: str | None = None

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.trials:
            out[t.state] = out.get(t.state, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready document (steps and rungs become string keys)."""
        doc = asdict(self)
        doc["counts"] = self.counts
        return doc


@dataclass(frozen=True)
class BestTrial:
    study: str
    metric: str
    number: int
    params: dict[str, Any]
    value: float
    job_id: int | None
    run_dir: str | None
    mlflow_run_id: str | None
    run_dir_note: str | None = None  # why run_dir is unknown

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- show


def rung_epochs(study: optuna.Study) -> list[int]:
    """The epochs at which the study's pruner judges trials: min_epochs × reduction_factor^k
    below its max epochs (successive halving, and Hyperband's first bracket); none for the
    median pruner or none."""
    tune = study.user_attrs.get(TUNE_ATTR) or {}
    pruner = tune.get("pruner") or {}
    if pruner.get("name") not in ("asha", "hyperband"):
        return []
    top = pruner.get("max_epochs") or (tune.get("train") or {}).get("epochs")
    lo, factor = int(pruner.get("min_epochs") or 1), int(pruner.get("reduction_factor") or 3)
    if not isinstance(top, int) or factor < 2:
        return []
    # The spec's own rungs (where trials pause), which stop before the last epoch.
    return spec_rung_epochs(lo, factor, top, str(pruner["name"]))


def _row(trial: FrozenTrial, rungs: list[int]) -> TrialRow:
    job = trial.user_attrs.get(JOB_ATTR)
    end = trial.user_attrs.get(END_ATTR)
    return TrialRow(
        number=trial.number,
        state=trial.state.name.lower(),
        params=dict(trial.params),
        intermediate={int(k): float(v) for k, v in sorted(trial.intermediate_values.items())},
        rungs={e: float(trial.intermediate_values[e]) for e in rungs if e in trial.intermediate_values},
        value=trial.value if trial.state == TrialState.COMPLETE else None,
        job_id=int(job) if job is not None else None,
        end=str(end) if end is not None else None,
    )


def _best(study: optuna.Study) -> FrozenTrial | None:
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return None
    return study.best_trial


def importances(study: optuna.Study) -> tuple[dict[str, float], str | None]:
    """Optuna's parameter importances over the complete trials, or none and why."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < MIN_TRIALS_FOR_IMPORTANCE:
        return {}, (
            f"parameter importances need at least {MIN_TRIALS_FOR_IMPORTANCE} complete trials; "
            f"this study has {len(complete)}."
        )
    try:
        found = optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError) as e:  # e.g. every complete trial has the same parameters
        return {}, f"parameter importances could not be computed: {e}"
    return {k: float(v) for k, v in found.items()}, None


def study_report(
    study: optuna.Study, jobs: JobLookup | None, *, no_jobs_reason: str | None = None
) -> StudyReport:
    """Every trial of `study` with its job's run directory and cost from `jobs` (None: no
    control plane; `no_jobs_reason` says why, and the report shows no cost)."""
    rungs = rung_epochs(study)
    rows = [_row(t, rungs) for t in study.get_trials(deepcopy=False)]
    cost_note = no_jobs_reason
    currency: str | None = None
    unpriced: set[str] = set()
    missing: list[int] = []
    if jobs is not None:
        answered: list[TrialRow] = []
        for i, row in enumerate(rows):
            if row.job_id is None:
                answered.append(row)
                continue
            try:
                answer = jobs.job(row.job_id)
            except NotFoundError:
                missing.append(row.job_id)
                answered.append(row)
                continue
            except VisionloopError as e:  # unreachable, timed out, refused: no cost for any trial
                cost_note = f"the control plane did not answer: {e}"
                answered.extend(rows[i:])
                break
            total = (answer.get("cost") or {}).get("total") or {}
            currency = (answer.get("cost") or {}).get("currency") or currency
            unpriced.update((answer.get("cost") or {}).get("unpriced") or [])
            job = answer.get("job") or {}
            answered.append(
                _with_job(row, job, float(total.get("gpu_hours", 0.0)), float(total.get("cost", 0.0)))
            )
        rows = answered
        if missing and cost_note is None:
            cost_note = (
                f"the control plane has no job {', '.join(map(str, missing))}: no cost for those trials."
            )
    known = [r for r in rows if r.gpu_hours is not None]
    best_frozen = _best(study)
    best = next((r for r in rows if best_frozen is not None and r.number == best_frozen.number), None)
    imp, imp_note = importances(study)
    parent = study.user_attrs.get(PARENT_RUN_ATTR)
    return StudyReport(
        study=study.study_name,
        metric=str(study.user_attrs.get(METRIC_ATTR, "value")),
        direction=study.direction.name.lower(),
        trials=rows,
        best=best,
        importances=imp,
        importances_note=imp_note,
        cost_note=cost_note,
        currency=currency,
        gpu_hours=sum(r.gpu_hours or 0.0 for r in known) if known else None,
        cost=sum(r.cost or 0.0 for r in known) if known else None,
        unpriced=sorted(unpriced),
        parent_run_id=parent if isinstance(parent, str) else None,
    )


def _with_job(row: TrialRow, job: dict[str, Any], gpu_hours: float, cost: float) -> TrialRow:
    run_dir = job.get("run_dir")
    state = job.get("state")
    return replace(
        row,
        job_state=str(state) if state is not None else None,
        run_dir=str(run_dir) if run_dir else None,
        gpu_hours=gpu_hours,
        cost=cost,
    )


# --------------------------------------------------------------------------- plots


@dataclass(frozen=True)
class Plots:
    written: dict[str, Path]  # plot name -> PNG
    skipped: dict[str, str]  # plot name -> why


def write_plots(study: optuna.Study, out_dir: Path) -> Plots:
    """PNGs of the optimization history, the parallel coordinates of the parameters and the
    intermediate values, drawn by Optuna (matplotlib, Agg). A plot with nothing to draw yet is
    skipped, with the reason."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        # No display needed. A caller that already drew with pyplot keeps its own backend.
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.exceptions import ExperimentalWarning
    from optuna.visualization import matplotlib as ovm

    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    skipped: dict[str, str] = {}
    if not complete:
        skipped["optimization_history"] = "no complete trial yet"
        skipped["parallel_coordinate"] = "no complete trial yet"
    elif not any(t.params for t in complete):
        skipped["parallel_coordinate"] = "the complete trials have no parameters"
    if not any(t.intermediate_values for t in trials):
        skipped["intermediate_values"] = "no trial has reported an intermediate value yet"
    draw: dict[str, Callable[[optuna.Study], Any]] = {
        "optimization_history": ovm.plot_optimization_history,
        "parallel_coordinate": ovm.plot_parallel_coordinate,
        "intermediate_values": ovm.plot_intermediate_values,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for name in PLOTS:
        if name in skipped:
            continue
        path = out_dir / f"{study.study_name}-{name}.png"
        with warnings.catch_warnings():
            # Optuna marks its matplotlib plots experimental; that warning says nothing to a user.
            warnings.simplefilter("ignore", ExperimentalWarning)
            ax = draw[name](study)
        fig = _figure(ax)
        try:
            fig.savefig(path, dpi=100, bbox_inches="tight")
        finally:
            plt.close(fig)
        written[name] = path
    return Plots(written=written, skipped=skipped)


def _figure(ax: Any) -> Any:
    """The figure an Optuna plot drew on (it returns one Axes, or an array of them)."""
    first = ax.flat[0] if hasattr(ax, "flat") else ax
    return first.get_figure()


# --------------------------------------------------------------------------- best


def best_trial(
    study: optuna.Study, jobs: JobLookup | None, settings: Settings, *, no_jobs_reason: str | None = None
) -> BestTrial:
    """The best complete trial and where its model is: its job's run directory (from the
    control plane; without one, from the trial's MLflow run). NotFoundError when no trial
    has completed yet. `no_jobs_reason`: why `jobs` is None."""
    best = _best(study)
    metric = str(study.user_attrs.get(METRIC_ATTR, "value"))
    if best is None:
        counts: dict[str, int] = {}
        for t in study.get_trials(deepcopy=False):
            counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
        have = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no trials"
        raise NotFoundError(
            f"study {study.study_name!r} has no complete trial yet ({have}); let `visionloop tune run` "
            "finish a trial, then ask again."
        )
    job = best.user_attrs.get(JOB_ATTR)
    job_id = int(job) if job is not None else None
    run_dir: str | None = None
    note = no_jobs_reason if jobs is None else None
    if jobs is not None and job_id is not None:
        try:
            found = (jobs.job(job_id).get("job") or {}).get("run_dir")
            run_dir = str(found) if found else None
        except VisionloopError as e:
            note = f"the control plane did not say ({e})"
    elif job_id is None:
        note = "the trial has no job"
    run_id = None
    mlflow_dir, mlflow_note = _run_from_mlflow(settings, study.study_name, best.number)
    if mlflow_dir is not None:
        run_id, found_dir = mlflow_dir
        run_dir = run_dir or found_dir
    if run_dir is None:
        note = "; ".join(n for n in (note, mlflow_note) if n) or None
    else:
        note = None
    assert best.value is not None  # a COMPLETE trial has a value
    return BestTrial(
        study=study.study_name,
        metric=metric,
        number=best.number,
        params=dict(best.params),
        value=float(best.value),
        job_id=job_id,
        run_dir=run_dir,
        mlflow_run_id=run_id,
        run_dir_note=note,
    )


def _run_from_mlflow(
    settings: Settings, study_name: str, number: int
) -> tuple[tuple[str, str | None] | None, str | None]:
    """(run id, run dir) of the trial's MLflow run, found by its study and trial tags."""
    from visionloop.track import store

    if not store.store_exists(settings):
        return None, "the tracking store has no runs"
    try:
        client = store.client(settings)
        runs = store.search_all(
            client,
            f"tags.`{STUDY_TAG}` = {store.quote_filter_value(study_name)} "
            f"and tags.`{TRIAL_TAG}` = '{number}'",
            max_results=10,
        )
    except VisionloopError as e:
        return None, str(e)
    except Exception as e:  # the tracking store is optional here: the control plane may know
        return None, f"the tracking store could not be searched: {e}"
    active = [r for r in runs if r.info.lifecycle_stage != "deleted"]
    if not active:
        return None, f"no MLflow run is tagged {STUDY_TAG}={study_name}, {TRIAL_TAG}={number}"
    run = min(active, key=lambda r: r.info.start_time or 0)
    return (str(run.info.run_id), run.data.tags.get(store.RUN_DIR_TAG)), None


def register_best(
    study: optuna.Study,
    name: str,
    jobs: JobLookup | None,
    settings: Settings,
    *,
    no_jobs_reason: str | None = None,
) -> tuple[BestTrial, ModelVersionInfo]:
    """Register the best trial's model as a new version of `name` in the model registry,
    as `visionloop models register` does for a run (lineage: the trial's run directory and
    MLflow run)."""
    from visionloop.registry import UnfinishedRunError, register
    from visionloop.registry.layout import check_name

    check_name(name)  # before anything slow: a bad name fails at once
    best = best_trial(study, jobs, settings, no_jobs_reason=no_jobs_reason)
    where = f"trial {best.number} of study {best.study!r}" + (f" (job {best.job_id})" if best.job_id else "")
    if best.run_dir is None:
        raise NotFoundError(
            f"cannot find the run directory of {where}: {best.run_dir_note}. Start the control plane "
            "(`visionloop up --detach`) so that it can say where the job ran, then register again."
        )
    if not Path(best.run_dir).is_dir():
        raise NotFoundError(
            f"the run directory of {where}, {best.run_dir}, is not on this machine; register it from "
            "the machine that holds it (`visionloop models register RUN_DIR --name NAME`)."
        )
    try:
        version = register(best.run_dir, name=name, settings=settings)
    except UnfinishedRunError as e:
        raise UnfinishedRunError(f"cannot register {where}: {e}") from e
    return best, version


def fmt_value(v: Any) -> str:
    """A number as a table shows it (4 significant digits)."""
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


__all__ = [
    "BestTrial",
    "JobLookup",
    "Plots",
    "StudyReport",
    "TrialRow",
    "best_trial",
    "fmt_value",
    "importances",
    "register_best",
    "rung_epochs",
    "study_report",
    "write_plots",
]
