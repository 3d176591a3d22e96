"""The steps of a loop's round, in order (`loop.runner` takes them, one pass at a time):

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

Each step returns "done", "skipped", "waiting" (the pass ends; the next goes on from it) or
"rejected", or raises; and each reads back what an earlier attempt of it made (one that crashed
before recording it) instead of making it again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from visionloop.core.errors import DataError, QueueFullError, VisionloopError
from visionloop.core.fsutil import atomic_write_bytes
from visionloop.core.settings import Settings
from visionloop.loop.spec import LoopSpec
from visionloop.loop.state import LoopState, Round, StepRecord, record_event, save_state

if TYPE_CHECKING:
    from visionloop.eval.gate import GateMargins

ClientFactory = Callable[[], Any]


class RoundSteps:
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
                try:
                    job = client.submit(body, idempotency_key=key)
                except QueueFullError as e:  # the team's queue is at its limit: the next pass submits again
                    rec.reason = str(e)
                    return "waiting"
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
