"""The input of selection: what a model said about each unlabelled image, checked once.

Every array is aligned with `ids` (row i is image ids[i]) and validated at construction, so a
strategy never meets NaN, logits passed as probabilities, or arrays of the wrong length; the
error names the first offending image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from visionloop.core.errors import VisionloopError
from visionloop.label.phash import as_hashes

FloatArray = npt.NDArray[np.float64]
# Rows of probabilities must sum to 1 within this: logits or unnormalised scores would give
# meaningless entropies, silently.
_SUM_TOLERANCE = 1e-3


class SelectionError(VisionloopError):
    """The pool or the request cannot make a selection."""


@dataclass(frozen=True, eq=False)
class Pool:
    """What a model said about each unlabelled image; every field but `ids` is optional and
    aligned with `ids` (row i is image ids[i])."""

    ids: tuple[str, ...]
    probabilities: npt.NDArray[np.floating[Any]] | None = None  # (n, classes), rows sum to 1
    detection_scores: Sequence[npt.NDArray[np.floating[Any]]] | None = None  # n arrays, in [0, 1]
    embeddings: npt.NDArray[np.floating[Any]] | None = None  # (n, dims)
    classes: npt.NDArray[np.integer[Any]] | None = None  # (n,) predicted class index
    hashes: npt.NDArray[np.uint64] | None = None  # (n,) pHash (visionloop.label.phash)

    def __post_init__(self) -> None:
        ids = tuple(str(i) for i in self.ids)
        object.__setattr__(self, "ids", ids)
        n = len(ids)
        if n == 0:
            raise SelectionError("the pool is empty: give it at least one unlabelled image")
        seen: set[str] = set()
        for i in ids:
            if i in seen:
                raise SelectionError(f"image id {i!r} is in the pool more than once; ids must be unique")
            seen.add(i)
        if self.probabilities is not None and self.detection_scores is not None:
            raise SelectionError(
                "the pool has both class probabilities and detection scores; "
                "give the one your model's task makes"
            )
        if self.probabilities is not None:
            object.__setattr__(self, "probabilities", self._probabilities(self.probabilities))
        if self.detection_scores is not None:
            object.__setattr__(self, "detection_scores", self._box_scores(self.detection_scores))
        if self.embeddings is not None:
            e = np.asarray(self.embeddings)
            if e.ndim != 2 or len(e) != n or e.dtype.kind not in "fiu":
                raise SelectionError(f"embeddings must be numbers, ({n}, dims) for {n} images; got {e.shape}")
            e = e.astype(np.float32 if e.dtype == np.float32 else np.float64, copy=False)
            self._finite("embeddings", e)
            object.__setattr__(self, "embeddings", e)
        if self.classes is not None:
            c = np.asarray(self.classes)
            if c.shape != (n,) or c.dtype.kind not in "iu" or (n and int(c.min()) < 0):
                raise SelectionError(
                    f"classes must be ({n},) non-negative class indices, one per image; got shape {c.shape}"
                )
            object.__setattr__(self, "classes", c.astype(np.int64))
        if self.hashes is not None:
            h = as_hashes(self.hashes)
            if h.shape != (n,):
                raise SelectionError(f"hashes must be ({n},), one pHash per image; got {h.shape}")
            object.__setattr__(self, "hashes", h)

    def __len__(self) -> int:
        return len(self.ids)

    def _finite(self, name: str, a: npt.NDArray[Any]) -> None:
        bad = ~np.isfinite(a).reshape(len(a), -1).all(axis=1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SelectionError(
                f"{name} of image {self.ids[i]!r} hold NaN or infinity ({int(bad.sum())} images do); "
                "check the model's outputs for those images, or leave them out of the pool"
            )

    def _probabilities(self, probs: npt.ArrayLike) -> FloatArray:
        p = np.asarray(probs, dtype=np.float64)
        n = len(self.ids)
        if p.ndim != 2 or len(p) != n or p.shape[1] < 2:
            raise SelectionError(
                f"probabilities must be (images, classes) with at least 2 classes: ({n}, C); got {p.shape}"
            )
        self._finite("probabilities", p)
        sums = p.sum(axis=1)
        bad = (p.min(axis=1) < 0) | (np.abs(sums - 1) > _SUM_TOLERANCE)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise SelectionError(
                f"the probabilities of image {self.ids[i]!r} sum to {sums[i]:.4g}, not 1 (or hold a "
                "negative value): pass probabilities (a softmax of the logits), not logits"
            )
        return p

    def _box_scores(self, scores: Sequence[npt.ArrayLike]) -> tuple[FloatArray, ...]:
        if len(scores) != len(self.ids):
            raise SelectionError(
                f"detection_scores must hold one array per image ({len(self.ids)}); got {len(scores)}"
            )
        out = tuple(np.asarray(s, dtype=np.float64).reshape(-1) for s in scores)
        for i, s in enumerate(out):
            if not np.isfinite(s).all() or (len(s) and (s.min() < 0 or s.max() > 1)):
                raise SelectionError(
                    f"detection scores of image {self.ids[i]!r} must be probabilities in [0, 1]; got "
                    f"{s[~np.isfinite(s) | (s < 0) | (s > 1)][:3].tolist()}"
                )
        return out
