"""A model version's view of unlabelled images: the `Pool` that selection picks from.

    scored = score_folder("pets@champion", Path("unlabelled/"))
    sel = select(scored.pool, "hybrid", 200, labelled_embeddings=scored.labelled.embeddings,
                 exclude_near_duplicates_of=scored.labelled.hash_map())

Each image goes through what the server does with it (`serve.images.decode_image`: the same
bounded decode and the card's preprocessing), the version's *served* ONNX export and its stored
temperature, then the task's `uncertainty_inputs` (a classifier's probabilities, a detector's
box scores) and the export's `embedding` output (for k-center; an export without one gives
none, and the strategies that need embeddings say so). Each image's pHash is taken from the
same bytes. A file that is not a readable image is left out and reported, never fatal.

The labelled side, for k-center's starting set and the near-duplicate filter: the training
split of the dataset the version was trained on, hashed (up to `MAX_LABELLED_HASHES` images)
and embedded (up to `MAX_LABELLED_EMBEDDINGS`, spread over the split).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from visionloop.core.errors import DataError
from visionloop.core.fsutil import TooLargeError, human_bytes, read_capped
from visionloop.label.phash import phash_bytes
from visionloop.label.pool import Pool, SelectionError
from visionloop.serve.protocol import ProtocolError
from visionloop.tasks.drift_outputs import EMBEDDING_OUTPUT

if TYPE_CHECKING:
    from visionloop.serve.images import DecodedImage

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
MAX_POOL_IMAGES = 200_000
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_LABELLED_HASHES = 100_000
MAX_LABELLED_EMBEDDINGS = 2_000
_BATCH = 32
Progress = Callable[[str, int, int], None]


@dataclass
class Labelled:
    """The training images the selection must not repeat or crowd."""

    ids: list[str] = field(default_factory=list)  # "train/<position>"
    hashes: list[int] = field(default_factory=list)
    embeddings: npt.NDArray[np.float32] | None = None

    def hash_map(self) -> dict[str, int]:
        return dict(zip(self.ids, self.hashes, strict=True))


@dataclass
class Scored:
    pool: Pool
    labelled: Labelled
    skipped: list[tuple[str, str]]  # (file, why) for files left out of the pool
    model: str  # NAME/VERSION
    precision: str
    has_embeddings: bool


def list_images(source: Path, *, limit: int = MAX_POOL_IMAGES) -> list[Path]:
    """The image files under `source` (recursively, by suffix, sorted; symbolic links are not
    followed), at most `limit`: DataError past it, naming the limit."""
    source = Path(source).expanduser()
    if not source.is_dir():
        raise DataError(f"{source} is not a folder of images; give a folder (searched recursively).")
    found: list[Path] = []
    for path in sorted(source.rglob("*")):
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file() and not path.is_symlink():
            found.append(path)
            if len(found) > limit:
                raise DataError(
                    f"{source} holds more than {limit:,} images; select from a subfolder, or split "
                    "the pool and select from each part."
                )
    if not found:
        raise DataError(
            f"{source} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))}); point --from at the "
            "folder of unlabelled images."
        )
    return found


class Scorer:
    """The served export of one version, run the way the server runs it."""

    def __init__(self, ref: str, settings: Any, precision: str) -> None:
        from visionloop.registry import get_version
        from visionloop.serve.images import needed_side
        from visionloop.serve.source import RegistrySource
        from visionloop.tasks import get_task

        self.info = get_version(ref, settings)
        resolved = RegistrySource(settings, precision=precision).version(self.info.name, self.info.version)
        self.card, self.task, self.temperature = (
            resolved.card,
            get_task(resolved.card.task),
            resolved.temperature,
        )
        # load: the export's bytes, checked against the sha256 its gate recorded.
        self.model = resolved.load(intra_op_threads=1)
        self.spec = self.model.inputs[0]
        self.transform = self.card.eval_preprocess().to_transform()
        self.need = needed_side(self.card.eval_preprocess())
        self.has_embeddings = any(o.name == EMBEDDING_OUTPUT for o in self.model.outputs)

    def decode(self, data: bytes) -> npt.NDArray[Any]:
        return self.decode_sized(data).input

    def decode_sized(self, data: bytes) -> DecodedImage:
        """The model's input and the image's upright size as sent (for answers in its pixels)."""
        from visionloop.serve.images import MAX_PIXELS, decode_image

        return decode_image(data, self.transform, self.spec.dtype, self.need, MAX_PIXELS)

    def run(self, inputs: Sequence[npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        outputs = self.model.run({self.spec.name: np.concatenate(list(inputs))})
        if self.temperature is not None:
            outputs = dict(self.task.calibrate(outputs, self.temperature))
        return outputs


def _read_image(path: Path) -> bytes:
    """The file's bytes, at most MAX_FILE_BYTES. Opened as a regular file only and read with
    the cap: a file swapped for a FIFO after listing is refused (an OSError) instead of hanging
    the scoring, and one grown past the cap after its size was seen is refused (a DataError)
    having read no more than the cap."""
    try:
        return read_capped(path, MAX_FILE_BYTES, what="an image to score")
    except TooLargeError:
        raise DataError(f"larger than {human_bytes(MAX_FILE_BYTES)}") from None


def score_folder(
    ref: str,
    source: Path,
    *,
    settings: Any = None,
    precision: str = "fp32",
    labelled: bool = True,
    progress: Progress | None = None,
) -> Scored:
    """Score every image under `source` with model version `ref` (NAME, NAME/V, NAME@ALIAS)."""
    from visionloop.core.settings import load_settings

    settings = settings or load_settings()
    scorer = Scorer(ref, settings, precision)
    files = list_images(source)
    ids: list[str] = []
    hashes: list[int] = []
    skipped: list[tuple[str, str]] = []
    probs: list[npt.NDArray[np.float64]] = []
    boxes: list[npt.NDArray[np.float32]] = []
    classes: list[npt.NDArray[np.int64]] = []
    embeds: list[npt.NDArray[np.float32]] = []
    batch: list[npt.NDArray[Any]] = []

    def flush() -> None:
        if not batch:
            return
        outputs = scorer.run(batch)
        u = scorer.task.uncertainty_inputs(outputs, scorer.card.class_names)
        if u is not None and u.probabilities is not None:
            probs.append(u.probabilities)
        if u is not None and u.box_scores is not None:
            boxes.extend(u.box_scores)
        if u is not None and u.classes is not None:
            classes.append(u.classes)
        if EMBEDDING_OUTPUT in outputs:
            embeds.append(np.asarray(outputs[EMBEDDING_OUTPUT], dtype=np.float32))
        batch.clear()

    for n, path in enumerate(files, 1):
        name = str(path.relative_to(source))
        try:
            data = _read_image(path)
            x = scorer.decode(data)
            h = phash_bytes(data, name=name)
        except (OSError, DataError, ValueError, ProtocolError) as e:
            skipped.append((name, str(e)))
            continue
        ids.append(name)
        hashes.append(h)
        batch.append(x)
        if len(batch) == _BATCH:
            flush()
        if progress is not None:
            progress("score", n, len(files))
    flush()
    if not ids:
        raise DataError(f"none of the {len(files)} images under {source} could be read: {skipped[0][1]}")
    pool = Pool(
        ids=tuple(ids),
        probabilities=np.concatenate(probs) if probs else None,
        detection_scores=tuple(boxes) if boxes else None,
        embeddings=np.concatenate(embeds) if embeds else None,
        classes=np.concatenate(classes) if classes else None,
        hashes=np.asarray(hashes, dtype=np.uint64),
    )
    train = _labelled(scorer, progress) if labelled else Labelled()
    return Scored(pool, train, skipped, scorer.info.ref, precision, scorer.has_embeddings)


def _labelled(scorer: Scorer, progress: Progress | None) -> Labelled:
    """The training split of the version's dataset: hashes, and embeddings of a spread sample."""
    from visionloop.eval.api import dataset_for, split_reader, spread_positions

    try:
        path, manifest = dataset_for(scorer.info, None)
        _, reader = split_reader(path, manifest, "train")
    except DataError:
        return Labelled()  # no training set to compare with: nothing to exclude
    out = Labelled()
    positions = spread_positions(len(reader), MAX_LABELLED_HASHES)
    embed_at = set(spread_positions(len(reader), MAX_LABELLED_EMBEDDINGS)) if scorer.has_embeddings else set()
    embeds: list[npt.NDArray[np.float32]] = []
    batch: list[npt.NDArray[Any]] = []
    for start in range(0, len(positions), _BATCH):
        chunk = positions[start : start + _BATCH]
        for pos, record in zip(chunk, reader.read_many(chunk), strict=True):
            data = bytes(record["image"])
            try:
                out.hashes.append(phash_bytes(data, name=f"train/{pos}"))
            except DataError:
                continue  # ingest re-encoded it; should it fail, it only escapes the filter
            out.ids.append(f"train/{pos}")
            if pos in embed_at:
                batch.append(scorer.decode(data))
        if len(batch) >= _BATCH:
            embeds.append(np.asarray(scorer.run(batch)[EMBEDDING_OUTPUT], dtype=np.float32))
            batch.clear()
        if progress is not None:
            progress("training set", min(start + _BATCH, len(positions)), len(positions))
    if batch:
        embeds.append(np.asarray(scorer.run(batch)[EMBEDDING_OUTPUT], dtype=np.float32))
    out.embeddings = np.concatenate(embeds) if embeds else None
    return out


def needs(strategy: str, scored: Scored) -> None:
    """SelectionError when `strategy` needs what this model's export does not give."""
    if strategy in ("kcenter", "hybrid") and not scored.has_embeddings:
        raise SelectionError(
            f"--strategy {strategy} needs embeddings, and {scored.model}'s {scored.precision} export has "
            "no `embedding` output (exported before it existed, or a torchvision detector). Re-export "
            f"it (`visionloop export {scored.model}`), or use --strategy entropy, margin or random."
        )
