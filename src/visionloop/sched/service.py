"""The control plane's core: one scheduling cycle, and the actions users and operators take.

A cycle (every `cycle_s`, and at once after a submit, a cancel or a spot notice):

1. **Reconcile** every open attempt with its executor: record the checkpoints the job
   reported in its log (visionloop.sched.progress), record exits as the job's workload reads
   them (visionloop.sched.workload; for training: 0 → succeeded; 75 → requeued to resume
   from its checkpoint; other codes → retried with back-off until `max_restarts`, then
   failed with its last log lines), detect processes that vanished or stopped
   heart-beating (requeued), and SIGKILL victims whose grace period ran out. An
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

The control plane is split by concern, each part a mixin over the shared state of
`service_base.PlaneBase`: admission (`service_admission`: submit, paths, who sees what),
reconciliation (`service_reconcile`: step 1), the GPU inventory and spot notices
(`service_gpus`); this module composes them and holds the cycle (steps 2 and 3), launching,
cancelling and the loop.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from visionloop.core.errors import ExecutorError, ExecutorUnavailableError, VisionloopError
from visionloop.core.settings import Settings
from visionloop.sched.config import ClusterConfig
from visionloop.sched.executors.base import Executor, LaunchRequest
from visionloop.sched.history import RuntimeHistory, Sample
from visionloop.sched.policy import PolicyConfig, schedule
from visionloop.sched.prices import load_catalog
from visionloop.sched.progress import ProgressReader
from visionloop.sched.records import ViewJob, pace_end
from visionloop.sched.service_admission import AdmissionMixin, Principal, SubmitError
from visionloop.sched.service_base import log
from visionloop.sched.service_gpus import GpuSyncMixin
from visionloop.sched.service_reconcile import ReconcileMixin
from visionloop.sched.states import JobState, TransitionError
from visionloop.sched.store import Attempt, Job, Store
from visionloop.sched.view import ActiveJob, ClusterView, Freed, Gpu, PendingJob, Team
from visionloop.sched.workload import ALL_CHECKPOINT_AT_SIGTERM, CommandContext
from visionloop.train.progress import ENV as PROGRESS_ENV

QUEUED, RUNNING = JobState.QUEUED.value, JobState.RUNNING.value

# The longest that launches wait after the executor was found unreachable, however long it stays so.
LAUNCH_PAUSE_MAX_S = 300.0


class ControlPlane(AdmissionMixin, ReconcileMixin, GpuSyncMixin):
    """The control plane: the queue's store, its executor and its policy, run by one cycle."""

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
            min_runtime_s=t.min_runtime_s,
            top_class_preempts_young=t.top_class_preempts_young,
            reclaim_preempts_young=t.reclaim_preempts_young,
            quota_under_head=t.quota_under_head,
            holds_yield_to_quota=t.holds_yield_to_quota,
            hold_freed_for_job=t.hold_freed_for_job,
            quota_keeps_lower_classes=t.quota_keeps_lower_classes,
            hold_within_s=t.hold_within_s,
            order=t.order,
            srpt_preemption=t.srpt_preemption,
            las_preemption=t.las_preemption,
            las_threshold_gpu_s=t.las_threshold_gpu_s,
            same_node=True,
            victim_order=t.victim_order,
            easy_backfill=t.easy_backfill,
            reservation_tenants=t.reservation_tenants,
            priorities=dict(config.priorities),
        )
        self.jobs_dir = settings.home / "jobs"
        self.catalog = load_catalog(config.prices)
        # Caches that only spare the store redundant writes and reads (never the source of a
        # decision; empty after a restart, which costs one full round of writes):
        self._beats_written: dict[int, float] = {}  # job → the heartbeat last stored
        self._ckpt_steps: dict[int, set[int]] = {}  # job → checkpoint steps known stored
        self._progress = ProgressReader()  # where each open attempt's log was read up to
        self._reasons_sent: dict[int, str] = {}  # queued job → the waiting reason last stored
        self._attempts_ended = 0
        self._freed_for: dict[str, Freed] = {}  # GPU → that job, for the cycle after it left
        # Launches (and the evictions made for them) wait until then: the executor was unreachable.
        self._launch_paused_until = 0.0
        self._unreachable_streak = 0
        self._inventory_at = 0.0
        self._pending: dict[int, tuple[ViewJob, PendingJob]] = {}  # queued job → (its row, built)
        self._rows: tuple[ViewJob, ...] | None = None  # the queue view last built from
        self._active_rows: dict[int, ViewJob] = {}  # job → its row, for the jobs not queued
        self._queued: list[PendingJob] = []  # the queued jobs of _rows, in queue order
        # The runtime history of the shapes in the view (sched/history.py), and its samples.
        self._history = RuntimeHistory(())
        self._samples: tuple[Sample, ...] = ()
        self._sync_inventory()
        self._sync_teams()

    # ------------------------------------------------------------------ actions

    def cancel(self, principal: Principal, job_id: int) -> Job:
        with self._lock:
            job = self.visible_job(principal, job_id)
            now = self.clock()
            if job.state.terminal:
                return job
            if job.state in (JobState.QUEUED, JobState.PAUSED):
                job = self.store.transition(
                    job_id,
                    JobState.CANCELLED,
                    f"cancelled by {self._who(principal)}",
                    expect=job.state,
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

    def resume(self, principal: Principal, job_id: int, until_epoch: int | None, why: str | None) -> Job:
        """Promote a paused tuning trial (see Store.resume_paused). A trial that is not
        paused any more (resumed or ended by another actor) is returned as it is, so a tuner
        repeating a promotion after a restart changes nothing."""
        with self._lock:
            job = self.visible_job(principal, job_id)
            if job.state != JobState.PAUSED:
                return job
            to = f"epoch {until_epoch}" if until_epoch is not None else "the end"
            reason = f"promoted by {self._who(principal)}: goes on to {to}" + (f" ({why})" if why else "")
            job = self.store.resume_paused(job_id, until_epoch, reason, now=self.clock())
        self.wake.set()
        return job

    def prune(self, principal: Principal, job_id: int, why: str | None) -> Job:
        """End a paused tuning trial for good (see Store.prune); a job already ended is
        returned as it is. Its run is marked pruned (run.json, MLflow), off the cycle."""
        with self._lock:
            job = self.visible_job(principal, job_id)
            if job.state != JobState.PAUSED:
                if not job.state.terminal:
                    raise TransitionError(
                        f"job {job_id} is {job.state}; only a paused trial can be pruned "
                        "(cancel it instead, or wait for it to reach its rung)."
                    )
                return job
            reason = f"pruned by {self._who(principal)}" + (f": {why}" if why else "")
            job = self.store.prune(job_id, reason, now=self.clock())
        self._close_run_later(job, "pruned", f"job {job_id} {reason}")
        return job

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
                for_job = None if ev.for_job is None else int(ev.for_job)
                try:
                    # Stored with the job it steps aside for, so that a restart during its
                    # grace period still keeps its GPUs for that job.
                    self.store.transition(
                        job_id,
                        JobState.PREEMPTING,
                        ev.reason,
                        expect=JobState.RUNNING,
                        now=now,
                        leaving_for=for_job,
                    )
                except TransitionError:
                    continue  # it finished meanwhile; the next cycle sees the freed GPUs
                self._signal(job_id, terminate=True)
            self._freed_for = {}  # for one cycle only
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
            self._read_history(rows)
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
                    # Its ended attempts and this one so far, as the policy reads it.
                    attained_gpu_s=job.attained_gpu_s
                    + len(attempt.allocations) * max(0.0, now - attempt.started_at),
                    preemptible=job.state == RUNNING,
                    submitted_at=job.submitted_at,
                    expected_end=pace_end(
                        job.pace_step, job.pace_total, job.pace_rate, job.pace_at, attempt.started_at, now
                    ),
                    max_runtime_s=job.max_runtime_s,
                    expected_runtime_s=self._expected_runtime(job),
                    checkpoints_at_stop=ALL_CHECKPOINT_AT_SIGTERM,
                    leaving_for=leaving_for(job.leaving_for, job.state),
                )
            )
        queued = self._queued  # shared between cycles while unchanged: the policy only reads it
        return ClusterView(
            now=now, gpus=gpus, teams=teams, running=running, queued=queued, freed_for=self._freed_for
        )

    def _read_history(self, rows: tuple[ViewJob, ...]) -> None:
        """Read the runtime history of the shapes in the view again (one indexed query; the
        queue changed, and a job that just ran its whole length leaves it). When the samples
        changed, every queued job is rebuilt with its new estimate."""
        samples = self.store.runtime_samples({j.shape_key for j in rows if j.shape_key is not None})
        if samples != self._samples:
            self._samples, self._history = samples, RuntimeHistory(samples)
            self._pending = {}

    def _expected_runtime(self, j: ViewJob) -> float | None:
        found = self._history.estimate(j.spec_key, j.shape_key, j.run_length)
        return None if found is None else found.seconds

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
                    j.nodes,
                    j.max_runtime_s,
                    self._expected_runtime(j),
                    checkpoints_at_stop=ALL_CHECKPOINT_AT_SIGTERM,
                )
            pending[j.id] = (j, p)
            queued.append(p)
        self._pending = pending
        return queued

    # ------------------------------------------------------------------ launching

    def _command(self, job: Job) -> list[str]:
        """The attempt's command, as the job's workload builds it (files it needs are written
        in the job's folder first)."""
        ctx = CommandContext(self.job_dir(job.id), Path(job.run_dir), job.gpus, nnodes=job.nodes)
        return job.workload.command(ctx)

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
        # Where the job copies its checkpoints, as the control plane was told (the job may
        # run where the home's visionloop.toml is not, or is another's). Credentials are not
        # passed: an admin allow-lists them (`env_allow`) or the nodes have their own.
        if self.settings.checkpoint_store:
            env["VISIONLOOP_CHECKPOINT_STORE"] = self.settings.checkpoint_store
        if self.settings.s3_endpoint_url:
            env["VISIONLOOP_S3_ENDPOINT_URL"] = self.settings.s3_endpoint_url
        # The job reports its checkpoints in its log (the control plane reads them there).
        env[PROGRESS_ENV] = "1"
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
            nodes=job.nodes,
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


def leaving_for(job: int | None, state: str) -> str | None:
    """The job a running job steps aside for, while it is on its way out (PREEMPTING)."""
    return None if job is None or state != JobState.PREEMPTING.value else str(job)
