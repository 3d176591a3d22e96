"""`visionloop runs ...`: list and show runs from the tracking store."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import out, print_wide

app = typer.Typer(help="List and inspect training runs recorded in the tracking store.", no_args_is_help=True)

_STATUS_STYLE = {"RUNNING": "yellow", "FINISHED": "green", "FAILED": "red", "KILLED": "magenta"}
# Shown in the header of `runs show`; the tags table lists the rest.
_HEADER_TAGS = (
    "visionloop.dataset_version",
    "visionloop.git.commit",
    "visionloop.git.dirty",
    "visionloop.run_dir",
    "visionloop.attempts",
    "visionloop.metrics_dropped",
)


def _when(dt: datetime | None) -> str:
    return dt.astimezone().strftime("%Y-%m-%d %H:%M:%S") if dt else "-"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def _status(status: str) -> str:
    style = _STATUS_STYLE.get(status)
    return f"[{style}]{status}[/]" if style else status


def _num(value: float) -> str:
    return f"{value:.6g}"


def _e(value: str | None) -> str:
    # Names, tags, params and paths are whatever a run was given: "[/]" in one is text to
    # show, not Rich markup (unescaped, it crashed the whole listing with a MarkupError).
    return escape(value) if value else "-"


def _echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, ensure_ascii=False))


@app.command("list")
def list_cmd(
    experiment: str | None = typer.Option(None, "--experiment", "-e", help="Only runs of this experiment."),
    status: str | None = typer.Option(
        None, "--status", "-s", help="Only runs in this state: RUNNING, FINISHED, FAILED, KILLED."
    ),
    limit: int = typer.Option(50, "--limit", "-n", help="Show at most this many runs (newest first)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List runs, newest first."""
    from visionloop.core.settings import load_settings
    from visionloop.track.query import list_runs

    settings = load_settings()
    runs = list_runs(settings, experiment=experiment, status=status, limit=limit)
    if as_json:
        _echo_json([r.to_json() for r in runs])
        return
    if not runs:
        if experiment or status:
            out.print("No runs match these filters. Drop --experiment/--status to see every run.")
        else:
            out.print(
                f"No runs yet in {settings.tracking_uri}. Start one with `visionloop train SPEC.yaml` "
                "(or try `visionloop demo`)."
            )
        return
    table = Table(title=f"Runs in {settings.tracking_uri}", title_justify="left")
    for name, kw in (
        ("id", {"no_wrap": True}),
        ("name", {}),
        ("experiment", {}),
        ("status", {"no_wrap": True}),
        ("started", {"no_wrap": True}),
        ("duration", {"justify": "right", "no_wrap": True}),
        ("step", {"justify": "right"}),
        ("val metric", {"justify": "right"}),
        ("dataset", {}),
        ("run dir", {"overflow": "fold"}),
    ):
        table.add_column(name, **kw)
    for r in runs:
        table.add_row(
            r.run_id[:8],
            _e(r.name),
            _e(r.experiment),
            _status(r.status),
            _when(r.start_time),
            _duration(r.duration_s),
            str(r.last_step) if r.last_step is not None else "-",
            f"{_e(r.primary_metric)} {r.primary_value:.4f}" if r.primary_value is not None else "-",
            _e(r.dataset_version),
            _e(r.run_dir),
        )
    print_wide(table)


@app.command("show")
def show_cmd(
    run: str = typer.Argument(
        ..., help="Run id, unique id prefix (6+ characters), run name or run directory."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """Show one run: status, times, tags, params, latest metrics, artifacts."""
    from visionloop.core.settings import load_settings
    from visionloop.track.query import describe_run

    d = describe_run(load_settings(), run)
    if as_json:
        _echo_json(d.to_json())
        return
    s = d.summary
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column(overflow="fold")
    head.add_row("run", f"{_e(s.name)}  ({_e(s.run_id)})")
    head.add_row("experiment", f"{_e(s.experiment)} (id {_e(d.experiment_id)})")
    head.add_row("status", _status(s.status))
    head.add_row("started", _when(s.start_time))
    head.add_row("ended", _when(s.end_time) if s.status != "RUNNING" else "-")
    head.add_row("duration", _duration(s.duration_s))
    head.add_row("last step", str(s.last_step) if s.last_step is not None else "-")
    head.add_row("dataset", _e(s.dataset_version))
    dirty = d.tags.get("visionloop.git.dirty") == "true"
    head.add_row("git commit", _e(d.git_commit) + (" (uncommitted changes)" if dirty else ""))
    head.add_row("run dir", _e(s.run_dir))
    head.add_row("attempts", str(d.attempts) if d.attempts is not None else "-")
    if d.metrics_dropped:
        head.add_row("dropped", f"[red]{d.metrics_dropped} metric values were not stored[/]")
    head.add_row("artifacts", _e(d.artifact_uri))
    print_wide(head)

    other_tags = {k: v for k, v in d.tags.items() if k not in _HEADER_TAGS and not k.startswith("mlflow.")}
    for title, rows in (("Params", d.params), ("Tags", other_tags)):
        if rows:
            t = Table(title=f"{title} ({len(rows)})", title_justify="left")
            t.add_column("key", overflow="fold")
            t.add_column("value", overflow="fold")
            for k, v in rows.items():
                t.add_row(escape(k), escape(v))
            print_wide(t)

    if d.metrics:
        t = Table(title=f"Metrics, latest value ({len(d.metrics)})", title_justify="left")
        t.add_column("key", overflow="fold")
        t.add_column("value", justify="right")
        t.add_column("step", justify="right")
        for m in d.metrics:
            t.add_row(escape(m.key), _num(m.value), str(m.step))
        print_wide(t)
    else:
        out.print("No metrics logged.")

    if d.artifacts:
        more = "+" if d.artifacts_truncated else ""
        t = Table(title=f"Artifacts ({len(d.artifacts)}{more})", title_justify="left")
        t.add_column("path", overflow="fold")
        t.add_column("size", justify="right")
        for a in d.artifacts:
            t.add_row(escape(a.path), f"{a.size:,} B" if a.size is not None else "-")
        print_wide(t)
    else:
        out.print("No artifacts.")
    out.print(f"\nOpen the MLflow UI on this store:\n  {escape(d.ui_command)}", soft_wrap=True)
