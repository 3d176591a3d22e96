"""The tuner: an ask-and-tell loop whose trials are queue jobs.

Each pass (`Tuner.step`) settles what the queue did, then fills free slots:

1. every RUNNING trial is matched with its job (the trial's user attribute `job_id`):
   - the job's new evaluations (the control plane appends them to the job's folder as it
     reads them from the job's log, see sched/service_reconcile.py) are reported as the
     trial's intermediate values at step = epochs completed; a step the trial already has
     in storage is never reported again, so an evaluation read twice (a control-plane
     restart, a resumed attempt) or a restarted tuner changes nothing;
   - if the pruner says stop, the trial is marked (`prune_epoch`), its job is cancelled
     through the queue (which stops it after a checkpoint and frees its GPUs) and the trial
     is told PRUNED;
   - a job that ended is told: succeeded → COMPLETE with the objective at its last
     evaluation (the trainer's final metrics are its last evaluation's), failed or cancelled
     by someone else → FAIL (the reason in the trial's `end` attribute);
   - a trial without a job (the tuner died between ask and submit) is submitted now.
2. while fewer than `concurrency` trials run and fewer than `trials` have been asked, a new
   trial is asked, its parameters suggested and applied to the base train spec, and its job
   submitted.

Every submit carries an idempotency key made of the study's uid and the trial's number, and
the job id is stored on the trial right after: a tuner SIGKILLed between the two submits
again on restart and gets the same job back, never a second one, and a trial is only ever
asked when no RUNNING trial is short of a job. All the loop's state is in the database
(Optuna's tables and the job store), none in this process: restarted at any moment, it
continues the study and ends with exactly `trials` finished trials. Liveness is the queue's
job state, not Optuna's heartbeat (which ask-and-tell does not have): a preempted,
spot-interrupted or retried job is still the same trial.

Known gap: a prune decided in the moment before a SIGKILL (values reported, `prune_epoch`
not yet stored) is not decided again after the restart (the pruner has moved past that
rung), so that trial runs to its end and completes instead.

The seam for pausing at a rung (ASHA promotion): `_on_prune` is where a trial that the
pruner stops would instead be paused (a checkpointed stop with its own ending, left RUNNING
in Optuna with a `paused_epoch` attribute) and `_fill` where a paused trial that the pruner
promotes would be resumed (its job requeued from that checkpoint) before a new one is asked.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from visionloop.core.errors import SpecError
from visionloop.sched.progress import EvalEvent
from visionloop.sched.service_reconcile import EVALS_FILE, read_evals
from visionloop.tune.space import apply, suggest
from visionloop.tune.spec import TuneSpec
from visionloop.tune.study import UID_ATTR

log = logging.getLogger(__name__)

# Trial user attributes.
JOB_ATTR = "job_id"
PRUNE_ATTR = "prune_epoch"  # set before the cancel: a restart finishes a prune it finds half-done
END_ATTR = "end"  # why a trial failed (or how it ended), for `tune show`

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
ENDED_JOB_STATES = ("succeeded", "failed", "cancelled")


class Queue(Protocol):
    """What the tuner needs of the control plane (visionloop.api.client.Client has it)."""

    def submit(self, spec: dict[str, Any], **fields: Any) -> dict[str, Any]: ...
    def job(self, job_id: int) -> dict[str, Any]: ...
    def cancel(self, job_id: int) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Progress:
    """One pass's counts."""

    finished: int
    running: int
    asked: int


def idempotency_key(study: optuna.Study, number: int) -> str:
    return f"tune-{study.user_attrs[UID_ATTR][:16]}-t{number}"


def job_name(study: optuna.Study, number: int) -> str:
    return f"{study.study_name}-t{number}"


