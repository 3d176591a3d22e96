"""The tuner: an ask-and-tell loop whose trials are queue jobs.

Every trial is a job whose workload is a tuning trial (sched/workload.py `TrialWorkload`): it
trains to the next rung of the study's pruner and pauses there through a checkpoint (exit
76, job PAUSED, its GPUs free at once). Each pass (`Tuner.step`) settles what the queue did,
then fills the free slots:

1. every RUNNING trial is matched with its job (the trial's user attribute `job_id`):
   - the job's new evaluations (the control plane reads them from the job's log, see
     sched/service_reconcile.py, and serves them at `GET /v1/jobs/{id}/evals`, so the tuner
     may run on any machine that reaches the control plane's API) are reported as the
     trial's intermediate values at step = epochs completed; a step the trial already has
     in storage is never reported again, so an evaluation read twice (a control-plane
     restart, a resumed attempt) or a restarted tuner changes nothing;
   - a job paused at a rung is judged: with asha's promotion (the default) it waits there
     for `tune.asha.promotable` (below); with the stop-only pruners (asha without promotion,
     hyperband, median) Optuna's pruner decides at once: pruned (the job is pruned through
     the queue, the trial told PRUNED) or sent on to its next rung;
   - a job that ended is told: succeeded → COMPLETE with the objective at its last
     evaluation (the trainer's final metrics are its last evaluation's), pruned → PRUNED (a
     prune the tuner made before a restart), failed or cancelled by someone else → FAIL
     (the reason in the trial's `end` attribute);
   - a trial without a job (the tuner died between ask and submit) is submitted now.
2. while fewer than `concurrency` trials hold a slot (queued or running), with asha's
   promotion a paused trial among the best 1/η of its rung goes on to the next rung (from its
   checkpoint, as the same job and the same Optuna trial); otherwise, while fewer than
   `trials` have been asked and the budget is not spent, a new trial is asked, its
   parameters suggested and applied to the base train spec, and its job submitted.
3. once nothing holds a slot and nothing more can start, the trials still paused are pruned:
   the study is over.

Every submit carries an idempotency key made of the study's uid and the trial's number, and
the job id is stored on the trial right after: a tuner SIGKILLed between the two submits
again on restart and gets the same job back, never a second one, and a trial is only ever
asked when no RUNNING trial is short of a job. Promoting and pruning are idempotent in the
queue (a job no longer paused is left as it is), and a paused job is judged again from the
database on every pass. All the loop's state is in the database (Optuna's tables and the job
store), none in this process: restarted at any moment, it continues the study and ends with
exactly `trials` finished trials (fewer only if the budget stopped it). Liveness is the
queue's job state, not Optuna's heartbeat (which ask-and-tell does not have): a preempted,
spot-interrupted or retried job is still the same trial.

Budgets: the GPU-hours and cost of every trial's job (the control plane's cost ledger, priced
from its catalog) are summed each pass; once either budget is reached, no trial starts and
none is promoted, the running ones finish their rung, and the study ends.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from visionloop.core.errors import ControlPlaneUnreachableError, QueueFullError, SpecError
from visionloop.core.settings import load_settings
from visionloop.sched.progress import EvalEvent
from visionloop.specs import TrialFields
from visionloop.tune.asha import promotable
from visionloop.tune.space import apply, suggest
from visionloop.tune.spec import TuneSpec
from visionloop.tune.study import UID_ATTR
from visionloop.tune.tracking import nest, study_parent_run

log = logging.getLogger(__name__)

# Trial user attributes.
JOB_ATTR = "job_id"
END_ATTR = "end"  # why a trial failed (or how it ended), for `tune show`
COST_ATTR = "cost"  # {"gpu_hours", "usd"} of its job, stored when it is told
PROMOTIONS_ATTR = "promotions"  # how many times asha promoted it (for `tune show`)
# Study user attribute: why no trial starts any more (a budget), once it happened.
STOPPED_ATTR = "visionloop_stopped"

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
# A pass that found its team's queue full waits at least this long (the API's Retry-After).
QUEUE_FULL_WAIT_S = 30.0
ENDED_JOB_STATES = ("succeeded", "failed", "cancelled", "pruned")


class Queue(Protocol):
    """What the tuner needs of the control plane (visionloop.api.client.Client has it)."""

    def submit(self, spec: dict[str, Any], **fields: Any) -> dict[str, Any]: ...
    def job(self, job_id: int) -> dict[str, Any]: ...
    def evals(self, job_id: int) -> list[dict[str, Any]]: ...
    def resume(self, job_id: int, until_epoch: int | None, reason: str | None = None) -> dict[str, Any]: ...
    def prune(self, job_id: int, reason: str | None = None) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Progress:
    """One pass's counts."""

    finished: int
    running: int  # trials holding a slot: their job queued or running
    asked: int
    paused: int = 0  # trials paused at a rung, waiting to be promoted
    gpu_hours: float = 0.0  # spent by every trial's job so far
    usd: float = 0.0
    stopped: str | None = None  # why no trial starts any more (a budget), if so
    done: bool = False  # the study is over: every trial it will have is finished


