"""The commented default config that `visionloop alerts init` writes. Every value in it is the
default (a test parses it and compares with `AlertConfig()`), so uncommenting a line changes
nothing until its value is edited."""

from __future__ import annotations

TEMPLATE = """\
# visionloop alert rules: `visionloop alerts check` evaluates them, delivers what starts
# firing (and what resolves) to the webhook, and records both in <home>/alerts/log.jsonl.
# Every value below is the default; a rule you do not mention runs with its defaults.
# Turn a rule off with `enabled = false`; every rule also takes a severity: "critical",
# "warning" or "info" (Alertmanager and chat receivers route by it).

[delivery]
# The webhook URL is a secret (anyone who has it can post to the channel). Prefer the
# environment variable VISIONLOOP_ALERTS_WEBHOOK; a URL written here is refused unless
# this file is private (chmod 600). Slack, Mattermost and Rocket.Chat incoming webhooks
# take the message as sent.
# webhook_url = "https://hooks.slack.com/services/..."
# timeout_s = 5        # per POST; a receiver that hangs is given up on after this long
# retries = 2          # more tries per check, with backoff; what still fails waits for the next check
# backoff_s = 1.0      # first pause between tries, doubled each time

[sources]
# Inference servers whose /metrics are read for error rate and p99 latency (rates are
# measured between two checks). A server started with API keys needs a key for all models
# (`visionloop serve keys create alerts --models '*'`) in VISIONLOOP_ALERTS_SERVE_KEY.
# serve_urls = ["http://127.0.0.1:8000"]
# scrape_timeout_s = 5
# Models whose monitor windows are watched (default: every model `visionloop monitor` judged).
# models = ["digits"]
# The cluster config whose price catalog prices GPU time (default: <home>/cluster.toml;
# a relative path is relative to this file).
# cluster_config = "/etc/visionloop/cluster.toml"

[rules.drift]
# Drift on this many judged windows of a model's traffic in a row (same version; windows
# with too few samples to judge are skipped, neither breaking nor extending the run).
# windows = 3
# severity = "warning"

[rules.accuracy]
# The label-free accuracy estimate of a model's latest window under this floor.
# floor = 0.8
# models = { digits = 0.9 }   # per-model floors
# severity = "critical"

[rules.error_rate]
# Server errors (HTTP 5xx: failures, full queues, timeouts) over all answered requests,
# per model, between two checks; quiet below min_requests requests.
# max_percent = 1.0
# min_requests = 20
# severity = "critical"

[rules.latency_p99]
# The 99th percentile of request latency (queue + compute) above the serving budget.
# budget_ms = 100
# min_requests = 20
# severity = "warning"

[rules.gpu_utilisation]
# A running job whose GPUs averaged under min_percent over the last for_minutes (from the
# system metrics its trainer logs to MLflow).
# min_percent = 50
# for_minutes = 30
# severity = "warning"

[rules.queue_wait]
# A job queued longer than this since it (last) entered the queue. Jobs of a priority class
# ranked high_priority_rank or more (cluster.toml [priorities]) get the shorter limit.
# max_minutes = 120
# high_priority_minutes = 5
# high_priority_rank = 100
# severity = "warning"

[rules.job_failure_rate]
# Failed jobs over the jobs that finished (succeeded or failed) in the last window_hours;
# quiet below min_jobs finished jobs.
# max_percent = 5
# window_hours = 24
# min_jobs = 5
# severity = "warning"

[rules.daily_cost]
# The last 24 hours' GPU cost above factor x the median of the trailing_days 24-hour
# periods before it (priced by the cluster's price catalog); quiet under min_cost.
# factor = 2.0
# trailing_days = 7
# min_cost = 1.0
# severity = "warning"

[rules.checkpoint_restore]
# A checkpoint that failed verification when a job resumed (set aside as *.corrupt in its
# run directory). Resolves once the file is removed.
# severity = "critical"
"""
