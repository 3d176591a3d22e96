"""The control plane from the command line: `up`, `down`, `submit`, `jobs ...` (`admin ...`
and `cost ...` are in queue_admin.py). Every command except `up`/`down` is a thin client of
the HTTP API."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from visionloop.cli.console import err, print_wide
from visionloop.cli.runs import _duration
from visionloop.core.durations import format_duration

jobs_app = typer.Typer(help="List, inspect, follow and cancel queued and running jobs.", no_args_is_help=True)

_STATE_STYLE = {
    "queued": "cyan",
    "running": "yellow",
    "preempting": "magenta",
    "cancelling": "magenta",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "dim",
    "paused": "blue",  # a tuning trial at a rung, waiting for its study
    "pruned": "dim",
}


def _client() -> Any:
    from visionloop.api.client import Client
    from visionloop.core.settings import load_settings

    return Client.from_settings(load_settings())


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _state(s: str) -> str:
    style = _STATE_STYLE.get(s)
    return f"[{style}]{s}[/]" if style else s


def _pace(j: dict[str, Any]) -> str:
    """A running job's pace and expected end (as `squeue` gives a time left), from what its
    trainer last reported; "" when it has not in this attempt."""
    end = j.get("expected_end")
    if end is None or j.get("pace_total") is None:
        return ""
    left = max(0.0, float(end) - time.time())
    return (
        f"step {j['pace_step']:,} of {j['pace_total']:,} at {j['pace_rate']:.3g} steps/s; "
        f"expected end {_when(end)} (in {_duration(left)})"
    )


def _planned_end(planned: dict[str, Any] | None) -> str:
    """A running job without a pace yet: the end reservations plan with (the API's
    `planned_end`: from its max runtime, else its history)."""
    if planned is None:
        return "no pace reported yet in this attempt"
    by = "its max runtime" if planned["by"] == "max_runtime" else "its history"
    return f"no pace reported yet in this attempt; planned end {_when(float(planned['at']))} by {by}"


def _money(x: float, currency: str = "USD") -> str:
    return f"{x:,.2f} {currency}"


# --------------------------------------------------------------------------- up / down


def up(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8765, help="Port to listen on."),
    config: Path | None = typer.Option(
        None,
        "--config",
        "-c",
        help="Cluster config (executor: local, Ray or Slurm; teams, quotas, inventory, prices). "
        "Default: <home>/cluster.toml.",
    ),
    db: str | None = typer.Option(
        None,
        "--db",
        help="Job store URL without a password (default sqlite:///<home>/state.db); "
        "one with a password goes in VISIONLOOP_DB_URL or --db-url-file.",
    ),
    db_url_file: Path | None = typer.Option(
        None,
        "--db-url-file",
        help="A file only you can read holding the job store URL, e.g. postgresql+psycopg://u:PASSWORD@host/db.",
    ),
    detach: bool = typer.Option(
        False, "--detach", "-d", help="Run in the background; `visionloop down` stops it."
    ),
) -> None:
    """Start the control plane: HTTP API, scheduler and executor.

    Jobs run as local processes by default; to run them on an existing Ray cluster, put
    `\\[executor]` with `kind = "ray"` and `address = "http://HEAD:8265"` in the cluster
    config, or on a Slurm cluster `kind = "slurm"` (with `partition = "gpu"`; Slurm's client
    commands here, the visionloop home on storage the nodes share). Jobs keep running when it
    stops; the next `up` re-adopts them. The first start writes an admin token to
    <home>/admin.token, which this machine's CLI uses by default.

    A PostgreSQL job store: put its URL in VISIONLOOP_DB_URL or a 0600 file (--db-url-file), never on
    the command line (other users can read it there).
    """
    from visionloop.api import server
    from visionloop.core.settings import load_settings, open_home_warning

    settings = load_settings()
    if (warning := open_home_warning(settings.home)) is not None:
        err.print(warning, soft_wrap=True)
    config_path = (config or settings.home / "cluster.toml").expanduser().resolve()
    if (
        config is not None
        and not config_path.exists()
        and config_path != (settings.home / "cluster.toml").resolve()
    ):
        # A mistyped --config would otherwise start the one-machine default (every GPU to one
        # team) without a word. The home's cluster.toml may be missing: that is the default.
        from visionloop.core.errors import ConfigError

        raise ConfigError(
            f"no cluster config at {config_path}; check the path given to --config, or leave it out "
            "for <home>/cluster.toml (the one-machine default when that is missing)."
        )
    db_url = server.resolve_db_url(db, db_url_file)
    if detach:
        url = server.detach(settings, config_path, db_url, host, port)
        err.print(
            f"control plane running at {url} (log: {settings.home / 'control-plane.log'}); "
            "stop it with `visionloop down`"
        )
        return
    err.print(f"control plane on http://{host}:{port} — Ctrl-C stops it (jobs keep running)")
    server.serve(settings, config_path, db_url, host, port)


def down() -> None:
    """Stop the control plane started by `visionloop up`. Running jobs are not stopped."""
    from visionloop.api import server
    from visionloop.core.settings import load_settings

    pid = server.stop(load_settings())
    err.print("control plane stopped" if pid else "no control plane was running")


# --------------------------------------------------------------------------- submit


def submit(
    spec: Path = typer.Argument(..., help="A job spec (train: + resources ...) or a bare train spec (YAML)."),
    gpus: int | None = typer.Option(None, "--gpus", help="GPUs for the job (overrides the spec)."),
    priority: str | None = typer.Option(
        None, "--priority", "-p", help="Priority class, e.g. low, normal, high."
    ),
    team: str | None = typer.Option(None, "--team", "-t", help="Team to bill (default: your token's team)."),
    spot: str | None = typer.Option(None, "--spot", help="never | allowed | preferred."),
    max_runtime: str | None = typer.Option(
        None,
        "--max-runtime",
        help="How long one run should take at most, e.g. 6h, 90m, 2d (overrides the spec's "
        "max_runtime): planned with for reservations and backfill, never enforced.",
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a train-spec field: --set optimizer.lr=0.01."
    ),
    idempotency_key: str | None = typer.Option(
        None, "--idempotency-key", help="Re-sending the same key returns the same job instead of a new one."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the job as JSON."),
) -> None:
    """Queue a training job. Prints its id; `visionloop jobs show ID` follows it."""
    from visionloop.spec_files import apply_overrides, parse_yaml_mapping, read_spec_text

    if spot is not None and spot not in ("never", "allowed", "preferred"):
        raise typer.BadParameter(f"--spot must be never, allowed or preferred, not {spot!r}.")
    doc = parse_yaml_mapping(read_spec_text(spec), str(spec))
    is_job = "train" in doc
    train_doc = doc["train"] if is_job else doc
    if not isinstance(train_doc, dict):
        from visionloop.core.errors import SpecError

        raise SpecError(f"{spec}: `train` must be a train spec mapping.")
    train_doc = apply_overrides(dict(train_doc), overrides)
    _absolute_paths(train_doc, spec.resolve().parent)
    body = {**doc, "train": train_doc} if is_job else {"train": train_doc}
    with _client() as c:
        job = c.submit(
            body,
            gpus=gpus,
            priority=priority,
            team=team,
            spot=spot,
            max_runtime=max_runtime,
            idempotency_key=idempotency_key,
        )
    if as_json:
        typer.echo(json.dumps(job, indent=2))
        return
    typer.echo(job["id"])
    err.print(
        f"job {job['id']} queued for team {job['team']} ({job['priority']}, {job['gpus']} GPU"
        f"{'s' if job['gpus'] != 1 else ''}); run dir {job['run_dir']}"
    )


def _absolute_paths(train_doc: dict[str, Any], base: Path) -> None:
    """The control plane cannot know what a relative path was relative to: resolve here
    (every path field of the train spec, as `spec_files.resolve_paths` does for `visionloop train`)."""
    from visionloop.spec_files import PATH_FIELDS

    for section, key in PATH_FIELDS:
        part = train_doc.get(section)
        # A NUL in the path is left as it is: the control plane's validation names the field.
        if isinstance(part, dict) and isinstance(part.get(key), str) and "\x00" not in part[key]:
            p = Path(part[key]).expanduser()
            part[key] = str(p if p.is_absolute() else (base / p).resolve())


# --------------------------------------------------------------------------- jobs


@jobs_app.command("list")
def jobs_list(
    state: list[str] = typer.Option([], "--state", "-s", help="Only jobs in this state (repeatable)."),
    team: str | None = typer.Option(None, "--team", "-t", help="Only this team's jobs (admin)."),
    limit: int = typer.Option(
        200, "--limit", "-n", min=1, max=10_000, help="At most this many jobs, newest first."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Jobs you can see, newest first, with why each queued one waits."""
    with _client() as c:
        # Newest first: before, the API's oldest-first page was shown, so past `--limit` jobs
        # the newest (the ones a user just submitted) were never listed.
        jobs = c.jobs(states=state or None, team=team, limit=limit, newest_first=True)
    if as_json:
        typer.echo(json.dumps(jobs, indent=2))
        return
    table = Table(title=f"{len(jobs)} job(s)")
    for col in (
        "id",
        "name",
        "team",
        "priority",
        "gpus",
        "state",
        "submitted",
        "restarts",
        "preempted",
        "why",
    ):
        table.add_column(col)
    for j in jobs:
        why = j.get("waiting_reason") if j["state"] == "queued" else _pace(j)
        table.add_row(
            str(j["id"]),
            j.get("name") or "-",
            j["team"],
            j["priority"],
            str(j["gpus"]),
            _state(j["state"]),
            _when(j["submitted_at"]),
            str(j["restarts"]),
            str(j["preemptions"]),
            (why or "").splitlines()[0][:100] if why else "",
        )
    print_wide(table)


