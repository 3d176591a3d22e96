"""The alert rules' configuration: `<home>/alerts.toml` (or a `.yaml` file given with
--config). Every rule has a default from practice, so a missing file (or a missing table)
means "all rules on, at their defaults"; a table changes only the keys it names.

    [rules.queue_wait]
    max_minutes = 240        # a normal job may wait 4 h before anyone is told
    [rules.drift]
    enabled = false          # this team watches drift in its own dashboards

`visionloop alerts init` writes the whole file with every key commented (template.py). A
malformed file fails when it is read, naming the file, the key, what was found and a line to
write instead: a rule that silently kept its default because of a typo would be an alert that
never fires.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from visionloop.core.errors import ConfigError
from visionloop.core.fsutil import NotTextError, TooLargeError, read_capped_text
from visionloop.core.safetoml import TomlError, load_toml

CONFIG_FILE = "alerts.toml"
WEBHOOK_ENV = "VISIONLOOP_ALERTS_WEBHOOK"  # the webhook URL, kept out of files (it is a secret)
SERVE_KEY_ENV = "VISIONLOOP_ALERTS_SERVE_KEY"  # an API key for the servers' /metrics
SEVERITIES = ("critical", "warning", "info")
MAX_CONFIG_BYTES = 1024 * 1024  # the commented default file is a few KiB


def _opt(default: Any, example: str, *, low: float | None = None, high: float | None = None) -> Any:
    """A config key: its default, a line a user could write, and its bounds (inclusive)."""
    meta = {"example": example, "low": low, "high": high}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


def _sev(default: str) -> Any:
    return field(default=default, metadata={"example": f'severity = "{default}"', "choices": SEVERITIES})


@dataclass(frozen=True)
class DriftRule:
    """Drift found on the last `windows` judged windows of a model's traffic, in a row."""

    enabled: bool = _opt(True, "enabled = true")
    windows: int = _opt(3, "windows = 3", low=1, high=1000)
    severity: str = _sev("warning")


@dataclass(frozen=True)
class AccuracyRule:
    """The label-free accuracy estimate of a model's latest window under a floor."""

    enabled: bool = _opt(True, "enabled = true")
    floor: float = _opt(0.8, "floor = 0.8", low=0.0, high=1.0)
    # Per-model floors: a 10-class classifier and a 2-class one have different baselines.
    models: Mapping[str, float] = _opt({}, "models = { digits = 0.9 }", low=0.0, high=1.0)
    severity: str = _sev("critical")

    def floor_for(self, model: str) -> float:
        return self.models.get(model, self.floor)


@dataclass(frozen=True)
class ErrorRateRule:
    """Server errors (5xx) over all answered requests, between two checks, per model."""

    enabled: bool = _opt(True, "enabled = true")
    max_percent: float = _opt(1.0, "max_percent = 1", low=0.0, high=100.0)
    # Below this many requests between two checks a rate says little (1 error in 3 is 33%).
    min_requests: int = _opt(20, "min_requests = 20", low=1)
    severity: str = _sev("critical")


@dataclass(frozen=True)
class LatencyRule:
    """The 99th percentile of request latency (queue + compute) above the serving budget."""

    enabled: bool = _opt(True, "enabled = true")
    budget_ms: float = _opt(100.0, "budget_ms = 100", low=0.001)
    min_requests: int = _opt(20, "min_requests = 20", low=1)
    severity: str = _sev("warning")


@dataclass(frozen=True)
class GpuUtilisationRule:
    """A running job whose GPUs averaged under `min_percent` over the last `for_minutes`."""

    enabled: bool = _opt(True, "enabled = true")
    min_percent: float = _opt(50.0, "min_percent = 50", low=0.0, high=100.0)
    for_minutes: float = _opt(30.0, "for_minutes = 30", low=1.0)
    severity: str = _sev("warning")


