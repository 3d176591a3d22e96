"""The prediction record: one line of the prediction log, one typed, versioned schema.

The server writes it (the primary or challenger that answered, and a shadow's answer with
whether it agreed); monitoring and labelling read it back with `PredictionRecord.from_json`.
On disk a record is one flat JSON object, the task's own fields (`Task.log_fields`: a
classifier's top class and confidence, a detector's detection count, counts per class and
best score) beside the common ones:

    {"schema": 2, "time": 1764230400.1, "model": "digits", "version": 3, "role": "primary",
     "latency_ms": 4.2, "top_class": "7", "confidence": 0.98}

Schema 1 (before this module) was the same object without "schema"; it still reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import orjson

SCHEMA_VERSION = 2
Role = Literal["primary", "challenger", "shadow"]
ROLES: tuple[Role, ...] = ("primary", "challenger", "shadow")
# The common fields; a task's field of the same name would be shadowed by them.
COMMON = ("schema", "time", "model", "version", "role", "latency_ms", "agrees")
# A record is a few hundred bytes; a line far longer was not written by the server.
MAX_LINE_BYTES = 64 * 1024


class RecordError(ValueError):
    """A line of a prediction log is not a prediction record this release can read."""


@dataclass(frozen=True, slots=True)
class PredictionRecord:
    time: float  # seconds since the epoch, when the batch was answered
    model: str
    version: int
    role: Role
    latency_ms: float  # queue + compute
    answer: Mapping[str, Any] = field(default_factory=dict)  # the task's log_fields
    agrees: bool | None = None  # a shadow's answer: whether it agreed with the primary's
    schema: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        """The flat JSON object written to the log (the common fields win a name clash)."""
        doc: dict[str, Any] = {**self.answer}
        doc.update(
            schema=self.schema,
            time=self.time,
            model=self.model,
            version=self.version,
            role=self.role,
            latency_ms=self.latency_ms,
        )
        if self.agrees is not None:
            doc["agrees"] = self.agrees
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> PredictionRecord:
        """Parse one logged object; RecordError saying which field is wrong."""
        if not isinstance(doc, dict):
            raise RecordError(f"a prediction record is a JSON object, not {type(doc).__name__}")
        schema = doc.get("schema", 1)
        if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
            raise RecordError(f"schema must be a positive integer, got {schema!r}")
        if schema > SCHEMA_VERSION:
            raise RecordError(
                f"schema {schema} was written by a newer visionloop (this one reads up to "
                f"{SCHEMA_VERSION}); upgrade visionloop to read it"
            )
        t = _number(doc, "time")
        latency = _number(doc, "latency_ms")
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise RecordError(f"model must be a non-empty string, got {model!r}")
        version = doc.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise RecordError(f"version must be a positive integer, got {version!r}")
        role = doc.get("role")
        if role not in ROLES:
            raise RecordError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        agrees = doc.get("agrees")
        if agrees is not None and not isinstance(agrees, bool):
            raise RecordError(f"agrees must be true or false, got {agrees!r}")
        answer = {k: v for k, v in doc.items() if k not in COMMON}
        return cls(t, model, version, cast(Role, role), latency, answer, agrees, SCHEMA_VERSION)


def _number(doc: Mapping[str, Any], key: str) -> float:
    value = doc.get(key)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise RecordError(f"{key} must be a finite number, got {value!r}")
    return float(value)


@dataclass
class ReadStats:
    """What `read_records` skipped, so a reader can say how much of a log it could not use."""

    read: int = 0
    bad: int = 0
    first_error: str | None = None


def read_records(path: Path, stats: ReadStats | None = None) -> Iterator[PredictionRecord]:
    """The records of one log file in order. Lines that are not records (torn by a crash,
    too long, from another program) are skipped and counted in `stats`, never fatal: a log
    is evidence, and one bad line must not hide the rest."""
    stats = stats if stats is not None else ReadStats()
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                if len(line) > MAX_LINE_BYTES:
                    raise RecordError(f"line of {len(line)} bytes (at most {MAX_LINE_BYTES})")
                record = PredictionRecord.from_json(orjson.loads(line))
            except (RecordError, orjson.JSONDecodeError) as e:
                stats.bad += 1
                if stats.first_error is None:
                    stats.first_error = f"{path}:{number}: {e}"
                continue
            stats.read += 1
            yield record
