"""The rules themselves: each turns typed signals (signals.py, scrape.py) into findings, one
per subject whose condition holds. Pure functions of their inputs and `now`, so each rule's
threshold logic is tested without the stores, and check.py wires them to the stores."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from visionloop.alerts.records import Finding
from visionloop.alerts.rules import (
    AccuracyRule,
    CheckpointRestoreRule,
    DailyCostRule,
    DriftRule,
    ErrorRateRule,
    GpuUtilisationRule,
    JobFailureRule,
    LatencyRule,
    QueueWaitRule,
)
from visionloop.alerts.scrape import Traffic
from visionloop.alerts.signals import DailyCost, FinishedJobs, GpuUtilisation
from visionloop.monitor.history import WindowRecord
from visionloop.sched.records import Job


def drift(rule: DriftRule, model: str, windows: Sequence[WindowRecord]) -> list[Finding]:
    """Drift on each of the last `rule.windows` judged windows, all of the latest version (a
    new version starts a new run: its predecessor's drift says nothing about it)."""
    if len(windows) < rule.windows:
        return []
    last = windows[-rule.windows :]
    version = last[-1].version
    if not all(w.drift and w.version == version for w in last):
        return []
    moved = ", ".join(dict.fromkeys(m for w in last for m in w.moved[:2]))
    p = last[-1].p_value
    return [
        Finding(
            rule="drift",
            key=f"drift:{model}",
            subject=f"model {model} v{version}",
            summary=(
                f"drift on the last {rule.windows} windows in a row"
                + (f" (latest p = {p:.2g})" if p is not None else "")
                + (f"; moved: {moved}" if moved else "")
            ),
            severity=rule.severity,
            value=float(rule.windows),
            threshold=float(rule.windows),
        )
    ]


def accuracy(rule: AccuracyRule, model: str, windows: Sequence[WindowRecord]) -> list[Finding]:
    """The latest judged window's estimated accuracy under the model's floor."""
    latest = next((w for w in reversed(windows) if w.estimated_accuracy is not None), None)
    if latest is None or latest.estimated_accuracy is None:
        return []
    floor = rule.floor_for(model)
    if latest.estimated_accuracy >= floor:
        return []
    return [
        Finding(
            rule="accuracy",
            key=f"accuracy:{model}",
            subject=f"model {model} v{latest.version}",
            summary=f"estimated accuracy {latest.estimated_accuracy:.3f} < floor {floor:.3f} "
            f"({latest.requests} requests in the latest window)",
            severity=rule.severity,
            value=latest.estimated_accuracy,
            threshold=floor,
        )
    ]


def error_rate(rule: ErrorRateRule, url: str, traffic: Iterable[Traffic], *, many: bool) -> list[Finding]:
    out: list[Finding] = []
    for t in traffic:
        if t.requests < rule.min_requests:
            continue
        percent = 100.0 * t.error_ratio
        if percent <= rule.max_percent:
            continue
        out.append(
            Finding(
                rule="error_rate",
                key=f"error_rate:{url}:{t.model}",
                subject=_served(t.model, url, many),
                summary=f"server errors {percent:.2f}% > {rule.max_percent:g}% "
                f"({t.server_errors:.0f} of {t.requests:.0f} requests in {t.seconds:.0f} s)",
                severity=rule.severity,
                value=percent,
                threshold=rule.max_percent,
            )
        )
    return out


def latency_p99(rule: LatencyRule, url: str, traffic: Iterable[Traffic], *, many: bool) -> list[Finding]:
    out: list[Finding] = []
    for t in traffic:
        if t.requests < rule.min_requests or t.p99_s is None:
            continue
        ms = 1000.0 * t.p99_s
        if ms <= rule.budget_ms:
            continue
        out.append(
            Finding(
                rule="latency_p99",
                key=f"latency_p99:{url}:{t.model}",
                subject=_served(t.model, url, many),
                summary=f"p99 latency {ms:.1f} ms > budget {rule.budget_ms:g} ms "
                f"({t.requests:.0f} requests in {t.seconds:.0f} s)",
                severity=rule.severity,
                value=ms,
                threshold=rule.budget_ms,
            )
        )
    return out


def _served(model: str, url: str, many: bool) -> str:
    return f"model {model} on {url}" if many else f"model {model}"


def gpu_utilisation(
    rule: GpuUtilisationRule, running: Iterable[Job], utilisation: Mapping[int, GpuUtilisation], now: float
) -> list[Finding]:
    """Jobs on GPUs, running (this attempt) for the whole window, that averaged under the
    floor in it. A job that started within the window is still loading data and warming up."""
    window_s = 60.0 * rule.for_minutes
    out: list[Finding] = []
    for job in running:
        u = utilisation.get(job.id)
        if job.gpus == 0 or u is None or now - job.state_since < window_s:
            continue
        if u.mean_percent >= rule.min_percent:
            continue
        out.append(
            Finding(
                rule="gpu_utilisation",
                key=f"gpu_utilisation:job-{job.id}",
                subject=_job(job),
                summary=f"GPU utilisation {u.mean_percent:.0f}% < {rule.min_percent:g}% averaged over "
                f"the last {rule.for_minutes:g} min on {job.gpus} GPU(s) ({u.samples} readings)",
                severity=rule.severity,
                value=u.mean_percent,
                threshold=rule.min_percent,
            )
        )
    return out


def queue_wait(rule: QueueWaitRule, queued: Iterable[Job], now: float) -> list[Finding]:
    """Jobs in the queue longer than their class's limit, counted from when they last entered
    it (a preempted job's earlier run is not waiting time)."""
    out: list[Finding] = []
    for job in queued:
        high = job.priority_rank >= rule.high_priority_rank
        limit_min = rule.high_priority_minutes if high else rule.max_minutes
        waited_min = (now - job.state_since) / 60.0
        if waited_min <= limit_min:
            continue
        why = f"; {job.waiting_reason}" if job.waiting_reason else ""
        out.append(
            Finding(
                rule="queue_wait",
                key=f"queue_wait:job-{job.id}",
                subject=_job(job),
                summary=f"queued {_minutes(waited_min)} > {_minutes(limit_min)} allowed for "
                f"{job.priority} priority{why}",
                severity=rule.severity,
                value=waited_min,
                threshold=limit_min,
            )
        )
    return out


def job_failure_rate(rule: JobFailureRule, finished: FinishedJobs) -> list[Finding]:
    if finished.total < rule.min_jobs:
        return []
    percent = 100.0 * finished.failed / finished.total
    if percent <= rule.max_percent:
        return []
    shown = ", ".join(map(str, finished.failed_ids[:10])) + (", ..." if len(finished.failed_ids) > 10 else "")
    return [
        Finding(
            rule="job_failure_rate",
            key="job_failure_rate",
            subject="the job queue",
            summary=f"{percent:.1f}% of jobs failed in the last {rule.window_hours:g} h > "
            f"{rule.max_percent:g}% ({finished.failed} of {finished.total}: job {shown})",
            severity=rule.severity,
            value=percent,
            threshold=rule.max_percent,
        )
    ]


def daily_cost(rule: DailyCostRule, cost: DailyCost) -> list[Finding]:
    """The last day's cost over `factor` x the trailing median. A trailing median of zero (a
    new or idle cluster) gives no baseline to compare with: quiet."""
    median = cost.median
    limit = rule.factor * median
    if median <= 0 or cost.last_day < rule.min_cost or cost.last_day <= limit:
        return []
    return [
        Finding(
            rule="daily_cost",
            key="daily_cost",
            subject="GPU spend",
            summary=f"the last 24 h cost {cost.last_day:,.2f} {cost.currency} > {rule.factor:g} x the "
            f"{len(cost.trailing)}-day median {median:,.2f} {cost.currency}",
            severity=rule.severity,
            value=cost.last_day,
            threshold=limit,
        )
    ]


def checkpoint_restore(rule: CheckpointRestoreRule, corrupt: Mapping[int, Sequence[str]]) -> list[Finding]:
    """One alert per checkpoint set aside, by job id -> file names."""
    return [
        Finding(
            rule="checkpoint_restore",
            key=f"checkpoint_restore:job-{job_id}:{name}",
            subject=f"job {job_id}",
            summary=f"checkpoint {name.removesuffix('.corrupt')} failed verification on restore and was "
            f"set aside as {name}; the job resumed from an older one, or failed. Remove the file once "
            "looked at.",
            severity=rule.severity,
        )
        for job_id, names in sorted(corrupt.items())
        for name in names
    ]


def _job(job: Job) -> str:
    return f"job {job.id}" + (f" ({job.name}, team {job.team})" if job.name else f" (team {job.team})")


def _minutes(m: float) -> str:
    return f"{m:.0f} min" if m < 120 else f"{m / 60:.1f} h"
