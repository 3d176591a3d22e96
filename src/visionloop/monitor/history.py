"""The monitor's window log: one typed record per window of served traffic it judged.

`visionloop monitor` appends a `WindowRecord` per window to
`<home>/monitor/<model>/windows.jsonl`; the alerts read them back (drift on N consecutive
windows, estimated accuracy under a floor) with `read_windows`. One flat JSON object a line:

    {"schema": 1, "model": "digits", "version": 3, "start": 1764230400.0, "end": 1764234000.0,
     "requests": 812, "tested": 406, "status": "ok", "drift": true, "p_value": 1.2e-05,
     "alpha": 0.05, "flagged": ["ks_bbsd"], "moved": ["ks_bbsd: p(7)"],
     "estimated_accuracy": 0.91, "p_values": {"ks_bbsd": 1.2e-05, "label_shift": 0.2}}
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from visionloop.core.fsutil import LongLine, capped_lines, open_regular
from visionloop.registry.layout import check_name

SCHEMA_VERSION = 1
WINDOWS_FILE = "windows.jsonl"
MAX_LINE_BYTES = 256 * 1024


class WindowRecordError(ValueError):
    """A line of a window log is not a window record this release can read."""


@dataclass(frozen=True, slots=True)
class WindowRecord:
    model: str
    version: int
    start: float  # seconds since the epoch: the window's first request
    end: float  # the window's last request
    requests: int  # records in the window
    tested: int  # samples the tests saw (after thinning correlated traffic)
    status: str  # "ok", or "too_few_samples" when no test ran
    drift: bool
    p_value: float | None  # the verdict's: min(1, T * smallest p) over the T tests that ran
    alpha: float
    flagged: tuple[str, ...] = ()  # tests that found drift
    moved: tuple[str, ...] = ()  # what moved in them, most significant first
    estimated_accuracy: float | None = None  # from calibrated confidences, no labels
    p_values: Mapping[str, float | None] = field(default_factory=dict)  # per test
    schema: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "model": self.model,
            "version": self.version,
            "start": self.start,
            "end": self.end,
            "requests": self.requests,
            "tested": self.tested,
            "status": self.status,
            "drift": self.drift,
            "p_value": self.p_value,
            "alpha": self.alpha,
            "flagged": list(self.flagged),
            "moved": list(self.moved),
            "estimated_accuracy": self.estimated_accuracy,
            "p_values": dict(self.p_values),
        }

    @classmethod
    def from_json(cls, doc: Any) -> WindowRecord:
        if not isinstance(doc, dict):
            raise WindowRecordError(f"a window record is a JSON object, not {type(doc).__name__}")
        schema = doc.get("schema")
        if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
            raise WindowRecordError(f"schema must be a positive integer, got {schema!r}")
        if schema > SCHEMA_VERSION:
            raise WindowRecordError(
                f"schema {schema} was written by a newer visionloop (this one reads up to "
                f"{SCHEMA_VERSION}); upgrade visionloop to read it"
            )
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise WindowRecordError(f"model must be a non-empty string, got {model!r}")
        p_values = doc.get("p_values", {})
        if not isinstance(p_values, dict):
            raise WindowRecordError("p_values must be an object of test name to p-value")
        return cls(
            model=model,
            version=_int(doc, "version", 1),
            start=_float(doc, "start"),
            end=_float(doc, "end"),
            requests=_int(doc, "requests", 0),
            tested=_int(doc, "tested", 0),
            status=str(doc.get("status", "ok")),
            drift=_bool(doc, "drift"),
            p_value=_optional_float(doc, "p_value"),
            alpha=_float(doc, "alpha"),
            flagged=_strings(doc, "flagged"),
            moved=_strings(doc, "moved"),
            estimated_accuracy=_optional_float(doc, "estimated_accuracy"),
            p_values={str(k): _optional_float(p_values, k) for k in p_values},
        )


def windows_path(home: Path, model: str) -> Path:
    """Where the monitor's window records for `model` go."""
    return Path(home) / "monitor" / check_name(model) / WINDOWS_FILE


def append_window(home: Path, record: WindowRecord) -> Path:
    """Append one record (a single write of one line: a crash leaves whole lines)."""
    path = windows_path(home, record.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(orjson.dumps(record.to_json()) + b"\n")
    return path


def read_windows(home: Path, model: str) -> Iterator[WindowRecord]:
    """The records for `model`, oldest first; torn or foreign lines are skipped."""
    path = windows_path(home, model)
    if not path.exists():
        return
    with open_regular(path) as f:  # a FIFO is refused, not waited on
        for _, line in capped_lines(f, MAX_LINE_BYTES):
            if isinstance(line, LongLine) or not line.strip():
                continue
            try:
                yield WindowRecord.from_json(orjson.loads(line))
            except (WindowRecordError, orjson.JSONDecodeError):
                continue


def _float(doc: Mapping[str, Any], key: str) -> float:
    value = doc.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise WindowRecordError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def _optional_float(doc: Mapping[str, Any], key: str) -> float | None:
    return None if doc.get(key) is None else _float(doc, key)


def _int(doc: Mapping[str, Any], key: str, least: int) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise WindowRecordError(f"{key} must be an integer >= {least}, got {value!r}")
    return value


def _bool(doc: Mapping[str, Any], key: str) -> bool:
    value = doc.get(key)
    if not isinstance(value, bool):
        raise WindowRecordError(f"{key} must be true or false, got {value!r}")
    return value


def _strings(doc: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = doc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WindowRecordError(f"{key} must be a list of strings")
    return tuple(value)
