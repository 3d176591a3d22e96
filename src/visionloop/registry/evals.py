"""What `visionloop eval` leaves in a model version's folder, read back without torch: the
reports under `<version dir>/evals/`, and the temperature in `<version dir>/calibration.json`
that the inference server applies to a classifier's confidences. Part of the registry's
layout, so that the server and `models show` read it without importing the evaluation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from visionloop.core.errors import DataError
from visionloop.registry.files import UnreadableFileError, read_json

EVALS_DIR = "evals"
REPORT_FILE = "eval.json"
CALIBRATION_FILE = "calibration.json"


def read_temperature(version_dir: Path) -> float | None:
    """The temperature stored with a model version by `visionloop eval`, or None."""
    path = version_dir / CALIBRATION_FILE
    try:
        # read_json: a FIFO here would hang the inference server's start; deep nesting would
        # raise RecursionError past this message.
        doc = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, UnreadableFileError) as e:
        raise DataError(f"{path} is unreadable ({e}); delete it and run `visionloop eval` again.") from e
    t = doc.get("temperature") if isinstance(doc, dict) else None
    if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
        raise DataError(f"{path} holds no positive temperature; delete it and run `visionloop eval` again.")
    return float(t)


def list_evals(version_dir: Path) -> list[dict[str, Any]]:
    """The eval reports stored with a version, oldest first (unreadable ones skipped)."""
    root = version_dir / EVALS_DIR
    out = []
    for path in sorted(root.glob(f"*/{REPORT_FILE}")) if root.is_dir() else []:
        try:
            doc = read_json(path)  # a FIFO used to hang `models show`
        except (OSError, UnreadableFileError):
            continue
        if isinstance(doc, dict):
            doc["path"] = str(path)
            out.append(doc)
    return out
