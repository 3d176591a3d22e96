"""What a served classifier answers, and what its prediction log records: numpy only (the
inference server runs without torch). The models output logits; probabilities are softmax."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt


def top1(scores: npt.NDArray[Any]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """Per row: the top class and its softmax probability."""
    flat = scores.reshape(scores.shape[0], -1).astype(np.float32, copy=False)
    idx = flat.argmax(axis=1)
    shifted = flat - flat.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    conf = exp[np.arange(len(idx)), idx] / exp.sum(axis=1)
    return idx, conf.astype(np.float32)


def top_k(scores: npt.NDArray[Any], class_names: Sequence[str], k: int) -> list[dict[str, Any]]:
    """One row of logits → its `k` most probable classes, most probable first (ties in index
    order), each {"label", "index", "score"} with the softmax probability (in float64)."""
    row = scores.reshape(-1).astype(np.float64)
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")[:k]
    return [
        {
            "label": class_names[i] if i < len(class_names) else str(i),
            "index": int(i),
            "score": float(probs[i]),
        }
        for i in order
    ]


def log_fields(scores: npt.NDArray[Any], class_names: Sequence[str]) -> list[dict[str, Any]]:
    """Per row: {"top_class": name (its index when the card has no name for it), "confidence"}."""
    idx, conf = top1(scores)
    out = []
    for r in range(len(idx)):
        k = int(idx[r])
        out.append(
            {
                "top_class": class_names[k] if k < len(class_names) else k,
                "confidence": round(float(conf[r]), 6),
            }
        )
    return out
