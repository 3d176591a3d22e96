"""The prediction record: one line of the prediction log, one typed, versioned schema.

The server writes it (the primary or challenger that answered, and a shadow's answer with
whether it agreed); monitoring and labelling read it back with `PredictionRecord.from_json`.
On disk a record is one flat JSON object, the task's own fields (`Task.log_fields`: a
classifier's top class and confidence, a detector's detection count, counts per class and
best score) beside the common ones:

    {"schema": 3, "time": 1764230400.1, "model": "digits", "version": 3, "role": "primary",
     "latency_ms": 4.2, "top_class": "7", "confidence": 0.98,
     "monitor": {"outputs": [0.001, ..., 0.98, ...], "predicted": 7, "confidence": 0.98,
                 "image": {"brightness": 0.41, "contrast": 0.2, ...}}}

`monitor` (schema 3) holds what `visionloop monitor` compares with the version's reference
(`MonitorFields`): the task's drift columns (`Task.drift_outputs`: a classifier's calibrated
class probabilities), the predicted class and its confidence, and, for a request to the image
endpoint, the image's statistics (`monitor.imagestats`); for a model exported with an
embedding output, also the image's PCA-reduced penultimate-layer embedding (`"embedding"`, 16
numbers). Schemas 1 (no "schema") and 2 (no
"monitor") still read, with `monitor` None.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import orjson

from visionloop.core.fsutil import LongLine, capped_lines, open_regular

SCHEMA_VERSION = 3
Role = Literal["primary", "challenger", "shadow"]
ROLES: tuple[Role, ...] = ("primary", "challenger", "shadow")
# The common fields; a task's field of the same name would be shadowed by them.
COMMON = ("schema", "time", "model", "version", "role", "latency_ms", "agrees", "monitor")
# A record's drift columns (a classifier's probabilities) and image statistics are bounded.
MAX_OUTPUTS = 1000
MAX_IMAGE_STATS = 32
MAX_EMBEDDING = 256
# Decimals the monitor fields keep. A reader comparing them with unrounded numbers must round
# those the same way: a probability under 5e-7 is logged as 0, below every unrounded one.
MONITOR_DECIMALS = 6
# A record is a few hundred bytes; a line far longer was not written by the server.
MAX_LINE_BYTES = 64 * 1024


class RecordError(ValueError):
    """A line of a prediction log is not a prediction record this release can read."""


@dataclass(frozen=True, slots=True)
class MonitorFields:
    """Per request, what drift monitoring reads (see the module docstring)."""

    outputs: Sequence[float] | None = None  # the task's drift columns, in its order
    predicted: int | None = None
    confidence: float | None = None
    image: Mapping[str, float] | None = None  # imagestats of the image as sent
    # The export's `embedding` output (penultimate layer, PCA-reduced); None without one.
    embedding: Sequence[float] | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if self.outputs is not None:
            doc["outputs"] = _rounded(self.outputs)
        if self.predicted is not None:
            doc["predicted"] = int(self.predicted)
        if self.confidence is not None:
            doc["confidence"] = round(float(self.confidence), MONITOR_DECIMALS)
        if self.image is not None:
            doc["image"] = {k: round(float(v), MONITOR_DECIMALS) for k, v in self.image.items()}
        if self.embedding is not None:
            doc["embedding"] = _rounded(self.embedding)
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> MonitorFields:
        if not isinstance(doc, dict):
            raise RecordError(f"monitor must be a JSON object, got {type(doc).__name__}")
        outputs = _numbers(doc, "outputs", MAX_OUTPUTS)
        embedding = _numbers(doc, "embedding", MAX_EMBEDDING)
        predicted = doc.get("predicted")
        if predicted is not None and (
            not isinstance(predicted, int) or isinstance(predicted, bool) or predicted < 0
        ):
            raise RecordError(f"monitor.predicted must be a class index (an integer >= 0), got {predicted!r}")
        confidence = (
            None if doc.get("confidence") is None else _number(doc, "monitor.confidence", "confidence")
        )
        image = doc.get("image")
        if image is not None:
            if not isinstance(image, dict) or len(image) > MAX_IMAGE_STATS:
                raise RecordError(f"monitor.image must be an object of at most {MAX_IMAGE_STATS} statistics")
            image = {str(k): _number(image, f"monitor.image.{k}", k) for k in image}
        return cls(outputs, predicted, confidence, image, embedding)


def _rounded(values: Sequence[float]) -> list[float]:
    # A numpy row from the server: tolist() gives Python floats (in the writer thread).
    items = values.tolist() if hasattr(values, "tolist") else list(values)
    return [round(float(v), MONITOR_DECIMALS) for v in items]


def _numbers(doc: dict[str, Any], key: str, limit: int) -> tuple[float, ...] | None:
    values = doc.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or len(values) > limit:
        raise RecordError(f"monitor.{key} must be a list of at most {limit} numbers")
    return tuple(_number({"v": v}, f"monitor.{key}[]", "v") for v in values)


@dataclass(frozen=True, slots=True)
class PredictionRecord:
    time: float  # seconds since the epoch, when the batch was answered
    model: str
    version: int
    role: Role
    latency_ms: float  # queue + compute
    answer: Mapping[str, Any] = field(default_factory=dict)  # the task's log_fields
    agrees: bool | None = None  # a shadow's answer: whether it agreed with the primary's
    monitor: MonitorFields | None = None
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
        if self.monitor is not None:
            doc["monitor"] = self.monitor.to_json()
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
        monitor = None if doc.get("monitor") is None else MonitorFields.from_json(doc["monitor"])
        answer = {k: v for k, v in doc.items() if k not in COMMON}
        return cls(t, model, version, cast(Role, role), latency, answer, agrees, monitor, SCHEMA_VERSION)


def _number(doc: Mapping[str, Any], what: str, key: str | None = None) -> float:
    value = doc.get(what if key is None else key)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise RecordError(f"{what} must be a finite number, got {value!r}")
    return float(value)


@dataclass
class ReadStats:
    """What `read_records` skipped, so a reader can say how much of a log it could not use."""

    read: int = 0
    bad: int = 0
    first_error: str | None = None

    def skip(self, where: str) -> None:
        """Count one item skipped; keep the first one's place and reason (`where`)."""
        self.bad += 1
        if self.first_error is None:
            self.first_error = where


def read_records(path: Path, stats: ReadStats | None = None) -> Iterator[PredictionRecord]:
    """The records of one log file in order. Lines that are not records (torn by a crash,
    too long, from another program) are skipped and counted in `stats`, never fatal: a log
    is evidence, and one bad line must not hide the rest."""
    stats = stats if stats is not None else ReadStats()
    try:
        f = open_regular(path)  # a FIFO among the logs is skipped, not waited on
    except OSError as e:
        stats.skip(f"{path}: {e}")
        return
    with f:
        for number, line in capped_lines(f, MAX_LINE_BYTES):
            if isinstance(line, LongLine):  # counted, never held whole
                stats.skip(f"{path}:{number}: line of {line.size} bytes (at most {MAX_LINE_BYTES})")
                continue
            if not line.strip():
                continue
            try:
                record = PredictionRecord.from_json(orjson.loads(line))
            except (RecordError, orjson.JSONDecodeError) as e:
                stats.skip(f"{path}:{number}: {e}")
                continue
            stats.read += 1
            yield record
