"""One pass of a loop (`visionloop loop run`): open a round when a trigger fires, then take the
open round's steps as far as they go without waiting.

A step that waits (the job is queued or running, the canary is watched) ends the pass; the
next pass goes on from it. A step that rejects the candidate (gate, export gate, canary) closes
the round as rejected with its reason; one that fails closes it as failed. The labels a round
took in stay consumed only once its dataset step finished (a failed one leaves them waiting).

What opens a round is in `loop.triggers`; the steps themselves in `loop.steps`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from visionloop.core.errors import VisionloopError
from visionloop.core.settings import Settings
from visionloop.loop.spec import LoopSpec
from visionloop.loop.state import (
    STEPS,
    LoopState,
    Round,
    StepRecord,
    load_state,
    loop_lock,
    record_event,
    save_state,
)
from visionloop.loop.steps import ClientFactory, RoundSteps
from visionloop.loop.triggers import trigger, waiting_folders

log = logging.getLogger("visionloop.loop")


@dataclass
class Pass:
    """What one pass did: the state after it, and why it stopped."""

    state: LoopState
    stopped: str  # "idle" (no trigger), "waiting" (a step waits), "closed" (a round ended)
    reason: str


def advance(
    spec: LoopSpec, settings: Settings, client_factory: ClientFactory, now: float | None = None
) -> Pass:
    """One pass: open a round if a trigger fires, then take its steps as far as they go."""
    # Under the loop's lock: a second `loop run` of the same loop is refused, rather than both
    # saving their own copy of the state over the other's.
    with loop_lock(settings.home, spec.name):
        return _advance(spec, settings, client_factory, now)


def _advance(spec: LoopSpec, settings: Settings, client_factory: ClientFactory, now: float | None) -> Pass:
    now = time.time() if now is None else now
    home = settings.home
    state = load_state(home, spec.name)
    if state is None:
        from visionloop.data.manifest import read_manifest

        state = LoopState(
            name=spec.name, dataset=str(spec.dataset), dataset_version=read_manifest(spec.dataset).version
        )
        save_state(home, state)
        record_event(home, spec.name, None, "created", f"from {spec.dataset}")
    rnd = state.current
    if rnd is None:
        why = trigger(spec, state, settings, now)
        if why is None:
            return Pass(state, "idle", "no trigger fired")
        rnd = Round(
            number=(state.rounds[-1].number + 1) if state.rounds else 1,
            opened_at=now,
            trigger=why,
            labels=[str(p.resolve()) for p in waiting_folders(spec, state)],
        )
        state.rounds.append(rnd)
        save_state(home, state)
        record_event(home, spec.name, rnd.number, "opened", why)
    steps = RoundSteps(spec, settings, state, rnd, client_factory)
    for name in STEPS:
        rec = rnd.steps[name]
        if rec.status in ("done", "skipped"):
            if rec.outputs.get("rejected"):  # an attempt that died before it closed the round
                return _close(spec, settings, state, rnd, "rejected", f"{name}: {rec.reason}")
            continue
        if rec.status != "waiting":
            rec.status, rec.started_at = "running", time.time()
            save_state(home, state)
        try:
            status = getattr(steps, name)(rec)
        except VisionloopError as e:
            return _close(spec, settings, state, rnd, "failed", f"{name}: {e}", rec)
        except Exception as e:  # a bug or a broken dependency: the round says so, the loop lives
            log.exception("loop %s round %d: step %s", spec.name, rnd.number, name)
            return _close(spec, settings, state, rnd, "failed", f"{name}: {type(e).__name__}: {e}", rec)
        if status == "rejected":
            rec.outputs["rejected"] = True
            status = "done"
        rec.status = status
        if status == "waiting":
            save_state(home, state)
            return Pass(state, "waiting", f"round {rnd.number}: {name}: {rec.reason}")
        rec.ended_at = time.time()
        save_state(home, state)
        record_event(home, spec.name, rnd.number, f"{name} {status}", rec.reason)
        if rec.outputs.get("rejected"):
            return _close(spec, settings, state, rnd, "rejected", f"{name}: {rec.reason}")
    # Every step done (now, or by an attempt that died before it could close the round).
    return _close(spec, settings, state, rnd, "promoted", rnd.steps["promote"].reason)


def _close(
    spec: LoopSpec,
    settings: Settings,
    state: LoopState,
    rnd: Round,
    outcome: str,
    reason: str,
    rec: StepRecord | None = None,
) -> Pass:
    if outcome == "failed" and rec is not None:
        rec.status, rec.ended_at, rec.reason = "failed", time.time(), reason
    for later in rnd.steps.values():  # what the round will not do now
        if later.status == "pending":
            later.status = "skipped"
    rnd.outcome, rnd.closed_at, rnd.reason = outcome, time.time(), reason  # type: ignore[assignment]
    save_state(settings.home, state)
    record_event(settings.home, spec.name, rnd.number, outcome, reason)
    return Pass(state, "closed", f"round {rnd.number} {outcome}: {reason}")
