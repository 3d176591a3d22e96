"""`evaluate_model`: a registered model version's metrics on a dataset split, under stress
(seeded corruptions at five severities), with its confidences' calibration, and per value of
the dataset's per-image metadata columns (`slices`: worst first, with bootstrap intervals).

The report and its plots go to `<version dir>/evals/<time>-<split>/` (eval.json, PNGs); a
temperature fitted on the model's own validation split goes to `<version dir>/calibration.json`,
where the server reads it, so that served confidences are calibrated.
"""

from __future__ import annotations

import io
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from visionloop.core.errors import DataError, NotFoundError, SpecError
from visionloop.core.fsutil import atomic_write_bytes, atomic_write_json
from visionloop.core.settings import Settings, load_settings
from visionloop.data.manifest import DatasetManifest, eval_split, read_manifest, shard_dir_of
from visionloop.data.metadata import Scalar, load_metadata, value_key
from visionloop.data.shards import ShardReader
from visionloop.eval import calibration as cal
from visionloop.eval import slices as sl
from visionloop.eval.corruptions import corrupt, image_seed
from visionloop.eval.options import EvalOptions, check_options
from visionloop.eval.report import EvalReport, StressCell, summarize_stress
from visionloop.eval.run import Corrupter, PassResult, score
from visionloop.eval.tracking import log_eval_run
from visionloop.registry import ModelVersionInfo, get_version
from visionloop.registry.evals import CALIBRATION_FILE, EVALS_DIR, REPORT_FILE
from visionloop.registry.layout import SPEC_RESOLVED_FILE
from visionloop.tasks import LossFn, Task, get_task

# Fewer held-out images than this make a fitted temperature and its measured ECE noise.
MIN_CALIBRATION_IMAGES = 50


