"""`visionloop alerts ...`: evaluate the alert rules, deliver to a webhook, list what fires,
write the commented default config and a Prometheus rules file (visionloop.alerts)."""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import err, out, print_wide

if TYPE_CHECKING:
    from visionloop.alerts import AlertConfig, CheckResult

app = typer.Typer(
    help=(
        "Alerts for models and infrastructure from one rule file (<home>/alerts.toml): drift, "
        "estimated accuracy, served error rate and p99 latency, idle GPUs, long queue waits, "
        "job failures, daily cost, checkpoints that failed to restore. `alerts init` writes the "
        "file, `alerts check --follow` evaluates and delivers, `alerts list` shows what fires."
    ),
    no_args_is_help=True,
)

_CONFIG_HELP = (
    "The alert rules (TOML, or YAML by suffix). Default: <home>/alerts.toml, else built-in defaults."
)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$")


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _config(path: Path | None) -> AlertConfig:
    from visionloop.alerts import load_config
    from visionloop.core.settings import load_settings

    return load_config(path, load_settings().home)


def parse_every(value: str) -> float:
    """ "60", "60s", "5m", "1h" -> seconds."""
    m = _DURATION.match(value)
    if m is None or float(m[1]) <= 0:
        raise typer.BadParameter(
            f"{value!r} is not a duration; write e.g. 60s, 5m or 1h.", param_hint="--every"
        )
    return float(m[1]) * {"s": 1, "m": 60, "h": 3600}[m[2] or "s"]


@app.command("check")
def check_cmd(
    config: Path | None = typer.Option(None, "--config", "-c", help=_CONFIG_HELP),
    follow: bool = typer.Option(
        False,
        "--follow",
        "-f",
        help="Keep checking (every --every) until Ctrl-C; the config is re-read each time.",
    ),
    every: str = typer.Option("60s", "--every", help="With --follow: time between checks, e.g. 30s, 5m."),
    as_json: bool = typer.Option(False, "--json", help="Print each check's result as one JSON line."),
) -> None:
    """Evaluate every enabled rule once (or repeatedly with --follow) and deliver what changed.

    An alert is delivered when it starts firing and once more when its condition clears; while it keeps firing nothing is re-sent, also across restarts (the state is kept in <home>/alerts/state.json). Every change goes to the append-only log <home>/alerts/log.jsonl; with a webhook (VISIONLOOP_ALERTS_WEBHOOK, or `\\[delivery] webhook_url` in the config) it is POSTed as Slack-compatible JSON. A receiver that fails or does not answer is retried with backoff, and what it did not take waits for the next check: nothing is lost, and the check never hangs on it.

    Error rate and latency are measured between two checks, so the first check after adding a server only takes its baseline. A signal that cannot be read (a server down) is reported and leaves its open alerts as they are.

    Exits 1 when the webhook did not take every notification (they are kept and retried on the next check), else 0.
    """  # noqa: E501 (one line per paragraph: Rich keeps the line breaks of a help text)
    from visionloop.alerts.check import follow as follow_checks
    from visionloop.alerts.check import run_check

    interval = parse_every(every)
    if not follow:
        result = run_check(_config(config))
        _show(result, as_json)
        if result.problems:
            raise typer.Exit(1 if any(p.startswith("webhook:") for p in result.problems) else 0)
        return
    _config(config)  # a broken config fails now, not silently in the loop
    err.print(f"checking every {interval:g} s; Ctrl-C stops")
    try:
        follow_checks(lambda: _config(config), interval, lambda r: _show(r, as_json))
    except KeyboardInterrupt:
        err.print("stopped")


def _show(result: CheckResult, as_json: bool) -> None:
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "changes": [n.to_json() for n in result.changes],
                    "open": [a.to_json() for a in result.open],
                    "problems": list(result.problems),
                    "delivered": result.delivered,
                    "pending": result.pending,
                    "webhook": result.webhook,
                }
            )
        )
        return
    stamp = _when(result.changes[0].at) if result.changes else _when(datetime.now().timestamp())
    for n in result.changes:
        style = "bold red" if n.status == "firing" else "green"
        out.print(
            f"{stamp} [{style}]{n.status.upper()}[/] {n.rule}: {escape(n.subject)}: {escape(n.summary)}"
        )
    for p in result.problems:
        err.print(f"[yellow]warning:[/] {escape(p)}")
    where = (
        f"delivered {result.delivered}"
        + (f", {result.pending} waiting for the receiver" if result.pending else "")
        if result.webhook
        else "no webhook configured: changes are in the alert log only"
    )
    out.print(f"{stamp} {len(result.open)} alert(s) firing; {len(result.changes)} change(s); {where}")