@dataclass(frozen=True)
class QueueWaitRule:
    """A job queued longer than its class allows (since it last entered the queue)."""

    enabled: bool = _opt(True, "enabled = true")
    max_minutes: float = _opt(120.0, "max_minutes = 120", low=0.0)
    high_priority_minutes: float = _opt(5.0, "high_priority_minutes = 5", low=0.0)
    # Jobs of a priority class ranked at least this high (cluster.toml [priorities]; the
    # default classes are low 10, normal 50, high 100) get `high_priority_minutes`.
    high_priority_rank: int = _opt(100, "high_priority_rank = 100")
    severity: str = _sev("warning")


@dataclass(frozen=True)
class JobFailureRule:
    """Failed jobs over all jobs that finished (succeeded or failed) in the window."""

    enabled: bool = _opt(True, "enabled = true")
    max_percent: float = _opt(5.0, "max_percent = 5", low=0.0, high=100.0)
    window_hours: float = _opt(24.0, "window_hours = 24", low=0.1)
    min_jobs: int = _opt(5, "min_jobs = 5", low=1)
    severity: str = _sev("warning")


@dataclass(frozen=True)
class DailyCostRule:
    """The last 24 hours' GPU cost above `factor` x the median of the `trailing_days` before."""

    enabled: bool = _opt(True, "enabled = true")
    factor: float = _opt(2.0, "factor = 2.0", low=1.0)
    trailing_days: int = _opt(7, "trailing_days = 7", low=1, high=90)
    # A day that cost less than this never alerts (a quiet week's median can be cents).
    min_cost: float = _opt(1.0, "min_cost = 1.0", low=0.0)
    severity: str = _sev("warning")


@dataclass(frozen=True)
class CheckpointRestoreRule:
    """A checkpoint that failed verification when a job tried to resume from it."""

    enabled: bool = _opt(True, "enabled = true")
    severity: str = _sev("critical")


@dataclass(frozen=True)
class Rules:
    drift: DriftRule = DriftRule()
    accuracy: AccuracyRule = AccuracyRule()
    error_rate: ErrorRateRule = ErrorRateRule()
    latency_p99: LatencyRule = LatencyRule()
    gpu_utilisation: GpuUtilisationRule = GpuUtilisationRule()
    queue_wait: QueueWaitRule = QueueWaitRule()
    job_failure_rate: JobFailureRule = JobFailureRule()
    daily_cost: DailyCostRule = DailyCostRule()
    checkpoint_restore: CheckpointRestoreRule = CheckpointRestoreRule()

    def enabled(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name).enabled]


RULE_NAMES = tuple(f.name for f in dataclasses.fields(Rules))
_DEFAULT_RULES = Rules()


@dataclass(frozen=True)
class Sources:
    """Where the signals come from, beyond the home's own stores."""

    # Inference servers whose /metrics are scraped (error rate, p99 latency).
    serve_urls: tuple[str, ...] = _opt((), 'serve_urls = ["http://127.0.0.1:8000"]')
    scrape_timeout_s: float = _opt(5.0, "scrape_timeout_s = 5", low=0.1, high=300.0)
    # None: every model with a monitor window log under the home.
    models: tuple[str, ...] | None = _opt(None, 'models = ["digits"]')
    # The cluster config whose price catalog prices GPU time (default <home>/cluster.toml).
    cluster_config: str | None = _opt(None, 'cluster_config = "/etc/visionloop/cluster.toml"')


@dataclass(frozen=True)
class Delivery:
    # A secret: never printed, never logged. Prefer the environment variable.
    webhook_url: str | None = field(
        default=None, repr=False, metadata={"example": 'webhook_url = "https://hooks.slack.com/services/..."'}
    )
    timeout_s: float = _opt(5.0, "timeout_s = 5", low=0.1, high=120.0)
    retries: int = _opt(2, "retries = 2", low=0, high=10)
    backoff_s: float = _opt(1.0, "backoff_s = 1.0", low=0.0, high=60.0)


@dataclass(frozen=True)
class AlertConfig:
    rules: Rules = Rules()
    sources: Sources = Sources()
    delivery: Delivery = Delivery()
    source: Path | None = None  # the file it was read from (None: the defaults)


def default_path(home: Path) -> Path:
    return Path(home) / CONFIG_FILE


