"""The alert rule config: defaults from practice, thresholds changed and rules disabled key by
key, and errors that name the key and say what to write."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from visionloop.alerts.rules import AlertConfig, load_config, parse_config
from visionloop.alerts.template import TEMPLATE
from visionloop.core.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_env_webhook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VISIONLOOP_ALERTS_WEBHOOK", raising=False)


def test_the_defaults_are_the_practice_the_issue_names() -> None:
    r = AlertConfig().rules
    assert (r.drift.windows, r.accuracy.floor) == (3, 0.8)
    assert (r.error_rate.max_percent, r.latency_p99.budget_ms) == (1.0, 100.0)
    assert (r.gpu_utilisation.min_percent, r.gpu_utilisation.for_minutes) == (50.0, 30.0)
    assert (r.queue_wait.max_minutes, r.queue_wait.high_priority_minutes) == (120.0, 5.0)
    assert (r.job_failure_rate.max_percent, r.job_failure_rate.window_hours) == (5.0, 24.0)
    assert (r.daily_cost.factor, r.daily_cost.trailing_days) == (2.0, 7)
    assert r.checkpoint_restore.severity == "critical"
    assert len(r.enabled()) == 9


def test_the_commented_template_is_the_defaults_and_every_key_in_it_is_valid() -> None:
    assert parse_config(tomllib.loads(TEMPLATE)) == AlertConfig()
    # Uncommenting every `# key = value` line must still parse, to the same values.
    uncommented = "\n".join(
        line[2:] if re.match(r"# [a-z_]+ = ", line) else line for line in TEMPLATE.splitlines()
    )
    doc = tomllib.loads(uncommented)
    assert doc["rules"]["queue_wait"]["max_minutes"] == 120
    cfg = parse_config(doc)
    defaults = AlertConfig()
    assert cfg.rules == dataclasses.replace(
        defaults.rules, accuracy=dataclasses.replace(defaults.rules.accuracy, models={"digits": 0.9})
    )
    assert cfg.sources.serve_urls == ("http://127.0.0.1:8000",)


def test_a_table_changes_only_the_keys_it_names(tmp_path: Path) -> None:
    path = tmp_path / "alerts.toml"
    path.write_text("[rules.queue_wait]\nmax_minutes = 240\n[rules.drift]\nenabled = false\n")
    cfg = load_config(path, tmp_path)
    assert cfg.rules.queue_wait.max_minutes == 240.0
    assert cfg.rules.queue_wait.high_priority_minutes == 5.0
    assert cfg.rules.drift.enabled is False and "drift" not in cfg.rules.enabled()
    assert cfg.source == path


def test_yaml_is_read_by_its_suffix(tmp_path: Path) -> None:
    path = tmp_path / "alerts.yaml"
    path.write_text("rules:\n  latency_p99:\n    budget_ms: 40\n    severity: critical\n")
    cfg = load_config(path, tmp_path)
    assert (cfg.rules.latency_p99.budget_ms, cfg.rules.latency_p99.severity) == (40.0, "critical")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"rules": {"queue_wait": {"max_minute": 240}}},
            "[rules.queue_wait] has no key 'max_minute' (did you mean max_minutes?). Its keys are: enabled, ",
        ),
        (
            {"rules": {"drfit": {}}},
            "there is no rule [rules.drfit] (did you mean drift?). The rules are: drift, ",
        ),
        (
            {"rules": {"queue_wait": {"max_minutes": "2h"}}},
            "rules.queue_wait.max_minutes must be a number >= 0, got '2h'. Write e.g. max_minutes = 120",
        ),
        (
            {"rules": {"error_rate": {"max_percent": 150}}},
            "error_rate.max_percent must be a number from 0 to 100, got 150. Write e.g. max_percent = 1",
        ),
        (
            {"rules": {"drift": {"windows": 2.5}}},
            "rules.drift.windows must be an integer from 1 to 1000, got 2.5. Write e.g. windows = 3",
        ),
        ({"rules": {"drift": {"enabled": "no"}}}, "rules.drift.enabled must be true or false, got 'no'"),
        (
            {"rules": {"drift": {"severity": "page"}}},
            "rules.drift.severity must be one of critical, warning, info, got 'page'",
        ),
        (
            {"rules": {"accuracy": {"models": {"digits": 1.5}}}},
            "rules.accuracy.models.digits must be a number from 0 to 1, got 1.5. Write e.g. models = ",
        ),
        ({"sources": {"serve_urls": "http://x"}}, "sources.serve_urls must be a list of strings"),
        (
            {"sources": {"serve_urls": ["localhost:8000"]}},
            "sources.serve_urls must be an http:// or https:// URL",
        ),
        ({"alerts": {}}, "the top level has no key 'alerts'"),
        ({"rules": []}, "rules must be a table"),
    ],
)
def test_a_malformed_config_names_the_key_and_what_to_write(doc: object, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(doc, "alerts.toml")
    assert message in str(e.value)
    assert str(e.value).startswith("alerts.toml: ")


def test_a_file_that_is_not_toml_says_so(tmp_path: Path) -> None:
    path = tmp_path / "alerts.toml"
    path.write_text("[rules.drift\nwindows = 3\n")
    with pytest.raises(ConfigError, match=r"alerts.toml is not valid TOML: .*Fix it"):
        load_config(path, tmp_path)
    with pytest.raises(ConfigError, match=r"no alert config at .*visionloop alerts init --config"):
        load_config(tmp_path / "missing.toml", tmp_path)


def test_a_webhook_url_is_refused_in_a_file_others_can_read_and_the_environment_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "https://hooks.slack.com/services/T000/B000/SECRET"
    path = tmp_path / "alerts.toml"
    path.write_text(f'[delivery]\nwebhook_url = "{secret}"\n')
    path.chmod(0o644)
    with pytest.raises(ConfigError) as e:
        load_config(path, tmp_path)
    assert f"chmod 600 {path}" in str(e.value) and "SECRET" not in str(e.value)
    path.chmod(0o600)
    assert load_config(path, tmp_path).delivery.webhook_url == secret
    assert "SECRET" not in repr(load_config(path, tmp_path))  # never printed by accident
    monkeypatch.setenv("VISIONLOOP_ALERTS_WEBHOOK", "http://127.0.0.1:9/hook")
    assert load_config(path, tmp_path).delivery.webhook_url == "http://127.0.0.1:9/hook"
    monkeypatch.setenv("VISIONLOOP_ALERTS_WEBHOOK", "not-a-url")
    with pytest.raises(ConfigError, match="VISIONLOOP_ALERTS_WEBHOOK must be an http"):
        load_config(None, tmp_path)