@app.command("list")
def list_cmd(
    show_all: bool = typer.Option(
        False,
        "--all",
        "-a",
        help="The history instead: every firing and resolution in the alert log, oldest first.",
    ),
    limit: int = typer.Option(100, "--limit", "-n", help="With --all: only the last N events."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """The alerts firing now (as of the last check), or with --all the history from the alert log."""
    from visionloop.alerts import alert_log
    from visionloop.alerts.engine import load_state
    from visionloop.core.settings import load_settings

    home = load_settings().home
    if show_all:
        events = [e for e in alert_log(home).read() if e.get("event") in ("firing", "resolved")][-limit:]
        if as_json:
            typer.echo(json.dumps(events, indent=2))
            return
        _history_table(events)
        return
    alerts = sorted(load_state(home).open.values(), key=lambda a: a.since)
    if as_json:
        typer.echo(json.dumps([a.to_json() for a in alerts], indent=2))
        return
    if not alerts:
        out.print("no alerts firing (as of the last `visionloop alerts check`)")
        return
    t = Table(title=f"{len(alerts)} alert(s) firing", title_justify="left")
    for col in ("since", "severity", "rule", "subject", "summary"):
        t.add_column(col)
    for a in alerts:
        t.add_row(_when(a.since), a.severity, a.rule, escape(a.subject), escape(a.summary))
    print_wide(t)


def _history_table(events: list[dict[str, Any]]) -> None:
    if not events:
        out.print("the alert log is empty: nothing has fired yet")
        return
    t = Table(title="alert history", title_justify="left")
    for col in ("at", "event", "rule", "subject", "summary"):
        t.add_column(col)
    for e in events:
        t.add_row(
            _when(float(e.get("at", 0))),
            str(e.get("event")),
            str(e.get("rule")),
            escape(str(e.get("subject"))),
            escape(str(e.get("summary"))),
        )
    print_wide(t)


@app.command("rules")
def rules_cmd(
    config: Path | None = typer.Option(None, "--config", "-c", help=_CONFIG_HELP),
    prometheus: Path | None = typer.Option(
        None,
        "--prometheus",
        help="Also write a Prometheus alerting-rules file here (error rate and p99 latency, over the metrics "
        "the inference server exports) for Prometheus + Alertmanager.",
    ),
    window: str = typer.Option("5m", "--window", help="With --prometheus: the rate window, e.g. 5m."),
    as_json: bool = typer.Option(False, "--json", help="Print the effective rules as JSON."),
) -> None:
    """Show the effective rules (the config over the defaults); with --prometheus, write the Prometheus alerting rules.

    Prometheus can evaluate the rules over metrics visionloop exports: served error rate and p99 latency (the inference server's /metrics) and estimated accuracy (the gauges of `visionloop monitor --metrics-port`). The file's header lists the rules it cannot hold, which `visionloop alerts check` keeps evaluating.
    """  # noqa: E501 (one line per paragraph: Rich keeps the line breaks of a help text)
    import dataclasses

    cfg = _config(config)
    rules = {f.name: dataclasses.asdict(getattr(cfg.rules, f.name)) for f in dataclasses.fields(cfg.rules)}
    if prometheus is not None:
        from visionloop.alerts.prometheus import write_rules

        if not re.fullmatch(r"\d+[smh]", window):
            raise typer.BadParameter(
                f"{window!r} is not a Prometheus duration; write e.g. 5m.", param_hint="--window"
            )
        names = write_rules(cfg, prometheus, window=window, for_=window)
        err.print(
            f"wrote {len(names)} Prometheus rule(s) ({', '.join(names) or 'none enabled'}) to {prometheus}"
        )
    if as_json:
        typer.echo(json.dumps(rules, indent=2))
        return
    t = Table(title=f"alert rules ({cfg.source or 'built-in defaults'})", title_justify="left")
    for col in ("rule", "on", "severity", "settings"):
        t.add_column(col)
    for name, values in rules.items():
        settings = ", ".join(f"{k}={v}" for k, v in values.items() if k not in ("enabled", "severity"))
        t.add_row(name, "yes" if values["enabled"] else "no", values["severity"], escape(settings))
    print_wide(t)
    hook = "set" if cfg.delivery.webhook_url else "not set (VISIONLOOP_ALERTS_WEBHOOK)"
    servers = ", ".join(cfg.sources.serve_urls) or "none (sources.serve_urls)"
    out.print(f"webhook: {hook}; servers scraped: {escape(servers)}")


@app.command("init")
def init_cmd(
    config: Path | None = typer.Option(
        None, "--config", "-c", help="Where to write it (default: <home>/alerts.toml)."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Write the default alert rules as a commented config file (<home>/alerts.toml).

    Every rule is listed with its default and what it means; uncomment a line to change it, or set `enabled = false`. The file is written private (mode 600) since it may come to hold the webhook URL.
    """  # noqa: E501 (one line per paragraph: Rich keeps the line breaks of a help text)
    from visionloop.alerts.rules import default_path
    from visionloop.alerts.template import TEMPLATE
    from visionloop.core.errors import ConfigError
    from visionloop.core.fsutil import atomic_write_text
    from visionloop.core.settings import load_settings

    path = config if config is not None else default_path(load_settings().home)
    if path.exists() and not force:
        raise ConfigError(f"{path} exists; edit it, or pass --force to overwrite it with the defaults.")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, TEMPLATE, mode=0o600)
    out.print(f"wrote {path}: every rule at its default; uncomment a line to change it")
    if not os.environ.get("VISIONLOOP_ALERTS_WEBHOOK"):
        out.print(
            "next: export VISIONLOOP_ALERTS_WEBHOOK=https://hooks.slack.com/services/... and run "
            "`visionloop alerts check --follow`"
        )
