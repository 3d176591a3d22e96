"""What opens a loop's round: the labelled folders in `spec.labels` that `label import` finished
and no round has taken in yet (`waiting_folders`), and `trigger`, which says why a round should
open now (enough new labelled images, a run of drifting windows of the model's traffic, or the
schedule), or None."""

from __future__ import annotations

import os
from pathlib import Path

from visionloop.core.settings import Settings
from visionloop.loop.spec import LoopSpec
from visionloop.loop.state import LoopState

REPORT_SUFFIX = ".visionloop-labels.json"  # what `label import` writes beside a finished folder
MAX_WAITING_FOLDERS = 1000
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif"}


def waiting_folders(spec: LoopSpec, state: LoopState) -> list[Path]:
    """Labelled folders in `spec.labels` that `label import` finished (its report beside the
    folder) and no round has taken in yet, oldest name first."""
    if not spec.labels.is_dir():
        return []
    consumed = set(state.consumed)
    found = [
        p
        for p in sorted(spec.labels.iterdir())
        if p.is_dir() and str(p.resolve()) not in consumed and p.with_name(p.name + REPORT_SUFFIX).is_file()
    ]
    return found[:MAX_WAITING_FOLDERS]


def count_images(folders: list[Path], limit: int = 10_000_000) -> int:
    n = 0
    for folder in folders:
        for _, _, files in os.walk(folder):
            n += sum(1 for f in files if Path(f).suffix.lower() in _IMAGE_SUFFIXES)
            if n >= limit:
                return n
    return n


def trigger(spec: LoopSpec, state: LoopState, settings: Settings, now: float) -> str | None:
    """Why a round should open now, or None."""
    t = spec.trigger
    waiting = waiting_folders(spec, state)
    if t.new_labels is not None:
        n = count_images(waiting)
        if n >= t.new_labels:
            return f"{n} labelled images waiting in {len(waiting)} folder(s) (trigger: {t.new_labels})"
    if t.drift_windows is not None:
        from visionloop.monitor.history import read_windows

        since = state.rounds[-1].opened_at if state.rounds else 0.0
        run = 0
        for w in read_windows(settings.home, spec.model):
            if w.end <= since:
                continue
            run = run + 1 if w.drift else 0
        if run >= t.drift_windows:
            return (
                f"{run} consecutive drifting windows of {spec.model}'s traffic (trigger: {t.drift_windows})"
            )
    if t.every_hours is not None:
        last = state.rounds[-1].opened_at if state.rounds else None
        if last is None or now - last >= t.every_hours * 3600:
            return f"every {t.every_hours:g} h" + (
                "" if last is None else f" ({(now - last) / 3600:.1f} h since the last round)"
            )
    return None
