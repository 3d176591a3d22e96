"""A model version's monitoring reference: what its traffic looked like on data it was
validated on, stored with the version, for `visionloop monitor` to compare windows of served
traffic with.

Built the way the server sees an image, so that undrifted traffic matches it: each image of
the split (the version's validation split by default) goes as its stored file through the
server's own decode (`serve.images.decode_image`, the same reduction of large images), the
model card's preprocessing and the *served* ONNX export (fp32 unless asked otherwise), then the
stored temperature and the task's `drift_outputs`. A reference built from the PyTorch weights
would differ from an INT8 export by more than a large window's KS test tolerates.

Stored under `<version>/monitor/`: `reference.npz` (arrays; read back with
`allow_pickle=False`, nothing in it is executed) and `reference.json` (what it was built from).
It holds the per-image statistics, the drift columns (a classifier's class probabilities), the
predicted-class counts, the confidences, the export's embeddings (its `embedding` output: the
penultimate layer reduced by the PCA fitted at export), and the threshold of the label-free accuracy estimate:
average thresholded confidence (ATC, Garg et al., "Leveraging Unlabeled Data to Predict
Out-of-Distribution Performance", ICLR 2022): t is chosen so that the share of reference images
with confidence >= t equals the accuracy on the reference; on a window, the estimated accuracy
is the share of requests with confidence >= t.
"""

from __future__ import annotations

import io
import json
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from visionloop.core.errors import DataError, NotFoundError
from visionloop.core.fsutil import (
    atomic_write_bytes,
    atomic_write_json,
    human_bytes,
    read_capped,
    read_capped_text,
)
from visionloop.tasks.drift_outputs import EMBEDDING_OUTPUT

REFERENCE_DIR = "monitor"
ARRAYS_FILE = "reference.npz"
META_FILE = "reference.json"
# What a stored reference may take: its files on disk, and its arrays once expanded (an .npz is a
# zip: a small one could expand to more than the machine holds). A reference of the default
# 2,000-image cap takes a few MB; these leave room for any cap a user sets.
MAX_META_BYTES = 16 * 2**20
MAX_ARRAYS_FILE_BYTES = 2**30
MAX_ARRAYS_BYTES = 4 * 2**30
DEFAULT_MAX_IMAGES = 2000
_BATCH = 32


@dataclass
class Reference:
    model: str
    version: int
    task: str
    dataset: str
    split: str
    images: int
    precision: str
    temperature: float | None
    output_names: tuple[str, ...]
    outputs: npt.NDArray[np.float32] | None  # (images, len(output_names))
    class_names: tuple[str, ...]
    class_counts: npt.NDArray[np.int64] | None  # predicted-class counts, one per class
    confidence: npt.NDArray[np.float32] | None  # (images,)
    image: dict[str, npt.NDArray[np.float32]] = field(default_factory=dict)  # statistic -> (images,)
    accuracy: float | None = None  # on the reference images, from their labels
    atc_threshold: float | None = None
    created: float = 0.0
    # The export's `embedding` output per image (images, k), for the MMD test; None for an
    # export without one (the monitor then runs MMD on the drift columns).
    embeddings: npt.NDArray[np.float32] | None = None

    def meta(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "task": self.task,
            "dataset": self.dataset,
            "split": self.split,
            "images": self.images,
            "precision": self.precision,
            "temperature": self.temperature,
            "output_names": list(self.output_names),
            "class_names": list(self.class_names),
            "accuracy": self.accuracy,
            "atc_threshold": self.atc_threshold,
            "created": self.created,
            "embedding_dim": None if self.embeddings is None else int(self.embeddings.shape[1]),
        }

    def estimate_accuracy(self, confidence: npt.NDArray[Any]) -> float | None:
        """ATC: the share of `confidence` at or over the reference's threshold."""
        if self.atc_threshold is None or len(confidence) == 0:
            return None
        return float(np.mean(np.asarray(confidence) >= self.atc_threshold))


def atc_threshold(confidence: npt.NDArray[Any], correct: npt.NDArray[Any]) -> float:
    """The threshold t with mean(confidence >= t) = mean(correct) on the reference."""
    conf = np.sort(np.asarray(confidence, dtype=np.float64))
    n = len(conf)
    wrong = n - int(np.count_nonzero(correct))
    if wrong <= 0:
        return float(conf[0])  # every image is right: every confidence counts
    if wrong >= n:
        return float(np.nextafter(conf[-1], np.inf))  # none is: no confidence reaches t
    # The `wrong` lowest confidences fall under t: t sits between them and the next.
    return float((conf[wrong - 1] + conf[wrong]) / 2.0)


