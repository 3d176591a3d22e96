"""Test helper: a classifier's monitoring reference built in memory (model "m" v1, classes a, b
and c), for tests of the drift monitor's pieces without a model or a registry."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from visionloop.monitor.reference import Reference


def three_class_reference(
    probs: npt.NDArray[np.floating],
    *,
    atc_threshold: float | None = None,
    embeddings: npt.NDArray[np.float32] | None = None,
) -> Reference:
    """The reference of validation images whose class probabilities are `probs` (n × 3)."""
    probs32 = probs.astype(np.float32)
    return Reference(
        model="m",
        version=1,
        task="classification",
        dataset="d",
        split="val",
        images=len(probs32),
        precision="fp32",
        temperature=None,
        output_names=("p(a)", "p(b)", "p(c)"),
        outputs=probs32,
        class_names=("a", "b", "c"),
        class_counts=np.bincount(probs32.argmax(axis=1), minlength=3),
        confidence=probs32.max(axis=1),
        atc_threshold=atc_threshold,
        embeddings=embeddings,
    )
