"""Likely label errors in a dataset split, found by confident learning (cleanlab) on
out-of-fold predictions.

A model's predictions on the images it was trained on are overconfident in their given labels,
so they hide exactly the mistakes this looks for. The predictions here are out-of-fold: the
registered model's served export embeds every image once (its `embedding` output, the layer
before the head), and a logistic regression on those embeddings is fitted K times, each time
without one fold, to predict that fold (cleanlab's recipe for large datasets: a cheap
classifier over a strong model's features instead of K trainings of the model). cleanlab's
`find_label_issues` then flags the images whose given label the out-of-fold probabilities
contradict more than the estimated noise rates explain (its `prune_by_noise_rate`), ranked by
the probability of the given label, lowest first.

Each finding names the image (split, shard position, record index), its given label and the
suggested one; `write_review` writes the flagged images with their stored bytes, a report and
a selection file that `visionloop label export` sends to Label Studio for review, and whose
relabelled images `visionloop data add` then matches back to these records.

One class per image (a classifier's dataset): a detector's images hold several boxes, which
`label.refit` judges from K trainings of the detector instead; its findings share these types.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from visionloop.core.errors import DataError
from visionloop.core.fsutil import atomic_write_bytes, atomic_write_text
from visionloop.tasks.drift_outputs import EMBEDDING_OUTPUT
from visionloop.tasks.label_issues import LabelFinding

Progress = Callable[[str, int, int], None]
# The most images one run embeds: 50k × a 512-wide embedding is 100 MB of float32.
MAX_IMAGES = 50_000
MIN_PER_CLASS = 2  # a class with fewer images cannot be split into folds at all
_BATCH = 64


@dataclass(frozen=True)
class LabelIssue:
    split: str
    position: int  # in the split's shards
    index: int  # the record's id (`data add` keeps it across versions)
    given: str  # the given label; for a detector, its boxes summed up ("2 car, 1 person")
    suggested: str
    # Out-of-fold probability of the given label (a detector: cleanlab's label quality score
    # of the image, 0..1): low is suspicious.
    given_probability: float
    suggested_probability: float | None  # None where there is no one suggested label (boxes)
    image: str | None = None  # the file `write_review` wrote, when it did
    findings: tuple[LabelFinding, ...] = ()  # the suspicious labels (boxes), least likely first

    def reason(self) -> str:
        """One line for a reviewer: what was given and what the model says instead."""
        if self.suggested_probability is not None:
            return f"labelled {self.given}, out-of-fold {self.suggested} ({self.suggested_probability:.2f})"
        kinds = ", ".join(
            f"{f.kind} {f.given or f.suggested}" for f in self.findings[:3] if f.kind != "wrong class"
        )
        return f"labelled {self.given}, out-of-fold {self.suggested}" + (f" ({kinds})" if kinds else "")


@dataclass(frozen=True)
class IssuesReport:
    model: str
    dataset: str
    dataset_version: str
    split: str
    images: int
    folds: int
    oof_accuracy: float | None  # of the out-of-fold predictions against the given labels
    issues: tuple[LabelIssue, ...]
    # "embeddings": a classifier over the served model's embeddings; "refit": the model's
    # recipe trained once per fold (`label.refit`).
    method: str = "embeddings"
    oof_metrics: dict[str, float] | None = None  # the task's metrics over the out-of-fold predictions

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "issues": [asdict(i) for i in self.issues]}


def out_of_fold_probabilities(
    embeddings: npt.NDArray[np.float32], labels: npt.NDArray[np.int64], folds: int, seed: int
) -> npt.NDArray[np.float64]:
    """(N, C) probabilities, each row from a logistic regression fitted without that row's
    fold (stratified), over standardised embeddings; C is the number of classes present."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    n_classes = int(labels.max()) + 1
    probs = np.zeros((len(labels), n_classes))
    splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    for train, held in splitter.split(embeddings, labels):
        model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=1.0))
        model.fit(embeddings[train], labels[train])
        cols = model.classes_.astype(np.int64)
        probs[np.ix_(held, cols)] = model.predict_proba(embeddings[held])
    return probs


