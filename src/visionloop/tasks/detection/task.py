"""Object detection: per image, a list of boxes with class labels.

Imports stay light (no torch at import time): the inference server uses the serving half of
this task (`answer`, numpy only). The training half imports its modules when first called.

Frames and labels, everywhere in the task:
- every image is letterboxed to S x S (S = `data.image_size`; the model card's `Letterbox`),
  and a sample's boxes are xyxy in those input pixels; each target carries its letterbox
  `scale`, by which the evaluators divide to measure in stored-image pixels;
- labels are 0-based dataset class indices, except inside the torchvision-API model, which
  counts background as 0: `train_loss` adds 1 on the way in, `eval_forward` subtracts 1 on
  the way out.

The model's input size S reaches `build_model` as `image_size`: the trainer passes
`data.image_size`, `load_model` the card's input side (`model.kwargs.image_size`, when a
caller gives no `image_size`, stands in for it and must agree with it otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from visionloop.core.errors import SpecError, TrainingError
from visionloop.tasks.base import LossFn, Task
from visionloop.tasks.drift_outputs import DriftOutputs, UncertaintyInputs
from visionloop.tasks.evaluation import Evaluator
from visionloop.tasks.export_seams import EmbeddingLayer, ExportComparison, OutputScorer
from visionloop.tasks.registry import register_task
from visionloop.tasks.serving import Answer, AnswerOptions, Arrays, ImageContext
from visionloop.tasks.summaries import DatasetSummary, SummaryTable

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from visionloop.data.ingest_options import IngestOptions, IngestReport, ProgressFn
    from visionloop.data.manifest import DatasetManifest, SplitName
    from visionloop.data.shards import Record, ShardReader
    from visionloop.models import ModelCard
    from visionloop.specs import TrainSpec
    from visionloop.tasks.detection.stats import DetectionStats


def sum_losses(losses: Mapping[str, torch.Tensor], _targets: Any = None) -> torch.Tensor:
    """A torchvision detector's loss dict → the scalar to back-propagate (their sum, in the
    dict's order, so the sum is the same on every run)."""
    values = list(losses.values())
    if not values:
        raise TrainingError("the detector returned no losses in training mode; check model.kwargs")
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def _image_size(kwargs: Mapping[str, Any], image_size: int | None) -> tuple[int, dict[str, Any]]:
    kw = dict(kwargs)
    given = kw.pop("image_size", None)
    if image_size is not None and given is not None and int(given) != int(image_size):
        raise SpecError(
            f"model.kwargs.image_size is {given} but the images are {image_size}x{image_size}; "
            f"drop model.kwargs.image_size or set it to data.image_size ({image_size})"
        )
    size = image_size if image_size is not None else given
    if size is None:
        raise SpecError(
            "a detector needs its input size: pass image_size (the trainer passes data.image_size), "
            "or set model.kwargs.image_size (e.g. image_size: 320)"
        )
    return int(size), kw


# The digits the detection demo draws (`demo_source`).
DEMO_CLASSES = (0, 1, 2, 3, 4)


