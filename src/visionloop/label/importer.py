"""Completed Label Studio annotations → a labelled folder that `visionloop data ingest` reads
(an ImageFolder for a classifier, a Label Studio export beside its images for a detector,
written by the task), with the QA findings (`label.qa`) on the way."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from visionloop.core.errors import DataError
from visionloop.core.fsutil import atomic_write_text
from visionloop.label.qa import CONFIDENT, ClassAgreement, Contradiction, agreement, contradictions
from visionloop.label.studio import LabelledTask, image_path, read_tasks, task_prediction
from visionloop.tasks.base import Task
from visionloop.tasks.labels import ImageLabels, LabelledImage

REPORT_FILE = "visionloop-labels.json"


@dataclass
class Imported:
    out_dir: Path
    labelled: list[LabelledImage]
    unlabelled: list[str] = field(default_factory=list)  # image ids no annotator finished
    left_out: list[str] = field(default_factory=list)  # "what: why", for a person to fix
    agreement: list[ClassAgreement] = field(default_factory=list)
    contradictions: list[Contradiction] = field(default_factory=list)
    annotators: list[str] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        return {
            "labelled": len(self.labelled),
            "classes": _counts(self.labelled),
            "unlabelled": self.unlabelled,
            "left_out": self.left_out,
            "annotators": self.annotators,
            "agreement": [asdict(a) for a in self.agreement],
            "contradictions": [asdict(c) for c in self.contradictions],
            "images": [
                {"id": i.id, "classes": list(i.labels.classes), "annotator": i.annotator}
                for i in self.labelled
            ],
        }


def _counts(items: Sequence[LabelledImage]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        for c in item.labels.classes:
            counts[c] = counts.get(c, 0) + 1
    return dict(sorted(counts.items()))


def model_of(doc: Any) -> str | None:
    """The model version that made the tasks' pre-annotations (their `model_version`)."""
    if not isinstance(doc, list):
        return None
    for task in doc:
        pred = task_prediction(task) if isinstance(task, Mapping) else None
        if pred is not None and isinstance(pred.get("model_version"), str):
            return str(pred["model_version"])
    return None


def import_annotations(
    doc: Any,
    where: str,
    *,
    task: Task,
    classes: Sequence[str],
    images: Path,
    out_dir: Path,
    confident: float = CONFIDENT,
    users: Mapping[int, str] | None = None,
) -> Imported:
    """Read a Label Studio export (`doc`, from `where`), label each image under `images` by the
    annotation that counts, write the folder and its report into `out_dir` (new or empty)."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise DataError(f"{out_dir} is not empty; give a new folder for the labelled images")
    tasks, left_out = read_tasks(doc, where, users)
    result = Imported(out_dir, [], left_out=left_out)
    per_image: list[list[ImageLabels]] = []
    annotators: set[str] = set()
    seen: set[str] = set()
    for t in tasks:
        item = _one(t, task, classes, images, result, per_image, annotators, confident)
        if item is None:
            continue
        if item.id in seen:
            result.left_out.append(f"{item.id}: labelled by two tasks; the first one is kept")
            continue
        seen.add(item.id)
        result.labelled.append(item)
    result.annotators = sorted(annotators)
    result.agreement = agreement(per_image, classes)
    if not result.labelled:
        why = f" ({result.left_out[0]})" if result.left_out else ""
        raise DataError(f"{where} has no finished annotation of a visionloop task{why}")
    out_dir.mkdir(parents=True, exist_ok=True)
    task.write_labelled(result.labelled, out_dir)
    atomic_write_text(out_dir.parent / f"{out_dir.name}.{REPORT_FILE}", json.dumps(result.report(), indent=1))
    return result


def _one(
    t: LabelledTask,
    task: Task,
    classes: Sequence[str],
    images: Path,
    result: Imported,
    per_image: list[list[ImageLabels]],
    annotators: set[str],
    confident: float,
) -> LabelledImage | None:
    name = f"task {t.task_id} ({t.image_id})" if t.task_id is not None else t.image_id
    chosen = t.chosen()
    if chosen is None:
        result.unlabelled.append(t.image_id)
        return None
    read: list[ImageLabels] = []
    labels: ImageLabels | None = None
    for a in t.annotations:
        try:
            got = task.read_labels(a.result, classes)
        except DataError as e:
            if a is chosen:
                result.left_out.append(f"{name}: {e}")
                return None
            continue
        if got is not None:
            read.append(got)
            annotators.add(a.annotator)
        if a is chosen:
            labels = got
    if labels is None:
        result.unlabelled.append(t.image_id)
        return None
    per_image.append(read)
    try:
        path = image_path(images, t.image_id)
    except DataError as e:
        result.left_out.append(f"{name}: {e}")
        return None
    if not path.is_file():
        result.left_out.append(f"{name}: no file {t.image_id} under {images}")
        return None
    if t.prediction:
        try:
            model = task.read_labels(t.prediction, None)
        except DataError:
            model = None
        if model is not None:
            result.contradictions += contradictions(
                t.image_id, t.prediction, model, labels, chosen.annotator, confident=confident
            )
    return LabelledImage(id=t.image_id, path=path, labels=labels, annotator=chosen.annotator)
