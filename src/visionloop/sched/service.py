"""The control plane's core: one scheduling cycle, and the actions users and operators take.

A cycle (every `cycle_s`, and at once after a submit, a cancel or a spot notice):

1. **Reconcile** every open attempt with its executor: record exits (0 → succeeded; 75 →
   requeued to resume from its checkpoint; other codes → retried with back-off until
   `max_restarts`, then failed with its last log lines), detect processes that vanished or
   stopped heart-beating (requeued), and SIGKILL victims whose grace period ran out. An
   attempt the executor cannot answer for (ExecutorError: Ray's dashboard unreachable, say)
   is left exactly as it is, GPUs included, and asked again next cycle; the others and the
   scheduling go on.
2. **Decide**: build a `ClusterView` from the store and hand it to the policy.
3. **Act**: evictions get SIGTERM (the trainer checkpoints and exits 75); placements are
   committed to the store (job RUNNING, GPUs allocated) *before* the executor launches them,
   and every queued job's waiting reason is stored. A launch that fails because the executor
   cannot be reached at all (ExecutorUnavailableError) requeues its job without counting it
   against `max_restarts`, and pauses all evictions and launches for a back-off that doubles
   while the executor stays unreachable (up to LAUNCH_PAUSE_MAX_S): nothing is preempted for
   a launch that cannot happen, and one attempt per pause, not one per job, finds out.

Why this order is safe against a SIGKILL of the control plane at any moment: the store
changes only in transactions, and an attempt is committed before its process exists. After a
restart, reconcile finds the attempt: its process is either alive (re-adopted), finished
(the executor reads its exit code back: from the attempt folder, or from Ray) or was never
started (lost → requeued). A
job is therefore never lost, never run twice at the same time, and never left running
without an open attempt that accounts for its GPUs.

All state changes hold `self._lock`, so API calls (cancel, spot notices) and the cycle never
interleave; submits need no lock because the store serialises them.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from visionloop.core.errors import (
    DataError,
    ExecutorError,
    ExecutorUnavailableError,
    NotFoundError,
    VisionloopError,
)
from visionloop.core.fsutil import atomic_write_text
from visionloop.core.settings import Settings
from visionloop.data.shardcheck import check_dataset
from visionloop.sched.config import DEFAULT_TEAM, ClusterConfig
from visionloop.sched.executors.base import AttemptStatus, Executor, Handle, LaunchRequest
from visionloop.sched.placement import capacities
from visionloop.sched.policy import PolicyConfig, schedule
from visionloop.sched.prices import load_catalog
from visionloop.sched.records import ViewJob
from visionloop.sched.states import ACTIVE, JobState, TransitionError
from visionloop.sched.store import Attempt, Job, Store
from visionloop.sched.view import ActiveJob, ClusterView, Gpu, PendingJob, Team
from visionloop.specs import JobSpec, TrainSpec, format_validation_error, spec_paths, spec_to_yaml
from visionloop.train.abandoned import Ending, close_abandoned_run
from visionloop.train.signals import EXIT_PREEMPTED

log = logging.getLogger(__name__)

QUEUED, RUNNING = JobState.QUEUED.value, JobState.RUNNING.value

# How many log lines a failed job shows as its reason.
FAILURE_LOG_LINES = 20
# The longest that launches wait after the executor was found unreachable, however long it stays so.
LAUNCH_PAUSE_MAX_S = 300.0
# How long an ended job's run waits for its lock before it is left as it is.
CLOSE_RUN_WAIT_S = 120.0
_CKPT_NAME = re.compile(r"step-(\d+)\.ckpt")


class SubmitError(VisionloopError):
    """A submission the control plane refuses (the API answers 4xx with this message)."""

    exit_code = 2

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Principal:
    """Who is calling: a team's token, or an admin token (team None)."""

    team: str | None
    admin: bool

    def may_see(self, job: Job) -> bool:
        return self.admin or job.team == self.team


_TAIL_BYTES = 64 * 1024


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


def _under(path: Path, real_roots: list[Path]) -> bool:
    try:
        real = Path(os.path.realpath(path))
    except (OSError, ValueError):  # a NUL byte, say: never a path a job may use
        return False
    return any(real.is_relative_to(root) for root in real_roots)


