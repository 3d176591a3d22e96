"""Out-of-fold predictions by training the model again K times: the labels of any task judged
by confident learning (`visionloop label issues MODEL --refit`).

The cheap recipe (`label.issues`: a logistic regression over the served model's embeddings)
fits a classifier's one label per image; a detector's labels are boxes, which no classifier
over a whole-image embedding predicts. So here the registered version's own train spec is
trained once per fold with that fold of the train split held out (`data.holdout`: the fold's
images never enter a training batch), and each fold's model predicts its held-out images
through the task contract (`eval.run.score`, one image per batch, `Task.image_result`). Every
image is then predicted by a model that never saw it, and the task judges the labels
(`Task.find_label_issues`: cleanlab's confident learning for a classifier, ObjectLab for a
detector).

The folds are ordinary run directories under `work_dir` (`fold-0`, `fold-1`, ...): an
interrupted check resumes each fold from its last checkpoint, and a finished fold is not
trained again, so running the command again costs only what was left. Training K models costs
K trainings of the recipe; `--set epochs=N` makes them shorter (a shorter recipe's predictions
are weaker and flag more images).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from visionloop.core.errors import DataError, TrainingError
from visionloop.label.issues import IssuesReport, LabelIssue
from visionloop.tasks.label_issues import ImageLabelIssue

Progress = Callable[[str, int, int], None]
MAX_FOLDS = 20


@dataclass(frozen=True)
class FoldRun:
    fold: int
    run_dir: str
    trained_images: int
    held_out: int


def fold_specs(spec: Any, folds: int, seed: int) -> list[Any]:
    """`spec` once per fold, with that fold held out (and nothing else changed)."""
    from visionloop.specs import HoldoutSpec

    def held(k: int) -> Any:
        return spec.data.model_copy(update={"holdout": HoldoutSpec(folds=folds, fold=k, seed=seed)})

    return [spec.model_copy(update={"data": held(k)}) for k in range(folds)]


def _version_spec(info: Any, overrides: Sequence[str], dataset: Path | None) -> Any:
    from visionloop.registry.layout import SPEC_RESOLVED_FILE
    from visionloop.specs import load_train_spec

    path = info.dir / SPEC_RESOLVED_FILE
    if not path.is_file():
        raise DataError(
            f"{info.ref} has no saved train spec ({path}), which --refit trains again; register a run "
            "made by this release, or use the embeddings recipe (leave --refit out)."
        )
    extra = [f"data.dataset={dataset}"] if dataset is not None else []
    spec, _ = load_train_spec(path, [*overrides, *extra])
    return spec


def refit_issues(
    ref: str,
    settings: Any,
    *,
    work_dir: Path,
    folds: int = 5,
    seed: int = 0,
    overrides: Sequence[str] = (),
    dataset: Path | None = None,
    top: int | None = None,
    progress: Progress | None = None,
) -> tuple[IssuesReport, list[FoldRun]]:
    """Train `ref`'s recipe once per fold under `work_dir`, predict each held-out fold, and
    return the likely label errors of the whole train split (and the folds' run folders);
    with `top`, the `top` least likely images, flagged or not (`Task.find_label_issues`)."""
    import torch

    from visionloop.data.manifest import read_manifest
    from visionloop.data.sampler import holdout_positions
    from visionloop.eval.api import split_reader
    from visionloop.eval.run import ImageResult, score
    from visionloop.models.card import ModelCard
    from visionloop.registry import get_version
    from visionloop.tasks import get_task
    from visionloop.train.api import train
    from visionloop.train.rundir import RunDir

    if not 2 <= folds <= MAX_FOLDS:
        raise DataError(f"--folds must be 2 to {MAX_FOLDS}, got {folds}.")
    info = get_version(ref, settings)
    spec = _version_spec(info, overrides, dataset)
    path = Path(spec.data.dataset)
    manifest = read_manifest(path)
    task = get_task(manifest.task)
    split, reader = split_reader(path, manifest, "train")
    if len(reader) < 2 * folds:
        raise DataError(
            f"{path} has {len(reader)} training images: too few for {folds} folds (at least two "
            "images a fold). Use fewer --folds."
        )
    results: dict[int, ImageResult] = {}
    runs: list[FoldRun] = []
    for k, fold_spec in enumerate(fold_specs(spec, folds, seed)):
        if progress is not None:
            progress("folds trained", k, folds)
        rd = RunDir(work_dir / f"fold-{k}")
        result = train(fold_spec, rd.path, settings=settings, track=False)
        if result.exit_code != 0:
            raise TrainingError(
                f"fold {k}'s training stopped (exit {result.exit_code}) with a checkpoint in {rd.path}; "
                "run the same command again to resume it."
            )
        held = holdout_positions(len(reader), folds, k, seed)
        card = ModelCard.load(rd.model_card)
        model = task.load_model(card, rd.final_weights)
        device = torch.device("cuda" if torch.cuda.is_available() and spec.device != "cpu" else "cpu")
        loss_fn = task.loss_fn(fold_spec)
        passed = score(task, card, model.to(device), loss_fn, reader, held, device=device, keep_images=True)
        assert passed.images is not None
        results.update(zip(held, passed.images, strict=True))
        runs.append(FoldRun(k, str(rd.path), len(reader) - len(held), len(held)))
        if progress is not None:
            progress("folds trained", k + 1, folds)
    positions = sorted(results)
    if len(positions) != len(reader):  # every image is in exactly one fold
        raise DataError(f"the folds predicted {len(positions)} of {len(reader)} images; report it as a bug.")
    pairs = [(results[p].outputs, results[p].targets) for p in positions]
    oof = _oof_metrics(task, manifest.classes, pairs)
    found = task.find_label_issues(pairs, manifest.classes, top=top)
    chunks = (positions[at : at + 256] for at in range(0, len(positions), 256))
    indices = [int(r["index"]) for chunk in chunks for r in reader.read_many(chunk)]
    report = IssuesReport(
        model=info.ref,
        dataset=str(path),
        dataset_version=manifest.version,
        split=split,
        images=len(positions),
        folds=folds,
        oof_accuracy=oof.get("accuracy"),
        issues=tuple(_issue(split, positions[f.item], indices[f.item], f) for f in found),
        method="refit",
        oof_metrics=oof,
    )
    return report, runs


def _oof_metrics(task: Any, class_names: Sequence[str], pairs: list[tuple[Any, Any]]) -> dict[str, float]:
    """The task's own metrics over every out-of-fold prediction at once: how good the judge is."""
    evaluator = task.evaluator(class_names)
    outputs, targets = task.join_results(pairs)
    evaluator.update(outputs, targets, 0.0)
    return {k: round(float(v), 6) for k, v in evaluator.compute().metrics.items() if k != "loss"}


def _issue(split: str, position: int, index: int, found: ImageLabelIssue) -> LabelIssue:
    return LabelIssue(
        split=split,
        position=position,
        index=index,
        given=found.given,
        suggested=found.suggested,
        given_probability=found.quality,
        suggested_probability=None,
        findings=found.findings,
    )


def fold_runs_dict(runs: Sequence[FoldRun]) -> list[dict[str, Any]]:
    return [asdict(r) for r in runs]