@dataclass
class _Pass:
    """What one pass learnt of the jobs."""

    active: int = 0
    # trial number → (the rung it is paused at, its job id, its job's cost so far)
    paused: dict[int, tuple[int, int, dict[str, float]]] = field(default_factory=dict)
    gpu_hours: float = 0.0
    usd: float = 0.0


def idempotency_key(study: optuna.Study, number: int) -> str:
    return f"tune-{study.user_attrs[UID_ATTR][:16]}-t{number}"


def job_name(study: optuna.Study, number: int) -> str:
    return f"{study.study_name}-t{number}"


def _cost(show: dict[str, Any]) -> dict[str, float]:
    total = (show.get("cost") or {}).get("total") or {}
    return {"gpu_hours": float(total.get("gpu_hours", 0.0)), "usd": float(total.get("cost", 0.0))}


class Tuner:
    """Runs `spec`'s study (from `visionloop.tune.study.create_or_load`) through `queue`."""

    def __init__(self, spec: TuneSpec, study: optuna.Study, queue: Queue) -> None:
        self.spec = spec
        self.study = study
        self.queue = queue
        self.metric = spec.objective.metric.removeprefix("val/")
        self.maximize = spec.objective.direction == "max"
        self._train_doc = spec.train_doc()
        # Every trial's MLflow run is nested under the study's own parent run (none when the
        # trials are not tracked: `tracking.enabled: false` in the base train spec).
        self.parent_run_id = study_parent_run(study, load_settings()) if spec.train.tracking.enabled else None

    # ------------------------------------------------------------------ the loop

    def run(
        self,
        poll_s: float = 2.0,
        on_pass: Callable[[Progress], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
        on_unreachable: Callable[[str], None] | None = None,
        on_queue_full: Callable[[str], None] | None = None,
    ) -> Progress:
        """Pass after pass until the study is over (or `should_stop()`). A control plane that
        does not answer (restarting, say) is waited for: a pass cut off midway is safe to
        redo, since every step of it is idempotent against the database."""
        while True:
            try:
                progress = self.step()
            except ControlPlaneUnreachableError as e:
                log.warning("control plane unreachable, retrying in %.1f s: %s", max(poll_s, 1.0), e)
                if on_unreachable is not None:
                    on_unreachable(str(e))
                if should_stop():
                    raise
                time.sleep(max(poll_s, 1.0))
                continue
            except QueueFullError as e:
                # The team's queue is at its limit: the trial stays asked but unsubmitted (the
                # next pass submits it, as after a crash) once the team's jobs have started.
                wait = max(poll_s, QUEUE_FULL_WAIT_S)
                log.warning("the team's queue is full, submitting again in %.0f s: %s", wait, e)
                if on_queue_full is not None:
                    on_queue_full(str(e))
                if should_stop():
                    raise
                time.sleep(wait)
                continue
            if on_pass is not None:
                on_pass(progress)
            if progress.done or should_stop():
                return progress
            time.sleep(poll_s)

    def step(self) -> Progress:
        """One pass: settle the running trials with their jobs, then start or promote."""
        seen = _Pass()
        for frozen in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self._settle(frozen, seen)
        for frozen in self.study.get_trials(deepcopy=False, states=FINISHED):
            cost = frozen.user_attrs.get(COST_ATTR) or {}
            seen.gpu_hours += float(cost.get("gpu_hours", 0.0))
            seen.usd += float(cost.get("usd", 0.0))
        return self._fill(seen)

    # ------------------------------------------------------------------ settling

    def _settle(self, frozen: FrozenTrial, seen: _Pass) -> None:
        job_id = frozen.user_attrs.get(JOB_ATTR)
        if job_id is None:
            self._submit(frozen)  # asked, but the tuner stopped before its job was submitted
            seen.active += 1
            return
        job_id = int(job_id)
        show = self.queue.job(job_id)
        job, cost = show["job"], _cost(show)
        values = self._report(frozen, job_id)
        state = str(job["state"])
        if state not in ENDED_JOB_STATES:
            seen.gpu_hours += cost["gpu_hours"]
            seen.usd += cost["usd"]
        if state == "paused":
            self._on_paused(frozen, job_id, job, values, cost, seen)
            return
        if state not in ENDED_JOB_STATES:
            seen.active += 1
            return
        if state == "succeeded":
            if values:
                last = values[max(values)]
                self._tell(frozen, TrialState.COMPLETE, last, f"job {job_id} succeeded", cost)
            else:
                why = f"job {job_id} succeeded without reporting {self.spec.objective.metric}"
                self._tell(frozen, TrialState.FAIL, None, why, cost)
        elif state == "pruned":  # pruned by this tuner before it was restarted
            self._tell(frozen, TrialState.PRUNED, None, f"pruned; job {job_id} {state}", cost)
        elif state == "failed":
            self._tell(frozen, TrialState.FAIL, None, f"job {job_id} failed", cost)
        else:
            why = f"job {job_id} was cancelled outside the tuner"
            self._tell(frozen, TrialState.FAIL, None, why, cost)

    def _on_paused(
        self,
        frozen: FrozenTrial,
        job_id: int,
        job: dict[str, Any],
        values: dict[int, float],
        cost: dict[str, float],
        seen: _Pass,
    ) -> None:
        rung = int((job.get("workload_doc") or {}).get("until_epoch") or 0)
        if rung not in values:
            # Its evaluation at the rung never reached the control plane (an evaluations file
            # past its size limit, a log that could not be read): nothing to judge it by.
            why = f"paused after epoch {rung} without reporting {self.spec.objective.metric} there"
            self._prune(frozen, job_id, why, cost, TrialState.FAIL)
            return
        if self.spec.pruner.promotes:
            seen.paused[frozen.number] = (rung, job_id, cost)
            return
        # Stop-only pruners judge the trial now, at its last reported step (the rung): a
        # pass after a restart asks the same question again and gets the same answer.
        if optuna.trial.Trial(self.study, frozen._trial_id).should_prune():
            self._prune(frozen, job_id, f"pruned at epoch {rung} ({self.spec.pruner.name})", cost)
            return
        nxt = self.spec.next_rung(rung)
        self.queue.resume(job_id, nxt, reason=f"trial {frozen.number} passed its rung at epoch {rung}")
        seen.active += 1

    def _report(self, frozen: FrozenTrial, job_id: int) -> dict[int, float]:
        """Report the job's evaluations that the trial does not have yet; return every value
        the trial has, by step (epochs completed)."""
        values = dict(frozen.intermediate_values)
        new: dict[int, float] = {}
        for doc in self.queue.evals(job_id):
            try:
                event = EvalEvent.from_doc(doc)
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # not an evaluation: nothing to report
            step = self._step_of(event)
            value = event.metrics.get(self.metric)
            if step is None or value is None or step in values or step in new:
                continue
            new[step] = value
        if new:
            trial = optuna.trial.Trial(self.study, frozen._trial_id)
            for step, value in sorted(new.items()):
                trial.report(value, step)
        values.update(new)
        return values

    def _step_of(self, event: EvalEvent) -> int | None:
        """The pruner's step: epochs completed (the spec's rungs are in epochs); for a train
        spec run by steps (no pruner then), the training step."""
        if self.spec.train.epochs is None:
            return event.step
        epochs = round(event.epoch)
        return epochs if math.isclose(event.epoch, epochs, abs_tol=1e-6) else None

    def _prune(
        self,
        frozen: FrozenTrial,
        job_id: int,
        why: str,
        cost: dict[str, float],
        state: TrialState = TrialState.PRUNED,
    ) -> None:
        self.queue.prune(job_id, reason=f"study {self.study.study_name}, trial {frozen.number}: {why}")
        self._tell(frozen, state, None, f"{why}; job {job_id} pruned", cost)

    def _tell(
        self,
        frozen: FrozenTrial,
        state: TrialState,
        value: float | None,
        why: str,
        cost: dict[str, float] | None = None,
    ) -> None:
        trial = optuna.trial.Trial(self.study, frozen._trial_id)
        trial.set_user_attr(END_ATTR, why)
        if cost is not None:
            trial.set_user_attr(COST_ATTR, cost)
        self.study.tell(frozen.number, value, state=state, skip_if_finished=True)
        log.info("trial %s: %s (%s)", frozen.number, state.name, why)

    # ------------------------------------------------------------------ starting trials

    def _budget_spent(self, seen: _Pass) -> str | None:
        budget = self.spec.budget
        if budget is None:
            return None
        if budget.gpu_hours is not None and seen.gpu_hours >= budget.gpu_hours:
            return f"the budget of {budget.gpu_hours:g} GPU-hours is spent ({seen.gpu_hours:.3f})"
        if budget.usd is not None and seen.usd >= budget.usd:
            return f"the budget of {budget.usd:g} USD is spent ({seen.usd:.2f})"
        return None

    def _fill(self, seen: _Pass) -> Progress:
        stopped = self._budget_spent(seen)
        if stopped and self.study.user_attrs.get(STOPPED_ATTR) != stopped:
            self.study.set_user_attr(STOPPED_ATTR, stopped)
            log.info("study %s: no trial starts any more: %s", self.study.study_name, stopped)
        trials = self.study.get_trials(deepcopy=False)
        # Enqueued trials (WAITING) are not asked yet: `ask` takes them first.
        asked = sum(t.state != TrialState.WAITING for t in trials)
        while seen.active < self.spec.concurrency and not stopped:
            if self._promote(trials, seen):
                continue
            if asked >= self.spec.trials:
                break
            trial = self.study.ask()
            asked += 1
            seen.active += 1
            self._submit(trial)
        if seen.active == 0 and seen.paused and (stopped or asked >= self.spec.trials):
            # Nothing runs and nothing more can (the loop above found no promotion, or the
            # budget is spent): the trials still paused were never promoted.
            why = stopped or "never among the best of its rung"
            by_number = {t.number: t for t in trials}
            for number, (rung, job_id, cost) in sorted(seen.paused.items()):
                self._prune(by_number[number], job_id, f"paused at epoch {rung}, {why}", cost)
            seen.paused.clear()
        trials = self.study.get_trials(deepcopy=False)
        finished = sum(t.state in FINISHED for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials) - len(seen.paused)
        done = finished == asked and (asked >= self.spec.trials or stopped is not None) and running == 0
        return Progress(
            finished=finished,
            running=running,
            asked=asked,
            paused=len(seen.paused),
            gpu_hours=seen.gpu_hours,
            usd=seen.usd,
            stopped=stopped,
            done=done,
        )

    @staticmethod
    def _paused_at(seen: _Pass) -> dict[int, int]:
        return {number: rung for number, (rung, _, _) in seen.paused.items()}

    def _asha_args(self) -> tuple[list[int], int, bool]:
        return self.spec.rungs(), self.spec.pruner.reduction_factor, self.maximize

    def _promote(self, trials: list[FrozenTrial], seen: _Pass) -> bool:
        """Promote the next paused trial that asha allows, if any."""
        if not self.spec.pruner.promotes or not seen.paused:
            return False
        found = promotable(trials, self._paused_at(seen), *self._asha_args())
        if found is None:
            return False
        _, job_id, _ = seen.paused.pop(found.number)
        nxt = self.spec.next_rung(found.rung)
        why = (
            f"trial {found.number} promoted: #{found.rank + 1} of the {found.reached} trials that reached "
            f"epoch {found.rung}"
        )
        self.queue.resume(job_id, nxt, reason=why)
        frozen = next(t for t in trials if t.number == found.number)
        done = int(frozen.user_attrs.get(PROMOTIONS_ATTR, 0))
        optuna.trial.Trial(self.study, frozen._trial_id).set_user_attr(PROMOTIONS_ATTR, done + 1)
        log.info("%s; goes on to %s", why, f"epoch {nxt}" if nxt else "the end")
        seen.active += 1
        return True

    def job_doc(self, trial: optuna.trial.Trial) -> dict[str, Any]:
        """The queue job of `trial`, as submitted: its parameters (suggested now, or read back
        as stored) applied to the base train spec, nested under the study's MLflow run,
        heading for the first rung. SpecError if that train spec is invalid."""
        params = suggest(trial, self.spec.space)
        doc = (
            nest(self._train_doc, self.parent_run_id, self.study.study_name, trial.number)
            if self.parent_run_id is not None
            else self._train_doc
        )
        marks = TrialFields(
            study=self.study.study_name, number=trial.number, until_epoch=self.spec.next_rung(None)
        )
        job = self.spec.trial_job(apply(doc, params), job_name(self.study, trial.number), marks)
        return job.model_dump(mode="json", exclude_none=True)

    def _submit(self, asked: FrozenTrial | optuna.trial.Trial) -> None:
        """Submit the trial's job, idempotently; store the job id on the trial."""
        trial = optuna.trial.Trial(self.study, asked._trial_id)
        try:
            doc = self.job_doc(trial)
        except SpecError as e:
            trial.set_user_attr(END_ATTR, f"its train spec is invalid: {e}")
            self.study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
            return
        found = self.queue.submit(doc, idempotency_key=idempotency_key(self.study, trial.number))
        trial.set_user_attr(JOB_ATTR, int(found["id"]))
        log.info("trial %s: job %s %s", trial.number, found["id"], trial.params)


__all__ = [
    "COST_ATTR",
    "END_ATTR",
    "JOB_ATTR",
    "STOPPED_ATTR",
    "Progress",
    "Queue",
    "Tuner",
    "idempotency_key",
]
