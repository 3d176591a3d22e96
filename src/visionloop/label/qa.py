"""Label QA on what comes back from Label Studio: agreement between annotators, and
annotations that contradict a confident model.

Agreement is Fleiss' kappa per class, over the images that two or more annotators labelled,
on "does this image's label include the class" (the class for a classifier, any box of it for
a detector). With a varying number of annotators per image it is Fleiss' (1971) category
kappa in its unequal-raters form:

    kappa_j = 1 - sum_i x_ij (n_i - x_ij) / (sum_i n_i (n_i - 1) p_j (1 - p_j))

where n_i annotators labelled image i, x_ij of them said class j, and p_j = sum x_ij / sum n_i.
1 is perfect agreement, 0 what chance gives; undefined (None) when every annotation says the
same about the class (p_j is 0 or 1).

A contradiction: the model was confident (a pre-annotation result scored at least
`confident`) and the annotation that labels the image disagrees: another class for a
classifier; for a detector, no box of that class over IoU 0.5 with the model's box. Either may
be wrong; both go to a reviewer with the image and both labels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from visionloop.tasks.labels import ImageLabels

CONFIDENT = 0.9
MATCH_IOU = 0.5


@dataclass(frozen=True)
class ClassAgreement:
    label: str
    kappa: float | None  # None: every annotation agreed the class is absent (or present)
    images: int  # images with 2+ annotations
    said: int  # annotations that included the class


@dataclass(frozen=True)
class Contradiction:
    image_id: str
    model_label: str
    model_score: float
    annotated: tuple[str, ...]  # what the annotation that counts says (classes, one per box)
    annotator: str


def agreement(per_image: Sequence[Sequence[ImageLabels]], classes: Sequence[str]) -> list[ClassAgreement]:
    """Fleiss' kappa per class over images with two or more annotations."""
    multi = [anns for anns in per_image if len(anns) >= 2]
    out = []
    for cls in classes:
        x = [sum(cls in a.classes for a in anns) for anns in multi]
        n = [len(anns) for anns in multi]
        total = sum(n)
        said = sum(x)
        p = said / total if total else 0.0
        denominator = sum(k * (k - 1) for k in n) * p * (1 - p)
        if not multi or denominator <= 0:
            out.append(ClassAgreement(cls, None, len(multi), said))
            continue
        disagreement = sum(xi * (ni - xi) for xi, ni in zip(x, n, strict=True))
        out.append(ClassAgreement(cls, 1 - disagreement / denominator, len(multi), said))
    return out


def _iou(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    """IoU of two (x, y, width, height) boxes in the same frame."""
    ix = max(0.0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = a[2] * a[3] + b[2] * b[3] - inter
    return inter / union if union > 0 else 0.0


def contradictions(
    image_id: str,
    prediction: Sequence[Mapping[str, Any]],
    model: ImageLabels,
    annotated: ImageLabels,
    annotator: str,
    *,
    confident: float = CONFIDENT,
) -> list[Contradiction]:
    """The confident parts of the model's pre-annotation that the annotation disagrees with.
    `prediction` is the raw result list (its entries carry the scores), `model` the same read
    by the task, one class (and box) per entry in order."""
    scores = [float(r.get("score", 0.0) or 0.0) for r in prediction]
    found = []
    for k, cls in enumerate(model.classes):
        score = scores[k] if k < len(scores) else 0.0
        if score < confident:
            continue
        if model.boxes is None or annotated.boxes is None:
            agrees = cls in annotated.classes
        else:
            box = model.boxes[k]
            agrees = any(
                c == cls and _iou(box, b) >= MATCH_IOU
                for c, b in zip(annotated.classes, annotated.boxes, strict=True)
            )
        if not agrees:
            found.append(Contradiction(image_id, cls, score, annotated.classes, annotator))
    return found
