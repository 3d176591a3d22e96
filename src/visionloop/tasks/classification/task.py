"""Image classification: one integer label per image, a model that returns logits.

Imports stay light (no torch at import time): the inference server uses the serving half of
this task. The training half imports its modules when first called.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from visionloop.core.errors import SpecError
from visionloop.tasks.base import LossFn, Task
from visionloop.tasks.classification import answer
from visionloop.tasks.drift_outputs import DriftOutputs, UncertaintyInputs
from visionloop.tasks.evaluation import Evaluator
from visionloop.tasks.export_seams import EmbeddingLayer, ExportComparison, OutputScorer
from visionloop.tasks.registry import register_task
from visionloop.tasks.serving import Answer, AnswerOptions, Arrays, ImageContext

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from visionloop.data.ingest_options import IngestOptions, IngestReport, ProgressFn
    from visionloop.data.manifest import DatasetManifest
    from visionloop.data.shards import Record, ShardReader
    from visionloop.models import ModelCard
    from visionloop.specs import TrainSpec


@register_task("classification")
class ClassificationTask(Task):
    """One integer label per image; the model returns logits (N, num_classes)."""

    primary_metric = "accuracy"
    primary_mode = "max"
    output_names = ("logits",)
    image_endpoint = "classify"
    labelling_module = "visionloop.tasks.classification.labelling"
    label_quality_module = "visionloop.tasks.classification.label_quality"
    labels_from_embeddings = True
    metric_label = "top-1"
    example_arch = "small_cnn"
    example_image_size = 16
    # An ImageFolder or CSV has no layout marker of its own: whatever no other task claims is
    # read as one, and `list_source` says what is wrong with a source that is neither.
    ingest_fallback = True

    # ------------------------------------------------------------------ ingest
    def ingest(
        self, source: Path, out: Path, options: IngestOptions, progress: ProgressFn | None = None
    ) -> IngestReport:
        from visionloop.data.ingest import ingest_images

        return ingest_images(source, out, options, progress)

    # ------------------------------------------------------------------ data
    def example_source(self, out_dir: Path, n_images: int, *, seed: int = 0) -> Path:
        """scikit-learn's bundled 8x8 digits (upscaled to 16x16), `n_images` of them in
        `train/<digit>/` and `val/<digit>/` folders (every fourth image to val)."""
        from PIL import Image
        from sklearn.datasets import load_digits

        digits = load_digits()
        order = np.random.default_rng(seed).permutation(len(digits.target))[:n_images]
        pixels = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
        for k, i in enumerate(order):
            folder = out_dir / ("val" if k % 4 == 3 else "train") / str(int(digits.target[i]))
            folder.mkdir(parents=True, exist_ok=True)
            pic = Image.fromarray(pixels[i], mode="L").resize((16, 16), Image.Resampling.NEAREST)
            pic.save(folder / f"{int(i):04d}.png")
        return out_dir

    def train_dataset(self, reader: ShardReader, spec: TrainSpec) -> Dataset[Any]:
        from visionloop.tasks.classification.data import ShardClassificationDataset
        from visionloop.tasks.classification.transforms import TrainTransform

        self.check_records(reader)
        t = TrainTransform(size=spec.data.image_size, augment=spec.data.augment, seed=spec.seed)
        return ShardClassificationDataset(reader, t)

    def eval_dataset(self, reader: ShardReader, spec: TrainSpec) -> Dataset[Any]:
        from visionloop.tasks.classification.data import ShardClassificationDataset
        from visionloop.tasks.classification.transforms import EvalTransform

        self.check_records(reader)
        return ShardClassificationDataset(reader, EvalTransform(spec.data.image_size, spec.data.crop_pct))

    def record_targets(self, records: Sequence[Record], *, image_size: int | None = None) -> torch.Tensor:
        import torch

        return torch.tensor([r["label"] for r in records], dtype=torch.int64)

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
        from visionloop.models import create_model

        if pretrained_backbone is not None:
            raise SpecError(
                "model.pretrained_backbone is for detectors; a classifier loads an ImageNet checkpoint "
                "through model.pretrained (its head is skipped when the classes differ)"
            )
        # A classifier's head does not depend on the image size (adaptive pooling).
        return create_model(arch, len(class_names), pretrained=pretrained, **kwargs)

    def check_output(self, outputs: Any, class_names: Sequence[str]) -> str | None:
        shape = tuple(getattr(outputs, "shape", ()))
        expected = (1, len(class_names))
        if shape != expected:
            return f"returned shape {shape} for one image, expected {expected}"
        return None

    def loss_fn(self, spec: TrainSpec) -> LossFn:
        from torch import nn

        return nn.CrossEntropyLoss(label_smoothing=spec.loss.label_smoothing)

    def evaluator(self, class_names: Sequence[str]) -> Evaluator:
        from visionloop.tasks.classification.evaluate import ClassificationEvaluator

        return ClassificationEvaluator(class_names)

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
        size = spec.data.image_size
        from visionloop.models import ModelCard

        return ModelCard.from_manifest(
            manifest,
            arch=spec.model.arch,
            model_kwargs=dict(spec.model.kwargs),
            input_size=(3, size, size),
            mean=tuple(mean),
            std=tuple(std),
            crop_pct=spec.data.crop_pct,
            # EvalTransform resizes bilinearly whatever the architecture's habit; the card must
            # describe what the reported metrics were measured with.
            interpolation="bilinear",
            metrics={k: float(v) for k, v in metrics.items() if "/" not in k},
            run_uid=run_uid,
        )

    # ------------------------------------------------------------------ export
    def embedding_layer(self, module: nn.Module) -> EmbeddingLayer | None:
        # The input of the classifier's last linear layer: the pooled features the head
        # separates the classes with (native archs name it `fc`; torchvision's resnets `fc`,
        # mobilenets and efficientnets `classifier[-1]`, ViT `heads.head`: the last Linear in
        # registration order for each).
        from torch import nn as tnn

        linear = [m for m in module.modules() if isinstance(m, tnn.Linear)]
        return EmbeddingLayer(linear[-1], "input") if linear else None

    def export_comparison(self) -> ExportComparison:
        from visionloop.tasks.classification.evaluate import ClassificationComparison

        return ClassificationComparison()

    def output_scorer(self) -> OutputScorer:
        from visionloop.tasks.classification.evaluate import TopOneScorer

        return TopOneScorer()

    # ------------------------------------------------------------------ serving
    def postprocess(self, outputs: Arrays, class_names: Sequence[str], *, top_k: int) -> list[Answer]:
        scores = _logits(outputs)
        return [answer.top_k(row, class_names, top_k) for row in scores]

    def served_answer(
        self,
        outputs: Arrays,
        class_names: Sequence[str],
        *,
        options: AnswerOptions,
        image: ImageContext | None = None,
    ) -> dict[str, Any]:
        # The top-k classes; with a score threshold, only those whose probability reaches it.
        # The image's size does not change a class.
        preds = answer.top_k(_logits(outputs)[0], class_names, 5 if options.top_k is None else options.top_k)
        if options.score_threshold is not None:
            preds = [p for p in preds if p["score"] >= options.score_threshold]
        return {"predictions": preds}

    def calibration_logits(self, outputs: Any, targets: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        # The classifier's outputs are its logits, its targets the class indices.
        return outputs, targets

    def calibrate(self, outputs: Arrays, temperature: float) -> Arrays:
        # softmax(logits / T): the top class stays, its confidence moves.
        key = "logits" if "logits" in outputs else next(iter(outputs))
        return {**outputs, key: outputs[key] / np.float32(temperature)}

    def drift_outputs(self, outputs: Arrays, class_names: Sequence[str]) -> DriftOutputs:
        return answer.drift_outputs(_logits(outputs), class_names)

    def uncertainty_inputs(self, outputs: Arrays, class_names: Sequence[str]) -> UncertaintyInputs:
        return answer.uncertainty_inputs(_logits(outputs))

    def log_fields(self, outputs: Arrays, class_names: Sequence[str]) -> list[dict[str, Any]]:
        return answer.log_fields(_logits(outputs), class_names)

    def agreement(self, a: Arrays, b: Arrays) -> np.ndarray:
        top_a, _ = answer.top1(_logits(a))
        top_b, _ = answer.top1(_logits(b))
        return np.asarray(top_a == top_b)


def _logits(outputs: Arrays) -> npt.NDArray[Any]:
    # A model exported by visionloop names its output "logits"; one registered from elsewhere
    # may name it otherwise, and a classifier has exactly one output either way.
    if "logits" in outputs:
        return outputs["logits"]
    return next(iter(outputs.values()))
