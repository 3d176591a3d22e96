"""Reconciliation: every cycle, each open attempt is asked of its executor and settled
(exits recorded as its workload says, lost or silent processes requeued, victims past their
grace period killed, the checkpoints the job reported in its log stored). Because the store
keeps an attempt open until it is settled, this is also what re-adopts the running jobs
after a control-plane restart: see service.py for why that is safe."""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from visionloop.core.errors import ExecutorError, VisionloopError
from visionloop.core.fsutil import json_objects, open_regular
from visionloop.sched.executors.base import AttemptStatus, Executor, Handle
from visionloop.sched.progress import CheckpointEvent, EvalEvent, PaceEvent
from visionloop.sched.service_base import PlaneBase, log
from visionloop.sched.states import ACTIVE, JobState
from visionloop.sched.store import Attempt, Job
from visionloop.sched.view import Freed
from visionloop.sched.workload import ALL_CHECKPOINT_AT_SIGTERM, AttemptExit
from visionloop.train.abandoned import Ending, close_abandoned_run

# How many log lines a failed job shows as its reason.
FAILURE_LOG_LINES = 20
# How long an ended job's run waits for its lock before it is left as it is.
CLOSE_RUN_WAIT_S = 120.0
# A read of a job's progress records at most this many new checkpoints (the newest).
MAX_CHECKPOINTS_PER_READ = 8

_TAIL_BYTES = 64 * 1024

# The evaluations a job reported, one JSON object a line ({"attempt", "step", "epoch",
# "metrics"}), in its job folder, served at GET /v1/jobs/{id}/evals: what the tuner reads
# its trials' intermediate values from. A file in the control plane's own home rather than a
# table: advisory progress, bounded in size, and the schema's models are not this module's.
EVALS_FILE = "evals.jsonl"
# A recorded evaluation is one progress line (at most 4 KiB) as JSON: far below this.
MAX_EVAL_LINE_BYTES = 64 * 1024
# A read of a job's progress records at most this many new evaluations (the newest), and a
# job's evaluations file stops growing at this size: a job flooding its log with made-up
# evaluations costs a bounded write.
MAX_EVALS_PER_READ = 8
MAX_EVALS_BYTES = 4 * 1024 * 1024