class ControlPlane:
    def __init__(
        self,
        store: Store,
        executor: Executor,
        config: ClusterConfig,
        settings: Settings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.executor = executor
        self.config = config
        self.settings = settings
        self.clock = clock
        self._lock = threading.RLock()
        self.wake = threading.Event()
        t = config.timings
        self.policy = PolicyConfig(
            min_runtime_s=t.min_runtime_s, order=t.order, same_node=True, priorities=dict(config.priorities)
        )
        self.jobs_dir = settings.home / "jobs"
        self.catalog = load_catalog(config.prices)
        # Caches that only spare the store redundant writes and reads (never the source of a
        # decision; empty after a restart, which costs one full round of writes):
        self._beats_written: dict[int, float] = {}  # job → the heartbeat last stored
        self._ckpt_steps: dict[int, set[int]] = {}  # job → checkpoint steps known stored
        self._reasons_sent: dict[int, str] = {}  # queued job → the waiting reason last stored
        self._attempts_ended = 0
        # Launches (and the evictions made for them) wait until then: the executor was unreachable.
        self._launch_paused_until = 0.0
        self._unreachable_streak = 0
        self._inventory_at = 0.0
        self._pending: dict[int, tuple[ViewJob, PendingJob]] = {}  # queued job → (its row, built)
        self._rows: tuple[ViewJob, ...] | None = None  # the queue view last built from
        self._active_rows: dict[int, ViewJob] = {}  # job → its row, for the jobs not queued
        self._queued: list[PendingJob] = []  # the queued jobs of _rows, in queue order
        self._sync_inventory()
        self._sync_teams()

    # ------------------------------------------------------------------ set-up

    def _sync_inventory(self) -> None:
        self.store.sync_gpus(self.executor.capacity())
        self._inventory_at = self.clock()

    def _resync_inventory(self, now: float) -> None:
        """Every `inventory_sync_s`, read the executor's GPUs again: a Ray node that joined
        adds its GPUs, one that left has its GPUs marked down (not deleted: attempts on them
        are still being settled, and a failure there counts as an interruption, not a
        failure). An executor that cannot answer keeps the inventory as it is."""
        every = self.config.timings.inventory_sync_s
        if every <= 0 or now - self._inventory_at < every:
            return
        self._inventory_at = now
        try:
            found = self.executor.capacity()
        except ExecutorError as e:
            log.warning("could not re-read the executor's GPUs (%s); keeping the inventory as it is", e)
            return
        before = {g.id: g.up for g in self.store.list_gpus()}
        after = {g.id: g.up for g in self.store.sync_gpus(found, now=now, missing="down")}
        added = sorted(after.keys() - before.keys())
        gone = sorted(k for k, up in after.items() if before.get(k) and not up)
        back = sorted(k for k, up in after.items() if up and before.get(k) is False)
        if added or gone or back:
            log.info("inventory changed: new GPUs %s, gone %s, back %s", added, gone, back)
        self._follow_inventory(sum(before.values()), sum(after.values()))  # GPUs up

    def _follow_inventory(self, before: int, after: int) -> None:
        """With no teams configured, the default team is entitled to every GPU that is up: when
        Ray nodes join (or the control plane first started with none) its quota grows with
        them, and it shrinks when they leave. A quota someone set by hand (`visionloop admin
        team set default ...`, not equal to the count before) is left alone."""
        if self.config.teams or before == after:
            return
        team = self.store.get_team(DEFAULT_TEAM)
        if team is not None and team.nominal_gpus == before:
            self.store.upsert_team(DEFAULT_TEAM, after, team.borrow_limit, team.weight)
            log.info("the default team's quota follows the inventory: %d -> %d GPUs", before, after)

    def _sync_teams(self) -> None:
        teams = list(self.config.teams)
        if not teams and self.store.get_team(DEFAULT_TEAM) is None:
            # One machine, no config: a single team entitled to every GPU.
            n = sum(g.up for g in self.store.list_gpus())
            teams = [Team(DEFAULT_TEAM, nominal_gpus=n, borrow_limit=0)]
        for team in teams:
            self.store.upsert_team(team.name, team.nominal_gpus, team.borrow_limit, team.weight)

    # ------------------------------------------------------------------ submit

    def submit(
        self,
        principal: Principal,
        doc: Mapping[str, Any],
        *,
        team: str | None = None,
        priority: str | None = None,
        gpus: int | None = None,
        spot: str | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        """Validate everything a job needs *now*, so nothing waits forever in the queue for a
        reason nobody sees: the spec, the team, the priority class, and that the cluster
        could ever hold it."""
        job_doc = dict(doc) if "train" in doc else {"train": dict(doc)}
        overrides: dict[str, Any] = {}
        if priority is not None:
            overrides["priority"] = priority
        if spot is not None:
            overrides["spot"] = spot
        if team is not None:
            overrides["team"] = team
        job_doc.update(overrides)
        if gpus is not None:
            job_doc["resources"] = {**dict(job_doc.get("resources") or {}), "gpus": gpus}
        from pydantic import ValidationError

        try:
            job = JobSpec.model_validate(job_doc)
        except ValidationError as e:
            raise SubmitError(format_validation_error(e, JobSpec, "the job spec")) from e
        team_name = job.team or principal.team or DEFAULT_TEAM
        if not principal.admin and team_name != principal.team:
            raise SubmitError(
                f"your token belongs to team {principal.team!r}; it cannot submit for team {team_name!r}.",
                status=403,
            )
        if self.store.get_team(team_name) is None:
            known = ", ".join(t.name for t in self.store.list_teams()) or "none"
            raise SubmitError(
                f"unknown team {team_name!r}; known teams: {known}. An admin adds one with "
                f"`visionloop admin team set {team_name} --nominal N`.",
                status=404,
            )
        try:
            rank = self.config.priority_rank(job.priority)
        except VisionloopError as e:
            raise SubmitError(str(e)) from e
        self._check_fits(job)
        self.check_paths(job.train, team_name)
        self._check_dataset(job.train)
        return self.store.submit(
            dict(doc),
            job,
            team=team_name,
            priority_rank=rank,
            run_dir=None,
            idempotency_key=idempotency_key,
            now=self.clock(),
        )

    def _check_fits(self, job: JobSpec) -> None:
        # The same capacity the policy judges "never fits" by, so submit refuses exactly
        # what the queue could never place.
        total, biggest = capacities(self.store.list_gpus())[job.spot]
        need = job.resources.gpus
        if need > biggest:
            where = "non-spot " if job.spot == "never" else ""
            raise SubmitError(
                f"the job asks for {need} GPUs but the largest machine has {biggest} {where}GPUs "
                f"({total} in all). Ask for at most {biggest} (--gpus {biggest})"
                + (" or allow spot capacity (--spot allowed)." if job.spot == "never" else "."),
            )

    def allowed_roots(self, team: str) -> tuple[Path, ...]:
        """The folders `team`'s jobs may read (cluster.toml's `allowed_roots`, else the home's
        datasets/ and weights/)."""
        roots = self.config.roots_for(team)
        return roots if roots is not None else (self.settings.datasets_dir, self.settings.weights_dir)

    def check_paths(self, train: TrainSpec, team: str) -> None:
        """Every path in the spec is absolute and, with symbolic links and `..` resolved, lies
        under one of the team's allowed roots. Admins submitting for a team are bound by that
        team's roots too. Called at submit and again before every launch (a path may have been
        re-pointed meanwhile). The refusal is the same whether the path exists or not, and
        names the path as given, never what it resolved to."""
        roots = self.allowed_roots(team)
        real_roots = [Path(os.path.realpath(r)) for r in roots]
        for field, path in spec_paths(train):
            if not path.is_absolute():
                raise SubmitError(
                    f"{field} {path} is relative; the control plane cannot know relative to what. "
                    "Submit with `visionloop submit` (it resolves paths against the spec file) or give an "
                    "absolute path."
                )
            if not _under(path, real_roots):
                where = self.config.source or "the cluster config (cluster.toml)"
                raise SubmitError(
                    f"{field} {path} is outside the allowed roots of team {team!r}: "
                    f"{', '.join(str(r) for r in roots)}. Every path in a job spec must lie under one of "
                    "them once symbolic links and '..' are resolved. Put the file there, or ask an admin "
                    f"to add its folder to the team's allowed_roots in {where}.",
                    status=403,
                )

    def _check_dataset(self, train: TrainSpec) -> None:
        # Runs after check_paths, which has refused a relative or out-of-roots data.dataset.
        dataset = Path(train.data.dataset)
        if not (dataset / "dataset.json").is_file():
            raise SubmitError(
                f"data.dataset {dataset} is not a dataset folder (no dataset.json). "
                "Make one with `visionloop data ingest SOURCE --out DIR`."
            )
        try:
            # Its manifest and shard indexes, exactly as ingest writes them: a dataset that would
            # be refused when the job starts (or that tries to run code) is refused now.
            check_dataset(dataset)
        except DataError as e:
            raise SubmitError(f"data.dataset: {e}") from e

    # ------------------------------------------------------------------ actions

    def cancel(self, principal: Principal, job_id: int) -> Job:
        with self._lock:
            job = self.visible_job(principal, job_id)
            now = self.clock()
            if job.state.terminal:
                return job
            if job.state == JobState.QUEUED:
                job = self.store.transition(
                    job_id,
                    JobState.CANCELLED,
                    f"cancelled by {self._who(principal)}",
                    expect=JobState.QUEUED,
                    now=now,
                )
            elif job.state != JobState.CANCELLING:
                job = self.store.transition(
                    job_id,
                    JobState.CANCELLING,
                    f"cancel requested by {self._who(principal)}: stopping after a checkpoint",
                    expect=job.state,
                    now=now,
                )
                self._signal(job_id, terminate=True)
        self.wake.set()
        return job

    def spot_interrupt(self, target: str, reason: str | None = None) -> list[int]:
        """A spot notice for a GPU id or a whole node: its GPUs go down, and the jobs on them
        get the same checkpoint-and-requeue handshake as a preemption."""
        with self._lock:
            now = self.clock()
            why = reason or f"spot interruption on {target}"
            affected = set(self.store.set_gpus_up(target, up=False, reason=why, now=now))
            if not affected:
                raise NotFoundError(f"no GPU or node named {target!r}; `visionloop admin gpus` lists them.")
            victims: list[int] = []
            for attempt in self.store.active_attempts():
                if not affected & {a.gpu_id for a in attempt.allocations}:
                    continue
                job = self.store.get_job(attempt.job_id)
                if job.state == JobState.RUNNING:
                    self.store.transition(
                        job.id,
                        JobState.PREEMPTING,
                        f"{why}: checkpointing before the GPU goes",
                        expect=JobState.RUNNING,
                        now=now,
                    )
                    self._signal(job.id, terminate=True)
                    victims.append(job.id)
        self.wake.set()
        return victims

    def spot_restore(self, target: str) -> list[str]:
        with self._lock:
            gpus = self.store.set_gpus_up(target, up=True, reason="spot capacity back", now=self.clock())
            if not gpus:
                raise NotFoundError(f"no GPU or node named {target!r}; `visionloop admin gpus` lists them.")
        self.wake.set()
        return gpus

    def visible_job(self, principal: Principal, job_id: int) -> Job:
        try:
            job = self.store.get_job(job_id)
        except NotFoundError:
            job = None
        if job is None or not principal.may_see(job):
            # The same answer for "absent" and "another team's": ids leak nothing.
            raise NotFoundError(f"no job {job_id} visible to you; `visionloop jobs list` shows yours.")
        return job

    @staticmethod
    def _who(principal: Principal) -> str:
        return "an admin" if principal.admin else f"team {principal.team}"

    # ------------------------------------------------------------------ the cycle

    def cycle(self) -> None:
        with self._lock:
            now = self.clock()
            self._resync_inventory(now)
            attempts = self._reconcile(now)
            view = self._view(now, attempts)
            decision = schedule(view, self.policy)
            paused = now < self._launch_paused_until
            for ev in () if paused else decision.evictions:
                job_id = int(ev.job_id)
                try:
                    self.store.transition(
                        job_id, JobState.PREEMPTING, ev.reason, expect=JobState.RUNNING, now=now
                    )
                except TransitionError:
                    continue  # it finished meanwhile; the next cycle sees the freed GPUs
                self._signal(job_id, terminate=True)
            gpus = {g.id: g for g in view.gpus}  # read this cycle, under the lock
            reasons = {int(k): v for k, v in decision.waiting.items()}
            for p in decision.placements:
                if now < self._launch_paused_until:
                    # The executor was unreachable: this job stays queued, unchanged, and says why.
                    at = datetime.fromtimestamp(self._launch_paused_until).strftime("%H:%M:%S")
                    reasons[int(p.job_id)] = f"the executor is unreachable; launches resume at {at}"
                    continue
                self._start(int(p.job_id), [gpus[i] for i in p.gpu_ids], now)
            self._store_waiting_reasons(reasons)

    def _store_waiting_reasons(self, reasons: dict[int, str]) -> None:
        """Send only the reasons that changed since the last cycle. The cache is rebuilt from
        this cycle's queue each time, so a job that left the queue (placed, cancelled) is
        forgotten and gets its reason written again if it comes back."""
        changed = {k: v for k, v in reasons.items() if self._reasons_sent.get(k) != v}
        if changed:
            self.store.set_waiting_reasons(changed)
        self._reasons_sent = reasons

    def _view(self, now: float, attempts: list[Attempt] | None) -> ClusterView:
        """The cluster as the policy sees it. `attempts`: the open attempts, if the caller
        read them this cycle and none has ended since (else they are read again)."""
        teams = {
            t.name: Team(t.name, t.nominal_gpus, t.borrow_limit, t.weight) for t in self.store.list_teams()
        }
        gpus = self.store.list_gpus()
        running: list[ActiveJob] = []
        rows = self.store.view_jobs()
        if rows is not self._rows:  # the queue changed since the last cycle
            self._rows = rows
            self._active_rows = {j.id: j for j in rows if j.state != QUEUED}
            self._queued = self._pending_jobs(rows)
        jobs = self._active_rows
        for attempt in self.store.active_attempts() if attempts is None else attempts:
            job = jobs.get(attempt.job_id)
            if job is None:
                continue
            running.append(
                ActiveJob(
                    id=str(job.id),
                    team=job.team,
                    priority=job.priority_rank,
                    gpu_ids=tuple(a.gpu_id for a in attempt.allocations),
                    started_at=attempt.started_at,
                    spot=job.spot,
                    cpus=job.cpus,
                    memory_gb=job.memory_gb,
                    last_checkpoint_at=job.last_checkpoint_at,
                    attained_gpu_s=job.attained_gpu_s,
                    preemptible=job.state == RUNNING,
                    submitted_at=job.submitted_at,
                )
            )
        queued = self._queued  # shared between cycles while unchanged: the policy only reads it
        return ClusterView(now=now, gpus=gpus, teams=teams, running=running, queued=queued)

    def _pending_jobs(self, rows: tuple[ViewJob, ...]) -> list[PendingJob]:
        """The queued rows as the policy's PendingJobs. One is rebuilt only when its row
        changed: the store hands back the same row object until then (view_jobs' cache), so
        10,000 queued jobs cost a dictionary lookup each rather than an object each."""
        previous, pending = self._pending, {}
        queued: list[PendingJob] = []
        for j in rows:
            if j.state != QUEUED:
                continue
            known = previous.get(j.id)
            if known is not None and known[0] is j:
                p = known[1]
            else:
                p = PendingJob(
                    str(j.id),
                    j.team,
                    j.priority_rank,
                    j.gpus,
                    j.submitted_at,
                    j.spot,
                    j.cpus,
                    j.memory_gb,
                    j.attained_gpu_s,
                    j.not_before or 0.0,
                )
            pending[j.id] = (j, p)
            queued.append(p)
        self._pending = pending
        return queued

    # ------------------------------------------------------------------ launching

    def job_dir(self, job_id: int) -> Path:
        return self.jobs_dir / f"job-{job_id}"

    def _command(self, job: Job) -> list[str]:
        spec_path = self.job_dir(job.id) / "train.yaml"
        if not spec_path.is_file():
            spec_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(spec_path, spec_to_yaml(job.train_spec))
        cmd = [sys.executable, "-m", "visionloop", "train", str(spec_path), "--run-dir", str(job.run_dir)]
        if job.gpus > 1:
            cmd += ["--nproc-per-node", str(job.gpus)]
        return cmd

    def _job_env(self) -> dict[str, str]:
        """The variables the control plane gives a job, on top of the executor's clean base
        (see visionloop.sched.executors.env): the names in `[jobs] env_allow` that are set
        here, then what the trainer needs to find the home and the tracking store."""
        env = {name: os.environ[name] for name in self.config.env_allow if name in os.environ}
        env.update(
            VISIONLOOP_HOME=str(self.settings.home),
            VISIONLOOP_TRACKING_URI=self.settings.tracking_uri,
            VISIONLOOP_EXPERIMENT=self.settings.experiment,
        )
        return env

    def _start(self, job_id: int, gpus: list[Gpu], now: float) -> None:
        queued = self.store.get_job(job_id)
        try:
            self.check_paths(queued.train_spec, queued.team)
        except SubmitError as e:
            # A path re-pointed (a symbolic link changed) since submit: the job never starts.
            try:
                self.store.transition(
                    job_id, JobState.FAILED, f"not started: {e}", expect=JobState.QUEUED, now=now
                )
            except TransitionError as race:
                log.warning("job %s was not started: %s", job_id, race)
            return
        try:
            attempt = self.store.start_attempt(job_id, self.executor.name, gpus, now=now)
        except (TransitionError, VisionloopError) as e:
            log.warning("job %s was not started: %s", job_id, e)
            return
        job = self.store.get_job(job_id)
        attempt_dir = self.job_dir(job_id) / f"attempt-{attempt.number}"
        # The folder is known before the process exists, so a control plane killed between
        # these lines finds the attempt again (its shim writes shim.json there).
        self.store.set_attempt_handle(job_id, attempt.number, {"attempt_dir": str(attempt_dir)})
        request = LaunchRequest(
            job_id=job_id,
            attempt=attempt.number,
            command=self._command(job),
            gpus=gpus,
            attempt_dir=attempt_dir,
            env=self._job_env(),
            cpus=job.cpus,
            memory_gb=job.memory_gb,
        )
        try:
            handle = self.executor.launch(request)
        except ExecutorUnavailableError as e:
            delay = min(
                self.config.timings.retry_backoff_s * math.pow(2, self._unreachable_streak),
                LAUNCH_PAUSE_MAX_S,
            )
            self._unreachable_streak += 1
            self._launch_paused_until = now + delay
            self._end_attempt(
                job_id,
                attempt.number,
                "failed",
                None,
                now,
                JobState.QUEUED,
                f"could not start: {e}; the executor is unreachable, which is not counted against "
                f"max_restarts; launches resume in {delay:.0f} s",
            )
            return
        except ExecutorError as e:
            self._finish_failed(job, attempt.number, None, f"could not start: {e}", now)
            return
        self._unreachable_streak = 0
        self.store.set_attempt_handle(job_id, attempt.number, handle)

    def _signal(self, job_id: int, *, terminate: bool) -> None:
        for attempt in self.store.active_attempts():
            if attempt.job_id == job_id and attempt.handle:
                try:
                    if terminate:
                        self.executor.terminate(attempt.handle)
                    else:
                        self.executor.kill(attempt.handle)
                except ExecutorError as e:
                    log.warning("could not signal job %s: %s", job_id, e)

    # ------------------------------------------------------------------ reconcile

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
        if next_state in (JobState.FAILED, JobState.CANCELLED) and job.run_dir:
            ending: Ending = "failed" if next_state == JobState.FAILED else "cancelled"
            # Off the cycle: the tracking store may be remote and slow.
            threading.Thread(
                target=self._close_run,
                args=(Path(job.run_dir), ending, f"job {job_id} {ending}: {reason}"),
                name=f"close-run-{job_id}",
                daemon=True,
            ).start()
        return job

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
        return attempts if self._attempts_ended == ended_before else None

    def _reconcile_attempt(
        self, job: Job, attempt: Attempt, handle: Handle, now: float, beats: dict[int, float]
    ) -> None:
        t = self.config.timings
        number = attempt.number
        status = self.executor.poll(handle)
        if status.state == "running":
            self._scan_checkpoints(job)
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

    def _scan_checkpoints(self, job: Job) -> None:
        """Checkpoints the trainer wrote since the last look (its run dir is the record):
        they decide which victim loses the least work, and what a preemption lost."""
        folder = Path(job.run_dir) / "checkpoints"
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        known = self._ckpt_steps.get(job.id, set())
        new = []
        for entry in entries:
            m = _CKPT_NAME.fullmatch(entry.name)
            if m and int(m.group(1)) not in known:
                new.append((int(m.group(1)), entry))
        if not new:
            return
        # Something this process has not seen stored: the store decides (a restart, or
        # another writer, may have recorded it already).
        known = self._ckpt_steps[job.id] = {c.step for c in self.store.checkpoints(job.id)}
        for step, entry in new:
            if step in known:
                continue
            try:
                at = entry.stat().st_mtime
            except OSError:
                continue  # pruned meanwhile
            self.store.record_checkpoint(job.id, step, at)
            known.add(step)

    def _finish_exited(
        self, job: Job, attempt: Attempt, status: AttemptStatus, handle: Handle, now: float
    ) -> None:
        number = attempt.number
        code = status.exit_code if status.exit_code is not None else -1
        if job.state == JobState.CANCELLING:
            outcome, nxt, why = "cancelled", JobState.CANCELLED, f"cancelled (exit {code})"
            if code == 0:
                outcome, nxt, why = "succeeded", JobState.SUCCEEDED, "finished before the cancel took effect"
            self._end_attempt(job.id, number, outcome, code, now, nxt, why)
            return
        if code == 0:
            self._end_attempt(job.id, number, "succeeded", 0, now, JobState.SUCCEEDED, "finished (exit 0)")
            return
        if job.state == JobState.PREEMPTING:
            # A preemption never counts as a failure, even if the victim had to be SIGKILLed:
            # it resumes from its last checkpoint.
            outcome = "interrupted" if self._on_down_gpu(attempt.gpu_ids) else "preempted"
            how = (
                "checkpointed and exited 75"
                if code == EXIT_PREEMPTED
                else f"exit {code} after the grace period"
            )
            self._end_attempt(
                job.id,
                number,
                outcome,
                code,
                now,
                JobState.QUEUED,
                f"{outcome}: {how}; requeued to resume",
                preemptions=job.preemptions + 1,
            )
            return
        if code == EXIT_PREEMPTED:
            self._end_attempt(
                job.id,
                number,
                "preempted",
                code,
                now,
                JobState.QUEUED,
                "stopped after a checkpoint (exit 75, signalled outside visionloop); requeued to resume",
            )
            return
        # The executor's word on it, if any (Ray's "could not start it: ..." for exit 126).
        why = f"exit {code} ({status.detail})" if status.detail else f"exit {code}"
        self._finish_failed(job, number, code, why, now, handle)

    def _on_down_gpu(self, gpu_ids: tuple[str, ...]) -> bool:
        """Whether the attempt held a GPU that is down now: its preemption was a spot
        interruption (which `cost report` counts apart)."""
        return any(not g.up for g in self.store.list_gpus() if g.id in gpu_ids)

    def _finish_failed(
        self, job: Job, number: int, code: int | None, why: str, now: float, handle: Handle | None = None
    ) -> None:
        if job.restarts < job.max_restarts:
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
            reason = f"{why}; no restarts left ({job.max_restarts})"
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

    # ------------------------------------------------------------------ the loop

    def run_forever(self, stop: threading.Event) -> None:
        """The scheduler thread: a cycle every `cycle_s`, or at once when woken."""
        while not stop.is_set():
            try:
                self.cycle()
            except Exception:  # the loop must outlive one bad cycle; the next one retries
                log.exception("scheduling cycle failed")
            self.wake.wait(self.config.timings.cycle_s)
            self.wake.clear()


__all__ = ["ControlPlane", "Principal", "SubmitError"]
