"""The types of the serving half of the Task contract (`Task.postprocess`, `served_answer`,
`log_fields`, `agreement`): a batch's raw outputs by name (`Arrays`), one image's answer
(`Answer`), what a client may ask of the image endpoint (`AnswerOptions`) and the image an
answer is about (`ImageContext`, which Label Studio's pre-annotation of a served answer reads
too, `Task.pre_annotation`).

The inference server and the labelling round trip use these without either training library:
this module imports neither torch nor numpy at run time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy.typing as npt

# A batch's raw outputs by output name (`Task.output_names`), as host arrays.
Arrays = Mapping[str, "npt.NDArray[Any]"]
# One image's answer: its items (top-k classes, detected boxes), each a JSON-safe dict.
Answer = list[dict[str, Any]]


@dataclass(frozen=True)
class AnswerOptions:
    """What a client may ask of the image endpoint (query parameters, checked by the server):
    `top_k` items at most, and only those scoring at least `score_threshold` (None: the
    task's default for either: 5 classes, 100 boxes)."""

    top_k: int | None = None
    score_threshold: float | None = None


@dataclass(frozen=True)
class ImageContext:
    """The image an answer is about: its upright size as sent (`width`, `height`, pixels), and
    the model input's (`input_height`, `input_width`). A task that answers in image
    coordinates (boxes) maps the model's input-frame outputs back with it."""

    width: int
    height: int
    input_height: int
    input_width: int