class Tuner:
    """Runs `spec`'s study (from `visionloop.tune.study.create_or_load`) through `queue`.
    `jobs_dir`: the control plane's job folders (`<home>/jobs`), where it keeps each job's
    evaluations."""

    def __init__(self, spec: TuneSpec, study: optuna.Study, queue: Queue, jobs_dir: Path) -> None:
        self.spec = spec
        self.study = study
        self.queue = queue
        self.jobs_dir = jobs_dir
        self.metric = spec.objective.metric.removeprefix("val/")
        self._train_doc = spec.train_doc()

    # ------------------------------------------------------------------ the loop

    def run(
        self,
        poll_s: float = 2.0,
        on_pass: Callable[[Progress], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Progress:
        """Pass after pass until `trials` trials have finished (or `should_stop()`)."""
        while True:
            progress = self.step()
            if on_pass is not None:
                on_pass(progress)
            if progress.finished >= self.spec.trials or should_stop():
                return progress
            time.sleep(poll_s)

    def step(self) -> Progress:
        """One pass: settle the running trials with their jobs, then start new ones."""
        for frozen in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self._settle(frozen)
        return self._fill()

    # ------------------------------------------------------------------ settling

    def _settle(self, frozen: FrozenTrial) -> None:
        job_id = frozen.user_attrs.get(JOB_ATTR)
        if job_id is None:
            self._submit(frozen)  # asked, but the tuner stopped before its job was submitted
            return
        if PRUNE_ATTR in frozen.user_attrs:
            self._finish_prune(frozen, int(job_id), int(frozen.user_attrs[PRUNE_ATTR]))
            return
        job = self.queue.job(int(job_id))["job"]
        values, prune_at = self._report(frozen, int(job_id))
        state = str(job["state"])
        if state not in ENDED_JOB_STATES:
            if prune_at is not None:
                self._on_prune(frozen, int(job_id), prune_at)
            return
        if state == "succeeded":
            if values:
                last = values[max(values)]
                self._tell(frozen, TrialState.COMPLETE, last, f"job {job_id} succeeded")
            else:
                why = f"job {job_id} succeeded without reporting {self.spec.objective.metric}"
                self._tell(frozen, TrialState.FAIL, None, why)
        elif state == "failed":
            self._tell(frozen, TrialState.FAIL, None, f"job {job_id} failed")
        else:
            self._tell(frozen, TrialState.FAIL, None, f"job {job_id} was cancelled outside the tuner")

    def _report(self, frozen: FrozenTrial, job_id: int) -> tuple[dict[int, float], int | None]:
        """Report the job's evaluations that the trial does not have yet, asking the pruner
        after each (which is also how successive halving records a trial's rungs, even for
        a job that has ended); return every value the trial has by step (epochs completed),
        and the first step after which the pruner said stop."""
        values = dict(frozen.intermediate_values)
        new: dict[int, float] = {}
        for event in read_evals(self.jobs_dir / f"job-{job_id}" / EVALS_FILE):
            step = self._step_of(event)
            value = event.metrics.get(self.metric)
            if step is None or value is None or step in values or step in new:
                continue
            new[step] = value
        prune_at = None
        if new:
            trial = optuna.trial.Trial(self.study, frozen._trial_id)
            for step, value in sorted(new.items()):
                trial.report(value, step)
                if prune_at is None and trial.should_prune():
                    prune_at = step
        values.update(new)
        return values, prune_at

    def _step_of(self, event: EvalEvent) -> int | None:
        """The pruner's step: epochs completed (the spec's rungs are in epochs); for a train
        spec run by steps (no pruner then), the training step."""
        if self.spec.train.epochs is None:
            return event.step
        epochs = round(event.epoch)
        return epochs if math.isclose(event.epoch, epochs, abs_tol=1e-6) else None

    def _on_prune(self, frozen: FrozenTrial, job_id: int, epoch: int) -> None:
        """The pruner stops the trial. (The seam for pausing instead, see the module docstring.)"""
        log.info("trial %s (job %s) pruned at epoch %s", frozen.number, job_id, epoch)
        optuna.trial.Trial(self.study, frozen._trial_id).set_user_attr(PRUNE_ATTR, epoch)
        self._finish_prune(frozen, job_id, epoch)

    def _finish_prune(self, frozen: FrozenTrial, job_id: int, epoch: int) -> None:
        self.queue.cancel(job_id)  # a no-op on a job that has ended meanwhile
        self._tell(frozen, TrialState.PRUNED, None, f"pruned at epoch {epoch}; job {job_id} cancelled")

    def _tell(self, frozen: FrozenTrial, state: TrialState, value: float | None, why: str) -> None:
        optuna.trial.Trial(self.study, frozen._trial_id).set_user_attr(END_ATTR, why)
        self.study.tell(frozen.number, value, state=state, skip_if_finished=True)
        log.info("trial %s: %s (%s)", frozen.number, state.name, why)

    # ------------------------------------------------------------------ starting trials

    def _fill(self) -> Progress:
        trials = self.study.get_trials(deepcopy=False)
        finished = sum(t.state in FINISHED for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        # Enqueued trials (WAITING) are not asked yet: `ask` takes them first.
        asked = sum(t.state != TrialState.WAITING for t in trials)
        while running < self.spec.concurrency and asked < self.spec.trials:
            trial = self.study.ask()
            asked += 1
            running += 1
            self._submit(trial)
        return Progress(finished, running, asked)

    def _submit(self, asked: FrozenTrial | optuna.trial.Trial) -> None:
        """Suggest the trial's parameters (those already stored come back as they were) and
        submit its job, idempotently; store the job id on the trial."""
        trial = optuna.trial.Trial(self.study, asked._trial_id)
        params = suggest(trial, self.spec.space)
        try:
            job = self.spec.trial_job(apply(self._train_doc, params), job_name(self.study, trial.number))
        except SpecError as e:
            trial.set_user_attr(END_ATTR, f"its train spec is invalid: {e}")
            self.study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
            return
        doc = job.model_dump(mode="json", exclude_none=True)
        found = self.queue.submit(doc, idempotency_key=idempotency_key(self.study, trial.number))
        trial.set_user_attr(JOB_ATTR, int(found["id"]))
        log.info("trial %s: job %s %s", trial.number, found["id"], params)


__all__ = ["END_ATTR", "JOB_ATTR", "PRUNE_ATTR", "Progress", "Queue", "Tuner", "idempotency_key"]