def evaluate_model(
    ref: str | ModelVersionInfo, options: EvalOptions | None = None, *, settings: Settings | None = None
) -> EvalReport:
    """Evaluate `ref`; write the report under its version folder and return it."""
    options = options or EvalOptions()
    settings = settings or load_settings()
    check_options(options)
    info = ref if isinstance(ref, ModelVersionInfo) else get_version(ref, settings)
    card = info.card()
    # verified_weights_bytes, before any image is read: the weights must be the ones registered,
    # or the report (and the temperature the server applies) would be filed under this version
    # for other weights. The model is built from these checked bytes, not the file read again.
    weights = info.verified_weights_bytes()
    task = get_task(card.task)
    path, manifest = dataset_for(info, options.dataset)
    split, reader = split_reader(path, manifest, options.split)
    positions = spread_positions(len(reader), options.max_images)
    slice_values = _slice_values(path, manifest, split, len(reader), positions, options.slices)
    device = _device(options.device)
    model = task.load_model(card, weights).to(device)
    loss_fn = _loss_fn(task, info)

    def run(corrupter: Corrupter | None, keep_images: bool = False) -> PassResult:
        return score(
            task, card, model, loss_fn, reader, positions,
            device=device, batch_size=options.batch_size, corrupter=corrupter, keep_images=keep_images,
        )  # fmt: skip

    clean = run(None, keep_images=bool(slice_values))
    own_data = card.dataset_version is not None and manifest.version == card.dataset_version
    primary = task.primary_metric
    if primary not in clean.result.metrics:
        raise DataError(f"the {task.name} evaluator reported no {primary!r}; the task is broken.")
    stamp = datetime.now(UTC)
    report = EvalReport(
        model=info.ref,
        task=task.name,
        dataset=str(path),
        dataset_version=manifest.version,
        split=split,
        images=len(positions),
        metric=primary,
        mode=task.primary_mode,
        clean=float(clean.result.metrics[primary]),
        clean_metrics={k: float(v) for k, v in clean.result.metrics.items() if "/" not in k},
        summary=clean.result.summary,
        same_data_as_training=own_data,
        seed=options.seed,
        created_at=stamp.isoformat(timespec="seconds"),
    )
    analysis = clean.evaluator.error_analysis()
    report.errors = analysis.to_dict() if analysis is not None else None
    if slice_values:
        assert clean.images is not None
        report.slices = {}
        for column, values in slice_values.items():
            rows = sl.compute_slices(
                task, card.class_names, clean.images, values,
                column=column, seed=options.seed, resamples=options.slice_resamples,
            )  # fmt: skip
            report.slices[column] = [s.to_dict() for s in rows]
        report.slice_bootstrap = {
            "confidence": sl.CONFIDENCE,
            "resamples": options.slice_resamples,
            "min_images": sl.MIN_INTERVAL_IMAGES,
            "max_images_resampled": sl.MAX_BOOTSTRAP_IMAGES,
            "seed": options.seed,
        }
    out_dir = _out_dir(info.dir, stamp, split)
    files: list[Path] = []
    files += _artifacts(clean, out_dir)
    temperature = _calibrate(
        report, clean, options, out_dir, files, fit_and_store=own_data and split != "train"
    )
    if options.stress:
        for name in options.corruptions:
            for severity in options.severities:
                got = run(_corrupter(name, severity, options.seed))
                ece = _ece(got) if got.logits is not None else None
                report.stress.append(
                    StressCell(
                        corruption=name,
                        severity=severity,
                        value=float(got.result.metrics[primary]),
                        metrics={k: float(v) for k, v in got.result.metrics.items() if "/" not in k},
                        ece=ece,
                    )
                )
        report.corruptions, report.stress_mean, report.mean_relative_error = summarize_stress(
            report.stress, report.clean, report.mode
        )
        files.append(plot_stress(report, out_dir / "stress.png"))
    report.files = [str(p) for p in files]
    report.path = str(out_dir / REPORT_FILE)
    atomic_write_json(out_dir / REPORT_FILE, report.to_dict())
    if options.track:
        # On disk first: a tracking store that fails costs the run, never the report.
        report.mlflow_run_id = log_eval_run(info, report, [*files, out_dir / REPORT_FILE], settings)
        atomic_write_json(out_dir / REPORT_FILE, report.to_dict())
    if temperature is not None:
        atomic_write_json(
            info.dir / CALIBRATION_FILE,
            {
                "temperature": temperature,
                "fitted_on": {"dataset_version": manifest.version, "split": split, "images": len(positions)},
                "ece_before": report.calibration["ece"] if report.calibration else None,
                "ece_after": report.calibration["ece_after"] if report.calibration else None,
                "report": str(out_dir / REPORT_FILE),
                "created_at": report.created_at,
            },
        )
    return report


# --------------------------------------------------------------------------- the pieces


def dataset_for(info: ModelVersionInfo, given: Path | None) -> tuple[Path, DatasetManifest]:
    """The dataset to evaluate on: `given` (any dataset of the model's task and classes), else
    the one the version was trained on."""
    card = info.card()
    if given is None:
        recorded = info.lineage().get("dataset_path")
        if not recorded:
            raise DataError(
                f"{info.ref} does not record where its dataset is; pass one with --dataset DIR "
                f"(any dataset with its classes: {', '.join(card.class_names[:5])}...)."
            )
        given = Path(recorded)
    path = Path(given).expanduser()
    try:
        manifest = read_manifest(path)
    except FileNotFoundError:
        raise NotFoundError(
            f"{path} is not an ingested dataset (no manifest); make one with `visionloop data ingest`."
        ) from None
    if manifest.task != card.task:
        raise DataError(f"{path} is a {manifest.task} dataset and {info.ref} a {card.task} model.")
    if list(manifest.classes) != list(card.class_names):
        raise DataError(
            f"{path} has classes {manifest.classes[:8]}, {info.ref} {card.class_names[:8]}: the "
            "metrics would compare different labels. Evaluate on a dataset with the model's classes, "
            "in the same order."
        )
    return path, manifest


