"""The control plane's administration and cost from the command line: `admin ...` (tokens,
teams, GPUs, spot notices; an admin token) and `cost ...`. Thin clients of the HTTP API, like
the job commands in queue.py, whose helpers they share."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import err, print_wide
from visionloop.cli.queue import _client, _money, _when

admin_app = typer.Typer(
    help="Administer the control plane: tokens, teams, GPUs and spot notices (admin token).",
    no_args_is_help=True,
)
token_app = typer.Typer(help="Create API tokens.", no_args_is_help=True)
team_app = typer.Typer(help="Add or change teams and their GPU quotas.", no_args_is_help=True)
cost_app = typer.Typer(help="What GPU time cost, per job and team.", no_args_is_help=True)
admin_app.add_typer(token_app, name="token")
admin_app.add_typer(team_app, name="team")


# --------------------------------------------------------------------------- admin


@token_app.command("create")
def token_create(
    team: str | None = typer.Option(None, "--team", "-t", help="The team the token acts for."),
    admin: bool = typer.Option(False, "--admin", help="An admin token instead of a team token."),
    label: str = typer.Option("", "--label", help="A note to recognise the token by (who has it)."),
) -> None:
    """Create a token; it is printed once and stored only as a hash."""
    if admin == (team is not None):
        raise typer.BadParameter("give --team T (a team token) or --admin, not both and not neither.")
    with _client() as c:
        out = c.create_token(team, admin, label)
    typer.echo(out["token"])
    err.print(f"token for {'admin' if admin else 'team ' + str(team)}; pass it as VISIONLOOP_TOKEN")


@team_app.command("set")
def team_set(
    name: str = typer.Argument(..., help="Team name."),
    nominal: int = typer.Option(..., "--nominal", help="GPUs the team is entitled to (can always reclaim)."),
    borrow: int = typer.Option(
        0, "--borrow", help="GPUs it may borrow beyond --nominal while they are idle."
    ),
    weight: float = typer.Option(1.0, "--weight", help="Fair-share weight."),
) -> None:
    """Add a team or change its quota."""
    with _client() as c:
        t = c.set_team(name, nominal, borrow, weight)
    err.print(
        f"team {t['name']}: nominal {t['nominal_gpus']}, borrow {t['borrow_limit']}, weight {t['weight']}"
    )


@admin_app.command("gpus")
def admin_gpus(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The GPU inventory, with what is down and why."""
    with _client() as c:
        data = c.cluster()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    t = Table(title="GPUs")
    for col in ("id", "node", "type", "price class", "up", "why down"):
        t.add_column(col)
    for g in data["gpus"]:
        t.add_row(
            g["id"],
            g["node"],
            g["type"],
            g["price_class"],
            "yes" if g["up"] else "[red]no[/]",
            g.get("down_reason") or "",
        )
    print_wide(t)


@admin_app.command("spot-interrupt")
def spot_interrupt(
    target: str = typer.Argument(..., help="A GPU id (node/index) or a node name."),
    reason: str | None = typer.Option(None, "--reason", help="Shown in the jobs' history."),
) -> None:
    """A spot interruption notice: jobs there checkpoint and are requeued; the GPUs go down."""
    with _client() as c:
        out = c.spot_interrupt(target, reason)
    err.print(f"{target}: down; preempting job(s) {', '.join(map(str, out['preempting'])) or 'none'}")


@admin_app.command("spot-restore")
def spot_restore(target: str = typer.Argument(..., help="A GPU id or a node name.")) -> None:
    """Spot capacity is back: the GPUs take work again."""
    with _client() as c:
        out = c.spot_restore(target)
    err.print(f"up again: {', '.join(out['up'])}")


# --------------------------------------------------------------------------- cost


def _since(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except (ValueError, OverflowError):
        shown = repr(value) if len(value) <= 40 else repr(value[:40]) + "..."  # not a pasted file whole
        raise typer.BadParameter(
            f"--since takes a date like 2026-11-01 or 2026-11-01T08:00, not {shown}."
        ) from None


@cost_app.command("report")
def cost_report(
    team: str | None = typer.Option(None, "--team", "-t", help="Only this team."),
    since: str | None = typer.Option(
        None, "--since", help="Only GPU time from this date on (YYYY-MM-DD[THH:MM])."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Cost per team and job: GPU-hours, money, hours lost to preemption and interruptions, spot savings."""
    with _client() as c:
        data = c.cost(team=team, since=_since(since))
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    cur = data["currency"]
    for title, rows in (("by team", data["by_team"]), ("by job", data["by_job"])):
        t = Table(title=title)
        for col in (
            "",
            "GPU-h",
            "cost",
            "lost: preemption",
            "lost: interruptions",
            "spot GPU-h",
            "spot saved",
        ):
            t.add_column(col)
        for key, line in sorted(rows.items()):
            t.add_row(
                # A team or job name is text, not Rich markup: "[/]" in one crashed the report.
                escape(str(key)),
                f"{line['gpu_hours']:.3f}",
                _money(line["cost"], cur),
                f"{line['lost_gpu_hours_preemption']:.3f}",
                f"{line['lost_gpu_hours_interruption']:.3f}",
                f"{line['spot_gpu_hours']:.3f}",
                _money(line["spot_saved"], cur),
            )
        print_wide(t)
    tot = data["total"]
    print_wide(
        f"total {_money(tot['cost'], cur)} for {tot['gpu_hours']:.3f} GPU-h; "
        f"spot saved {_money(tot['spot_saved'], cur)}"
    )
    if data.get("labelling"):
        t = Table(title="labelling, by the dataset version it produced")
        for col in ("version", "parent", "team", "images", "cost", "recorded", "dataset"):
            t.add_column(col, justify="right" if col in ("images", "cost") else "left")
        for e in data["labelling"]:
            t.add_row(
                e["dataset_version"][:12],
                (e["parent_version"] or "-")[:12],
                escape(e["team"]),
                f"{e['images']:,}",
                _money(e["cost"], cur),
                _when(e["recorded_at"]),
                escape(e["dataset_path"]),
            )
        print_wide(t)
        print_wide(f"labelling total {_money(data['labelling_total'], cur)}")


@cost_app.command("labelling")
def cost_labelling(
    dataset: Path = typer.Argument(
        ..., help="A dataset version `visionloop data add --cost-per-image` made.", show_default=False
    ),
    team: str | None = typer.Option(None, "--team", "-t", help="The team that paid (admin tokens only)."),
) -> None:
    """Put what labelling DATASET's new images cost into the control plane's ledger, against
    its version (`data add` does this itself when the control plane answers). Recording a
    version twice is harmless: it is billed once."""
    from visionloop.cli.data_add import record_labelling

    with _client() as c:
        record_labelling(c, dataset, team)