@register_task("detection")
class DetectionTask(Task):
    """Boxes with class labels; torchvision's detection model API (`archs.build_detector`)."""

    primary_metric = "mAP"
    primary_mode = "max"
    output_names = ("boxes", "scores", "labels")
    image_endpoint = "detect"
    metric_label = "mAP"
    model_normalizes = True
    # How export reports name `GateMeasurement.agreement` (see evaluate.DetectionComparison).
    agreement_label = "matched boxes (IoU ≥ 0.99)"
    # Matched boxes (IoU >= 0.99) are fp32's parity check only: fp16 and int8 move a box by a
    # fraction of a pixel, often enough past 0.99 IoU on small objects; the mAP gate judges
    # them. (The demo's int8 detector matched 6.7% of boxes at 0.99 IoU and lost 1.2 mAP points.)
    parity_limits = MappingProxyType({"fp32": (1e-3, 0.99), "fp16": (None, 0.0), "int8": (None, 0.0)})
    example_arch = "native_detector"
    example_image_size = 64
    # Each record's boxes (`boxes.encode_boxes`); its label is the number of boxes.
    record_fields = ("boxes",)
    # The annotation formats `annotations` reads, with the spellings it also takes.
    source_formats = ("coco", "yolo", "voc", "label_studio", "labelstudio", "label-studio", "pascal_voc")
    labelling_module = "visionloop.tasks.detection.labelling"
    label_quality_module = "visionloop.tasks.detection.label_quality"

    # ------------------------------------------------------------------ ingest
    def claims_source(self, path: Path) -> bool:
        from visionloop.tasks.detection.ingest_support import is_detection_source

        return is_detection_source(path)

    def ingest(
        self, source: Path, out: Path, options: IngestOptions, progress: ProgressFn | None = None
    ) -> IngestReport:
        from visionloop.tasks.detection.ingest import ingest_detection

        return ingest_detection(source, out, options, progress)

    def record_classes(self, record: Record) -> tuple[int, ...]:
        from visionloop.tasks.detection import versions

        return versions.record_classes(record)

    def remap_classes(self, record: Record, mapping: Sequence[int]) -> Record:
        from visionloop.tasks.detection import versions

        return versions.remap_classes(record, mapping)

    def version_stats(
        self,
        classes: Sequence[str],
        records: Sequence[tuple[SplitName, Record]],
        parent: DatasetManifest,
        incoming: DatasetManifest,
    ) -> dict[str, Any] | None:
        from visionloop.tasks.detection import versions

        return versions.version_stats(classes, records, parent, incoming)

    def dataset_stats(self, manifest: DatasetManifest) -> DetectionStats | None:
        from visionloop.core.errors import DataError
        from visionloop.tasks.detection.stats import DetectionStats

        if manifest.task_stats is None:
            return None
        try:
            return DetectionStats.model_validate(manifest.task_stats)
        except ValueError as e:  # pydantic's ValidationError
            raise DataError(
                f"the dataset's task_stats are not detection statistics ({e}); re-run "
                "`visionloop data ingest`."
            ) from e

    def dataset_summary(self, manifest: DatasetManifest) -> DatasetSummary | None:
        stats = self.dataset_stats(manifest)
        if stats is None:
            return None
        return _summary(manifest, stats)

    # ------------------------------------------------------------------ data
    def example_source(self, out_dir: Path, n_images: int, *, seed: int = 0) -> Path:
        """`n_images` rendered handwritten digits 0-2 (64x64, up to two per image, COCO json
        + PNGs: `synthetic`); ingest splits off the val images."""
        from visionloop.tasks.detection.synthetic import generate_detection_dataset

        generate_detection_dataset(
            out_dir, n_images, image_size=64, seed=seed, classes=(0, 1, 2), max_objects=2, digit_size=(16, 30)
        )
        return out_dir

    def demo_source(self, out_dir: Path, n_train: int, n_val: int, *, image_size: int) -> Path:
        """Digit scenes of five classes (0-4) as COCO, val in handwriting training never
        shows: the demo's budget (under 5 minutes on 2 cores) reaches mAP50 >= 0.9 on five
        classes; ten need about twice the training (BENCHMARKS.md)."""
        from visionloop.tasks.detection.synthetic import write_coco_source

        return write_coco_source(out_dir, n_train, n_val, image_size=image_size, classes=DEMO_CLASSES)

    def train_dataset(self, reader: ShardReader, spec: TrainSpec) -> Dataset[Any]:
        from visionloop.data.manifest import read_manifest
        from visionloop.tasks.detection.data import ShardDetectionDataset
        from visionloop.tasks.detection.transforms import DetectionTrainTransform

        _check_spec(self, spec, reader)
        t = DetectionTrainTransform(size=spec.data.image_size, augment=spec.data.augment, seed=spec.seed)
        return ShardDetectionDataset(reader, t, read_manifest(spec.data.dataset).classes)

    def eval_dataset(self, reader: ShardReader, spec: TrainSpec) -> Dataset[Any]:
        from visionloop.data.manifest import read_manifest
        from visionloop.tasks.detection.data import ShardDetectionDataset
        from visionloop.tasks.detection.transforms import DetectionEvalTransform

        _check_spec(self, spec, reader)
        t = DetectionEvalTransform(spec.data.image_size)
        return ShardDetectionDataset(reader, t, read_manifest(spec.data.dataset).classes)

    def collate(self, samples: list[Any]) -> tuple[torch.Tensor, Any]:
        """Images (all S x S) stacked into (N, 3, S, S); targets stay a list of dicts."""
        import torch

        images = torch.stack([image for image, _ in samples])
        return images, [target for _, target in samples]

    def targets_to(self, targets: Any, device: torch.device) -> Any:
        import torch

        return [
            {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in t.items()}
            for t in targets
        ]

    def record_targets(
        self, records: Sequence[Record], *, image_size: int | None = None
    ) -> list[dict[str, Any]]:
        """The targets of raw records as the eval dataset makes them: boxes in the pixels of
        the image letterboxed to `image_size` (the card's input side), with the scale.

        `image_size` is required for detection; the base contract has no such argument, so
        a caller that does not pass it gets an error that says so, not targets in a
        different frame than the model's boxes."""
        if image_size is None:
            raise SpecError(
                "detection targets depend on the model's input size: call "
                "record_targets(records, image_size=card.input_size[1])"
            )
        from visionloop.tasks.detection.data import record_target

        # Ignored (crowd, difficult) boxes stay in the targets, flagged, as the eval dataset
        # keeps them: the export gate and bench score mAP by the same rule as training's eval.
        return [record_target(r, image_size) for r in records]

    # ------------------------------------------------------------------ model
    def build_model(
        self,
        arch: str,
        class_names: Sequence[str],
        *,
        pretrained: Path | bytes | None = None,
        kwargs: Mapping[str, Any],
        image_size: int | None = None,
        pretrained_backbone: Path | None = None,
    ) -> nn.Module:
        """`archs.build_detector(arch, len(class_names), image_size=S, ...)`. S is `image_size`
        when given (the trainer's `data.image_size`, the card's input side), else
        `kwargs["image_size"]`; the rest of `kwargs` goes to the architecture."""
        from visionloop.tasks.detection.archs import build_detector

        size, kw = _image_size(kwargs, image_size)
        return build_detector(
            arch,
            len(class_names),
            image_size=size,
            pretrained=pretrained,
            weights_backbone=pretrained_backbone,
            **kw,
        )

    def check_output(self, outputs: Any, class_names: Sequence[str]) -> str | None:
        if not isinstance(outputs, list | tuple) or len(outputs) != 1 or not isinstance(outputs[0], Mapping):
            return f"returned {type(outputs).__name__} for one image, expected a list of one dict"
        d = outputs[0]
        missing = [k for k in ("boxes", "scores", "labels") if k not in d]
        if missing:
            return f"returned a dict without {missing} (expected boxes, scores, labels)"
        boxes, scores, labels = (tuple(getattr(d[k], "shape", ())) for k in ("boxes", "scores", "labels"))
        if len(boxes) != 2 or boxes[1] != 4 or scores != boxes[:1] or labels != boxes[:1]:
            return f"returned boxes {boxes}, scores {scores}, labels {labels}; expected (K, 4), (K,), (K,)"
        return None

    def loss_fn(self, spec: TrainSpec) -> LossFn:
        return sum_losses

    def train_loss(
        self, model: nn.Module, images: torch.Tensor, targets: Any, loss_fn: LossFn
    ) -> torch.Tensor:
        # torchvision's detectors count background as class 0.
        model_targets = [{"boxes": t["boxes"], "labels": t["labels"] + 1} for t in targets]
        return loss_fn(model(list(images), model_targets), targets)

    def eval_forward(
        self, model: nn.Module, images: torch.Tensor, targets: Any, loss_fn: LossFn
    ) -> tuple[Any, float]:
        out = model(list(images))
        # The input image rides along (a view, no copy) so the evaluator can draw a few.
        dets = [
            {"boxes": d["boxes"], "scores": d["scores"], "labels": d["labels"] - 1, "image": image}
            for d, image in zip(out, images, strict=True)
        ]
        return dets, 0.0

    def image_result(self, outputs: Any, targets: Any) -> tuple[Any, Any]:
        # The input image rides along in the outputs for drawing; a kept result needs only
        # the boxes to be scored again.
        kept = [{k: v for k, v in d.items() if k != "image"} for d in outputs]
        return super().image_result(kept, targets)

    def repeated_targets(self, targets: Any, copy: int) -> Any:
        # The evaluator refuses an image_id given twice (a padded distributed sampler); a
        # bootstrap repeat is another image to it.
        if copy == 0:
            return targets
        return [{k: v for k, v in t.items() if k != "image_id"} for t in targets]

    def evaluator(self, class_names: Sequence[str]) -> Evaluator:
        from visionloop.tasks.detection.evaluate import DetectionTaskEvaluator

        return DetectionTaskEvaluator(class_names)

    def model_card(
        self,
        manifest: DatasetManifest,
        spec: TrainSpec,
        *,
        mean: Sequence[float],
        std: Sequence[float],
        metrics: Mapping[str, float],
        run_uid: str | None,
    ) -> ModelCard:
        from visionloop.models import ModelCard

        size = spec.data.image_size
        kwargs = dict(spec.model.kwargs)
        kwargs.pop("image_size", None)  # the card's input_size says it
        # Built directly: ModelCard.from_manifest consults the classification arch registry.
        return ModelCard(
            task="detection",
            arch=spec.model.arch,
            model_kwargs=kwargs,
            num_classes=manifest.num_classes,
            class_names=list(manifest.classes),
            input_size=(3, size, size),
            mean=tuple(mean),
            std=tuple(std),
            crop_pct=1.0,
            interpolation="bilinear",  # what Letterbox resizes with in the eval dataset
            alpha_background=manifest.image_policy.alpha_background,
            resize="letterbox",
            dataset_version=manifest.version,
            metrics={k: float(v) for k, v in metrics.items() if "/" not in k},
            run_uid=run_uid,
        )

    # ------------------------------------------------------------------ export
    def export_module(self, model: nn.Module) -> nn.Module:
        from visionloop.tasks.detection.export import export_module

        return export_module(model)

    def embedding_layer(self, module: nn.Module) -> EmbeddingLayer | None:
        # The native detector: its backbone's deepest features (stage 4, stride 32), averaged
        # over the image. torchvision's detectors export their network inside an ONNX Loop over
        # the images (`export.BatchLoop`), which a second output cannot leave: none for them.
        from visionloop.tasks.detection.export import NativeExport

        if isinstance(module, NativeExport):
            return EmbeddingLayer(module.model.stage4, "output")
        return None

    def export_comparison(self) -> ExportComparison:
        from visionloop.tasks.detection.evaluate import DetectionComparison

        return DetectionComparison()

    def output_scorer(self) -> OutputScorer:
        from visionloop.tasks.detection.evaluate import MapScorer

        return MapScorer()

    # ------------------------------------------------------------------ serving (numpy only)
    def postprocess(self, outputs: Arrays, class_names: Sequence[str], *, top_k: int) -> list[Answer]:
        from visionloop.tasks.detection import answer

        return answer.detections(outputs, class_names, options=AnswerOptions(top_k=top_k))

    def served_answer(
        self,
        outputs: Arrays,
        class_names: Sequence[str],
        *,
        options: AnswerOptions,
        image: ImageContext | None = None,
    ) -> dict[str, Any]:
        from visionloop.tasks.detection import answer

        return answer.served(outputs, class_names, options=options, image=image)

    def calibration_logits(self, outputs: Any, targets: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        # Each detection is a binary event, right or wrong: logits [0, logit(score)] and 1 when
        # it is a true positive at IoU 0.5 (tasks/detection/calibration.py).
        from visionloop.tasks.detection.calibration import calibration_pairs

        return calibration_pairs(outputs, targets)

    def calibrate(self, outputs: Arrays, temperature: float) -> Arrays:
        # sigmoid(logit(score) / T): the ranking (so mAP) stays, the scores move.
        from visionloop.tasks.detection.calibration import scaled_scores

        return {**outputs, "scores": scaled_scores(outputs["scores"], temperature)}

    def drift_outputs(self, outputs: Arrays, class_names: Sequence[str]) -> DriftOutputs:
        from visionloop.tasks.detection import answer

        return answer.drift_outputs(outputs)

    def uncertainty_inputs(self, outputs: Arrays, class_names: Sequence[str]) -> UncertaintyInputs:
        from visionloop.tasks.detection import answer

        return answer.uncertainty_inputs(outputs)

    def log_fields(self, outputs: Arrays, class_names: Sequence[str]) -> list[dict[str, Any]]:
        from visionloop.tasks.detection import answer

        return answer.log_fields(outputs, class_names)

    def agreement(self, a: Arrays, b: Arrays) -> np.ndarray:
        from visionloop.tasks.detection import answer

        return answer.agreement(a, b)


def _check_spec(task: Task, spec: TrainSpec, reader: ShardReader) -> None:
    # A split without boxes (ingested from an ImageFolder) is refused by check_records, which
    # names the fields the records have and the ones a detector reads.
    task.check_records(reader)
    _image_size(spec.model.kwargs, spec.data.image_size)


def _summary(manifest: DatasetManifest, stats: DetectionStats) -> DatasetSummary:
    """Per class and split: boxes, and images containing the class; then background images
    and boxes by size."""
    from visionloop.tasks.detection.stats import SPLIT_NAMES

    det = stats.splits
    splits = [s for s in SPLIT_NAMES if s in det and det[s].images]
    boxes = sum(sum(s.instances.values()) for s in det.values())
    background = sum(s.background_images for s in det.values())
    rows: list[tuple[str, ...]] = []
    for cls in manifest.classes:
        counts = [det[s].instances.get(cls, 0) for s in splits]
        images = [manifest.splits[s].per_class.get(cls, 0) if s in manifest.splits else 0 for s in splits]
        cells = [f"{b:,} ({n:,})" for b, n in zip(counts, images, strict=True)]
        rows.append((cls, *cells, f"{sum(counts):,} ({sum(images):,})"))
    rows.append(
        (
            "background",
            *(f"({det[s].background_images:,})" for s in splits),
            f"({sum(det[s].background_images for s in splits):,})",
        )
    )
    sizes = [det[s].box_sizes for s in splits]
    rows.append(
        (
            "small/medium/large",
            *(f"{z.small}/{z.medium}/{z.large}" for z in sizes),
            f"{sum(z.small for z in sizes)}/{sum(z.medium for z in sizes)}/{sum(z.large for z in sizes)}",
        )
    )
    table = SummaryTable(
        title="boxes (images) per split and class",
        columns=("class", *splits, "total"),
        rows=tuple(rows),
        footer=(
            "images",
            *(f"{det[s].images:,}" for s in splits),
            f"{sum(det[s].images for s in splits):,}",
        ),
    )
    return DatasetSummary(
        headline=f"with {boxes:,} boxes",
        lines=(
            ("background", f"{background:,} images with no box (kept)"),
            ("clipped", f"{stats.clipped_boxes:,} boxes clipped to the image edges (kept)"),
        ),
        table=table,
    )