def split_reader(path: Path, manifest: DatasetManifest, split: str | None) -> tuple[str, ShardReader]:
    name = split if split is not None else eval_split(manifest)
    info = manifest.splits.get(name) if name is not None else None  # type: ignore[call-overload]
    if name is None or info is None or info.count == 0:
        have = [s for s, i in manifest.splits.items() if i.count > 0]
        what = f"no {name!r} images" if name is not None else "no val or test images"
        raise DataError(
            f"{path} has {what}; it has {', '.join(have) or 'none'}. Pick one with --split, or "
            "re-ingest with a validation split (--val-fraction 0.1)."
        )
    return name, ShardReader(shard_dir_of(path, info))


def spread_positions(total: int, limit: int | None) -> list[int]:
    """`limit` positions spread evenly over the split (every class of a dataset written class
    by class), or all of them."""
    if limit is None or total <= limit:
        return list(range(total))
    return sorted({int(i) for i in np.linspace(0, total - 1, num=limit)})


def _slice_values(
    path: Path,
    manifest: DatasetManifest,
    split: str,
    records: int,
    positions: list[int],
    columns: tuple[str, ...],
) -> dict[str, list[Scalar | None]]:
    """Per column asked for, each scored image's value (None: it has none), read and checked
    before any image is scored."""
    if not columns:
        return {}
    have = manifest.metadata_columns
    if not have:
        raise DataError(
            f"--slices {','.join(columns)}: {path} has no per-image metadata, so there is nothing to "
            "slice by. Ingest the images with their metadata: a CSV with extra columns "
            "(path,label,split,camera,...) or a COCO file whose `images` entries carry fields "
            "(camera, site, ...), e.g. `visionloop data ingest labels.csv --out DIR`; then "
            "evaluate on it with --dataset DIR."
        )
    unknown = [c for c in columns if c not in have]
    if unknown:
        raise SpecError(
            f"--slices {unknown[0]!r}: {path} has no metadata column {unknown[0]!r}; its columns are "
            f"{', '.join(have)}."
        )
    rows = load_metadata(path, manifest, split)
    if rows is None or len(rows) != records:
        raise DataError(
            f"{path}: the {split} metadata does not describe the {records} records of its shards; "
            "re-run `visionloop data ingest` to rebuild the dataset."
        )
    out: dict[str, list[Scalar | None]] = {}
    for column in columns:
        values = [rows[p].get(column) for p in positions]
        distinct = len({value_key(v) for v in values})
        if distinct > sl.MAX_SLICE_VALUES:
            raise SpecError(
                f"--slices {column!r}: the {len(positions)} images scored have {distinct} distinct values "
                f"of {column!r}, more than the {sl.MAX_SLICE_VALUES} a slice report shows (a value "
                "per image is an id, not a slice). Slice by a coarser column."
            )
        out[column] = values
    return out


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SpecError("--device cuda: no CUDA device is visible here; use --device cpu.")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _loss_fn(task: Task, info: ModelVersionInfo) -> LossFn:
    """The loss the model was trained with (label smoothing and all, from its saved spec), so
    the reported loss matches training's; plain cross-entropy-like defaults if it is gone."""
    from visionloop.bench.evalset import read_saved_spec
    from visionloop.specs import TrainSpec

    path = info.dir / SPEC_RESOLVED_FILE
    try:
        # Not yaml.safe_load(path.read_text()): a FIFO in the spec's place hung `eval` for ever,
        # and a huge or alias-bomb file was read and expanded without a limit.
        doc = read_saved_spec(path)
        spec = TrainSpec.model_validate(doc)
    except Exception:  # an old or missing spec costs only the loss's details
        # `epochs` too: without it this fallback itself failed validation (a traceback).
        fallback = {"data": {"dataset": "."}, "model": {"arch": info.card().arch}, "epochs": 1}
        spec = TrainSpec.model_validate(fallback)
    return task.loss_fn(spec)