def find_issues(
    ref: str,
    settings: Any,
    *,
    dataset: Path | None = None,
    split: str = "train",
    folds: int = 5,
    max_images: int | None = None,
    seed: int = 0,
    precision: str = "fp32",
    top: int | None = None,
    progress: Progress | None = None,
) -> IssuesReport:
    """The likely label errors of `split` of `dataset` (default: the version's own), judged
    from `ref`'s embeddings; with `top`, the `top` images whose given label is least likely,
    flagged or not (a review budget)."""
    from visionloop.eval.api import dataset_for, split_reader, spread_positions
    from visionloop.label.scoring import Scorer
    from visionloop.tasks.label_issues import rank_given_labels

    if not 2 <= folds <= 20:
        raise DataError(f"--folds must be 2 to 20, got {folds}.")
    limit = MAX_IMAGES if max_images is None else min(max_images, MAX_IMAGES)
    scorer = Scorer(ref, settings, precision)
    if not scorer.has_embeddings:
        raise DataError(
            f"{scorer.info.ref}'s {precision} export has no `embedding` output, which the out-of-fold "
            f"predictions are made from; re-export it (`visionloop export {scorer.info.ref}`)."
        )
    path, manifest = dataset_for(scorer.info, dataset)
    split, reader = split_reader(path, manifest, split)
    positions = spread_positions(len(reader), limit)
    embeds: list[npt.NDArray[np.float32]] = []
    labels: list[int] = []
    indices: list[int] = []
    batch: list[npt.NDArray[Any]] = []
    for start in range(0, len(positions), _BATCH):
        chunk = positions[start : start + _BATCH]
        for record in reader.read_many(chunk):
            present = scorer.task.record_classes(record)
            if len(present) != 1:
                raise DataError(
                    f"{path} ({split}) holds images with {len(present)} labelled classes; finding label "
                    "errors here needs one class per image (a classifier's dataset)."
                )
            labels.append(present[0])
            indices.append(int(record["index"]))
            batch.append(scorer.decode(bytes(record["image"])))
        embeds.append(
            np.asarray(scorer.run(batch)[EMBEDDING_OUTPUT], dtype=np.float32).reshape(len(batch), -1)
        )
        batch.clear()
        if progress is not None:
            progress("embedding", min(start + _BATCH, len(positions)), len(positions))
    y = np.asarray(labels, dtype=np.int64)
    counts = np.bincount(y, minlength=len(manifest.classes))
    present_counts = counts[counts > 0]
    if len(present_counts) < 2:
        raise DataError(
            f"{path} ({split}) has images of one class only; there is nothing to confuse it with."
        )
    folds = min(folds, int(present_counts.min()))
    if folds < MIN_PER_CLASS:
        rare = [manifest.classes[c] for c in np.flatnonzero((counts > 0) & (counts < MIN_PER_CLASS))]
        raise DataError(
            f"class(es) {', '.join(rare[:5])} have a single image in {split}: out-of-fold predictions need "
            f"at least {MIN_PER_CLASS} per class. Label more of them, or leave --max-images out."
        )
    x = np.concatenate(embeds)
    # Only the classes present here, numbered 0..K-1: what cleanlab expects of labels and columns.
    in_split = np.flatnonzero(counts > 0)
    dense = np.searchsorted(in_split, y)
    probs = out_of_fold_probabilities(x, dense, folds, seed)
    if progress is not None:
        progress("cross-validation", 1, 1)
    ranked = rank_given_labels(dense, probs, top)
    names = [manifest.classes[int(c)] for c in in_split]
    y = dense
    issues = tuple(
        LabelIssue(
            split=split,
            position=positions[i],
            index=indices[i],
            given=names[int(y[i])],
            suggested=names[int(probs[i].argmax())],
            given_probability=round(float(probs[i, y[i]]), 6),
            suggested_probability=round(float(probs[i].max()), 6),
        )
        for i in ranked
    )
    return IssuesReport(
        model=scorer.info.ref,
        dataset=str(path),
        dataset_version=manifest.version,
        split=split,
        images=len(y),
        folds=folds,
        oof_accuracy=round(float((probs.argmax(1) == y).mean()), 6),
        issues=issues,
    )


def _suffix(data: bytes) -> str:
    if data.startswith(b"\x89PNG"):
        return ".png"
    if data.startswith(b"\xff\xd8"):
        return ".jpg"
    return ".bin"


def write_review(report: IssuesReport, out_dir: Path, limit: int | None = None) -> IssuesReport:
    """Write the flagged images (their stored bytes, as `images/<split>-<index>.<ext>`), the
    report (`issues.json`) and a selection (`selection.json`) that `visionloop label export`
    sends to Label Studio; return the report with each issue's image path."""
    from visionloop.data.manifest import read_manifest, shard_dir_of
    from visionloop.data.shards import ShardReader

    chosen = report.issues[:limit] if limit is not None else report.issues
    manifest = read_manifest(Path(report.dataset))
    reader = ShardReader(shard_dir_of(Path(report.dataset), manifest.splits[report.split]))  # type: ignore[index]
    images = out_dir / "images"
    images.mkdir(parents=True, exist_ok=True)
    written = []
    for issue, record in zip(chosen, reader.read_many([i.position for i in chosen]), strict=True):
        data = bytes(record["image"])
        name = f"{issue.split}-{issue.index}{_suffix(data)}"
        atomic_write_bytes(images / name, data)
        written.append(dataclasses.replace(issue, image=str(images / name)))
    out = dataclasses.replace(report, issues=tuple(written))
    atomic_write_text(out_dir / "issues.json", json.dumps(out.to_dict(), indent=1) + "\n")
    selection = {
        "model": report.model,
        "source": str(images),
        "strategy": "label-issues",
        "chosen": [
            {
                "id": Path(i.image or "").name,
                "score": 1.0 - i.given_probability,
                "reason": i.reason(),
            }
            for i in written
        ],
    }
    atomic_write_text(out_dir / "selection.json", json.dumps(selection, indent=1) + "\n")
    return out
