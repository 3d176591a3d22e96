"""Confusion-matrix plot as a PNG, readable from 2 to ~100 classes.

Drawn with matplotlib's object API on an Agg canvas — never `pyplot` — so it needs no
display, keeps no global figure state between calls, and is safe from a trainer's thread.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from visionloop.core.fsutil import atomic_write_bytes

MAX_ANNOTATED_CLASSES = 30  # above this, per-cell numbers would overlap; colour carries it
_MAX_LABEL_CHARS = 24


def _short(name: str) -> str:
    return name if len(name) <= _MAX_LABEL_CHARS else name[: _MAX_LABEL_CHARS - 1] + "…"


def plot_confusion_matrix(
    matrix: torch.Tensor | np.ndarray | Sequence[Sequence[int]],
    class_names: Sequence[str],
    path: Path,
    normalize: bool = True,
    *,
    title: str | None = None,
) -> Path:
    """Write a heat map of `matrix[true, pred]` to `path` (PNG, atomically); return the path.

    With `normalize`, each row is divided by its support, so a cell reads "fraction of class
    `true` predicted as `pred`" and the diagonal is per-class recall; rows without samples
    stay 0.
    """
    m = matrix.detach().cpu().numpy() if isinstance(matrix, torch.Tensor) else np.asarray(matrix)
    n = len(class_names)
    if m.shape != (n, n):
        raise ValueError(f"matrix of shape {m.shape} does not match {n} class names")
    counts = m.astype(np.int64)
    values = counts.astype(np.float64)
    if normalize:
        rows = values.sum(axis=1, keepdims=True)
        values = np.divide(values, rows, out=np.zeros_like(values), where=rows > 0)

    # ~0.22 inch (22 px at 100 dpi) per class fits a 6-point label at 100 classes.
    side = float(np.clip(3.0 + 0.22 * n, 5.0, 26.0))
    label_size = float(np.clip(10 - 0.04 * n, 6.0, 10.0))
    heading_size = float(np.clip(10 + 0.06 * n, 10.0, 16.0))
    fig = Figure(figsize=(side + 1.2, side), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    vmax = 1.0 if normalize else max(1.0, float(values.max()))
    image = ax.imshow(values, cmap="Blues", vmin=0.0, vmax=vmax)
    bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02, shrink=1.0 if n <= 30 else 0.6)
    bar.set_label("fraction of true class" if normalize else "count", fontsize=heading_size)

    labels = [_short(str(c)) for c in class_names]
    ax.set_xticks(range(n), labels, rotation=90 if n > 10 else 45, ha="center" if n > 10 else "right")
    ax.set_yticks(range(n), labels)
    ax.tick_params(labelsize=label_size)
    ax.set_xlabel("predicted", fontsize=heading_size)
    ax.set_ylabel("true", fontsize=heading_size)
    total = int(counts.sum())
    accuracy = float(np.trace(counts)) / total if total else 0.0
    ax.set_title(
        title or f"confusion matrix — {total} samples, accuracy {accuracy:.1%}", fontsize=heading_size
    )

    if n <= MAX_ANNOTATED_CLASSES:
        font = float(np.clip(12 - 0.25 * n, 5.0, 11.0))
        for i in range(n):
            for j in range(n):
                v = values[i, j]
                text = f"{v:.2f}" if normalize else str(int(v))
                if normalize and v == 0:
                    text = "0"
                # White on dark cells, black on light ones.
                colour = "white" if v > 0.5 * vmax else "black"
                ax.text(j, i, text, ha="center", va="center", fontsize=font, color=colour)

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)