def reference_dir(version_dir: Path) -> Path:
    return Path(version_dir) / REFERENCE_DIR


def save_reference(version_dir: Path, ref: Reference) -> Path:
    """Write the arrays, then the metadata (its presence marks a complete reference)."""
    import io

    out = reference_dir(version_dir)
    out.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, npt.NDArray[Any]] = {f"image.{k}": v for k, v in ref.image.items()}
    for key, value in (
        ("outputs", ref.outputs),
        ("class_counts", ref.class_counts),
        ("confidence", ref.confidence),
        ("embeddings", ref.embeddings),
    ):
        if value is not None:
            arrays[key] = value
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)  # type: ignore[arg-type]
    atomic_write_bytes(out / ARRAYS_FILE, buf.getvalue())
    atomic_write_json(out / META_FILE, ref.meta())
    return out


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a reference's .npz, read once, refused before expanding when their sizes
    (as the zip declares them, which also bounds what it yields) exceed MAX_ARRAYS_BYTES."""
    raw = read_capped(path, MAX_ARRAYS_FILE_BYTES, what="a reference's arrays")
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        expanded = sum(info.file_size for info in zf.infolist())
    if expanded > MAX_ARRAYS_BYTES:
        raise ValueError(
            f"{path.name} would expand to {human_bytes(expanded)}, more than {human_bytes(MAX_ARRAYS_BYTES)}"
        )
    with np.load(io.BytesIO(raw), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def load_reference(version_dir: Path) -> Reference:
    """The stored reference; NotFoundError saying how to build it, DataError if damaged."""
    out = reference_dir(version_dir)
    if not (out / META_FILE).exists():
        raise NotFoundError(f"no monitoring reference in {out}")
    try:
        # Capped reads, a FIFO refused: the registry can sit on storage a whole team writes.
        meta = json.loads(read_capped_text(out / META_FILE, MAX_META_BYTES, what="a reference's metadata"))
        arrays = _read_arrays(out / ARRAYS_FILE)
        image = {
            k.removeprefix("image."): v.astype(np.float32)
            for k, v in arrays.items()
            if k.startswith("image.")
        }
        ref = Reference(
            model=str(meta["model"]),
            version=int(meta["version"]),
            task=str(meta["task"]),
            dataset=str(meta["dataset"]),
            split=str(meta["split"]),
            images=int(meta["images"]),
            precision=str(meta["precision"]),
            temperature=None if meta["temperature"] is None else float(meta["temperature"]),
            output_names=tuple(str(n) for n in meta["output_names"]),
            outputs=arrays.get("outputs"),
            class_names=tuple(str(n) for n in meta["class_names"]),
            class_counts=arrays.get("class_counts"),
            confidence=arrays.get("confidence"),
            image=image,
            accuracy=None if meta["accuracy"] is None else float(meta["accuracy"]),
            atc_threshold=None if meta["atc_threshold"] is None else float(meta["atc_threshold"]),
            created=float(meta["created"]),
            embeddings=arrays.get("embeddings"),
        )
    except (OSError, ValueError, KeyError, TypeError, MemoryError, zipfile.BadZipFile) as e:
        raise DataError(
            f"the monitoring reference in {out} is damaged ({e}); rebuild it with "
            "`visionloop monitor MODEL --rebuild-reference`."
        ) from e
    if ref.outputs is not None and ref.outputs.shape != (ref.images, len(ref.output_names)):
        raise DataError(
            f"the monitoring reference in {out} is damaged (outputs {ref.outputs.shape}); rebuild it."
        )
    if ref.embeddings is not None and (ref.embeddings.ndim != 2 or len(ref.embeddings) != ref.images):
        raise DataError(
            f"the monitoring reference in {out} is damaged (embeddings {ref.embeddings.shape}); rebuild it."
        )
    return ref


def build_reference(
    ref: str,
    *,
    settings: Any = None,
    dataset: Path | None = None,
    split: str | None = None,
    max_images: int = DEFAULT_MAX_IMAGES,
    precision: str = "fp32",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Reference, Path]:
    """Build and store the reference of model version `ref` (NAME, NAME/V, NAME@ALIAS);
    returns it and the folder it was written to."""
    import torch

    from visionloop.core.settings import load_settings
    from visionloop.eval.api import dataset_for, split_reader, spread_positions
    from visionloop.registry import get_version
    from visionloop.serve.images import MAX_PIXELS, decode_image, needed_side
    from visionloop.serve.source import RegistrySource
    from visionloop.tasks import get_task

    if max_images < 20:
        raise DataError(
            f"--reference-images must be at least 20 (the drift tests need them), got {max_images}."
        )
    settings = settings or load_settings()
    info = get_version(ref, settings)
    resolved = RegistrySource(settings, precision=precision).version(info.name, info.version)
    card, task = resolved.card, get_task(resolved.card.task)
    path, manifest = dataset_for(info, dataset)
    split_name, reader = split_reader(path, manifest, split)
    positions = spread_positions(len(reader), max_images)
    if len(positions) < 20:
        raise DataError(f"{path} has {len(positions)} {split_name} images; a reference needs at least 20.")
    # load: the export's bytes, checked against the sha256 its gate recorded.
    model = resolved.load(intra_op_threads=1)
    spec = model.inputs[0]
    transform = card.eval_preprocess().to_transform()
    need = needed_side(card.eval_preprocess())
    columns: list[npt.NDArray[np.float32]] = []
    classes: list[npt.NDArray[np.int64]] = []
    confidence: list[npt.NDArray[np.float32]] = []
    labels: list[npt.NDArray[np.int64]] = []
    embeddings: list[npt.NDArray[np.float32]] = []
    stats: dict[str, list[float]] = {}
    names: tuple[str, ...] = ()
    for start in range(0, len(positions), _BATCH):
        chunk = positions[start : start + _BATCH]
        records = reader.read_many(chunk)
        inputs = []
        for record in records:
            d = decode_image(record["image"], transform, spec.dtype, need, MAX_PIXELS, stats=True)
            inputs.append(d.input)
            assert d.stats is not None
            for k, v in d.stats.items():
                stats.setdefault(k, []).append(v)
        outputs = model.run({spec.name: np.concatenate(inputs)})
        if EMBEDDING_OUTPUT in outputs:
            embeddings.append(np.asarray(outputs[EMBEDDING_OUTPUT], dtype=np.float32))
        if resolved.temperature is not None:
            outputs = dict(task.calibrate(outputs, resolved.temperature))
        drift = task.drift_outputs(outputs, card.class_names)
        if drift is not None:
            names = drift.names
            columns.append(drift.columns)
            if drift.classes is not None:
                classes.append(drift.classes)
            if drift.confidence is not None:
                confidence.append(drift.confidence)
                first = torch.from_numpy(np.asarray(outputs[task.output_names[0]]))
                pair = task.calibration_logits(
                    first, task.record_targets(records, image_size=card.input_size[1])
                )
                if pair is not None:
                    labels.append(np.asarray(pair[1], dtype=np.int64))
        if progress is not None:
            progress(min(start + _BATCH, len(positions)), len(positions))

    n = len(positions)
    conf = np.concatenate(confidence) if confidence else None
    pred = np.concatenate(classes) if classes else None
    accuracy = threshold = None
    if conf is not None and pred is not None and labels:
        correct = pred == np.concatenate(labels)
        accuracy = float(correct.mean())
        threshold = atc_threshold(conf, correct)
    reference = Reference(
        model=info.name,
        version=info.version,
        task=task.name,
        dataset=str(path),
        split=split_name,
        images=n,
        precision=precision,
        temperature=resolved.temperature,
        output_names=names,
        outputs=np.concatenate(columns) if columns else None,
        class_names=tuple(card.class_names),
        class_counts=None
        if pred is None
        else np.bincount(pred, minlength=len(card.class_names)).astype(np.int64),
        confidence=conf,
        image={k: np.asarray(v, dtype=np.float32) for k, v in stats.items()},
        accuracy=accuracy,
        atc_threshold=threshold,
        created=time.time(),
        embeddings=np.concatenate(embeddings) if embeddings else None,
    )
    return reference, save_reference(info.dir, reference)