def append_evals(path: Path, attempt: int, events: list[EvalEvent]) -> None:
    """Append `events` to the job's evaluations file, synced: one write per read, so a
    crash leaves at most a torn last line, which `read_evals` skips."""
    try:
        if path.stat().st_size > MAX_EVALS_BYTES:
            return
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(
        json.dumps(
            {"attempt": attempt, "step": e.step, "epoch": e.epoch, "metrics": e.metrics},
            separators=(",", ":"),
            allow_nan=False,
        )
        + "\n"
        for e in events
    )
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        # A torn line from a crash mid-write would swallow the next one: start on a new line.
        if os.fstat(fd).st_size and _ends_mid_line(path):
            lines = "\n" + lines
        os.write(fd, lines.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _ends_mid_line(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def read_evals(path: Path) -> Iterator[EvalEvent]:
    """The evaluations in a job's evaluations file (`<job folder>/EVALS_FILE`), in the order
    they were recorded; none if there is no file yet. A line that does not parse (torn by a
    crash) is skipped. The same step can appear twice (a control-plane restart reads the
    job's log again from its start): readers keep the first."""
    try:
        f = open_regular(path)
    except FileNotFoundError:
        return
    with f:  # line by line: a tuner reads it after every evaluation, for studies of any length
        for doc in json_objects(f, MAX_EVAL_LINE_BYTES):
            try:
                yield EvalEvent.from_doc(doc)
            except (ValueError, TypeError, KeyError, AttributeError):
                continue


def _tail(executor: Executor, handle: Handle | None, lines: int) -> str:
    """The last `lines` lines of an attempt's log, through the executor (a Ray job's log is
    on its node, not here). Best effort: a log that cannot be read says so, and never keeps
    a failure from being recorded."""
    if not handle:
        return ""
    try:
        offset = 0
        path = executor.log_path(handle)
        if path is not None:
            offset = max(0, path.stat().st_size - _TAIL_BYTES) if path.is_file() else 0
        data = b""
        for piece in executor.read_log(handle, offset):
            data = (data + piece)[-_TAIL_BYTES:]
    except (ExecutorError, OSError) as e:
        return f"(the log could not be read: {e})"
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


class ReconcileMixin(PlaneBase):
    """Settling the open attempts with what their executor says about them."""

    def _end_attempt(
        self,
        job_id: int,
        attempt: int,
        outcome: str,
        exit_code: int | None,
        now: float,
        next_state: JobState,
        reason: str,
        **kwargs: Any,
    ) -> Job:
        """Store.end_attempt, counted: the cycle re-reads the open attempts only if one ended.
        A job that ended for good gets its run closed if its trainer could not (SIGKILL)."""
        self._attempts_ended += 1
        job = self.store.end_attempt(job_id, attempt, outcome, exit_code, now, next_state, reason, **kwargs)
        if next_state in (JobState.FAILED, JobState.CANCELLED):
            ending: Ending = "failed" if next_state == JobState.FAILED else "cancelled"
            self._close_run_later(job, ending, f"job {job_id} {ending}: {reason}")
        return job

    def _close_run_later(self, job: Job, ending: Ending, reason: str) -> None:
        """Close the ended job's run (`_close_run`) off the cycle and off the request: the
        tracking store may be remote and slow."""
        if not job.run_dir:
            return
        threading.Thread(
            target=self._close_run,
            args=(Path(job.run_dir), ending, reason),
            name=f"close-run-{job.id}",
            daemon=True,
        ).start()

    def _close_run(self, run_dir: Path, ending: Ending, reason: str) -> None:
        try:
            # The job is over, so whatever holds the run's lock is a dying straggler (a killed
            # trainer's data-loader workers): wait for it rather than give up.
            run_id = close_abandoned_run(run_dir, self.settings, ending, reason, wait_s=CLOSE_RUN_WAIT_S)
        except Exception as e:  # the job's state is settled already; this is bookkeeping
            log.warning("could not close the run in %s: %s", run_dir, e)
            return
        if run_id:
            log.info("run %s (%s) ended without its trainer: marked %s", run_dir, run_id, ending)

    def _reconcile(self, now: float) -> list[Attempt] | None:
        """Poll every open attempt and settle those that ended. Returns the open attempts if
        none ended meanwhile (the view can use them as they are), else None."""
        ended_before = self._attempts_ended
        attempts = self.store.active_attempts()
        # The attempts' jobs in one query (without their spec documents, which reconcile does
        # not read); a job in no active state (should not happen) is read on its own.
        jobs = {j.id: j for j in self.store.list_jobs(states=ACTIVE)} if attempts else {}
        beats: dict[int, float] = {}
        for attempt in attempts:
            job = jobs.get(attempt.job_id) or self.store.get_job(attempt.job_id)
            handle: Handle = attempt.handle or {
                "attempt_dir": str(self.job_dir(job.id) / f"attempt-{attempt.number}")
            }
            try:
                self._reconcile_attempt(job, attempt, handle, now, beats)
            except ExecutorError as e:
                # The executor could not answer (the Ray dashboard is unreachable, say): this
                # attempt keeps its state and GPUs until a later cycle gets an answer, and the
                # other attempts and the scheduling go on. Nothing is concluded from silence,
                # so nothing that may still run is requeued (and run twice).
                log.warning(
                    "job %s attempt %s: the executor did not answer (%s); asking again next cycle",
                    job.id,
                    attempt.number,
                    e,
                )
        # Heartbeats in one write per cycle, and only those that moved: a job's beat is stored
        # for `jobs show`; the timeout above is judged on the executor's answer, not on this.
        changed = {k: v for k, v in beats.items() if self._beats_written.get(k) != v}
        if changed:
            self.store.heartbeats(changed)
        open_jobs = {a.job_id for a in attempts}
        self._beats_written = {k: v for k, v in (self._beats_written | changed).items() if k in open_jobs}
        self._ckpt_steps = {k: v for k, v in self._ckpt_steps.items() if k in open_jobs}
        self._progress.forget_except({(a.job_id, a.number) for a in attempts})
        return attempts if self._attempts_ended == ended_before else None

    def _reconcile_attempt(
        self, job: Job, attempt: Attempt, handle: Handle, now: float, beats: dict[int, float]
    ) -> None:
        t = self.config.timings
        number = attempt.number
        status = self.executor.poll(handle)
        self._record_progress(job, attempt, handle, now, final=status.state != "running")
        if status.state == "running":
            beat = status.heartbeat_at
            if beat is not None:
                beats[job.id] = beat
            if beat is not None and now - beat > t.heartbeat_timeout_s:
                self.executor.kill(handle)
                self._finish_lost(job, number, f"no heartbeat for {now - beat:.0f} s; killed", now)
            elif (
                job.state in (JobState.PREEMPTING, JobState.CANCELLING) and now - job.state_since > t.grace_s
            ):
                log.warning("job %s did not stop within %.0f s of SIGTERM: SIGKILL", job.id, t.grace_s)
                self.executor.kill(handle)
            return
        if status.state == "lost":
            self._finish_lost(job, number, status.detail or "process vanished", now)
            return
        self._finish_exited(job, attempt, status, handle, now)

    def _record_progress(
        self, job: Job, attempt: Attempt, handle: Handle, now: float, *, final: bool
    ) -> None:
        """Checkpoints the job reported in its log since the last look (see
        visionloop.sched.progress): they decide which victim loses the least work, and what a
        preemption lost. Its latest pace gives its expected end. `final`: the attempt ended,
        so its last lines are read now (a victim reports the checkpoint it stopped on just
        before it exits). Its evaluations are appended to the job's EVALS_FILE, for the tuner."""
        try:
            key = (job.id, attempt.number)
            events = self._progress.read(self.executor, handle, key, now=now, final=final)
        except (ExecutorError, OSError) as e:
            # Progress is advisory: the attempt's state is settled without it, and the log is
            # read again (from where it stopped) next cycle.
            log.warning("job %s attempt %s: could not read its progress (%s)", job.id, attempt.number, e)
            return
        steps: dict[int, float] = {}
        evals: list[EvalEvent] = []
        pace: PaceEvent | None = None
        for event in events:
            if isinstance(event, CheckpointEvent):
                steps[event.step] = event.at
            elif isinstance(event, PaceEvent):
                pace = event  # only the latest counts
            else:
                evals.append(event)
        if pace is not None and attempt.ended_at is None:
            # The job's clock, within this attempt's life (so it is never taken for an
            # earlier attempt's, nor put in the future).
            at = min(max(pace.at, attempt.started_at), now)
            self.store.record_pace(job.id, pace.step, pace.total, pace.rate, at)
        if evals:
            try:
                path = self.job_dir(job.id) / EVALS_FILE
                append_evals(path, attempt.number, evals[-MAX_EVALS_PER_READ:])
            except OSError as e:  # advisory, like the rest of progress
                log.warning("job %s: could not record its evaluations (%s)", job.id, e)
        known = self._ckpt_steps.get(job.id, set())
        # A job floods its log with made-up steps? Only the newest few of a read count.
        new = [(step, at) for step, at in steps.items() if step not in known][-MAX_CHECKPOINTS_PER_READ:]
        if not new:
            return
        # Something this process has not seen stored: the store decides (a restart, or
        # another writer, may have recorded it already).
        known = self._ckpt_steps[job.id] = {c.step for c in self.store.checkpoints(job.id)}
        for step, at in new:
            if step in known:
                continue
            # The job's clock, within what this attempt can have done: a line cannot move the
            # job's last checkpoint before its start or into the future.
            at = min(max(at, attempt.started_at), now)
            self.store.record_checkpoint(job.id, step, at, attempt=attempt.number)
            known.add(step)

    def _finish_exited(
        self, job: Job, attempt: Attempt, status: AttemptStatus, handle: Handle, now: float
    ) -> None:
        """The workload says what its exit means (`Workload.ending`); the queue applies it,
        and owns only the retries of a failure."""
        number = attempt.number
        code = status.exit_code if status.exit_code is not None else -1
        try:
            workload = self.store.get_job(job.id).workload
        except VisionloopError as e:  # its stored spec no longer validates: it cannot run again
            self._end_attempt(job.id, number, "failed", code, now, JobState.FAILED, f"exit {code}; and {e}")
            return
        ending = workload.ending(
            AttemptExit(code, job.state, status.detail, gpu_lost=self._on_down_gpu(attempt.gpu_ids))
        )
        if ending.state == JobState.FAILED:
            self._finish_failed(job, number, code, ending.reason, now, handle, retry=ending.retry)
            return
        extra = {"preemptions": job.preemptions + 1} if ending.preemption else {}
        freed_for = job.leaving_for
        self._end_attempt(job.id, number, ending.outcome, code, now, ending.state, ending.reason, **extra)
        if freed_for is not None and ending.preemption and ALL_CHECKPOINT_AT_SIGTERM:
            # It stepped aside for that job, checkpointed: its GPUs are that job's next cycle.
            self._freed_for.update(dict.fromkeys(attempt.gpu_ids, Freed(str(freed_for), job.team)))

    def _on_down_gpu(self, gpu_ids: tuple[str, ...]) -> bool:
        """Whether the attempt held a GPU that is down now: its preemption was a spot
        interruption (which `cost report` counts apart)."""
        return any(not g.up for g in self.store.list_gpus() if g.id in gpu_ids)

    def _finish_failed(
        self,
        job: Job,
        number: int,
        code: int | None,
        why: str,
        now: float,
        handle: Handle | None = None,
        *,
        retry: bool = True,
    ) -> None:
        """A failure: retried with back-off while the job has restarts left (and `retry`),
        else the job fails with its last log lines."""
        if retry and job.restarts < job.max_restarts:
            delay = self.config.timings.retry_backoff_s * math.pow(2, job.restarts)
            self._end_attempt(
                job.id,
                number,
                "failed",
                code,
                now,
                JobState.QUEUED,
                f"{why}; retry {job.restarts + 1} of {job.max_restarts} in {delay:.0f} s",
                restarts=job.restarts + 1,
                not_before=now + delay,
            )
        else:
            reason = f"{why}; no restarts left ({job.max_restarts})" if retry else why
            tail = _tail(self.executor, handle, FAILURE_LOG_LINES)
            if tail:
                reason += f". Last log lines:\n{tail}"
            self._end_attempt(job.id, number, "failed", code, now, JobState.FAILED, reason)

    def _finish_lost(self, job: Job, number: int, detail: str, now: float) -> None:
        if job.state == JobState.CANCELLING:
            self._end_attempt(
                job.id, number, "cancelled", None, now, JobState.CANCELLED, f"cancelled ({detail})"
            )
            return
        self._end_attempt(
            job.id, number, "lost", None, now, JobState.QUEUED, f"process lost ({detail}); requeued to resume"
        )
