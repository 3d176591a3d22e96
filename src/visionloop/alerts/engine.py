"""From findings to firing and resolved alerts, delivered once each.

The engine keeps, in `<home>/alerts/state.json`:
- the open alerts, by key. A finding whose key is already open changes nothing that is
  delivered (it only refreshes the summary): an alert that keeps firing is told once. An open
  alert whose rule ran and did not find it again resolves, and that is told once too;
- the outbox: notifications not yet delivered to the webhook. They leave it only when the
  receiver accepted them, so a receiver that is down loses nothing: the next check retries;
- the last reading of each inference server, which rates are measured against.

The state file is written (atomically) before anything is delivered, so a restart never
re-fires what was already open. A crash between a delivery and the write that follows it can
deliver that notification once more (at least once, never lost); every notification carries
the alert's id for a receiver that wants to drop the duplicate.

Checks are serialised by a lock file: a `--follow` loop and a manual `check` never judge (and
deliver) the same transition twice.
"""

from __future__ import annotations

import fcntl
import json
import logging
import secrets
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from visionloop.alerts.records import Finding, Notification, OpenAlert, RuleOutcome
from visionloop.alerts.scrape import Reading
from visionloop.core.errors import ConfigError
from visionloop.core.fsutil import atomic_write_text, ensure_private_dir

log = logging.getLogger(__name__)

STATE_SCHEMA = 1
STATE_FILE = "state.json"
LOCK_FILE = ".lock"
# A receiver down for days must not grow the state without bound: the oldest undelivered
# notifications go first (the alert log still has every one of them).
MAX_OUTBOX = 1000


def alerts_dir(home: Path) -> Path:
    return Path(home) / "alerts"


@dataclass
class AlertState:
    open: dict[str, OpenAlert] = field(default_factory=dict)
    outbox: list[Notification] = field(default_factory=list)
    readings: dict[str, Reading] = field(default_factory=dict)  # by server URL

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": STATE_SCHEMA,
            "open": {k: a.to_json() for k, a in self.open.items()},
            "outbox": [n.to_json() for n in self.outbox],
            "readings": {u: r.to_json() for u, r in self.readings.items()},
        }

    @classmethod
    def from_json(cls, doc: Any) -> AlertState:
        if not isinstance(doc, dict) or doc.get("schema") != STATE_SCHEMA:
            raise ValueError(f"not an alert state of schema {STATE_SCHEMA}")
        return cls(
            open={k: OpenAlert.from_json(a) for k, a in doc["open"].items()},
            outbox=[Notification.from_json(n) for n in doc["outbox"]],
            readings={u: Reading.from_json(r) for u, r in doc["readings"].items()},
        )


def load_state(home: Path) -> AlertState:
    path = alerts_dir(home) / STATE_FILE
    if not path.is_file():
        return AlertState()
    try:
        return AlertState.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        # Starting over would re-fire every open alert and drop undelivered ones: stop instead.
        raise ConfigError(
            f"the alert state {path} is unreadable ({type(e).__name__}: {e}). Move it aside to start "
            "over (open alerts then fire again on the next check); <home>/alerts/log.jsonl keeps the history."
        ) from e


def save_state(home: Path, state: AlertState) -> None:
    folder = alerts_dir(home)
    ensure_private_dir(folder)
    atomic_write_text(folder / STATE_FILE, json.dumps(state.to_json(), indent=1) + "\n", mode=0o600)


@contextmanager
def locked(home: Path) -> Iterator[None]:
    """Hold the alerts' lock (blocking) for one check."""
    folder = alerts_dir(home)
    ensure_private_dir(folder)
    with open(folder / LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def apply(
    state: AlertState, outcomes: Iterable[RuleOutcome], disabled: Iterable[str], now: float
) -> list[Notification]:
    """Update `state` with one check's outcomes; return the transitions (also queued in its
    outbox). Rules in `disabled` resolve whatever they left open."""
    changes: list[Notification] = []
    for outcome in outcomes:
        found = {f.key: f for f in outcome.findings}
        for key, finding in found.items():
            current = state.open.get(key)
            if current is None:
                alert = _opened(finding, now)
                state.open[key] = alert
                changes.append(_note(alert, "firing", now))
            else:  # still firing: fresher numbers, nothing to tell
                state.open[key] = replace(
                    current,
                    subject=finding.subject,
                    summary=finding.summary,
                    severity=finding.severity,
                    value=finding.value,
                    threshold=finding.threshold,
                    last_seen=now,
                )
        for key, alert in list(state.open.items()):
            if alert.rule != outcome.rule or key in found or key.startswith(outcome.unknown):
                continue
            del state.open[key]
            changes.append(_note(alert, "resolved", now))
    off = set(disabled)
    for key, alert in list(state.open.items()):
        if alert.rule in off:
            del state.open[key]
            changes.append(
                _note(replace(alert, summary=f"rule disabled; was: {alert.summary}"), "resolved", now)
            )
    state.outbox.extend(changes)
    if len(state.outbox) > MAX_OUTBOX:
        dropped = len(state.outbox) - MAX_OUTBOX
        log.warning("alert outbox full: %d undelivered notifications dropped (still in the log)", dropped)
        del state.outbox[:dropped]
    return changes


def delivered(state: AlertState, ids: Sequence[tuple[str, str]]) -> None:
    """Remove notifications the receiver accepted, by (id, status)."""
    done = set(ids)
    state.outbox = [n for n in state.outbox if (n.id, n.status) not in done]


def _opened(f: Finding, now: float) -> OpenAlert:
    return OpenAlert(
        rule=f.rule,
        key=f.key,
        subject=f.subject,
        summary=f.summary,
        severity=f.severity,
        value=f.value,
        threshold=f.threshold,
        since=now,
        last_seen=now,
        id=secrets.token_hex(8),
    )


def _note(a: OpenAlert, status: str, now: float) -> Notification:
    return Notification(
        id=a.id,
        status="firing" if status == "firing" else "resolved",
        rule=a.rule,
        key=a.key,
        subject=a.subject,
        summary=a.summary,
        severity=a.severity,
        value=a.value,
        threshold=a.threshold,
        since=a.since,
        at=now,
    )
