"""Label Studio for image classification: a single-choice labelling config, the model's top
class as the pre-annotation, the annotator's choice read back, an ImageFolder written out."""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import quoteattr

from visionloop.core.errors import DataError
from visionloop.tasks.labels import ImageLabels, LabelledImage
from visionloop.tasks.serving import ImageContext

FROM_NAME = "label"
TO_NAME = "image"


def config(class_names: Sequence[str]) -> str:
    choices = "\n".join(f"    <Choice value={quoteattr(str(c))}/>" for c in class_names)
    return (
        "<View>\n"
        f'  <Image name="{TO_NAME}" value="$image"/>\n'
        f'  <Choices name="{FROM_NAME}" toName="{TO_NAME}" choice="single" showInline="true">\n'
        f"{choices}\n"
        "  </Choices>\n"
        "</View>\n"
    )


def pre_annotation(served: Mapping[str, Any], image: ImageContext) -> tuple[list[dict[str, Any]], float]:
    """The served answer's top class as a `choices` result, and its probability."""
    preds = served.get("predictions") or []
    if not preds:
        return [], 0.0
    top = preds[0]
    score = float(top["score"])
    result = {
        "from_name": FROM_NAME,
        "to_name": TO_NAME,
        "type": "choices",
        "value": {"choices": [str(top["label"])]},
        "score": score,
    }
    return [result], score


def read_labels(result: Sequence[Mapping[str, Any]], class_names: Sequence[str] | None) -> ImageLabels | None:
    """The one class chosen; None when the annotator chose none (the image stays unlabelled)."""
    chosen: list[str] = []
    for r in result:
        if r.get("type") != "choices":
            continue
        value = r.get("value")
        picks = value.get("choices") if isinstance(value, Mapping) else None
        if not isinstance(picks, list) or not all(isinstance(p, str) for p in picks):
            raise DataError(f"a choices result without a list of class names: {dict(r)!r:.200}")
        chosen.extend(picks)
    if not chosen:
        return None
    if len(set(chosen)) > 1:
        raise DataError(
            f"several classes chosen for one image ({', '.join(sorted(set(chosen)))}): a classifier's "
            "image has one; fix the annotation in Label Studio (the config is single-choice)"
        )
    name = chosen[0]
    if class_names is not None and name not in class_names:
        raise DataError(f"class {name!r} is not one of the model's classes ({', '.join(class_names)})")
    return ImageLabels(classes=(name,))


def _safe_name(image_id: str) -> str:
    return image_id.replace("\\", "/").replace("/", "__")


def write_labelled(items: Sequence[LabelledImage], out_dir: Path) -> Path:
    """An ImageFolder (`<class>/<image>`) that `visionloop data ingest` reads as it is."""
    for item in items:
        (cls,) = item.labels.classes
        if cls in ("", ".", "..") or "/" in cls or "\\" in cls:
            raise DataError(f"class {cls!r} cannot be a folder name; rename it in the labelling config")
        target = out_dir / cls / _safe_name(item.id)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(item.path, target)
    return out_dir
