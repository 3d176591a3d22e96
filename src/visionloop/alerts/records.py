"""What flows through the alerts: a rule's findings, the alerts the engine keeps open, and the
notifications it sends when one starts firing or resolves. Plain frozen data, JSON both ways
(the engine's state and the alert log are JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Status = Literal["firing", "resolved"]


@dataclass(frozen=True, slots=True)
class Finding:
    """A rule's condition holds for one subject (a model, a job, the cluster) right now.

    `key` is the alert's identity: the same condition on the same subject has the same key
    from one check to the next, which is what makes an alert fire once and not every check."""

    rule: str
    key: str
    subject: str  # what it is about, for people: "model digits", "job 12"
    summary: str  # one line with the numbers: "p99 240 ms > budget 100 ms (512 requests)"
    severity: str
    value: float | None = None
    threshold: float | None = None


@dataclass(frozen=True, slots=True)
class RuleOutcome:
    """One rule's evaluation. `unknown` lists key prefixes the rule could not judge this time
    (a server that did not answer, no baseline yet): their open alerts stay as they are
    rather than resolve, since "no data" is not "condition cleared". `problem` says why, for
    the person running the check."""

    rule: str
    findings: tuple[Finding, ...] = ()
    unknown: tuple[str, ...] = ()
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class OpenAlert:
    rule: str
    key: str
    subject: str
    summary: str
    severity: str
    value: float | None
    threshold: float | None
    since: float  # when it started firing
    last_seen: float  # the last check that found it
    id: str  # of the firing notification; its resolution carries the same id

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> OpenAlert:
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True, slots=True)
class Notification:
    """A change to deliver: an alert started firing, or resolved."""

    id: str  # the alert's id: a firing and its resolution share it
    status: Status
    rule: str
    key: str
    subject: str
    summary: str
    severity: str
    value: float | None
    threshold: float | None
    since: float  # when the alert started firing
    at: float  # when this change was seen

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Notification:
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__})
