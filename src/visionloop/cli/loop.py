"""`visionloop loop run|status LOOP.yaml`: the retraining loop (`visionloop.loop`)."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import out, print_wide

app = typer.Typer(
    help=(
        "The retraining loop: new labels, drift or a schedule open a round; the round makes the next "
        "dataset version, trains on the queue from the champion's weights, registers, evaluates "
        "against the champion, passes the gate and (with a rollout) the export gate and a canary "
        "on the server, then promotes or rolls back. `loop run` drives it, `loop status` shows "
        "where it stands and why."
    ),
    no_args_is_help=True,
)


def _when(ts: object) -> str:
    # A time from a hand-edited state or event log may be a string, or past year 9999: shown as
    # "?" rather than a traceback that hides the rest of the status.
    if ts is None or ts == 0:
        return "-"
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        return "?"
    try:
        return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, ValueError, OSError):
        return "?"


@app.command("run")
def run_command(
    spec_path: Path = typer.Argument(..., metavar="LOOP.yaml", help="The loop spec.", show_default=False),
    once: bool = typer.Option(False, "--once", help="One pass, then exit (for cron or a test)."),
    poll: float = typer.Option(30.0, "--poll", min=0.1, help="Seconds between passes."),
) -> None:
    """Drive the loop: each pass opens a round when a trigger fires and takes the open round's
    steps as far as they go (a queued training job ends the pass; the next goes on from it).

    Safe to stop and start at any moment: the state under <home>/loops/NAME/ says which step
    each round is in, and a step reads back what an earlier attempt made (the job by its
    idempotency key, the version by its run) instead of making it twice.
    """
    from visionloop.api.client import Client
    from visionloop.core.settings import load_settings
    from visionloop.loop.runner import advance
    from visionloop.loop.spec import load_loop_spec

    spec = load_loop_spec(spec_path)
    settings = load_settings()
    last = ""
    while True:
        result = advance(spec, settings, lambda: Client.from_settings(settings))
        if result.reason != last:
            out.print(f"{_when(time.time())}  {escape(result.reason)}", soft_wrap=True)
            last = result.reason
        if once:
            return
        if result.stopped == "closed":
            continue  # another round may be due at once
        time.sleep(poll)


@app.command("status")
def status_command(
    spec_path: Path = typer.Argument(..., metavar="LOOP.yaml", help="The loop spec.", show_default=False),
    rounds: int = typer.Option(5, "--rounds", min=1, help="How many of the latest rounds to show."),
) -> None:
    """Where the loop stands: its dataset version, what is waiting, each recent round's steps
    with what they made and why, and the latest events."""
    from visionloop.core.settings import load_settings
    from visionloop.loop.spec import load_loop_spec
    from visionloop.loop.state import STEPS, load_state, read_events
    from visionloop.loop.triggers import count_images, trigger, waiting_folders

    spec = load_loop_spec(spec_path)
    settings = load_settings()
    state = load_state(settings.home, spec.name)
    if state is None:
        out.print(f"loop {escape(spec.name)} has not run yet: `visionloop loop run {escape(str(spec_path))}`")
        return
    waiting = waiting_folders(spec, state)
    out.print(f"[bold]loop {escape(spec.name)}[/] for {escape(spec.model)}")
    version = escape(state.dataset_version[:12])
    out.print(f"  dataset     {escape(state.dataset)} (version {version})", soft_wrap=True)
    out.print(
        f"  waiting     {count_images(waiting):,} labelled images in {len(waiting)} folder(s) of "
        f"{escape(str(spec.labels))}"
    )
    if state.current is None:
        why = trigger(spec, state, settings, time.time())
        out.print(f"  next round  {escape(why) + ' (on the next pass)' if why else 'when a trigger fires'}")
    for rnd in state.rounds[-rounds:]:
        head = rnd.outcome or "open"
        t = Table(
            title=f"round {rnd.number}: {head} — opened {_when(rnd.opened_at)}: {escape(rnd.trigger)}",
            title_justify="left",
        )
        for col in ("step", "status", "ended", "what"):
            t.add_column(col, overflow="fold")
        for name in STEPS:
            rec = rnd.steps[name]
            t.add_row(name, rec.status, _when(rec.ended_at), escape(rec.reason))
        print_wide(t)
        if rnd.outcome:
            out.print(f"  {rnd.outcome}: {escape(rnd.reason)}", soft_wrap=True)
    events = read_events(settings.home, spec.name, limit=10)
    if events:
        out.print("latest events:")
        for e in events:
            # escape: a hand-edited line's "[/]" would stop the status with a markup error.
            where = f"round {escape(str(e['round']))} " if e.get("round") else ""
            out.print(
                f"  {_when(e.get('at'))}  {where}{escape(str(e.get('event')))}  "
                f"{escape(str(e.get('reason', '')))[:200]}",
                soft_wrap=True,
            )
