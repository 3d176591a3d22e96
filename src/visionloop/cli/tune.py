"""`visionloop tune run TUNE.yaml` and `visionloop tune show STUDY`: hyperparameter search whose
trials are queue jobs (visionloop.tune.tuner), its study kept in the control plane's database."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from visionloop.cli.console import err, print_wide

app = typer.Typer(
    help="Hyperparameter search: every trial is a job in the queue, the study is in its database.",
    no_args_is_help=True,
)

_DB_HELP = (
    "The control plane's database (default: VISIONLOOP_DB_URL, else sqlite:///<home>/state.db); "
    "one with a password goes in VISIONLOOP_DB_URL or --db-url-file."
)
_DB_FILE_HELP = "A file only you can read holding the database URL (as for `visionloop up`)."


def _db_url(db: str | None, db_url_file: Path | None) -> str | None:
    from visionloop.api.server import resolve_db_url

    return resolve_db_url(db, db_url_file)


@app.command("run")
def run(
    spec: Path = typer.Argument(..., help="The tune spec (YAML): train spec, space, objective, trials, ..."),
    db: str | None = typer.Option(None, "--db", help=_DB_HELP),
    db_url_file: Path | None = typer.Option(None, "--db-url-file", help=_DB_FILE_HELP),
    poll_s: float = typer.Option(2.0, "--poll", help="Seconds between looks at the queue.", min=0.05),
) -> None:
    """Run a study in the foreground until it has `trials` finished trials.

    Each trial is submitted as a job to the running control plane (`visionloop up`; its URL
    and token as for `visionloop submit`), stopped early through the queue when the pruner
    says so, and told to the study when its job ends. Safe to stop (Ctrl-C, or even SIGKILL)
    and run again with the same spec: it continues the study, never repeats a trial and
    ends with exactly `trials` finished ones. The tuner must run where the control plane's
    home is (it reads the trials' evaluations from its job folders).
    """
    from visionloop.api.client import Client
    from visionloop.core.settings import load_settings
    from visionloop.tune.spec import load_tune_spec
    from visionloop.tune.study import create_or_load
    from visionloop.tune.tuner import Progress, Tuner

    settings = load_settings()
    tune_spec, _ = load_tune_spec(spec)
    if tune_spec.budget is not None:
        # Refused rather than ignored: a study told to stop at a budget must not spend past it.
        err.print(
            f"[red]error:[/] {spec}: `budget` is not enforced by this version of `visionloop tune run` "
            f"(the study would run all {tune_spec.trials} trials whatever they cost). Remove `budget` "
            "and bound the study with `trials` instead."
        )
        raise typer.Exit(2)
    study = create_or_load(tune_spec, _db_url(db, db_url_file))
    last: list[Progress] = []

    def on_pass(p: Progress) -> None:
        if not last or last[-1] != p:
            err.print(
                f"study {study.study_name}: {p.finished}/{tune_spec.trials} finished, {p.running} running"
            )
        last[:] = [p]

    with Client.from_settings(settings) as client:
        tuner = Tuner(tune_spec, study, client, settings.home / "jobs")
        try:
            tuner.run(poll_s=poll_s, on_pass=on_pass)
        except KeyboardInterrupt:
            err.print("stopped; the trials' jobs go on. Run the same command again to continue the study.")
            raise typer.Exit(130) from None
    _print_best(study)


def _print_best(study: Any) -> None:
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not done:
        err.print("no trial completed")
        return
    best = study.best_trial
    err.print(f"best: trial {best.number} ({best.value:.6g}) {json.dumps(best.params)}")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


@app.command("show")
def show(
    study_name: str = typer.Argument(..., metavar="STUDY", help="The study's name (the tune spec's `name`)."),
    db: str | None = typer.Option(None, "--db", help=_DB_HELP),
    db_url_file: Path | None = typer.Option(None, "--db-url-file", help=_DB_FILE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the trials as JSON."),
) -> None:
    """The trials of a study: parameters, state, the value at each epoch, the final value and
    the job that ran it; then the best trial."""
    from optuna.trial import TrialState

    from visionloop.tune.study import METRIC_ATTR, load
    from visionloop.tune.tuner import END_ATTR, JOB_ATTR

    study = load(study_name, _db_url(db, db_url_file))
    trials = study.get_trials(deepcopy=False)
    rows: list[dict[str, Any]] = [
        {
            "number": t.number,
            "state": t.state.name.lower(),
            "params": t.params,
            "intermediate": {int(k): v for k, v in sorted(t.intermediate_values.items())},
            "value": t.value,
            "job_id": t.user_attrs.get(JOB_ATTR),
            "end": t.user_attrs.get(END_ATTR),
        }
        for t in trials
    ]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = study.best_trial.number if complete else None
    if as_json:
        typer.echo(json.dumps({"study": study_name, "best": best, "trials": rows}, indent=2))
        return
    metric = study.user_attrs.get(METRIC_ATTR, "value")
    table = Table(title=f"study {study_name}: {metric} ({study.direction.name.lower()})")
    for col in ("#", "state", "params", f"{metric} by epoch", "final", "job"):
        table.add_column(col)
    for r in rows:
        by_epoch = " ".join(f"{k}:{_fmt(v)}" for k, v in r["intermediate"].items())
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in r["params"].items())
        mark = " *" if r["number"] == best else ""
        value = "-" if r["value"] is None else _fmt(r["value"])
        table.add_row(
            f"{r['number']}{mark}", r["state"], params, by_epoch or "-", value, str(r["job_id"] or "-")
        )
    print_wide(table)
    if best is None:
        err.print("no trial completed yet")
    else:
        b = study.best_trial
        err.print(f"best: trial {b.number} ({metric} {_fmt(b.value)}), job {b.user_attrs.get(JOB_ATTR)}")
