"""What a served classifier answers, and what its prediction log records: numpy only (the
inference server runs without torch). The models output logits; probabilities are softmax."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from visionloop.tasks.drift_outputs import MAX_PROBABILITY_COLUMNS, DriftOutputs, UncertaintyInputs


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


def drift_outputs(scores: npt.NDArray[Any], class_names: Sequence[str]) -> DriftOutputs:
    """Per row: the class probabilities (softmax of the, already calibrated, logits) as
    columns "p(<class>)", or confidence, margin (top-1 minus top-2) and entropy past
    `MAX_PROBABILITY_COLUMNS` classes; the top class; the top probability as confidence."""
    flat = scores.reshape(scores.shape[0], -1).astype(np.float64)
    probs = np.exp(flat - flat.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    top = probs.argmax(axis=1)
    conf = probs[np.arange(len(top)), top]
    k = probs.shape[1]
    if k <= MAX_PROBABILITY_COLUMNS:
        names = tuple(f"p({class_names[i] if i < len(class_names) else i})" for i in range(k))
        columns = probs
    else:
        second = np.partition(probs, k - 2, axis=1)[:, k - 2]
        entropy = -(probs * np.log(np.clip(probs, 1e-12, None))).sum(axis=1)
        names = ("confidence", "margin", "entropy")
        columns = np.stack([conf, conf - second, entropy], axis=1)
    return DriftOutputs(names, columns.astype(np.float32), top.astype(np.int64), conf.astype(np.float32))


def uncertainty_inputs(scores: npt.NDArray[Any]) -> UncertaintyInputs:
    """Per row: the softmax probabilities of the (already calibrated) logits, and the top class."""
    flat = scores.reshape(scores.shape[0], -1).astype(np.float64)
    probs = np.exp(flat - flat.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    return UncertaintyInputs(probabilities=probs, classes=probs.argmax(axis=1).astype(np.int64))
