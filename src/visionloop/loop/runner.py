"""One pass of a loop (`visionloop loop run`): open a round when a trigger fires, then take the
open round's steps as far as they go without waiting.

    dataset   `data add` of each labelled folder the round took in (none: the current version)
    train     a queue job on the round's version, warm-started from the champion's weights,
              submitted with an idempotency key (a resubmission after a crash is the same job)
    register  the finished run as a new version of the model (found again by its run if a
              crash came after registering)
    evaluate  the candidate and the champion on the round's evaluation split
    gate      `models promote`'s gate on those evaluations: a worse candidate ends the round
    export    (with a rollout) the export the server serves, through the export gate
    canary    (with a rollout) the candidate as the server's challenger with its canary and
              shadow shares, watched (`loop.canary`); a failed watch rolls it back
    promote   the candidate becomes the champion (the gate checked again against whoever is
              champion now), and the challenger alias and the canary share are cleared

A step that waits (the job is queued or running, the canary is watched) ends the pass; the
next pass goes on from it. A step that rejects the candidate (gate, export gate, canary) closes
the round as rejected with its reason; one that fails closes it as failed. The labels a round
took in stay consumed only once its dataset step finished (a failed one leaves them waiting).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from visionloop.core.errors import DataError, VisionloopError
from visionloop.core.fsutil import atomic_write_bytes
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

if TYPE_CHECKING:
    from visionloop.eval.gate import GateMargins

log = logging.getLogger("visionloop.loop")

REPORT_SUFFIX = ".visionloop-labels.json"  # what `label import` writes beside a finished folder
MAX_WAITING_FOLDERS = 1000
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif"}


@dataclass
class Pass:
    """What one pass did: the state after it, and why it stopped."""

    state: LoopState
    stopped: str  # "idle" (no trigger), "waiting" (a step waits), "closed" (a round ended)
    reason: str


ClientFactory = Callable[[], Any]


def waiting_folders(spec: LoopSpec, state: LoopState) -> list[Path]:
    """Labelled folders in `spec.labels` that `label import` finished (its report beside the
    folder) and no round has taken in yet, oldest name first."""
    if not spec.labels.is_dir():
        return []
    consumed = set(state.consumed)
    found = [
        p
        for p in sorted(spec.labels.iterdir())
        if p.is_dir() and str(p.resolve()) not in consumed and p.with_name(p.name + REPORT_SUFFIX).is_file()
    ]
    return found[:MAX_WAITING_FOLDERS]


def count_images(folders: list[Path], limit: int = 10_000_000) -> int:
    n = 0
    for folder in folders:
        for _, _, files in os.walk(folder):
            n += sum(1 for f in files if Path(f).suffix.lower() in _IMAGE_SUFFIXES)
            if n >= limit:
                return n
    return n


def trigger(spec: LoopSpec, state: LoopState, settings: Settings, now: float) -> str | None:
    """Why a round should open now, or None."""
    t = spec.trigger
    waiting = waiting_folders(spec, state)
    if t.new_labels is not None:
        n = count_images(waiting)
        if n >= t.new_labels:
            return f"{n} labelled images waiting in {len(waiting)} folder(s) (trigger: {t.new_labels})"
    if t.drift_windows is not None:
        from visionloop.monitor.history import read_windows

        since = state.rounds[-1].opened_at if state.rounds else 0.0
        run = 0
        for w in read_windows(settings.home, spec.model):
            if w.end <= since:
                continue
            run = run + 1 if w.drift else 0
        if run >= t.drift_windows:
            return (
                f"{run} consecutive drifting windows of {spec.model}'s traffic (trigger: {t.drift_windows})"
            )
    if t.every_hours is not None:
        last = state.rounds[-1].opened_at if state.rounds else None
        if last is None or now - last >= t.every_hours * 3600:
            return f"every {t.every_hours:g} h" + (
                "" if last is None else f" ({(now - last) / 3600:.1f} h since the last round)"
            )
    return None


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
    steps = _Steps(spec, settings, state, rnd, client_factory)
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


class _Steps:
    """The steps of one round; each reads back what an earlier attempt of it made."""

    def __init__(
        self, spec: LoopSpec, settings: Settings, state: LoopState, rnd: Round, client_factory: ClientFactory
    ) -> None:
        self.spec, self.settings, self.state, self.rnd = spec, settings, state, rnd
        self.client_factory = client_factory

    @property
    def round_dataset(self) -> Path:
        return Path(self.rnd.steps["dataset"].outputs["dataset"])

    # ------------------------------------------------------------------ dataset
    def dataset(self, rec: StepRecord) -> str:
        from visionloop.data.derive import add_images
        from visionloop.data.manifest import read_manifest

        current = Path(self.state.dataset)
        root = self.spec.datasets_dir or (self.settings.datasets_dir / self.spec.name)
        made: list[str] = []
        labelled = 0
        for k, folder in enumerate(self.rnd.labels, 1):
            out = root / f"round-{self.rnd.number}-{k}"
            if (out / "dataset.json").is_file() and _made_from(out, folder):
                m = read_manifest(out)  # made by an earlier attempt that crashed before recording it
            else:
                try:
                    report = add_images(
                        current, Path(folder), out, cost_per_image=self._price(current), overwrite=True
                    )
                except DataError as e:
                    if "adds no image and changes no label" in str(e):
                        made.append(f"{folder}: nothing new")
                        continue
                    raise
                m = report.manifest
            self._bill(out)  # idempotent per version: billed once, however often this runs
            labelled += m.lineage[0].labelled if m.lineage else 0
            current = out
            made.append(f"{Path(folder).name} → {m.version[:12]}")
        version = read_manifest(current).version
        rec.outputs = {"dataset": str(current), "version": version, "labelled": labelled}
        rec.reason = "; ".join(made) if made else "no labelled folders: the current version"
        self.state.dataset, self.state.dataset_version = str(current), version
        self.state.consumed.extend(self.rnd.labels)
        return "done" if self.rnd.labels else "skipped"

    def _price(self, dataset: Path) -> float | None:
        if self.spec.labelling_cost_per_image is not None:
            return self.spec.labelling_cost_per_image
        from visionloop.data.manifest import read_manifest

        return self.settings.labelling_cost_per_image(read_manifest(dataset).task)

    def _bill(self, dataset: Path) -> None:
        """Put the version's labelling cost into the ledger; a control plane that refuses is
        noted, not fatal (`visionloop cost labelling DIR` does it later)."""
        from visionloop.data.manifest import read_manifest

        m = read_manifest(dataset)
        bill = m.lineage[0].bill(m.version, dataset) if m.lineage else None
        if bill is None:
            return
        try:
            with self.client_factory() as client:
                client.record_labelling(**bill, team=self.spec.job.team)
        except VisionloopError as e:
            record_event(self.settings.home, self.spec.name, self.rnd.number, "labelling not billed", str(e))

    # ------------------------------------------------------------------ train
    def train(self, rec: StepRecord) -> str:
        with self.client_factory() as client:
            if "job" not in rec.outputs:
                body = self._job()
                key = f"loop:{self.spec.name}:round:{self.rnd.number}"
                job = client.submit(body, idempotency_key=key)
                rec.outputs["job"] = int(job["id"])
                save_state(self.settings.home, self.state)  # the job is known before anything else happens
                record_event(
                    self.settings.home, self.spec.name, self.rnd.number, "train submitted", f"job {job['id']}"
                )
            show = client.job(int(rec.outputs["job"]))
        job = show["job"]
        state = job["state"]
        if state == "succeeded":
            rec.outputs["run_dir"] = job["run_dir"]
            rec.reason = f"job {job['id']} succeeded"
            return "done"
        if state in ("failed", "cancelled"):
            last = (show.get("transitions") or [{}])[-1].get("reason", "")
            raise VisionloopError(f"job {job['id']} {state}: {last}".strip())
        rec.reason = f"job {job['id']} is {state}"
        return "waiting"

    def _job(self) -> dict[str, Any]:
        """The round's job: the loop's train spec on the round's dataset, warm-started from the
        champion's weights (copied where queue jobs may read them)."""
        from visionloop.registry import CHAMPION, aliases, get_version

        doc = self.spec.train.model_dump(mode="json")
        doc["data"]["dataset"] = str(self.round_dataset)
        champion = aliases(self.spec.model, self.settings).get(CHAMPION)
        if champion is not None:
            info = get_version(f"{self.spec.model}/{champion}", self.settings)
            weights = self.settings.weights_dir / f"{self.spec.name}-round-{self.rnd.number}.safetensors"
            weights.parent.mkdir(parents=True, exist_ok=True)
            if not weights.exists():
                # verified_weights_bytes: the round warm-starts from the champion's registered
                # weights, not from whatever file replaced them. The copy is written from the
                # bytes that were checked (a link, or a copy of the path, would be made after the
                # check, from a file that could be swapped meanwhile), atomically: a file an
                # earlier attempt of this round left is whole and was checked when it was made.
                atomic_write_bytes(weights, info.verified_weights_bytes())
            doc["model"]["pretrained"] = str(weights)
            if doc["data"].get("normalize", "auto") == "auto":
                # Keep the champion's normalisation: "auto" would switch to ImageNet's with weights.
                doc["data"]["normalize"] = "imagenet" if _imagenet_stats(info.card().mean) else "dataset"
        job = self.spec.job.model_dump(mode="json", exclude_none=True)
        return {**job, "train": doc, "name": f"{self.spec.name}-round-{self.rnd.number}"}

    # ------------------------------------------------------------------ register
    def register(self, rec: StepRecord) -> str:
        from visionloop.core.errors import NotFoundError
        from visionloop.registry import list_versions, register

        run_dir = str(Path(self.rnd.steps["train"].outputs["run_dir"]).resolve())
        try:
            versions = list_versions(self.spec.model, self.settings)
        except NotFoundError:  # the model's first version
            versions = []
        # Registered by an attempt that crashed before recording it: found by its run.
        found = [v for v in versions if v.lineage().get("run_dir") == run_dir]
        info = found[0] if found else register(run_dir, name=self.spec.model, settings=self.settings)
        rec.outputs = {"version": info.version}
        rec.reason = f"{info.ref}"
        return "done"

    # ------------------------------------------------------------------ evaluate
    def evaluate(self, rec: StepRecord) -> str:
        from visionloop.eval.api import evaluate_model
        from visionloop.eval.options import EvalOptions
        from visionloop.registry import CHAMPION, aliases

        g = self.spec.gate
        options = EvalOptions(
            dataset=self.round_dataset, stress=g.stress, max_images=g.max_images, calibrate=False
        )
        version = int(self.rnd.steps["register"].outputs["version"])
        champion = aliases(self.spec.model, self.settings).get(CHAMPION)
        done: dict[str, Any] = dict(rec.outputs)
        for who, v in (("candidate", version), ("champion", champion)):
            if v is None or who in done:
                continue
            report = evaluate_model(f"{self.spec.model}/{v}", options, settings=self.settings)
            done[who] = {"version": v, "metric": report.metric, "clean": report.clean, "path": report.path}
            rec.outputs = done
            save_state(self.settings.home, self.state)
        rec.reason = ", ".join(
            f"{who} v{d['version']} {d['metric']} {d['clean']:.4f}"
            for who, d in done.items()
            if isinstance(d, dict)
        )
        return "done"

    # ------------------------------------------------------------------ gate
    def gate(self, rec: StepRecord) -> str:
        from visionloop.eval.gate import decide, refusal_message
        from visionloop.registry import CHAMPION, aliases, get_version

        version = self._candidate
        champion = aliases(self.spec.model, self.settings).get(CHAMPION)
        if champion is None or champion == version:
            rec.reason = f"no champion to compare with: {self.spec.model}/{version} goes on"
            return "done"
        candidate = get_version(f"{self.spec.model}/{version}", self.settings)
        decision = decide(candidate, champion, self._margins(), self.settings)
        rec.outputs = {"champion": champion, "outcome": decision.outcome}
        if decision.outcome == "refused":
            rec.reason = refusal_message(self.spec.model, version, champion, decision, CHAMPION)
            return "rejected"
        rec.reason = f"v{version} against the champion v{champion}: {decision.outcome}"
        return "done"

    def _margins(self) -> GateMargins:
        from visionloop.eval.gate import GateMargins

        g = self.spec.gate
        return GateMargins(
            max_drop=g.max_drop, max_stress_drop=g.max_stress_drop, max_ece_rise=g.max_ece_rise
        )

    @property
    def _candidate(self) -> int:
        return int(self.rnd.steps["register"].outputs["version"])

    # ------------------------------------------------------------------ export
    def export(self, rec: StepRecord) -> str:
        from visionloop.export.api import export_model
        from visionloop.export.report import ExportGateError
        from visionloop.registry import get_version

        rollout = self.spec.rollout
        if rollout is None:
            rec.reason = "no rollout in the loop spec: promoted without a canary"
            return "skipped"
        info = get_version(f"{self.spec.model}/{self._candidate}", self.settings)
        if info.export_path("onnx", rollout.precision) is not None:  # an earlier attempt made it
            rec.reason = f"{info.ref} has a passing onnx {rollout.precision} export"
            return "done"
        try:
            report = export_model(info, precision=rollout.precision, settings=self.settings)
        except ExportGateError as e:
            rec.reason = f"the export gate refused {info.ref}: {e}"
            return "rejected"
        rec.outputs = {"precision": rollout.precision, "size_bytes": report.size_bytes}
        rec.reason = f"{info.ref} onnx {rollout.precision} passed its export gate"
        return "done"

    # ------------------------------------------------------------------ canary
    def canary(self, rec: StepRecord) -> str:
        from visionloop.loop.rollout import Canary

        if self.spec.rollout is None:
            rec.reason = "no rollout in the loop spec"
            return "skipped"

        def save() -> None:
            save_state(self.settings.home, self.state)

        return Canary(self.spec, self.spec.rollout, self.settings, self.state, self.rnd, rec, save).step()

    # ------------------------------------------------------------------ promote
    def promote(self, rec: StepRecord) -> str:
        from visionloop.eval.gate import PromotionGateError, promote
        from visionloop.registry import CHAMPION, alias_history, aliases

        version = self._candidate
        if aliases(self.spec.model, self.settings).get(CHAMPION) == version:
            # Promoted by an attempt that died before recording it: read the move back rather
            # than make (and record) it a second time.
            moves = [
                e
                for e in alias_history(self.spec.model, self.settings)
                if e.alias == CHAMPION and e.action == "set" and e.version == version
            ]
            last = moves[-1] if moves else None
            rec.outputs = {
                "promoted": True,
                "version": version,
                "gate": None if last is None or last.gate is None else last.gate.get("outcome"),
                "previous": None if last is None else last.previous,
            }
            rec.reason = f"{self.spec.model}/{version} is the champion"
            self._clear_canary()
            return "done"
        try:
            result = promote(
                self.spec.model,
                version,
                margins=self._margins(),
                reason=f"loop {self.spec.name} round {self.rnd.number}: {self.rnd.trigger}",
                actor=f"loop {self.spec.name}",
                settings=self.settings,
            )
        except PromotionGateError as e:  # the champion moved since the gate step, to a better one
            rec.outputs = {"promoted": False, "version": version}
            rec.reason = str(e)
            self._clear_canary()
            return "rejected"
        rec.outputs = {
            "promoted": True,
            "version": version,
            "gate": result.outcome,
            "previous": result.previous,
        }
        rec.reason = f"{self.spec.model}/{version} is the champion (gate: {result.outcome})"
        self._clear_canary()
        return "done"

    def _clear_canary(self) -> None:
        if self.spec.rollout is not None and self.rnd.steps["canary"].status == "done":
            from visionloop.loop.rollout import clear

            clear(self.spec, self.spec.rollout, self.settings, self._candidate, self.rnd.number)


def _made_from(dataset: Path, folder: str) -> bool:
    from visionloop.data.manifest import read_manifest

    try:
        lineage = read_manifest(dataset).lineage or []
    except DataError:
        return False
    return bool(lineage) and lineage[0].source == str(Path(folder).resolve())


def _imagenet_stats(mean: tuple[float, ...]) -> bool:
    from visionloop.models.registry import IMAGENET_MEAN

    return len(mean) == 3 and all(
        math.isclose(a, b, abs_tol=1e-3) for a, b in zip(mean, IMAGENET_MEAN, strict=True)
    )
