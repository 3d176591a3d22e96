"""The images a benchmark measures accuracy on, and feeds as latency input.

Accuracy comes from the model's own validation split, preprocessed with the model card's eval
recipe (`card.eval_preprocess()`), exactly as serving will preprocess a request. The split is
found through the train spec saved with the model (`data.dataset`); a dataset whose version
differs from the card's `dataset_version` is refused, because accuracy on other images is not
the model's accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from visionloop.bench.result import BenchError

if TYPE_CHECKING:
    from visionloop.models.card import ModelCard

# resolved first: its dataset path is absolute (train writes it into the run directory).
_SPEC_FILES = ("spec.resolved.yaml", "spec.yaml")


@dataclass(frozen=True)
class EvalSet:
    images: np.ndarray  # float32 (N, C, H, W), preprocessed and normalised
    # The task's targets for the N images, sliceable like them: int64 (N,) labels for
    # classification; a list of per-image targets for a task whose targets are not one array.
    labels: Any
    source: str  # e.g. "/data/digits-ds [val] 360 of 360 images"
    task: str = "classification"


# A saved train spec is a few kB; a file far larger is not one.
MAX_SPEC_BYTES = 1 * 2**20


def read_saved_spec(path: Path) -> Any:
    """The YAML document of a train spec saved beside a model, read as untrusted: never waits
    on a FIFO (read_capped), at most MAX_SPEC_BYTES, no aliases (a billion-laughs file), and
    bytes that are not UTF-8 are an error. Raises OSError, ValueError or yaml.YAMLError."""
    from visionloop.core.fsutil import TooLargeError, read_capped
    from visionloop.core.safeyaml import load_untrusted

    try:
        data = read_capped(path, MAX_SPEC_BYTES, what="a saved train spec")
    except TooLargeError as e:
        raise ValueError(f"{path} is over {MAX_SPEC_BYTES // 2**20} MiB") from e
    return load_untrusted(data.decode("utf-8"))


def dataset_from_spec(model_dir: Path) -> Path | None:
    """The dataset folder named by the train spec saved beside the model, if any."""
    for name in _SPEC_FILES:
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            # read_saved_spec: is_file() above can be raced by a FIFO, and a huge or
            # alias-bomb YAML must not take the memory (yaml.safe_load of read_text did).
            doc: Any = read_saved_spec(path)
            raw = doc["data"]["dataset"]
        except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
            continue
        dataset = Path(str(raw)).expanduser()
        if not dataset.is_absolute():
            dataset = (model_dir / dataset).resolve()
        return dataset
    return None


def spread_positions(total: int, limit: int | None) -> list[int]:
    """`limit` positions spread evenly over `total` records (all of them if that is fewer):
    a dataset written class by class still gets every class into the subset."""
    if limit is None or total <= limit:
        return list(range(total))
    return sorted({int(i) for i in np.linspace(0, total - 1, num=limit)})


def load_eval_set(card: ModelCard, dataset_dir: Path, *, max_images: int | None) -> EvalSet:
    """The validation split (else the test split) of `dataset_dir`, preprocessed for `card`
    by the export gate's own reader (`visionloop.export.ModelDataset`), so the accuracy bench reports
    and the accuracy an export was gated on are measured the same way."""
    import torch

    from visionloop.data.manifest import eval_split, read_manifest
    from visionloop.export import ModelDataset

    manifest = read_manifest(dataset_dir)
    if card.dataset_version and manifest.version != card.dataset_version:
        raise BenchError(
            f"{dataset_dir} is dataset version {manifest.version[:12]}, but the model was trained on "
            f"{card.dataset_version[:12]}; give the dataset it was trained on with --dataset DIR "
            "(accuracy on other images is not this model's accuracy), or run with --no-accuracy."
        )
    if list(manifest.classes) != list(card.class_names):
        raise BenchError(
            f"{dataset_dir} has classes {manifest.classes[:5]}..., the model {card.class_names[:5]}...; "
            "give the dataset the model was trained on with --dataset DIR, or run with --no-accuracy."
        )
    data = ModelDataset(path=dataset_dir, manifest=manifest, card=card)
    split = eval_split(manifest)
    reader = data.reader(split) if split is not None else None
    if reader is None:
        raise BenchError(
            f"{dataset_dir} has no val or test images to measure accuracy on; re-ingest it with "
            "--val-fraction 0.1, or run with --no-accuracy."
        )
    positions = spread_positions(len(reader), max_images)
    # One batch of them all: the task collates the targets of the whole set at once.
    images, targets = next(data.batches(reader, positions, batch_size=max(len(positions), 1)))
    return EvalSet(
        images=np.ascontiguousarray(images.numpy().astype(np.float32, copy=False)),
        labels=targets.numpy() if isinstance(targets, torch.Tensor) else targets,
        source=f"{dataset_dir} [{split}] {len(positions)} of {len(reader)} images",
        task=card.task,
    )


def synthetic_inputs(card: ModelCard, count: int = 32, seed: int = 0) -> np.ndarray:
    """Normal noise of the model's input size: latency input when no dataset is at hand
    (a CNN's cost does not depend on pixel values)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((count, *card.input_size), dtype=np.float32)


def score(predict: Any, evalset: EvalSet, batch_size: int = 64) -> float:
    """The task's gate metric (top-1 accuracy for classification) of `predict` (float32 batch
    → its raw output, or a sequence of outputs) over the evaluation images."""
    from visionloop.tasks import get_task

    scorer = get_task(evalset.task).output_scorer()
    for start in range(0, len(evalset.images), batch_size):
        out = predict(evalset.images[start : start + batch_size])
        outputs = [out] if isinstance(out, np.ndarray) else list(out)
        scorer.update(outputs, evalset.labels[start : start + batch_size])
    return scorer.compute()
