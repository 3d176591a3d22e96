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
from visionloop.registry.export_record import ExportReport, read_export_report
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
    # A registered version's `verified_weights`: the weights, checked against the sha256
    # recorded at registration (raises RegistryError for a changed file). None for a folder.
    verify_weights: Callable[[], Path] | None = None


def _reason(report: ExportReport | None, precision: str, hint: str) -> str | None:
    """Why an export that exists may not be benchmarked, from its export.json (None: usable)."""
    if report is None:
        return f"onnx {precision} export has no readable {EXPORT_REPORT_FILE}; re-export it (`{hint}`)"
    if report.passed:
        return None
    detail = f" ({report.metric} drop {report.drop_points:.2f} points > {report.threshold_points:.2f})"
    return f"onnx {precision} export failed its {report.metric} gate{detail}"


def onnx_exports(model_dir: Path, export_hint: str) -> dict[str, Path | str]:
    """Each precision's ONNX file under `model_dir/exports/`, or why it cannot be used."""
    found: dict[str, Path | str] = {}
    for precision in PRECISIONS:
        folder = export_dir(model_dir, "onnx", precision)
        hint = f"{export_hint} --precision {precision}"
        model = folder / ONNX_FILE
        if not model.is_file():
            found[precision] = f"no onnx {precision} export; make one with `{hint}`"
            continue
        reason = _reason(read_export_report(folder / EXPORT_REPORT_FILE), precision, hint)
        found[precision] = model if reason is None else reason
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
    """A registered version (`visionloop.registry.ModelVersionInfo`). Exports come from
    `info.export_path`, which only returns an export that passed its gate; for the others the
    folder says why (missing, or the failed report)."""
    ref = f"{info.name}/{info.version}"
    exports: dict[str, Path | str] = {}
    for precision in PRECISIONS:
        path = info.export_path("onnx", precision)
        if path is not None:
            exports[precision] = Path(path)
            continue
        hint = f"visionloop export {ref} --precision {precision}"
        report = info.export_report("onnx", precision)
        if report is None:
            exports[precision] = f"no onnx {precision} export; make one with `{hint}`"
        else:
            exports[precision] = _reason(report, precision, hint) or (
                f"onnx {precision} export's {ONNX_FILE} is missing or changed since its gate passed; "
                f"re-export it (`{hint}`)"
            )
    weights = Path(info.dir) / WEIGHTS_FILE
    return BenchTarget(
        label=ref,
        card=info.card(),
        weights=weights if weights.is_file() else None,
        onnx=exports,
        dataset=dataset or _lineage_dataset(info) or dataset_from_spec(Path(info.dir)),
        name=info.name,
        version=info.version,
        verify_weights=info.verified_weights,
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
