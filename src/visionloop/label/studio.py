"""Label Studio, both ways: tasks carrying the model's predictions as pre-annotations out, the
completed annotations back in (from an export file or from the server).

What travels in a task: `data.image` (a URL Label Studio's browser page can load) and
`data.visionloop_id`, the image's path under the folder it was selected from. That id, not the
URL, is how an annotation finds its image again on the way back, whatever Label Studio did to
the URL (an upload prefix, a storage link). The labelling config and the pre-annotation come
from the task contract (`Task.labelling_config`, `Task.pre_annotation`), so one exporter serves
classification and detection alike.

Which annotation counts for an image: the one marked ground truth, else the last one not
cancelled (the rule the detection ingest reads Label Studio with); the others still count for
agreement (`label.qa`).
"""

from __future__ import annotations

import base64
import json
import mimetypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from visionloop.core.errors import DataError
from visionloop.core.fsutil import TooLargeError, human_bytes, read_capped

ID_KEY = "visionloop_id"
MAX_EXPORT_BYTES = 512 * 1024 * 1024  # a Label Studio export read from a file or a server
MAX_TASKS = 200_000
MAX_IMAGE_BYTES = 64 * 1024 * 1024
_BATCH = 32


class LabelStudioError(DataError):
    """Label Studio refused or could not be reached; the message says what to check."""


# --------------------------------------------------------------------------------------- out


@dataclass(frozen=True)
class Exported:
    config: str  # the labelling config (XML) that fits the tasks
    tasks: list[dict[str, Any]]
    model: str  # NAME/VERSION that made the pre-annotations
    skipped: list[tuple[str, str]]  # (image id, why)


def image_path(source: Path, image_id: str) -> Path:
    """`source / image_id`, refusing an id that leaves `source` (an export file is user input)."""
    root = source.resolve()
    try:
        path = (root / image_id).resolve()
    except (ValueError, OSError) as e:  # a NUL byte in it, a name too long to resolve
        raise DataError(f"image id {image_id[:200]!r} is not a path inside {source} ({e})") from None
    if not path.is_relative_to(root) or path == root:
        raise DataError(f"image id {image_id!r} is not a path inside {source}")
    return path


def data_uri(path: Path, data: bytes) -> str:
    """The image `data` (read from `path`) inline, as a `data:` URL: Label Studio shows it with
    no storage set up. The bytes that were scored, not the file read again: what a labeller
    sees is what the pre-annotation was made on."""
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(data).decode('ascii')}"


def export_tasks(
    model: str,
    source: Path,
    ids: Sequence[str],
    *,
    image_url: Callable[[str, Path, bytes], str],
    settings: Any = None,
    precision: str = "fp32",
) -> Exported:
    """One Label Studio task per image id (a path under `source`), each with the model's
    prediction as a pre-annotation, scored the way the server scores it. `image_url` gives a
    task's image URL from its id, path and the bytes that were scored."""
    from visionloop.core.settings import load_settings
    from visionloop.label.scoring import Scorer
    from visionloop.serve.protocol import ProtocolError
    from visionloop.tasks.serving import AnswerOptions, ImageContext

    settings = settings or load_settings()
    scorer = Scorer(model, settings, precision)
    names = list(scorer.card.class_names)
    config = scorer.task.labelling_config(names)
    tasks: list[dict[str, Any]] = []
    skipped: list[tuple[str, str]] = []
    pending: list[tuple[str, Path, bytes, Any]] = []

    def flush() -> None:
        if not pending:
            return
        outputs = scorer.run([d.input for _, _, _, d in pending])
        for row, (image_id, path, data, decoded) in enumerate(pending):
            one = {k: v[row : row + 1] for k, v in outputs.items()}
            _, _, in_h, in_w = decoded.input.shape
            context = ImageContext(decoded.size[0], decoded.size[1], int(in_h), int(in_w))
            served = scorer.task.served_answer(one, names, options=AnswerOptions(), image=context)
            result, score = scorer.task.pre_annotation(served, context)
            tasks.append(
                {
                    "data": {"image": image_url(image_id, path, data), ID_KEY: image_id},
                    "predictions": [{"model_version": scorer.info.ref, "score": score, "result": result}],
                }
            )
        pending.clear()

    for image_id in dict.fromkeys(ids):  # once each, in the given order
        try:
            path = image_path(source, image_id)
            # Once, capped, a FIFO refused (stat's size then read_bytes waited on one forever).
            data = read_capped(path, MAX_IMAGE_BYTES, what="an image to label")
            decoded = scorer.decode_sized(data)
        except TooLargeError:
            skipped.append((image_id, f"larger than {human_bytes(MAX_IMAGE_BYTES)}"))
            continue
        except (OSError, DataError, ValueError, ProtocolError) as e:
            skipped.append((image_id, str(e)))
            continue
        pending.append((image_id, path, data, decoded))
        if len(pending) == _BATCH:
            flush()
    flush()
    if not tasks:
        why = f": {skipped[0][0]}: {skipped[0][1]}" if skipped else ""
        raise DataError(f"none of the {len(ids)} images could be read{why}")
    return Exported(config, tasks, scorer.info.ref, skipped)


