"""Label Studio for object detection: a rectangle-labels config, the model's boxes as the
pre-annotation (in percent of the upright image, Label Studio's frame), the annotator's boxes
read back, and a Label Studio export written out that `visionloop data ingest` reads."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote
from xml.sax.saxutils import quoteattr

from visionloop.core.errors import DataError
from visionloop.core.fsutil import atomic_write_text
from visionloop.tasks.labels import ImageLabels, LabelledImage
from visionloop.tasks.serving import ImageContext

FROM_NAME = "label"
TO_NAME = "image"
EXPORT_FILE = "export.json"


def config(class_names: Sequence[str]) -> str:
    labels = "\n".join(f"    <Label value={quoteattr(str(c))}/>" for c in class_names)
    return (
        "<View>\n"
        f'  <Image name="{TO_NAME}" value="$image" zoom="true"/>\n'
        f'  <RectangleLabels name="{FROM_NAME}" toName="{TO_NAME}">\n'
        f"{labels}\n"
        "  </RectangleLabels>\n"
        "</View>\n"
    )


def pre_annotation(served: Mapping[str, Any], image: ImageContext) -> tuple[list[dict[str, Any]], float]:
    """Each served detection (a box in the image's pixels) as a `rectanglelabels` result; the
    prediction's score is the mean of the boxes' (0 for an image with none)."""
    w, h = float(image.width), float(image.height)
    results: list[dict[str, Any]] = []
    scores: list[float] = []
    for i, d in enumerate(served.get("detections") or []):
        x1, y1, x2, y2 = (float(v) for v in d["box"])
        x1, x2 = max(0.0, min(x1, w)), max(0.0, min(x2, w))
        y1, y2 = max(0.0, min(y1, h)), max(0.0, min(y2, h))
        if x2 <= x1 or y2 <= y1:
            continue
        score = float(d["score"])
        scores.append(score)
        results.append(
            {
                "id": f"p{i}",
                "from_name": FROM_NAME,
                "to_name": TO_NAME,
                "type": "rectanglelabels",
                "original_width": image.width,
                "original_height": image.height,
                "image_rotation": 0,
                "value": {
                    "x": round(100 * x1 / w, 4),
                    "y": round(100 * y1 / h, 4),
                    "width": round(100 * (x2 - x1) / w, 4),
                    "height": round(100 * (y2 - y1) / h, 4),
                    "rotation": 0,
                    "rectanglelabels": [str(d["label"])],
                },
                "score": score,
            }
        )
    return results, (sum(scores) / len(scores) if scores else 0.0)


def _percent(value: Mapping[str, Any], key: str) -> float:
    v = value.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise DataError(f"a rectangle's {key} is {v!r}, not a number")
    return float(v)


def read_labels(result: Sequence[Mapping[str, Any]], class_names: Sequence[str] | None) -> ImageLabels:
    """The annotator's boxes (an image with none is a background image, which is a label)."""
    classes: list[str] = []
    boxes: list[tuple[float, float, float, float]] = []
    for r in result:
        if r.get("type") != "rectanglelabels":
            continue
        value = r.get("value")
        if not isinstance(value, Mapping):
            raise DataError(f"a rectangle without a value: {dict(r)!r:.200}")
        rotation = value.get("rotation", 0) or 0
        image_rotation = r.get("image_rotation", 0) or 0
        if not isinstance(rotation, int | float) or not isinstance(image_rotation, int | float):
            raise DataError(f"a rectangle's rotation is not a number: {dict(r)!r:.200}")
        if rotation % 360 or image_rotation % 360:
            raise DataError(
                "a box is rotated in Label Studio (or drawn on a rotated image): it is no axis-aligned "
                "box; redraw it unrotated"
            )
        box = tuple(_percent(value, k) for k in ("x", "y", "width", "height"))
        names = value.get("rectanglelabels")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise DataError(f"a rectangle without a label: {dict(r)!r:.200}")
        for name in names:
            if class_names is not None and name not in class_names:
                raise DataError(
                    f"class {name!r} is not one of the model's classes ({', '.join(class_names)})"
                )
            classes.append(name)
            boxes.append((box[0], box[1], box[2], box[3]))
    return ImageLabels(classes=tuple(classes), boxes=tuple(boxes))


def write_labelled(items: Sequence[LabelledImage], out_dir: Path) -> Path:
    """`export.json` (Label Studio's JSON export, one task per image) beside the images under
    `images/`, the layout `visionloop data ingest` reads as Label Studio."""
    tasks = []
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    for n, item in enumerate(items, 1):
        name = item.id.replace("\\", "/").replace("/", "__")
        shutil.copy2(item.path, out_dir / "images" / name)
        boxes = item.labels.boxes or ()
        result = [
            {
                "id": f"r{k}",
                "from_name": FROM_NAME,
                "to_name": TO_NAME,
                "type": "rectanglelabels",
                "image_rotation": 0,
                "value": {"x": x, "y": y, "width": bw, "height": bh, "rotation": 0, "rectanglelabels": [cls]},
            }
            for k, ((x, y, bw, bh), cls) in enumerate(zip(boxes, item.labels.classes, strict=True))
        ]
        tasks.append(
            {
                "id": n,
                "data": {
                    "image": f"/data/local-files/?d={quote('images/' + name)}",
                    "visionloop_id": item.id,
                },
                "annotations": [{"id": n, "result": result}],
            }
        )
    atomic_write_text(out_dir / EXPORT_FILE, json.dumps(tasks, indent=1) + "\n")
    return out_dir