def _corrupter(name: str, severity: int, seed: int) -> Corrupter:
    def apply(image: np.ndarray, position: int) -> np.ndarray:
        # Each image its own stream, by its position in the split: the same image gets the
        # same corruption in every run and for every model, whatever the batch size.
        return corrupt(image, name, severity, image_seed(seed, position))

    return apply


def _out_dir(version_dir: Path, stamp: datetime, split: str) -> Path:
    base = version_dir / EVALS_DIR / f"{stamp.strftime('%Y%m%dT%H%M%SZ')}-{split}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    out.mkdir(parents=True)
    return out


def _artifacts(clean: PassResult, out_dir: Path) -> list[Path]:
    """The task's own plots of the clean pass (confusion matrix, detections)."""
    return list(clean.evaluator.write_artifacts(clean.result, out_dir))


def _ece(result: PassResult) -> float:
    assert result.logits is not None and result.labels is not None
    return cal.calibration(cal.softmax(result.logits), result.labels).ece


def _calibrate(
    report: EvalReport,
    clean: PassResult,
    options: EvalOptions,
    out_dir: Path,
    files: list[Path],
    *,
    fit_and_store: bool,
) -> float | None:
    """Calibration of the clean pass; with enough images, temperature scaling measured by
    two-fold cross-fitting (fitted on one half, measured on the other, both ways), so the
    'after' figure is on images the temperature never saw. Returns the temperature fitted on
    the whole split when it is to be stored with the model (its own validation split)."""
    if clean.logits is None or clean.labels is None:
        report.calibration_note = (
            f"no calibration: the {report.task} model gave no confidences to calibrate on this split "
            "(e.g. a detector that detected nothing)"
        )
        return None
    before = cal.calibration(cal.softmax(clean.logits), clean.labels)
    report.calibration = before.to_dict()
    n = len(clean.labels)
    if n < MIN_CALIBRATION_IMAGES:
        report.calibration_note = (
            f"{n} images are too few to fit a temperature (at least {MIN_CALIBRATION_IMAGES})"
        )
        files.append(cal.reliability_diagram(before, out_dir / "reliability.png", title=report.model))
        return None
    order = np.random.default_rng(options.seed).permutation(n)
    halves = (order[: n // 2], order[n // 2 :])
    probs_after = np.empty_like(clean.logits, dtype=np.float64)
    for fit, held in (halves, halves[::-1]):
        t = cal.fit_temperature(clean.logits[fit], clean.labels[fit])
        probs_after[held] = cal.softmax(clean.logits[held], t)
    after = cal.calibration(probs_after, clean.labels)
    temperature = cal.fit_temperature(clean.logits, clean.labels)
    report.calibration.update(
        temperature=temperature,
        ece_after=after.ece,
        mce_after=after.mce,
        brier_after=after.brier,
        nll_after=after.nll,
        after=after.to_dict(),
        stored=fit_and_store and options.calibrate,
    )
    if not (fit_and_store and options.calibrate):
        report.calibration_note = (
            "temperature measured but not stored: only an evaluation on the model's own "
            "validation data sets the temperature the server applies"
            if options.calibrate
            else "temperature measured but not stored (--no-calibrate)"
        )
    files.append(
        cal.reliability_diagram(before, out_dir / "reliability.png", title=report.model, after=after)
    )
    return temperature if fit_and_store and options.calibrate else None


def plot_stress(report: EvalReport, path: Path) -> Path:
    """The primary metric against severity, one line per corruption, clean as a dashed line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for s in report.corruptions:
        ax.plot(s.severities, s.values, marker="o", label=f"{s.corruption} ({s.mean:.3f})")
    ax.axhline(report.clean, color="black", linestyle="--", label=f"clean ({report.clean:.3f})")
    ax.set_xlabel("severity")
    ax.set_ylabel(report.metric)
    ax.set_xticks(sorted({c.severity for c in report.stress}))
    ax.set_title(f"{report.model}: {report.metric} under corruption ({report.split}, {report.images} images)")
    ax.legend(fontsize=8, loc="lower left")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
    return path