# ---------------------------------------------------------------------------------------- in


@dataclass(frozen=True)
class Annotation:
    annotator: str  # Label Studio's completed_by (a user id or an email)
    result: tuple[Mapping[str, Any], ...]
    ground_truth: bool


@dataclass(frozen=True)
class LabelledTask:
    task_id: int | None
    image_id: str
    annotations: tuple[Annotation, ...]  # not cancelled, in Label Studio's order
    prediction: tuple[Mapping[str, Any], ...] | None  # the pre-annotation's result, if any
    prediction_score: float | None

    def chosen(self) -> Annotation | None:
        """The annotation that labels the image: ground truth, else the last one."""
        truth = [a for a in self.annotations if a.ground_truth]
        pool = truth or list(self.annotations)
        return pool[-1] if pool else None


def _annotator(a: Mapping[str, Any], users: Mapping[int, str]) -> str:
    who = a.get("completed_by")
    if isinstance(who, Mapping):
        who = who.get("email") or who.get("id")
    if isinstance(who, int) and who in users:
        return users[who]
    return f"user {who}" if isinstance(who, int) else str(who) if who is not None else "unknown"


def read_tasks(
    doc: Any, where: str, users: Mapping[int, str] | None = None
) -> tuple[list[LabelledTask], list[str]]:
    """Label Studio's JSON export (a list of tasks) → the tasks visionloop exported (those with
    `data.visionloop_id`), and a line for each task left out and why. An export names an
    annotator by user id; `users` (from the server) turns the ids into emails."""
    if not isinstance(doc, list):
        raise DataError(
            f"{where} holds a JSON {type(doc).__name__}, not a list of tasks: use Label Studio's "
            "Export → JSON (not JSON-MIN or CSV)"
        )
    if len(doc) > MAX_TASKS:
        raise DataError(f"{where} has {len(doc)} tasks, more than {MAX_TASKS}; export fewer at a time")
    tasks: list[LabelledTask] = []
    left_out: list[str] = []
    for n, task in enumerate(doc):
        tid = task.get("id") if isinstance(task, Mapping) else None
        name = f"task {tid}" if tid is not None else f"task [{n}]"
        data = task.get("data") if isinstance(task, Mapping) else None
        image_id = data.get(ID_KEY) if isinstance(data, Mapping) else None
        if not isinstance(image_id, str) or not image_id:
            left_out.append(f"{name}: no data.{ID_KEY} (not a task `visionloop label export` made)")
            continue
        anns = task.get("annotations") or []
        if not isinstance(anns, list):
            left_out.append(f"{name}: `annotations` is not a list")
            continue
        kept = []
        for a in anns:
            if not isinstance(a, Mapping) or a.get("was_cancelled"):
                continue
            result = a.get("result")
            if not isinstance(result, list) or not all(isinstance(r, Mapping) for r in result):
                left_out.append(f"{name}: an annotation without a `result` list")
                continue
            kept.append(Annotation(_annotator(a, users or {}), tuple(result), a.get("ground_truth") is True))
        pred = task_prediction(task)
        pred_result = pred.get("result") if pred is not None else None
        pred_score = pred.get("score") if pred is not None else None
        tasks.append(
            LabelledTask(
                task_id=tid if isinstance(tid, int) else None,
                image_id=image_id,
                annotations=tuple(kept),
                prediction=tuple(pred_result) if isinstance(pred_result, list) else None,
                prediction_score=float(pred_score) if isinstance(pred_score, int | float) else None,
            )
        )
    return tasks, left_out


def task_prediction(task: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A task's (last) prediction: in `predictions` as a task list shows it, or, in Label
    Studio's JSON export (which lists prediction ids there), inside its annotations."""
    # An export is user input: `predictions` or `annotations` may be anything, not a list.
    predictions, annotations = task.get("predictions"), task.get("annotations")
    found = [p for p in predictions if isinstance(p, Mapping)] if isinstance(predictions, list) else []
    for a in annotations if isinstance(annotations, list) else []:
        nested = a.get("prediction") if isinstance(a, Mapping) else None
        if isinstance(nested, Mapping) and nested.get("result") is not None:
            found.append(nested)
    return found[-1] if found else None


def load_export(path: Path) -> list[Any]:
    """A Label Studio JSON export file, read within MAX_EXPORT_BYTES."""
    try:
        # A regular file only (a FIFO would hang the read), refused from its size before reading.
        data = read_capped(path, MAX_EXPORT_BYTES, what="a Label Studio export")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from e
    except TooLargeError as e:
        if e.size is None:  # it grew since its size was read
            raise DataError(f"{path} is more than {MAX_EXPORT_BYTES // 2**20} MiB") from None
        raise DataError(
            f"{path} is {e.size / 2**20:.0f} MiB, more than {MAX_EXPORT_BYTES // 2**20} MiB"
        ) from None
    try:
        doc = json.loads(data)
    except (RecursionError, ValueError) as e:
        raise DataError(f"{path} is not a JSON file ({e}); use Label Studio's Export → JSON") from e
    if not isinstance(doc, list):
        raise DataError(f"{path} holds a JSON {type(doc).__name__}, not a list of tasks")
    return doc
