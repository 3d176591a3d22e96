"""Likely label errors of a classification dataset: cleanlab's confident learning over the
softmax of out-of-fold logits (`visionloop label issues --refit`, where each image is predicted
by a model trained without its fold).

cleanlab expects its labels numbered 0..K-1 with a probability column for each; a subset of the
images may lack some classes, so the classes present are renumbered and the probabilities
renormalised over them (a class absent from the images cannot be a given label, and the
suggestion is among the classes the images have)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from visionloop.tasks.label_issues import ImageLabelIssue, LabelFinding, rank_given_labels


def find_label_issues(
    results: Sequence[tuple[Any, Any]], class_names: Sequence[str], *, top: int | None = None
) -> list[ImageLabelIssue]:
    """The flagged images of `results` (one-image (logits (1, C), label (1,)) pairs, out of
    fold), lowest probability of the given label first; with `top`, the `top` images of
    lowest probability of the given label, flagged or not (a review budget)."""
    if not results:
        return []
    logits = np.concatenate([np.asarray(o, dtype=np.float64).reshape(1, -1) for o, _ in results])
    y = np.concatenate([np.asarray(t, dtype=np.int64).reshape(-1) for _, t in results])
    present = np.unique(y)
    if len(present) < 2:
        return []  # one class: nothing to confuse it with
    z = logits[:, present]
    z = np.exp(z - z.max(axis=1, keepdims=True))
    probs = z / z.sum(axis=1, keepdims=True)
    dense = np.searchsorted(present, y)
    ranked = rank_given_labels(dense, probs, top)
    names = [class_names[int(c)] for c in present]
    issues = []
    for i in (int(k) for k in ranked):
        given, suggested = names[int(dense[i])], names[int(probs[i].argmax())]
        p_given = round(float(probs[i, dense[i]]), 6)
        issues.append(
            ImageLabelIssue(
                item=i,
                quality=p_given,
                given=given,
                suggested=suggested,
                findings=(LabelFinding(kind="wrong class", given=given, suggested=suggested, score=p_given),),
            )
        )
    return issues
