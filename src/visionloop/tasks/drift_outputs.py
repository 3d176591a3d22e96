"""What drift monitoring reads from a model's outputs, per image: the task's side of the
contract between serving, `visionloop monitor` and its reference (`Task.drift_outputs`).

- `columns`: per image, the numbers whose distribution black-box shift detection compares
  (KS on each column, Bonferroni over them: Rabanser et al., "Failing Loudly", NeurIPS 2019).
  A classifier gives its class probabilities (softmax after the served temperature), or, past
  `MAX_PROBABILITY_COLUMNS` classes, its confidence, margin and entropy, so a log record stays
  small; a detector its detection count and best and mean score.
- `classes`: per image, the predicted class index, for the label-shift test; None for a task
  without one answer class per image.
- `confidence`: per image, the calibrated probability that the answer is right, for the
  label-free accuracy estimate; None where the task has no such number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

# The exported output holding each image's penultimate-layer embedding, reduced by PCA at
# export (`Task.embedding_layer`, `export.embedding`): the prediction log records it and the
# monitor's MMD test compares it with the reference's.
EMBEDDING_OUTPUT = "embedding"

# 100 probabilities are ~1 KB of JSON per logged request; more classes log summaries instead.
MAX_PROBABILITY_COLUMNS = 100


@dataclass(frozen=True)
class DriftOutputs:
    names: tuple[str, ...]  # a name per column, e.g. "p(cat)", "detections"
    columns: npt.NDArray[np.float32]  # (images, len(names))
    classes: npt.NDArray[np.int64] | None = None  # (images,)
    confidence: npt.NDArray[np.float32] | None = None  # (images,)

    def __post_init__(self) -> None:
        n = self.columns.shape[0]
        if self.columns.ndim != 2 or self.columns.shape[1] != len(self.names):
            raise ValueError(f"columns must be (images, {len(self.names)}), got {self.columns.shape}")
        for name, a in (("classes", self.classes), ("confidence", self.confidence)):
            if a is not None and a.shape != (n,):
                raise ValueError(f"{name} must be ({n},), got {a.shape}")

    def __len__(self) -> int:
        return int(self.columns.shape[0])


@dataclass(frozen=True)
class UncertaintyInputs:
    """Per image of a batch: what active-learning selection scores its uncertainty from
    (`Task.uncertainty_inputs`, `visionloop.label.select`). A classifier gives its class
    probabilities (calibrated softmax) and predicted classes; a detector each image's box
    scores after NMS (`box_scores`, every box above a small floor) and no one class."""

    probabilities: npt.NDArray[np.float64] | None = None  # (images, classes)
    box_scores: tuple[npt.NDArray[np.float32], ...] | None = None  # one array per image
    classes: npt.NDArray[np.int64] | None = None  # (images,)
