"""What a sweep benchmarks: a model card, its weights and its ONNX exports, wherever they live.

A registered version (`target_from_version`) and a bare folder (`target_from_dir`: a run
directory or a copied version folder) give the same `BenchTarget`; the sweep never asks where
the files came from. An export that is missing, or failed its accuracy gate, is carried as the
reason it cannot be benchmarked, which the sweep turns into a "skipped" row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from visionloop.bench.evalset import dataset_from_spec
from visionloop.bench.result import PRECISIONS, BenchError
from visionloop.registry.export_record import ExportReport, passing_export, read_export_report
from visionloop.registry.layout import CARD_FILE, EXPORT_REPORT_FILE, ONNX_FILE, WEIGHTS_FILE, export_dir

if TYPE_CHECKING:
    from visionloop.models.card import ModelCard


@dataclass(frozen=True)
class BenchTarget:
    label: str  # how results name it: NAME/VERSION, or the folder
    card: ModelCard
    weights: Path | None
    # precision → the ONNX file to run, or the reason there is none to run
    onnx: Mapping[str, Path | str] = field(default_factory=dict)
    dataset: Path | None = None
    name: str | None = None
    version: int | None = None
    # A registered version's `verified_weights_bytes`: the weights' bytes, read once and checked
    # against the sha256 recorded at registration (raises RegistryError for a changed file),
    # which are what the pytorch runner loads. None for a folder.
    verify_weights: Callable[[], bytes] | None = None


def _reason(report: ExportReport | None, precision: str, hint: str) -> str | None:
    """Why an export that exists may not be benchmarked, from its export.json (None: usable)."""
    if report is None:
        return f"onnx {precision} export has no readable {EXPORT_REPORT_FILE}; re-export it (`{hint}`)"
    if report.passed:
        return None
    detail = f" ({report.metric} drop {report.drop_points:.2f} points > {report.threshold_points:.2f})"
    return f"onnx {precision} export failed its {report.metric} gate{detail}"


def onnx_exports(model_dir: Path, export_hint: str) -> dict[str, Path | str]:
    """Each precision's ONNX file under `model_dir/exports/`, or why it cannot be used.

    An export is usable by the registry's own rule (`passing_export`: its report passed and
    the file has the size the gate measured), for a registered version and a bare folder alike;
    the bytes are checked against the report's sha256 when they are loaded to run
    (`read_passing_export`)."""
    found: dict[str, Path | str] = {}
    for precision in PRECISIONS:
        folder = export_dir(model_dir, "onnx", precision)
        hint = f"{export_hint} --precision {precision}"
        passed = passing_export(folder)
        if passed is not None:
            found[precision] = passed
            continue
        report = read_export_report(folder / EXPORT_REPORT_FILE)
        if report is None and not (folder / ONNX_FILE).is_file():
            found[precision] = f"no onnx {precision} export; make one with `{hint}`"
            continue
        found[precision] = _reason(report, precision, hint) or (
            f"onnx {precision} export's {ONNX_FILE} is missing or changed since its gate passed; "
            f"re-export it (`{hint}`)"
        )
    return found


def target_from_dir(model_dir: Path, *, dataset: Path | None = None) -> BenchTarget:
    """A folder holding model_card.json and final.safetensors (a run directory, or a model
    version folder), with whatever ONNX exports it has under exports/."""
    from visionloop.models.card import ModelCard

    model_dir = Path(model_dir).expanduser().resolve()
    if not (model_dir / CARD_FILE).is_file():
        raise BenchError(
            f"{model_dir} has no {CARD_FILE}; give a registered model (NAME, NAME@ALIAS, NAME/VERSION) "
            "or the folder of a finished training run."
        )
    card = ModelCard.load(model_dir)
    weights = model_dir / WEIGHTS_FILE
    return BenchTarget(
        label=str(model_dir),
        card=card,
        weights=weights if weights.is_file() else None,
        onnx=onnx_exports(model_dir, "visionloop export NAME/VERSION"),
        dataset=dataset or dataset_from_spec(model_dir),
    )


def _lineage_dataset(info: Any) -> Path | None:
    """The dataset folder the registry recorded for the version's training run."""
    raw = info.lineage().get("dataset_path") if hasattr(info, "lineage") else None
    return Path(raw) if isinstance(raw, str) and raw else None


def target_from_version(info: Any, *, dataset: Path | None = None) -> BenchTarget:
    """A registered version (`visionloop.registry.ModelVersionInfo`). Its exports are found
    as a folder's are (`onnx_exports`: only an export that passed its gate, by the registry's
    `passing_export`, which `info.export_path` applies too); for the others it says why
    (missing, the failed report, a file changed since)."""
    ref = f"{info.name}/{info.version}"
    exports = onnx_exports(Path(info.dir), f"visionloop export {ref}")
    weights = Path(info.dir) / WEIGHTS_FILE
    return BenchTarget(
        label=ref,
        card=info.card(),
        weights=weights if weights.is_file() else None,
        onnx=exports,
        dataset=dataset or _lineage_dataset(info) or dataset_from_spec(Path(info.dir)),
        name=info.name,
        version=info.version,
        verify_weights=info.verified_weights_bytes,
    )


def resolve_target(model: str, *, dataset: Path | None = None, settings: Any = None) -> BenchTarget:
    """`model` as the CLI takes it: an existing model folder, else a registry reference."""
    path = Path(model).expanduser()
    if path.is_dir():
        return target_from_dir(path, dataset=dataset)
    try:
        from visionloop.registry import get_version
    except ImportError as e:  # the registry API is not installed in this build
        raise BenchError(
            f"{model!r} is not a folder, and this visionloop has no model registry to look it up "
            f"({e}); give the folder of a trained model."
        ) from e
    return target_from_version(get_version(model, settings=settings), dataset=dataset)
