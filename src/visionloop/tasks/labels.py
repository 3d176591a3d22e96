"""What an annotator said about one image, in a task's own terms: the typed seam between the
labelling round trip (`visionloop.label`) and a task (`Task.read_labels`, `Task.write_labelled`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ImageLabels:
    """A classifier's image: `classes` holds its one class and `boxes` is None. A detector's:
    one class per box, `boxes` in percent of the upright image as (x, y, width, height), Label
    Studio's frame; no boxes is a background image, which is a label too."""

    classes: tuple[str, ...]
    boxes: tuple[tuple[float, float, float, float], ...] | None = None

    def __post_init__(self) -> None:
        if self.boxes is not None and len(self.boxes) != len(self.classes):
            raise ValueError(f"{len(self.boxes)} boxes for {len(self.classes)} classes: one class per box")


@dataclass(frozen=True)
class LabelledImage:
    id: str  # the image's path under the folder it was selected from
    path: Path  # the file on this machine
    labels: ImageLabels
    annotator: str = ""
