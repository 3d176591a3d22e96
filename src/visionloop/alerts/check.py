"""One check: read the signals, evaluate every enabled rule, update the open alerts, record
what changed in the alert log, deliver the outbox. What `visionloop alerts check` runs, once
or every N seconds.

A signal that cannot be read (a server down, no job store yet) makes its rules "unknown" for
this check: their open alerts stay open and the check says why, instead of failing whole or
resolving alerts for lack of data.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from visionloop.alerts import evaluate, signals
from visionloop.alerts.deliver import LOG_FILE, AlertLog, Delivery, Webhook, deliver
from visionloop.alerts.engine import AlertState, alerts_dir, apply, delivered, load_state, locked, save_state
from visionloop.alerts.records import Finding, Notification, OpenAlert, RuleOutcome
from visionloop.alerts.rules import RULE_NAMES, SERVE_KEY_ENV, AlertConfig
from visionloop.alerts.scrape import ScrapeError, scrape, traffic
from visionloop.core.errors import VisionloopError
from visionloop.core.settings import Settings, load_settings

if TYPE_CHECKING:
    from visionloop.sched.store import Store

log = logging.getLogger(__name__)

# The job store's URL when it is not the home's SQLite file (the variable `visionloop up`
# reads, api/server.py): a URL with a password stays out of files and argv.
DB_URL_ENV = "VISIONLOOP_DB_URL"


@dataclass(frozen=True)
class CheckResult:
    changes: tuple[Notification, ...]  # what started firing or resolved in this check
    open: tuple[OpenAlert, ...]  # what is firing after it
    problems: tuple[str, ...]  # signals that could not be read, deliveries that failed
    delivered: int
    pending: int  # notifications still waiting for the receiver
    webhook: bool  # False: no webhook configured (the log is the only record)


def alert_log(home: Path) -> AlertLog:
    return AlertLog(alerts_dir(home) / LOG_FILE)


def run_check(
    config: AlertConfig,
    settings: Settings | None = None,
    *,
    now: float | None = None,
    store_url: str | None = None,
) -> CheckResult:
    """Evaluate every enabled rule once and deliver what changed. `store_url`: the job store
    (default VISIONLOOP_DB_URL, else the home's SQLite file)."""
    settings = settings or load_settings()
    now = time.time() if now is None else now
    home = settings.home
    with locked(home):
        state = load_state(home)
        with _job_store(settings, store_url) as (store, store_problem):
            outcomes = list(_evaluate(config, settings, state, store, store_problem, now))
        disabled = [name for name in RULE_NAMES if name not in config.rules.enabled()]
        changes = apply(state, outcomes, disabled, now)
        journal = alert_log(home)
        for n in changes:
            journal.notification(n)
        save_state(home, state)  # before delivering: a crash now never re-fires these
        problems = [o.problem for o in outcomes if o.problem]
        sent = 0
        hook = _webhook(config)
        if hook is None:
            state.outbox.clear()  # nowhere to deliver: the log is the record
            save_state(home, state)
        elif state.outbox:
            try:
                result = deliver(hook, list(state.outbox))
            except Exception as e:  # a bug or an odd URL must not lose the evaluation: all kept
                log.exception("webhook delivery failed")
                result = Delivery((), f"{type(e).__name__} while posting", 0)
            sent = len(result.delivered)
            delivered(state, [(n.id, n.status) for n in result.delivered])
            if result.error is not None:
                left = len(state.outbox)
                problems.append(f"webhook: {result.error}; {left} notification(s) kept for the next check")
                journal.append(
                    "delivery_failed", at=now, error=result.error, pending=[n.id for n in state.outbox]
                )
            save_state(home, state)
        return CheckResult(
            changes=tuple(changes),
            open=tuple(sorted(state.open.values(), key=lambda a: (a.rule, a.key))),
            problems=tuple(problems),
            delivered=sent,
            pending=len(state.outbox),
            webhook=hook is not None,
        )


def follow(
    config_loader: Callable[[], AlertConfig],
    every_s: float,
    on_result: Callable[[CheckResult], None],
    *,
    settings: Settings | None = None,
    store_url: str | None = None,
) -> None:
    """Check every `every_s` seconds until interrupted, re-reading the config each time (an
    edited rule applies from the next check; a broken edit is reported and the check skipped)."""
    while True:
        started = time.monotonic()
        try:
            on_result(run_check(config_loader(), settings, store_url=store_url))
        except (VisionloopError, OSError) as e:  # a broken config edit, a full disk: retry next time
            log.error("alert check failed: %s", e)
            on_result(CheckResult((), (), (f"check failed: {e}",), 0, 0, False))
        time.sleep(max(0.0, every_s - (time.monotonic() - started)))


def _webhook(config: AlertConfig) -> Webhook | None:
    d = config.delivery
    if d.webhook_url is None:
        return None
    return Webhook(d.webhook_url, timeout_s=d.timeout_s, retries=d.retries, backoff_s=d.backoff_s)


@contextmanager
def _job_store(settings: Settings, url: str | None) -> Iterator[tuple[Store | None, str | None]]:
    """The job store, or None and why. A SQLite store that does not exist is not created:
    no control plane has run here, so there are no jobs to judge."""
    from visionloop.sched.store import Store, default_url

    url = url or os.environ.get(DB_URL_ENV) or default_url(settings)
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        yield None, None
        return
    try:
        store = Store.open(url, runs_dir=settings.runs_dir)
    except VisionloopError as e:
        yield None, f"job rules not evaluated: {e}"
        return
    try:
        yield store, None
    finally:
        store.close()


def _evaluate(
    config: AlertConfig,
    settings: Settings,
    state: AlertState,
    store: Store | None,
    store_problem: str | None,
    now: float,
) -> Iterator[RuleOutcome]:
    rules = config.rules
    on = set(rules.enabled())
    if on & {"drift", "accuracy"}:
        yield from _model_rules(config, settings.home, on)
    if on & {"error_rate", "latency_p99"}:
        yield from _serve_rules(config, state, on, now)
    job_rules = on & {"queue_wait", "job_failure_rate", "gpu_utilisation", "checkpoint_restore", "daily_cost"}
    if not job_rules:
        return
    if store is None:
        for i, name in enumerate(sorted(job_rules)):
            # Unknown, not clear: open job alerts stay open while the store cannot be read.
            yield RuleOutcome(name, unknown=(f"{name}",), problem=store_problem if i == 0 else None)
        return
    for name in sorted(job_rules):
        try:
            yield _JOB_RULES[name](config, settings, store, state, now)
        except VisionloopError as e:
            yield RuleOutcome(name, unknown=(name,), problem=f"{name} not evaluated: {e}")


def _model_rules(config: AlertConfig, home: Path, on: set[str]) -> Iterator[RuleOutcome]:
    rules = config.rules
    models = config.sources.models if config.sources.models is not None else signals.monitored_models(home)
    n = max(rules.drift.windows, 1)
    drift: list[Finding] = []
    accuracy: list[Finding] = []
    unreadable: list[str] = []
    problems: list[str] = []
    for model in models:
        try:
            windows = signals.recent_windows(home, model, n)
        except (VisionloopError, OSError) as e:  # a bad name in sources.models, an unreadable file
            unreadable.append(model)
            problems.append(f"windows of model {model!r} not read: {e}")
            continue
        drift += evaluate.drift(rules.drift, model, windows)
        accuracy += evaluate.accuracy(rules.accuracy, model, windows)
    problem = "; ".join(problems) or None
    if "drift" in on:
        yield RuleOutcome("drift", tuple(drift), tuple(f"drift:{m}" for m in unreadable), problem)
        problem = None
    if "accuracy" in on:
        yield RuleOutcome("accuracy", tuple(accuracy), tuple(f"accuracy:{m}" for m in unreadable), problem)


def _serve_rules(config: AlertConfig, state: AlertState, on: set[str], now: float) -> Iterator[RuleOutcome]:
    rules, urls = config.rules, config.sources.serve_urls
    key = os.environ.get(SERVE_KEY_ENV) or None
    errors: list[Finding] = []
    slow: list[Finding] = []
    unknown: list[str] = []
    problems: list[str] = []
    for url in urls:
        try:
            reading = scrape(url, at=now, timeout_s=config.sources.scrape_timeout_s, api_key=key)
        except ScrapeError as e:
            unknown.append(f":{url}:")
            problems.append(str(e))
            continue
        previous = state.readings.get(url)
        state.readings[url] = reading
        if previous is None or reading.at <= previous.at:
            unknown.append(f":{url}:")  # the first reading is the baseline: no rate yet
            continue
        seen = traffic(previous, reading)
        errors += evaluate.error_rate(rules.error_rate, url, seen, many=len(urls) > 1)
        slow += evaluate.latency_p99(rules.latency_p99, url, seen, many=len(urls) > 1)
    for url in list(state.readings):
        if url not in urls:
            del state.readings[url]  # a server no longer configured
    problem = "; ".join(problems) or None
    for name, found in (("error_rate", errors), ("latency_p99", slow)):
        if name in on:
            yield RuleOutcome(name, tuple(found), tuple(f"{name}{u}" for u in unknown), problem)
            problem = None  # said once


def _queue_wait(
    config: AlertConfig, settings: Settings, store: Store, state: AlertState, now: float
) -> RuleOutcome:
    rule = config.rules.queue_wait
    return RuleOutcome("queue_wait", tuple(evaluate.queue_wait(rule, signals.queued_jobs(store), now)))


def _failure_rate(
    config: AlertConfig, settings: Settings, store: Store, state: AlertState, now: float
) -> RuleOutcome:
    rule = config.rules.job_failure_rate
    finished = signals.finished_since(store, now - 3600.0 * rule.window_hours)
    return RuleOutcome("job_failure_rate", tuple(evaluate.job_failure_rate(rule, finished)))


def _gpu(config: AlertConfig, settings: Settings, store: Store, state: AlertState, now: float) -> RuleOutcome:
    rule = config.rules.gpu_utilisation
    window_s = 60.0 * rule.for_minutes
    running = [j for j in signals.running_jobs(store) if j.gpus > 0]  # CPU-only jobs have no GPU to idle
    util, problems = signals.gpu_utilisation(settings, running, now - window_s)
    found = evaluate.gpu_utilisation(rule, running, util, now)
    unknown = tuple(f"gpu_utilisation:job-{j.id}" for j in running if j.id not in util)
    return RuleOutcome("gpu_utilisation", tuple(found), unknown, "; ".join(problems) or None)


def _restore(
    config: AlertConfig, settings: Settings, store: Store, state: AlertState, now: float
) -> RuleOutcome:
    rule = config.rules.checkpoint_restore
    with_alert = {
        int(a.key.split(":")[1].removeprefix("job-"))
        for a in state.open.values()
        if a.rule == "checkpoint_restore"
    }
    corrupt = {}
    for job in signals.jobs_to_scan(store, now - signals.DAY_S, with_alert):
        names = signals.corrupt_checkpoints(job.run_dir)
        if names:
            corrupt[job.id] = names
    return RuleOutcome("checkpoint_restore", tuple(evaluate.checkpoint_restore(rule, corrupt)))


def _cost(
    config: AlertConfig, settings: Settings, store: Store, state: AlertState, now: float
) -> RuleOutcome:
    from visionloop.sched.config import load_cluster_config
    from visionloop.sched.prices import load_catalog

    rule = config.rules.daily_cost
    cluster = config.sources.cluster_config
    path = Path(cluster).expanduser() if cluster else settings.home / "cluster.toml"
    catalog = load_catalog(load_cluster_config(path).prices)
    cost = signals.daily_cost(store, catalog, now, rule.trailing_days)
    return RuleOutcome("daily_cost", tuple(evaluate.daily_cost(rule, cost)))


_JOB_RULES: dict[str, Callable[[AlertConfig, Settings, Store, AlertState, float], RuleOutcome]] = {
    "queue_wait": _queue_wait,
    "job_failure_rate": _failure_rate,
    "gpu_utilisation": _gpu,
    "checkpoint_restore": _restore,
    "daily_cost": _cost,
}
