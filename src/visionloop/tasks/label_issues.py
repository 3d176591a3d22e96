"""What a task reports of an image whose given labels its out-of-fold predictions contradict:
the typed seam between `visionloop label issues --refit` (which trains the folds and predicts
each held-out image) and a task's `Task.find_label_issues` (which judges them with cleanlab).

A classifier's finding is one label: the given class and the one the model suggests. A
detector's is a list of boxes, each of a kind (as cleanlab's object detection module names
them, Tkachenko et al., "ObjectLab", 2023):

- `overlooked`: the model sees an object of a class where no box is labelled;
- `swapped`: a labelled box whose class the model gives as another;
- `badly located`: a labelled box of the right class whose edges miss the object.

Boxes are in the pixels of the image as stored. Importing this module imports neither torch
nor numpy (the contract in `tasks/base.py` is imported by the inference server).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import numpy.typing as npt

FindingKind = Literal["wrong class", "overlooked", "swapped", "badly located"]
Box = tuple[float, float, float, float]  # x1, y1, x2, y2


@dataclass(frozen=True)
class LabelFinding:
    """One suspicious label of an image: what was given, what the model suggests, how sure."""

    kind: FindingKind
    given: str | None  # the given class; None for an overlooked object (nothing was labelled)
    suggested: str | None  # the model's class; None where the model sees no object there
    score: float  # cleanlab's quality score of this label, 0..1: low is suspicious
    given_box: Box | None = None
    suggested_box: Box | None = None


@dataclass(frozen=True)
class ImageLabelIssue:
    """An image flagged by confident learning: `item` indexes the results it was judged from,
    `quality` is its label quality score (0..1, lowest first in a report), `given` and
    `suggested` sum up its labels and the model's in a line each, and `findings` lists the
    labels that made it suspicious, least likely first."""

    item: int
    quality: float
    given: str
    suggested: str
    findings: tuple[LabelFinding, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(classes: list[str]) -> str:
    """'2 car, 1 person' for the classes of an image's boxes (sorted by count, then name);
    'nothing' for none."""
    if not classes:
        return "nothing"
    counts: dict[str, int] = {}
    for c in classes:
        counts[c] = counts.get(c, 0) + 1
    return ", ".join(f"{n} {c}" for c, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def rank_given_labels(
    labels: npt.NDArray[Any], probs: npt.NDArray[Any], top: int | None = None
) -> npt.NDArray[Any]:
    """Positions of the labels `probs` (N, K) contradicts, lowest probability of the given
    label first: confident learning's flags (cleanlab), or with `top`, the `top` least likely
    labels, flagged or not (ties by position). `labels` are 0..K-1. Both recipes of `label
    issues` (embeddings and --refit) rank through here."""
    import numpy as np
    from cleanlab.filter import find_label_issues as cl_find

    if top is None:
        ranked: npt.NDArray[Any] = cl_find(
            labels, probs, return_indices_ranked_by="self_confidence", n_jobs=1
        )
        return ranked
    given_p = probs[np.arange(len(labels)), labels]
    chosen: npt.NDArray[Any] = np.lexsort((np.arange(len(labels)), given_p))[:top]
    return chosen