def load_config(path: Path | None, home: Path) -> AlertConfig:
    """The config at `path` (an error if it is missing), else `<home>/alerts.toml` if it
    exists, else the defaults. The webhook URL from VISIONLOOP_ALERTS_WEBHOOK wins over the
    file's."""
    # exists(), not is_file(): a FIFO, device or folder there is refused by _read_text ("is a
    # FIFO"), not taken for a missing file (which for the home's meant every rule silently
    # back at its defaults, and for --config advice to `init` over it).
    if path is not None and not Path(path).exists():
        raise ConfigError(
            f"no alert config at {path}. Write one with `visionloop alerts init --config {path}`."
        )
    chosen = Path(path) if path is not None else default_path(home)
    config = _read(chosen) if chosen.exists() else AlertConfig()
    env_url = os.environ.get(WEBHOOK_ENV, "").strip()
    if env_url:
        config = dataclasses.replace(
            config, delivery=dataclasses.replace(config.delivery, webhook_url=_url(env_url, WEBHOOK_ENV))
        )
    return config


def _read_text(path: Path) -> str:
    """The file's text: a regular file (a FIFO would hang us) of at most MAX_CONFIG_BYTES, UTF-8."""
    try:
        return read_capped_text(path, MAX_CONFIG_BYTES, what="an alert config", encoding="utf-8-sig")
    except OSError as e:
        raise ConfigError(f"cannot read the alert config {path}: {e.strerror or e}.") from e
    except TooLargeError:
        raise ConfigError(
            f"{path} is larger than {MAX_CONFIG_BYTES // 1024} KiB; an alert config is a few dozen lines. "
            "Check that --config names the right file, or write one with `visionloop alerts init`."
        ) from None
    except NotTextError as e:
        raise ConfigError(str(e)) from e


def _read(path: Path) -> AlertConfig:
    text = _read_text(path)
    try:
        if path.suffix in (".yaml", ".yml"):
            from visionloop.core.safeyaml import load_untrusted

            doc = load_untrusted(text)  # no aliases: a few hundred bytes could stand for billions
        else:
            doc = load_toml(text)
    except TomlError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}. Fix it, or remove it for the defaults.") from e
    except Exception as e:  # yaml.YAMLError, without importing yaml for every TOML file
        if type(e).__module__.startswith("yaml"):
            raise ConfigError(f"{path} is not valid YAML: {e}. Fix it, or remove it for the defaults.") from e
        raise
    config = parse_config({} if doc is None else doc, str(path))
    if config.delivery.webhook_url is not None and path.stat().st_mode & 0o007:
        raise ConfigError(
            f"{path} holds the webhook URL (a secret: whoever has it can post to your channel) and "
            f"every user can read it. `chmod 600 {path}`, or move the URL to the {WEBHOOK_ENV} "
            "environment variable."
        )
    cluster = config.sources.cluster_config
    if cluster is not None and not Path(cluster).expanduser().is_absolute():
        # Relative to the config file, as cluster.toml's own `prices` is: not to wherever
        # `alerts check` happens to be started from.
        config = dataclasses.replace(
            config, sources=dataclasses.replace(config.sources, cluster_config=str(path.parent / cluster))
        )
    return dataclasses.replace(config, source=path)


