"""Delivering notifications: a webhook POST of Slack-compatible JSON, and the alert log.

The webhook gets `{"text": ..., "attachments": [...]}`: `text` alone is a readable message
(what Slack shows in notifications, and all some receivers read); each attachment is one
alert with a colour bar (red firing, green resolved) that Slack, Mattermost and Rocket.Chat
render. Up to MAX_PER_MESSAGE alerts go in one message, so a queue of 200 stuck jobs is a few
messages rather than 200.

A POST has a timeout and a few retries with doubling backoff (on connection errors, timeouts,
429 and 5xx); whatever still fails stays in the outbox for the next check. Nothing here
raises: a broken receiver must never stop the evaluation, and the check reports it instead.

The log, `<home>/alerts/log.jsonl`, is append-only: one JSON line per firing, resolution and
delivery failure, written whole in one write (a crash leaves whole lines).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from visionloop.alerts.records import Notification
from visionloop.core.fsutil import json_objects

log = logging.getLogger(__name__)

LOG_FILE = "log.jsonl"
# A line of the alert log longer than this was not written by it (an event is a few KiB).
MAX_EVENT_BYTES = 1 << 20
MAX_PER_MESSAGE = 20
MAX_RETRY_AFTER_S = 30.0
_COLOURS = {"resolved": "#2eb886", "critical": "#d62728", "warning": "#ff9f0e", "info": "#1f77b4"}


# ----------------------------------------------------------------------------- the alert log


class AlertLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, event: str, **fields: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"event": event, **fields}, separators=(",", ":"), default=str) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)

    def notification(self, n: Notification) -> None:
        self.append(n.status, **n.to_json())

    def read(self) -> Iterator[dict[str, Any]]:
        """Every event, oldest first; a torn last line is skipped."""
        if not self.path.is_file():
            return
        with open(self.path, "rb") as f:
            yield from json_objects(f, MAX_EVENT_BYTES)


# ----------------------------------------------------------------------------- the webhook


@dataclass(frozen=True)
class Webhook:
    url: str
    timeout_s: float = 5.0
    retries: int = 2
    backoff_s: float = 1.0

    def __repr__(self) -> str:  # the URL is a secret
        return f"Webhook(timeout_s={self.timeout_s}, retries={self.retries})"


@dataclass(frozen=True)
class Delivery:
    delivered: tuple[Notification, ...]
    error: str | None  # why the rest were not (None: everything went)
    posts: int


def deliver(hook: Webhook, notes: Sequence[Notification]) -> Delivery:
    """POST `notes` in messages of MAX_PER_MESSAGE, oldest first. Stops at the first message
    the receiver does not take (it is down: the rest would only wait out more timeouts)."""
    done: list[Notification] = []
    posts = 0
    with httpx.Client(timeout=hook.timeout_s, follow_redirects=False) as client:
        for i in range(0, len(notes), MAX_PER_MESSAGE):
            chunk = notes[i : i + MAX_PER_MESSAGE]
            ok, error, tries = _post(client, hook, slack_message(chunk))
            posts += tries
            if not ok:
                return Delivery(tuple(done), error, posts)
            done.extend(chunk)
    return Delivery(tuple(done), None, posts)


def _post(client: httpx.Client, hook: Webhook, payload: dict[str, Any]) -> tuple[bool, str | None, int]:
    error: str | None = None
    pause = hook.backoff_s
    for attempt in range(hook.retries + 1):
        if attempt:
            time.sleep(pause)
            pause *= 2
        try:
            r = client.post(hook.url, json=payload)
        except httpx.HTTPError as e:
            # The exception's text can hold the URL (a secret): say what kind of failure only.
            error = f"{type(e).__name__} (no answer within {hook.timeout_s:g} s or no connection)"
            continue
        if 200 <= r.status_code < 300:
            return True, None, attempt + 1
        error = f"the receiver answered HTTP {r.status_code}"
        if r.status_code == 429:
            pause = max(pause, min(_retry_after(r), MAX_RETRY_AFTER_S))
        elif r.status_code < 500:
            return False, error + " (a client error: check the webhook URL)", attempt + 1
    return False, error, hook.retries + 1


def _retry_after(r: httpx.Response) -> float:
    try:
        return float(r.headers.get("Retry-After", "0"))
    except ValueError:
        return 0.0


def slack_message(notes: Sequence[Notification]) -> dict[str, Any]:
    """A Slack incoming-webhook message for these notifications."""
    firing = sum(1 for n in notes if n.status == "firing")
    resolved = len(notes) - firing
    if len(notes) == 1:
        text = _line(notes[0])
    else:
        parts = [f"{n} {what}" for n, what in ((firing, "firing"), (resolved, "resolved")) if n]
        text = f"visionloop: {', '.join(parts)}\n" + "\n".join(_line(n) for n in notes)
    return {"text": text, "attachments": [_attachment(n) for n in notes]}


def _line(n: Notification) -> str:
    if n.status == "firing":
        return f"[FIRING {n.severity}] {n.rule}: {n.subject}: {n.summary}"
    return f"[RESOLVED] {n.rule}: {n.subject} (fired {_when(n.since)}, was: {n.summary})"


def _attachment(n: Notification) -> dict[str, Any]:
    colour = _COLOURS["resolved"] if n.status == "resolved" else _COLOURS.get(n.severity, _COLOURS["warning"])
    title = f"{'Resolved' if n.status == 'resolved' else 'Firing'}: {n.rule} on {n.subject}"
    return {
        "color": colour,
        "fallback": _line(n),
        "title": title,
        "text": n.summary,
        "fields": [
            {"title": "severity", "value": n.severity, "short": True},
            {"title": "since", "value": _when(n.since), "short": True},
        ],
        "footer": f"visionloop alert {n.id} ({n.key})",
        "ts": int(n.at),
    }


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M UTC")
