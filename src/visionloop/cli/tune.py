"""`visionloop tune run TUNE.yaml`, `tune show STUDY` and `tune best STUDY`: hyperparameter search
whose trials are queue jobs (visionloop.tune.tuner), its study kept in the control plane's
database; what `show` and `best` say comes from visionloop.tune.report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import err, out, print_wide

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
    """Run a study in the foreground until it has `trials` finished trials (or its budget is spent).

    Each trial is submitted as a job to the running control plane (`visionloop up`; its URL
    and token as for `visionloop submit`). It pauses at each rung of the pruner through a
    checkpoint, freeing its GPUs; with asha's promotion (the default) it goes on from there
    when it is among the best of its rung, otherwise it is pruned when the study ends. Safe
    to stop (Ctrl-C, or even SIGKILL) and run again with the same spec: it continues the
    study, never repeats a trial and ends with exactly `trials` finished ones. With a
    `budget` (GPU-hours, USD from the price catalog), no trial starts or is promoted once it
    is spent. The tuner reads the trials' evaluations through the control plane's API, so
    it may run on any machine that reaches it; the study lives in the control plane's
    database (--db, or the default in this home).
    """
    from visionloop.api.client import Client
    from visionloop.core.settings import load_settings
    from visionloop.tune.spec import load_tune_spec
    from visionloop.tune.study import create_or_load
    from visionloop.tune.tuner import QUEUE_FULL_WAIT_S, Progress, Tuner

    settings = load_settings()
    tune_spec, _ = load_tune_spec(spec)
    # The control plane first: a study is not made for a tuner that cannot submit its trials.
    client = Client.from_settings(settings)
    study = create_or_load(tune_spec, _db_url(db, db_url_file))
    shown: dict[str, str] = {}

    def on_pass(p: Progress) -> None:
        paused = f", {p.paused} paused at a rung" if p.paused else ""
        spent = f", {p.gpu_hours:.2f} GPU-h, {p.usd:.2f} USD" if p.gpu_hours or p.usd else ""
        done = f"{p.finished}/{tune_spec.trials} finished"
        line = f"study {study.study_name}: {done}, {p.running} running{paused}{spent}"
        # Compared as printed: the GPU-hours of running trials change every pass.
        if line != shown.get("line"):
            err.print(line)
        if p.stopped and p.stopped != shown.get("stopped"):
            err.print(f"no new trial starts: {p.stopped}")
        shown.update(line=line, stopped=p.stopped or "", away="", full="")

    def on_unreachable(why: str) -> None:
        if not shown.get("away"):  # once per outage
            err.print(f"{escape(why)} Waiting for it; the study goes on when it answers (Ctrl-C stops).")
        shown["away"] = "yes"

    def on_queue_full(why: str) -> None:
        if not shown.get("full"):  # once until a pass goes through
            err.print(f"{escape(why)} The study tries again every {QUEUE_FULL_WAIT_S:.0f} s (Ctrl-C stops).")
        shown["full"] = "yes"

    with client:
        tuner = Tuner(tune_spec, study, client)
        try:
            tuner.run(
                poll_s=poll_s, on_pass=on_pass, on_unreachable=on_unreachable, on_queue_full=on_queue_full
            )
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


def _jobs(settings: Any) -> tuple[Any, str | None]:
    """A client of the control plane, or None and why (cost then goes unshown)."""
    from visionloop.api.client import Client
    from visionloop.core.errors import ConfigError

    try:
        return Client.from_settings(settings), None
    except ConfigError as e:
        return None, f"the control plane is not reachable: {e}"


@app.command("show")
def show(
    study_name: str = typer.Argument(..., metavar="STUDY", help="The study's name (the tune spec's `name`)."),
    db: str | None = typer.Option(None, "--db", help=_DB_HELP),
    db_url_file: Path | None = typer.Option(None, "--db-url-file", help=_DB_FILE_HELP),
    plots: Path | None = typer.Option(
        None,
        "--plots",
        help="Write PNG plots here: optimization history, parallel coordinates, intermediate values.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """The trials of a study, its best trial and its parameters' importances.

    Per trial: parameters, state, the objective at each epoch and rung, the final value, the job that ran it with its GPU-hours and cost (from the control plane, when it is reachable).
    """  # noqa: E501 (one line per paragraph: Rich keeps the line breaks of a help text)
    from visionloop.core.settings import load_settings
    from visionloop.tune.report import study_report, write_plots
    from visionloop.tune.study import load

    study = load(study_name, _db_url(db, db_url_file))
    client, why = _jobs(load_settings())
    try:
        report = study_report(study, client, no_jobs_reason=why)
    finally:
        if client is not None:
            client.close()
    written = write_plots(study, plots) if plots is not None else None
    if as_json:
        doc = report.to_json()
        if written is not None:
            doc["plots"] = {k: str(v) for k, v in written.written.items()}
            doc["plots_skipped"] = written.skipped
        typer.echo(json.dumps(doc, indent=2))
        return
    _print_report(report)
    if written is not None:
        for name, path in written.written.items():
            out.print(f"plot {name}: {path}")
        for name, reason in written.skipped.items():
            err.print(f"plot {name} not written: {reason}")


def _print_report(report: Any) -> None:
    from visionloop.tune.report import fmt_value as f

    money = report.cost_note is None or any(t.gpu_hours is not None for t in report.trials)
    table = Table(title=f"study {report.study}: {report.metric} ({report.direction})")
    columns = ["#", "state", "params", f"{report.metric} by epoch", "at rungs", "final", "job"]
    if money:
        columns += ["GPU-h", f"cost ({report.currency or 'USD'})"]
    for col in columns:
        table.add_column(col)
    best = report.best.number if report.best is not None else None
    for t in report.trials:
        cells = [
            f"{t.number}{' *' if t.number == best else ''}",
            t.state if t.state != "running" or not t.job_state else f"running (job {t.job_state})",
            ", ".join(f"{k}={f(v)}" for k, v in t.params.items()),
            " ".join(f"{k}:{f(v)}" for k, v in t.intermediate.items()) or "-",
            " ".join(f"{k}:{f(v)}" for k, v in t.rungs.items()) or "-",
            "-" if t.value is None else f(t.value),
            str(t.job_id if t.job_id is not None else "-"),
        ]
        if money:
            cells += [
                "-" if t.gpu_hours is None else f"{t.gpu_hours:.4f}",
                "-" if t.cost is None else f"{t.cost:.4f}",
            ]
        table.add_row(*cells)
    print_wide(table)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(report.counts.items())) or "no trials"
    out.print(f"trials: {counts}")
    if report.gpu_hours is not None:
        out.print(f"total: {report.gpu_hours:.4f} GPU-hours, {report.cost:.4f} {report.currency or 'USD'}")
    if report.unpriced:
        err.print(f"no price in the catalog for {', '.join(report.unpriced)}: counted at no cost")
    if report.cost_note is not None:
        err.print(f"no cost shown: {report.cost_note}", soft_wrap=True)
    if report.best is None:
        out.print("best: no trial completed yet")
    else:
        b = report.best
        params = ", ".join(f"{k}={f(v)}" for k, v in b.params.items())
        out.print(f"best: trial {b.number} ({report.metric} {f(b.value)}), job {b.job_id or '-'}: {params}")
    if report.importances:
        shown = ", ".join(f"{k} {v:.2f}" for k, v in report.importances.items())
        out.print(f"parameter importances: {shown}")
    else:
        out.print(report.importances_note)
    if report.parent_run_id:
        out.print(f"MLflow parent run: {report.parent_run_id}")


@app.command("best")
def best(
    study_name: str = typer.Argument(..., metavar="STUDY", help="The study's name (the tune spec's `name`)."),
    register: str | None = typer.Option(
        None, "--register", metavar="NAME", help="Register its model as a new version of model NAME."
    ),
    db: str | None = typer.Option(None, "--db", help=_DB_HELP),
    db_url_file: Path | None = typer.Option(None, "--db-url-file", help=_DB_FILE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """The best complete trial: its parameters, value, job and run directory.

    With --register NAME, its final model becomes a new version of NAME in the model registry (as `visionloop models register` does for a run).
    """  # noqa: E501 (one line per paragraph: Rich keeps the line breaks of a help text)
    from visionloop.core.settings import load_settings
    from visionloop.registry.layout import check_name
    from visionloop.tune.report import best_trial, fmt_value, register_best
    from visionloop.tune.study import load

    if register is not None:
        check_name(register)  # a bad name fails before the study is even opened
    settings = load_settings()
    study = load(study_name, _db_url(db, db_url_file))
    client, why = _jobs(settings)
    try:
        if register is None:
            b, version = best_trial(study, client, settings, no_jobs_reason=why), None
        else:
            b, version = register_best(study, register, client, settings, no_jobs_reason=why)
    finally:
        if client is not None:
            client.close()
    if as_json:
        doc = b.to_json()
        if version is not None:
            doc["registered"] = {"name": version.name, "version": version.version, "dir": str(version.dir)}
        typer.echo(json.dumps(doc, indent=2))
        return
    out.print(f"best: trial {b.number} of study {b.study}: {b.metric} {fmt_value(b.value)}")
    for k, v in b.params.items():
        out.print(f"  {k} = {fmt_value(v)}")
    out.print(f"  job          {b.job_id if b.job_id is not None else '-'}")
    out.print(f"  run dir      {b.run_dir or '-'}")
    out.print(f"  MLflow run   {b.mlflow_run_id or '-'}")
    if b.run_dir is None and b.run_dir_note:
        err.print(f"run directory unknown: {b.run_dir_note}")
    if version is not None:
        out.print(f"registered [bold]{version.name}/{version.version}[/] ({version.dir})")
        out.print(f"  next         visionloop models alias {version.name} {version.version} champion")
