"""Alerts for models and infrastructure, from one set of rules (`<home>/alerts.toml`).

    rules.py       the rule config: defaults from practice, thresholds, clear errors
    template.py    the commented default config (`alerts init`)
    signals.py     typed reads of the stores the rules judge (monitor, jobs, cost, MLflow)
    scrape.py      the inference servers' /metrics: requests, 5xx, p99 between readings
    evaluate.py    the rules: signals -> findings
    engine.py      findings -> firing / resolved, deduplicated, state kept across restarts
    deliver.py     the webhook (Slack-compatible JSON, retries) and the alert log
    check.py       one check end to end (`alerts check`, `--follow`)
    prometheus.py  the Prometheus alerting-rules file for the rules over exported metrics

Library first: `run_check(load_config(None, home))` is what the CLI runs.
"""

from __future__ import annotations

from visionloop.alerts.check import CheckResult, alert_log, run_check
from visionloop.alerts.records import Finding, Notification, OpenAlert, RuleOutcome
from visionloop.alerts.rules import AlertConfig, load_config, parse_config

__all__ = [
    "AlertConfig",
    "CheckResult",
    "Finding",
    "Notification",
    "OpenAlert",
    "RuleOutcome",
    "alert_log",
    "load_config",
    "parse_config",
    "run_check",
]
