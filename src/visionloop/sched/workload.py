"""What a job runs: a typed workload, one kind per sort of work.

The queue itself knows nothing of training. A workload says three things:

- **its command** (`command`): the process an attempt runs, and the files it needs in the
  job's folder (written there first);
- **its progress**: what it reports on its stdout as progress lines (see
  visionloop.train.progress), which the control plane reads back from the attempt's log;
- **what its exit means** (`ending`): an `Ending`, which the reconciler applies as it is.
  Only the queue's own rules stay in the reconciler: a failure's retries with back-off
  until `max_restarts`, a vanished process (lost, requeued), and which attempts a spot
  interruption took.

So a tuning trial (`TrialWorkload`: training that pauses at its study's rungs through a
checkpoint, with its own exit status) is a class of its own with its own `ending`, and the
reconciler does not know it exists.

Workloads are pydantic models, discriminated on `kind`, so they validate and serialise like
every spec. A job stores its train spec and, for any kind but plain training, a workload
document (the jobs table's `workload_doc`; `Job.workload` puts the two together).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from visionloop.core.fsutil import atomic_write_text
from visionloop.sched.history import RuntimeProfile
from visionloop.sched.records import Outcome
from visionloop.sched.states import JobState
from visionloop.spec_files import spec_to_yaml
from visionloop.specs import TrainSpec
from visionloop.train.signals import EXIT_PAUSED, EXIT_PREEMPTED


@dataclass(frozen=True)
class CommandContext:
    """Where and how big an attempt is, for building its command."""

    job_dir: Path  # the job's own folder on the control plane's side (specs and files go here)
    run_dir: Path
    gpus: int
    python: str = sys.executable
    # Machines the run spans (resources.nodes): `gpus` is the total over them. Each node's
    # rendezvous (node rank, node 0's address and port) is the executor's, given through the
    # environment (visionloop.train.launch), so one command serves every node.
    nnodes: int = 1


@dataclass(frozen=True)
class AttemptExit:
    """How an attempt's process ended, and what the control plane had asked of it."""

    code: int  # the exit status (-1 if the executor could not tell)
    state: JobState  # the job's state when it exited: RUNNING, PREEMPTING or CANCELLING
    detail: str = ""  # the executor's word on it (Ray's "could not start it: ..."), if any
    gpu_lost: bool = False  # it held a GPU that went down (a spot interruption)


@dataclass(frozen=True)
class Ending:
    """What the reconciler does with an attempt that exited: end it with `outcome`, move the
    job to `state` with `reason`.

    `retry`: a failure (state FAILED) that the queue retries with back-off while the job has
    restarts left; the reconciler then requeues it (and says "retry N of M") instead.
    `preemption`: counts towards the job's preemptions (a stop the job resumes from)."""

    outcome: Outcome
    state: JobState
    reason: str
    retry: bool = False
    preemption: bool = False


