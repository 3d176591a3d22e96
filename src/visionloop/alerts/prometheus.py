"""A Prometheus alerting-rules file for teams that run Prometheus and Alertmanager.

Only the rules over metrics visionloop exports can be Prometheus rules: the inference
server's error rate and p99 latency (serve/metrics.py), and the estimated accuracy that
`visionloop monitor` publishes per model (monitor/service.py `Gauges`). The others read stores
Prometheus does not scrape (the job store, the tracking store, the run directories), and drift
"on N windows in a row" needs the window history while the monitor's gauge holds only the last
window's verdict; the file lists them in a comment and `visionloop alerts check` keeps
evaluating them.

The expressions compute what `alerts check` computes: 5xx errors over all answered requests
per model, and the 0.99 quantile of the request-latency histogram per model, both over
`window`, quiet below the rule's min_requests; the latest estimate under the model's floor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from visionloop.alerts.rules import AlertConfig
from visionloop.alerts.scrape import ERRORS, LATENCY, REQUESTS
from visionloop.core.fsutil import atomic_write_text

PROMETHEUS_RULES = ("error_rate", "latency_p99", "accuracy")
# The monitor's gauge (monitor/service.py); a unit test checks it against what `Gauges` renders.
ESTIMATED_ACCURACY = "visionloop_estimated_accuracy"


def _answered(window: str) -> str:
    """Requests answered per model over the window: successes plus errors. `or ... * 0` keeps
    a model with only one of the two counters (every request failed, or none did)."""
    ok = f"sum by (model) (increase({REQUESTS}_total[{window}]))"
    err = f"sum by (model) (increase({ERRORS}_total[{window}]))"
    return f"(\n    ({ok} or {err} * 0)\n  + ({err} or {ok} * 0)\n)"


def rules_document(config: AlertConfig, *, window: str = "5m", for_: str = "5m") -> dict[str, Any]:
    """The rules file as a document (groups -> rules), for the enabled Prometheus-able rules."""
    r = config.rules
    answered = _answered(window)
    rules: list[dict[str, Any]] = []
    if r.error_rate.enabled:
        ratio = r.error_rate.max_percent / 100.0
        server_errors = f'sum by (model) (increase({ERRORS}_total{{code=~"5.."}}[{window}]))'
        rules.append(
            {
                "alert": "VisionloopServeErrorRate",
                "expr": f"(\n  {server_errors}\n/\n  {_indent(answered)}\n) > {ratio:g}\n"
                f"and on (model)\n  {_indent(answered)} >= {r.error_rate.min_requests}\n",
                "for": for_,
                "labels": {"severity": r.error_rate.severity, "visionloop_rule": "error_rate"},
                "annotations": {
                    "summary": "Server errors of model {{ $labels.model }} at "
                    f"{{{{ $value | humanizePercentage }}}} (> {r.error_rate.max_percent:g}%)",
                    "description": "HTTP 5xx answers (failures, full queues, timeouts) over all answered "
                    f"requests in the last {window}.",
                },
            }
        )
    if r.latency_p99.enabled:
        budget_s = r.latency_p99.budget_ms / 1000.0
        rules.append(
            {
                "alert": "VisionloopServeLatencyP99",
                "expr": f"histogram_quantile(0.99, sum by (model, le) (rate({LATENCY}_bucket[{window}])))"
                f" > {budget_s:g}\nand on (model)\n  {_indent(answered)} >= {r.latency_p99.min_requests}\n",
                "for": for_,
                "labels": {"severity": r.latency_p99.severity, "visionloop_rule": "latency_p99"},
                "annotations": {
                    "summary": "p99 latency of model {{ $labels.model }} is {{ $value | humanizeDuration }}"
                    f" (budget {r.latency_p99.budget_ms:g} ms)",
                    "description": "Queue + compute time of requests, 99th percentile over the last "
                    f"{window}.",
                },
            }
        )
    groups = [{"name": "visionloop-serving", "rules": rules}]
    if r.accuracy.enabled:
        groups.append({"name": "visionloop-models", "rules": _accuracy_rules(config, for_)})
    return {"groups": groups}


def _accuracy_rules(config: AlertConfig, for_: str) -> list[dict[str, Any]]:
    """One rule per model with a floor of its own, and one for every other model."""
    rule = config.rules.accuracy
    floors: list[tuple[str, float, str | None]] = [
        (f'{{model="{m}"}}', f, m) for m, f in sorted(rule.models.items())
    ]
    # Model names are letters, digits, '_', '.', '-' (registry/layout.py): only '.' needs
    # escaping in the regular expression, and the backslash itself in the PromQL string.
    others = "|".join(m.replace(".", "\\\\.") for m in sorted(rule.models))
    floors.append((f'{{model!~"{others}"}}' if others else "", rule.floor, None))
    return [
        {
            "alert": "VisionloopEstimatedAccuracyLow",
            "expr": f"{ESTIMATED_ACCURACY}{selector} < {floor:g}",
            "for": for_,
            "labels": {"severity": rule.severity, "visionloop_rule": "accuracy"},
            "annotations": {
                "summary": "Estimated accuracy of model {{ $labels.model }} v{{ $labels.version }} is "
                f'{{{{ $value | printf "%.3f" }}}} (floor {floor:g}' + (f" for {model})" if model else ")"),
                "description": "The label-free accuracy estimate of the last window that "
                "`visionloop monitor` judged.",
            },
        }
        for selector, floor, model in floors
    ]


def write_rules(config: AlertConfig, out: Path, *, window: str = "5m", for_: str = "5m") -> list[str]:
    """Write the rules file to `out`; return the names of the rules it holds."""
    doc = rules_document(config, window=window, for_=for_)
    elsewhere = [n for n in config.rules.enabled() if n not in PROMETHEUS_RULES]
    header = (
        f"# Prometheus alerting rules generated by `visionloop alerts rules --prometheus` from "
        f"{config.source or 'the default alert rules'}.\n"
        "# Load with `rule_files:` in prometheus.yml; Alertmanager routes them by `severity`.\n"
        "# Check with: promtool check rules THIS_FILE\n"
    )
    if elsewhere:
        header += (
            "# Not here (their signals are not Prometheus metrics), evaluated by `visionloop alerts check`:\n"
            f"#   {', '.join(elsewhere)}\n"
        )
    body = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=1000, default_flow_style=False)
    atomic_write_text(Path(out), header + body)
    return [rule["alert"] for group in doc["groups"] for rule in group["rules"]]


def _indent(text: str) -> str:
    return text.replace("\n", "\n  ")


class _Dumper(yaml.SafeDumper):
    """Multi-line expressions as YAML block literals (`expr: |`), as people write them."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)