@jobs_app.command("show")
def jobs_show(
    job_id: int = typer.Argument(..., help="The job id (from `visionloop submit` or `jobs list`)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """A job's state history, attempts with their GPUs, checkpoints and cost."""
    with _client() as c:
        data = c.job(job_id)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    j = data["job"]
    print_wide(
        f"[bold]job {j['id']}[/] {j.get('name') or ''}  {_state(j['state'])}  team {j['team']}  "
        f"priority {j['priority']}  {j['gpus']} GPU(s), spot {j['spot']}\n"
        f"run dir {j['run_dir']}\n"
        f"restarts {j['restarts']}/{j['max_restarts']}  preemptions {j['preemptions']}"
    )
    limit = j.get("max_runtime_s")
    print_wide(
        "max runtime: "
        + ("none given" if limit is None else format_duration(float(limit)))
        + " (planned with for reservations and backfill; not enforced)"
    )
    est = data.get("runtime_estimate")
    if est is not None:
        used = "planned with, as no max runtime was given" if limit is None else "the max runtime comes first"
        spread = ""
        if est["runs"] > 1:
            spread = f"; they took {format_duration(est['shortest'])} to {format_duration(est['longest'])}"
        print_wide(
            f"expected runtime: {format_duration(float(est['seconds']))}, {est['basis']} ({used}{spread})"
        )
    if j["state"] == "queued" and j.get("waiting_reason"):
        print_wide(f"waiting: {j['waiting_reason']}")
    if j["state"] == "running":
        print_wide(f"progress: {_pace(j) or _planned_end(data.get('planned_end'))}")
    t = Table(title="state history")
    for col in ("at", "from", "to", "reason"):
        t.add_column(col)
    for tr in data["transitions"]:
        t.add_row(_when(tr["at"]), tr["from_state"] or "-", _state(tr["to_state"]), tr["reason"])
    print_wide(t)
    a = Table(title="attempts")
    for col in ("#", "started", "ran", "GPUs", "price class", "outcome", "exit"):
        a.add_column(col)
    for at in data["attempts"]:
        end = at.get("ended_at") or time.time()
        allocs = at.get("allocations", [])
        a.add_row(
            str(at["number"]),
            _when(at["started_at"]),
            _duration(end - at["started_at"]),
            ", ".join(x["gpu_id"] for x in allocs) or "cpu",
            ", ".join(sorted({x["price_class"] for x in allocs})) or "-",
            at.get("outcome") or "running",
            "-" if at.get("exit_code") is None else str(at["exit_code"]),
        )
    print_wide(a)
    if data.get("checkpoints"):
        ck = Table(title="checkpoints reported")
        ck.add_column("step")
        ck.add_column("at")
        for c in data["checkpoints"][-10:]:
            ck.add_row(str(c["step"]), _when(c["at"]))
        print_wide(ck)
    cost = data["cost"]
    line = cost["total"]
    print_wide(
        f"cost {_money(line['cost'], cost['currency'])} for {line['gpu_hours']:.3f} GPU-h; "
        f"lost to preemption {line['lost_gpu_hours_preemption']:.3f} GPU-h, "
        f"to interruptions {line['lost_gpu_hours_interruption']:.3f} "
        f"GPU-h; spot saved {_money(line['spot_saved'], cost['currency'])}"
    )


@jobs_app.command("logs")
def jobs_logs(
    job_id: int = typer.Argument(..., help="The job id."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
    attempt: int | None = typer.Option(
        None, "--attempt", help="A given attempt's log (default: the latest)."
    ),
) -> None:
    """The job's training log (stdout and stderr)."""
    with _client() as c:
        if follow:
            for piece in c.follow_logs(job_id):
                sys.stdout.buffer.write(piece)
                sys.stdout.buffer.flush()
            return
        # Page by page (the API answers at most 1 MiB at a time), all from the attempt the
        # first page came from: before, a log past 1 MiB was cut there without a word.
        offset = 0
        while True:
            data, offset, attempt = c.logs(job_id, offset, attempt)
            if not data:
                break
            sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


@jobs_app.command("cancel")
def jobs_cancel(job_id: int = typer.Argument(..., help="The job id.")) -> None:
    """Cancel a job: a queued one at once, a running one after it writes a checkpoint."""
    with _client() as c:
        job = c.cancel(job_id)
    err.print(f"job {job_id}: {job['state']}")