def parse_config(doc: Any, where: str = "alert config") -> AlertConfig:
    """An AlertConfig from a parsed document; ConfigError naming the key on anything wrong."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected tables such as [rules.drift], got {type(doc).__name__}.")
    _known(doc, ("rules", "sources", "delivery"), where, "the top level")
    rules_doc = _table(doc.get("rules", {}), "rules", where)
    for name in rules_doc:
        if name not in RULE_NAMES:
            # str(): YAML keys can be numbers or null, and difflib would raise TypeError on them.
            raise ConfigError(
                f"{where}: there is no rule [rules.{str(name)[:64]}]{_did_you_mean(str(name), RULE_NAMES)}. "
                f"The rules are: {', '.join(RULE_NAMES)}."
            )
    built: dict[str, Any] = {
        f.name: _build(
            type(getattr(_DEFAULT_RULES, f.name)), rules_doc.get(f.name, {}), f"rules.{f.name}", where
        )
        for f in dataclasses.fields(Rules)
    }
    rules = Rules(**built)
    sources = _build(Sources, doc.get("sources", {}), "sources", where)
    for url in sources.serve_urls:
        _url(url, f"{where}: sources.serve_urls")
    delivery = _build(Delivery, doc.get("delivery", {}), "delivery", where)
    if delivery.webhook_url is not None:
        _url(delivery.webhook_url, f"{where}: delivery.webhook_url")
    return AlertConfig(rules=rules, sources=sources, delivery=delivery)


def _url(url: str, where: str) -> str:
    if not url.startswith(("http://", "https://")) or len(url) < 10:
        # The value may be a secret: say what is wrong with it without echoing it.
        raise ConfigError(
            f"{where} must be an http:// or https:// URL, e.g. https://hooks.slack.com/services/..."
        )
    return url


T = TypeVar("T")


def _build(cls: type[T], raw: Any, table: str, where: str) -> T:
    """`cls` with the table's values over its defaults, each checked against its metadata."""
    raw = _table(raw, table, where)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    _known(raw, tuple(fields), where, f"[{table}]")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        f = fields[key]
        values[key] = _value(value, f, f"{table}.{key}", where)
    return cls(**values)


def _value(value: Any, f: dataclasses.Field[Any], key: str, where: str) -> Any:
    meta = f.metadata
    example = meta.get("example", f"{f.name} = ...")
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))

    def bad(what: str, got: Any = value, at: str = key) -> ConfigError:
        return ConfigError(f"{where}: {at} must be {what}, got {_cut(got)}. Write e.g. {example}")

    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if kind == "str":
        choices = meta.get("choices")
        if not isinstance(value, str) or (choices and value not in choices):
            raise bad(f"one of {', '.join(choices)}" if choices else "a string")
        return value
    if kind in ("int", "float"):
        return _number(value, kind == "int", meta, lambda what: bad(what))
    if kind.startswith("Mapping"):
        if not isinstance(value, dict):
            raise bad("a table of model name to number")
        floors: dict[str, float] = {}
        for k, v in value.items():
            # Named to the model, with its own value: "rules.accuracy.models.digits ... got 1.5".
            floors[str(k)] = _number(v, False, meta, partial(bad, got=v, at=f"{key}.{k}"))
        return floors
    # Printable: a NUL in cluster_config made every later check of it answer "no such file"
    # (pathlib's exists() is False for it), so alerts priced GPU time from the default config.
    if kind.startswith("tuple"):
        if not isinstance(value, list) or not all(
            isinstance(v, str) and v and v.isprintable() for v in value
        ):
            raise bad("a list of strings")
        return tuple(value)
    if kind.startswith("str |"):  # an optional string: a path or a secret URL
        if not isinstance(value, str) or not value or not value.isprintable():
            raise ConfigError(
                f"{where}: {key} must be a non-empty string of printable characters. Write e.g. {example}"
            )
        return value
    raise AssertionError(f"unhandled config type {kind} of {key}")  # a bug, not a user error


def _number(value: Any, integer: bool, meta: Mapping[str, Any], bad: Callable[[str], ConfigError]) -> Any:
    low, high = meta.get("low"), meta.get("high")
    if low is not None and high is not None:
        bounds = f" from {low:g} to {high:g}"
    else:
        bounds = f" >= {low:g}" if low is not None else ""
    what = ("an integer" if integer else "a number") + bounds
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type or not _finite(value):
        raise bad(what)
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad(what)
    return int(value) if integer else float(value)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float: math.isfinite(10**400) raises
        return False


def _cut(value: Any, limit: int = 80) -> str:
    """`repr(value)` cut short: `rules = [0, 1, ..., 99999]` must not come back as a 600 KB message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _table(raw: Any, table: str, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {table} must be a table, e.g. [{table}], got {_cut(raw)}.")
    return raw


def _known(raw: Mapping[str, Any], known: tuple[str, ...], where: str, table: str) -> None:
    for key in raw:
        if key not in known:
            raise ConfigError(
                f"{where}: {table} has no key {_cut(key)}{_did_you_mean(str(key), known)}. "
                f"Its keys are: {', '.join(known)}."
            )


def _did_you_mean(word: str, options: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]}?)" if close else ""