class TrainWorkload(BaseModel):
    """One `visionloop train` run: exit 0 is done, exit 75 (EXIT_PREEMPTED) is "checkpointed
    and stopped" (resumed from that checkpoint on the next attempt), anything else a failure."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["train"] = "train"
    train: TrainSpec

    # The trainer writes a checkpoint when SIGTERM asks it to stop (visionloop.train.signals),
    # so an eviction costs only the grace period and a restart.
    CHECKPOINTS_AT_SIGTERM: ClassVar[bool] = True
    # Where the spec goes in the job's folder; written once, so every attempt runs the same spec.
    SPEC_FILE: ClassVar[str] = "train.yaml"

    def command(self, ctx: CommandContext) -> list[str]:
        spec_path = ctx.job_dir / self.SPEC_FILE
        if not spec_path.is_file():
            spec_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(spec_path, spec_to_yaml(self.train))
        cmd = [ctx.python, "-m", "visionloop", "train", str(spec_path), "--run-dir", str(ctx.run_dir)]
        per_node = ctx.gpus // max(ctx.nnodes, 1)
        if per_node > 1:
            cmd += ["--nproc-per-node", str(per_node)]
        return cmd

    def runtime_profile(self) -> RuntimeProfile:
        """What decides how long it runs (sched/history.py): its speed from the model, the
        data and how they are run; its length in epochs or steps. Not its seed or tracking."""
        return train_profile(self.train, None)

    def ending(self, ex: AttemptExit) -> Ending:
        code = ex.code
        if ex.state == JobState.CANCELLING:
            if code == 0:
                return Ending("succeeded", JobState.SUCCEEDED, "finished before the cancel took effect")
            return Ending("cancelled", JobState.CANCELLED, f"cancelled (exit {code})")
        if code == 0:
            return Ending("succeeded", JobState.SUCCEEDED, "finished (exit 0)")
        if ex.state == JobState.PREEMPTING:
            # A preemption never counts as a failure, even if the victim had to be SIGKILLed:
            # it resumes from its last checkpoint.
            outcome: Outcome = "interrupted" if ex.gpu_lost else "preempted"
            how = (
                "checkpointed and exited 75"
                if code == EXIT_PREEMPTED
                else f"exit {code} after the grace period"
            )
            return Ending(outcome, JobState.QUEUED, f"{outcome}: {how}; requeued to resume", preemption=True)
        if code == EXIT_PREEMPTED:
            return Ending(
                "preempted",
                JobState.QUEUED,
                "stopped after a checkpoint (exit 75, signalled outside visionloop); requeued to resume",
            )
        why = f"exit {code} ({ex.detail})" if ex.detail else f"exit {code}"
        return Ending("failed", JobState.FAILED, why, retry=True)


class TrialWorkload(BaseModel):
    """One trial of a tuning study: training that stops at its study's rungs.

    Run with `--until-epoch` (the rung it is heading for), it exits 76 (EXIT_PAUSED) there
    after a checkpoint, and the job is PAUSED: its GPUs are free at once, and it waits, holding
    nothing, for its study to promote it (`Store.resume_paused`: queued again, heading for the
    next rung, resumed from that checkpoint) or to prune it (`Store.prune`: ended for good).
    Every other exit means what it means for training."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["trial"] = "trial"
    train: TrainSpec
    CHECKPOINTS_AT_SIGTERM: ClassVar[bool] = True  # it is the trainer
    study: str
    number: int
    until_epoch: int | None = None

    def command(self, ctx: CommandContext) -> list[str]:
        cmd = TrainWorkload(train=self.train).command(ctx)
        if self.until_epoch is not None:
            cmd += ["--until-epoch", str(self.until_epoch)]
        return cmd

    def runtime_profile(self) -> RuntimeProfile:
        """As training's, but as long as the rung it is heading for: a trial paused at epoch 3
        ran 3 epochs, whatever its spec's `epochs`."""
        return train_profile(self.train, self.until_epoch)

    def ending(self, ex: AttemptExit) -> Ending:
        if ex.code == EXIT_PAUSED and ex.state in (JobState.RUNNING, JobState.PREEMPTING):
            # At its rung (also when a preemption asked it to stop as it got there): the stop
            # the study asked for, so neither a preemption nor a failure.
            return Ending(
                "paused",
                JobState.PAUSED,
                f"paused after epoch {self.until_epoch}, a rung of study {self.study} (exit 76); "
                "waiting for the study to promote or prune it",
            )
        return TrainWorkload(train=self.train).ending(ex)


def train_profile(train: TrainSpec, until_epoch: int | None) -> RuntimeProfile:
    """A training run's runtime profile, stopping after `until_epoch` epochs if given."""
    doc = train.model_dump(mode="json")
    ckpt = doc["checkpoint"]
    shape = {
        **{k: doc[k] for k in ("task", "data", "model", "precision", "device", "distributed")},
        "deterministic": doc["deterministic"],  # deterministic kernels are slower
        "eval": doc["eval"],  # how often it evaluates takes time too
        "checkpoint": {k: ckpt[k] for k in ("every_steps", "every_minutes")},
    }
    detail = {k: doc[k] for k in ("optimizer", "schedule", "loss")}
    if train.epochs is not None:
        return RuntimeProfile(shape, detail, until_epoch or train.epochs, "epochs")
    assert train.steps is not None  # TrainSpec asks for exactly one of them
    return RuntimeProfile(shape, detail, train.steps, "steps")


# Every kind of workload, told apart by `kind`.
Workload = Annotated[TrainWorkload | TrialWorkload, Field(discriminator="kind")]
# Does every kind checkpoint at SIGTERM? The scheduler's view tells the policy so for each
# running job (`ActiveJob.checkpoints_at_stop`); a kind that does not would have to be read
# per job from its workload document there.
ALL_CHECKPOINT_AT_SIGTERM = all(k.CHECKPOINTS_AT_SIGTERM for k in (TrainWorkload, TrialWorkload))
WORKLOAD: TypeAdapter[TrainWorkload | TrialWorkload] = TypeAdapter(Workload)


def workload_of(train: TrainSpec, doc: dict[str, Any] | None) -> TrainWorkload | TrialWorkload:
    """A stored job's workload: its workload document (None: plain training) with its train spec."""
    if doc is None:
        return TrainWorkload(train=train)
    return WORKLOAD.validate_python({**doc, "train": train})


__all__ = [
    "ALL_CHECKPOINT_AT_SIGTERM",
    "WORKLOAD",
    "AttemptExit",
    "CommandContext",
    "Ending",
    "TrainWorkload",
    "TrialWorkload",
    "Workload",
    "workload_of",
]
