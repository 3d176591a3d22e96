"""The contract between the task-agnostic stages and a task (classification, detection, ...).

A task decides everything that depends on what is being predicted: what a sample's target is
(an integer label, a list of boxes), how samples are batched and augmented, how the model and
its head are built and what its output must look like, the loss, what an evaluation measures
and which metric is primary, how the model is exported and how an export is compared with
eager PyTorch, how raw outputs become an answer, and what the prediction log records.

The stages (train, export, bench, serve, track, the CLI) only move data and call these
methods; they find the task by the name recorded in the dataset manifest or the model card:

>>> from visionloop.tasks import get_task
>>> task = get_task(manifest.task)
>>> model = task.build_model(spec.model.arch, manifest.classes, kwargs=spec.model.kwargs)
>>> evaluator = task.evaluator(manifest.classes)
>>> evaluator.reset(); evaluator.update(outputs, targets, loss_sum); evaluator.compute()

Adding a task adds a subpackage `tasks/<name>/` with a `Task` subclass decorated with
`@register_task("<name>")`; no stage is touched. Data ingest finds the task too: the one whose
`claims_source` recognises the source, or that reads the `--format` asked for
(`source_formats`), builds the dataset with its `ingest`; its shard records carry the extra
bytes fields it declares (`record_fields`), and the manifest its statistics (`task_stats`,
read back with `dataset_stats`). Shapes to keep in mind while implementing:

- targets may be a tensor (classification: (N,) int64) or anything else the task's `collate`
  makes (detection: a list of {"boxes", "labels"} dicts); the stages only hand them back to the
  task (`targets_to`, the loss, the evaluator, the export comparison);
- outputs may be one tensor or several (detection: boxes, scores, labels); exported models name
  each (`output_names`), and served outputs arrive as a name → array mapping;
- metrics may need every prediction before computing (mAP): the evaluator streams `update`
  calls and computes once, and its state crosses DDP ranks through `state`/`load_state`.

The types these methods take and return live beside this module, each named for what it is:
`tasks.evaluation` (`Evaluator`, `EvalResult`, `ErrorAnalysis`), `tasks.export_seams`
(`ExportComparison`, `GateMeasurement`, `OutputScorer`, `EmbeddingLayer`), `tasks.serving`
(`Arrays`, `Answer`, `AnswerOptions`, `ImageContext`), `tasks.summaries` (`DatasetSummary`,
`SummaryTable`), `tasks.labels`, `tasks.drift_outputs` and `tasks.label_issues`; the package
(`visionloop.tasks`) re-exports the common ones.

This module imports neither torch nor numpy at run time: the inference server uses the serving
half of the contract without either training library.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from visionloop.core.errors import DataError
from visionloop.tasks.evaluation import Evaluator
from visionloop.tasks.export_seams import EmbeddingLayer, ExportComparison, OutputScorer
from visionloop.tasks.labels import ImageLabels, LabelledImage
from visionloop.tasks.serving import Answer, AnswerOptions, Arrays, ImageContext
from visionloop.tasks.summaries import DatasetSummary

if TYPE_CHECKING:
    import numpy as np
    import torch
    from pydantic import BaseModel
    from torch import nn
    from torch.utils.data import Dataset

    from visionloop.data.ingest_options import IngestOptions, IngestReport, ProgressFn
    from visionloop.data.manifest import DatasetManifest, SplitName
    from visionloop.data.shards import Record, ShardReader
    from visionloop.models import ModelCard
    from visionloop.specs import TrainSpec
    from visionloop.tasks.drift_outputs import DriftOutputs, UncertaintyInputs
    from visionloop.tasks.label_issues import ImageLabelIssue

# (model outputs, targets) -> scalar loss. Outputs and targets are whatever the task's model
# returns and its collate makes.
LossFn = Callable[[Any, Any], "torch.Tensor"]


class Task(ABC):
    """One task. Stateless: `get_task(name)` hands out one shared instance."""

    name: ClassVar[str]
    # The metric that decides "best" (logged as val/<primary_metric>) and its direction.
    primary_metric: ClassVar[str]
    primary_mode: ClassVar[Literal["max", "min"]] = "max"
    # The names of the exported model's outputs, in the order the export wrapper returns them.
    output_names: ClassVar[tuple[str, ...]]
    # The image endpoint's last path segment: POST /v2/models/NAME/<image_endpoint>.
    image_endpoint: ClassVar[str]
    # How reports and bench tables name the gate metric ("top-1", "mAP"), and what the
    # export's agreement counts ("top-1 agreement", "matched boxes (IoU ≥ 0.99)").
    metric_label: ClassVar[str]
    agreement_label: ClassVar[str] = "top-1 agreement"
    # An export's parity with eager PyTorch, per precision: (the largest raw-output difference
    # allowed, or None for no limit; the least agreement). The gate on the primary metric
    # applies at every precision besides. Defaults: a classifier's logits and top-1.
    parity_limits: ClassVar[Mapping[str, tuple[float | None, float]]] = MappingProxyType(
        {"fp32": (1e-3, 0.99), "fp16": (0.1, 0.98), "int8": (None, 0.90)}
    )
    # True when the model normalises its own input (torchvision's detectors do): the trainer
    # then hands it images scaled to [0, 1] only, and the model card says mean 0, std 1.
    model_normalizes: ClassVar[bool] = False
    # A small architecture and input size that train on a CPU in seconds, on the data that
    # `example_source` writes: what the contract tests over every task use.
    example_arch: ClassVar[str] = ""
    example_image_size: ClassVar[int] = 32
    # The extra fields of this task's shard records, in order after image/label/index: opaque
    # bytes that the task encodes at ingest and decodes in its datasets (detection: "boxes").
    # At most `shardcheck.MAX_EXTRA_FIELDS`, each a lowercase identifier.
    record_fields: ClassVar[tuple[str, ...]] = ()
    # The `--format` names (lowercase, aliases included) of the sources this task's ingest reads.
    source_formats: ClassVar[tuple[str, ...]] = ()
    # True for the one task that ingests a source no other task claims (classification: an
    # ImageFolder or CSV); its own ingest then says what it could not read.
    ingest_fallback: ClassVar[bool] = False

    # ------------------------------------------------------------------ ingest
    def claims_source(self, path: Path) -> bool:
        """True when `path` has the layout of a source this task ingests. Cheap (a few stats
        and at most a file's first bytes) and never raises for a missing or odd path."""
        return False

    def ingest(
        self, source: Path, out: Path, options: IngestOptions, progress: ProgressFn | None = None
    ) -> IngestReport:
        """Build this task's dataset at `out` from `source` (`options.format`, when given, is one
        of `source_formats`): shards whose records carry `record_fields`, and a manifest naming
        this task. Same guarantees as `visionloop.data.ingest.ingest`."""
        raise NotImplementedError(f"task {self.name!r} has no ingest; implement Task.ingest")

    def dataset_stats(self, manifest: DatasetManifest) -> BaseModel | None:
        """The manifest's `task_stats` parsed with this task's own model (None: it keeps none)."""
        return None

    def dataset_summary(self, manifest: DatasetManifest) -> DatasetSummary | None:
        """What the CLI shows of the dataset beyond image counts (None: nothing more)."""
        return None

    # ------------------------------------------------------------------ dataset versions
    # `visionloop data add` merges a parent version's records with a new source's without
    # decoding the images; these say what a record's labels are. The defaults read the one
    # class in `label` (a single-label task); a task whose labels live elsewhere overrides them.
    def record_classes(self, record: Record) -> tuple[int, ...]:
        """The class indices a stored record is labelled with (what `per_class` counts)."""
        return (int(record["label"]),)

    def remap_classes(self, record: Record, mapping: Sequence[int]) -> Record:
        """`record` with each class index i replaced by mapping[i]: a new version keeps its
        parent's class list, while its source numbered the classes it has by itself."""
        from visionloop.data.shards import extra_fields, make_record

        return make_record(
            record["image"], mapping[int(record["label"])], record["index"], **extra_fields(record)
        )

    def version_stats(
        self,
        classes: Sequence[str],
        records: Sequence[tuple[SplitName, Record]],
        parent: DatasetManifest,
        incoming: DatasetManifest,
    ) -> dict[str, Any] | None:
        """The new version's `task_stats` (as JSON) over its `records` (split, record), from
        what the parent's and the incoming source's manifests say of what records do not hold
        (boxes dropped at ingest, ...). None: the task keeps none."""
        return None

    # ------------------------------------------------------------------ data
    def example_source(self, out_dir: Path, n_images: int, *, seed: int = 0) -> Path:
        """Write a small labelled source of this task that `visionloop data ingest` reads,
        generated in the process (no download), with a train and a val split; return the path
        to ingest. The contract tests run every registered task on one."""
        raise NotImplementedError(f"task {self.name!r} has no example source; implement example_source")

    def demo_source(self, out_dir: Path, n_train: int, n_val: int, *, image_size: int) -> Path:
        """Write the source `visionloop demo --task NAME` ingests: `n_train` and `n_val`
        generated images (no download) whose val split is hard enough to mean something;
        return the path to ingest. Only tasks with a demo implement it."""
        raise NotImplementedError(f"task {self.name!r} has no demo source; implement demo_source")

    @abstractmethod
    def train_dataset(self, reader: ShardReader, spec: TrainSpec) -> Dataset[Any]:
        """Shard records → (uint8 image, target) samples, augmented per (seed, epoch, sample).
        Refuses shards whose records lack this task's fields (`check_records`)."""

    @abstractmethod
    def eval_dataset(self, reader: ShardReader, spec: TrainSpec) -> Dataset[Any]: ...

    def check_records(self, reader: ShardReader) -> None:
        """DataError unless the shards' records carry exactly `record_fields` (a dataset
        ingested for another task): what `train_dataset` and `eval_dataset` call first."""
        reader.require_fields(self.record_fields, task=self.name)

    def collate(self, samples: list[Any]) -> tuple[torch.Tensor, Any]:
        """A list of samples → (images (N, C, H, W), targets). Default: torch's default collate,
        right for tensor targets; a task with per-image lists of boxes overrides it."""
        from torch.utils.data import default_collate

        images, targets = default_collate(samples)
        return images, targets

    def targets_to(self, targets: Any, device: torch.device) -> Any:
        """Move collated targets to `device` (a tensor by default)."""
        return targets.to(device, non_blocking=True)

    @abstractmethod
    def record_targets(self, records: Sequence[Record], *, image_size: int | None = None) -> Any:
        """The collated targets of raw shard records (the label schema ingest wrote), for
        evaluating an exported model on the records of an eval split; `image_size` is the
        model's input side, for targets that live in the input's frame (boxes)."""

    # ------------------------------------------------------------------ model
    @abstractmethod
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
        """The registered architecture `arch` with this task's head for `class_names`.
        `image_size` is the side of the square images it will see (`data.image_size`, the card's
        input size): a detector sizes its anchors or heatmap from it; a classifier may ignore it.
        `pretrained` is a whole model's weights (a file, or safetensors bytes already read),
        `pretrained_backbone` a backbone's file (a task without a separate backbone refuses it)."""

    def load_model(self, card: ModelCard, weights: Path | bytes | None) -> nn.Module:
        """The model a card describes with its trained `weights` (a safetensors or
        `weights_only` state dict file, or safetensors bytes) loaded, in eval mode: what export,
        eval and bench run. A registered version's weights come as the bytes its sha256 was
        checked on (`ModelVersionInfo.verified_weights_bytes`), so what is loaded is what was
        checked; a path would be opened again, after the check."""
        model = self.build_model(
            card.arch,
            card.class_names,
            pretrained=weights,
            kwargs=card.model_kwargs,
            image_size=card.input_size[1],
        )
        return model.eval()

    @abstractmethod
    def check_output(self, outputs: Any, class_names: Sequence[str]) -> str | None:
        """What is wrong with the outputs of one image (eval mode), or None when they are right."""

    @abstractmethod
    def loss_fn(self, spec: TrainSpec) -> LossFn: ...

    def train_loss(
        self, model: nn.Module, images: torch.Tensor, targets: Any, loss_fn: LossFn
    ) -> torch.Tensor:
        """One training forward: the scalar loss to back-propagate. Default `loss_fn(model(x), y)`;
        a model that computes its own losses from targets (torchvision's detectors:
        `model(images, targets)` → a dict of losses) overrides it."""
        return loss_fn(model(images), targets)

    def eval_forward(
        self, model: nn.Module, images: torch.Tensor, targets: Any, loss_fn: LossFn
    ) -> tuple[Any, float]:
        """One evaluation forward (eval mode, no grad): the outputs the evaluator takes, and the
        batch's summed loss (0.0 where eval mode computes none, as for torchvision's detectors)."""
        out = model(images)
        return out, float(loss_fn(out, targets)) * images.shape[0]

    @abstractmethod
    def evaluator(self, class_names: Sequence[str]) -> Evaluator: ...

    def image_result(self, outputs: Any, targets: Any) -> tuple[Any, Any]:
        """One image's (outputs, targets), from a one-image batch of `eval_forward`, as kept to
        score subsets of a split again without running the model (`visionloop eval --slices`:
        the metric per metadata value, bootstrap intervals): on the CPU, without anything the
        evaluator does not need to score. A one-image batch is a valid batch for `evaluator`'s
        `update`. Default: every tensor in them moved to the CPU."""
        return _to_cpu(outputs), _to_cpu(targets)

    def join_results(self, results: Sequence[tuple[Any, Any]]) -> tuple[Any, Any]:
        """Several kept one-image results (`image_result`'s (outputs, targets)) as one batch for
        `evaluator`'s update, in order. Default: tensors concatenated along their first (batch)
        axis, lists joined, tuples and dicts joined item by item; a task whose outputs or
        targets are shaped otherwise overrides it."""
        return _join([o for o, _ in results]), _join([t for _, t in results])

    def repeated_targets(self, targets: Any, copy: int) -> Any:
        """The targets of a kept one-image result (`image_result`) given again in the same
        evaluator pass, as its `copy`-th repeat (1, 2, ...): a bootstrap resample draws images
        with replacement. Default: unchanged; a task whose evaluator refuses an image it has
        seen (an image id given twice) makes the repeat another image."""
        return targets

    def calibration_logits(self, outputs: Any, targets: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A batch's (logits (N, C), true labels (N,)) for confidence calibration (ECE, Brier,
        temperature scaling), from `eval_forward`'s outputs and the collated targets; None for
        a task whose outputs are not one softmax over classes per image (the default)."""
        return None

    @abstractmethod
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
        """What a consumer of the final weights needs: preprocessing, labels, provenance."""

    # ------------------------------------------------------------------ export
    def export_module(self, model: nn.Module) -> nn.Module:
        """The module to export: returns a tensor or a tuple in `output_names` order. Default:
        the model itself."""
        return model

    def embedding_layer(self, module: nn.Module) -> EmbeddingLayer | None:
        """Where the penultimate-layer embedding of `module` (what `export_module` returned)
        is read: the export adds it, reduced by PCA, as an output named `EMBEDDING_OUTPUT`
        (`tasks.drift_outputs`), which drift monitoring and label selection use. None: this
        task's exports carry no embedding (the default)."""
        return None

    @abstractmethod
    def export_comparison(self) -> ExportComparison:
        """How an export is compared with eager PyTorch (parity and gate)."""

    @abstractmethod
    def output_scorer(self) -> OutputScorer:
        """The gate metric over raw host outputs (benchmarks report it per format)."""

    # ------------------------------------------------------------------ serving (numpy only)
    @abstractmethod
    def postprocess(self, outputs: Arrays, class_names: Sequence[str], *, top_k: int) -> list[Answer]:
        """Raw outputs of a batch → per image, its answer items (e.g. top-k classes with scores)."""

    def served_answer(
        self,
        outputs: Arrays,
        class_names: Sequence[str],
        *,
        options: AnswerOptions,
        image: ImageContext | None = None,
    ) -> dict[str, Any]:
        """The image endpoint's JSON body for one image (outputs of a batch of one), without
        the model name and version, which the server adds."""
        top_k = 5 if options.top_k is None else options.top_k
        return {"predictions": self.postprocess(outputs, class_names, top_k=top_k)[0]}

    def calibrate(self, outputs: Arrays, temperature: float) -> Arrays:
        """A batch's raw outputs with temperature scaling applied (`visionloop eval` fits the
        temperature), before `served_answer` and `log_fields` read confidences from them. The
        default, for a task without `calibration_logits`, leaves them as they are."""
        return outputs

    def drift_outputs(self, outputs: Arrays, class_names: Sequence[str]) -> DriftOutputs | None:
        """Per image of a batch (calibrated outputs): what drift monitoring compares with the
        version's reference (`tasks.drift_outputs`). Default: nothing, so the monitor tests
        only the image statistics."""
        return None

    def uncertainty_inputs(self, outputs: Arrays, class_names: Sequence[str]) -> UncertaintyInputs | None:
        """Per image of a batch (calibrated outputs): what label selection scores uncertainty
        from (`tasks.drift_outputs.UncertaintyInputs`). Default: nothing, so only the
        strategies that need no model uncertainty (random, k-center) apply."""
        return None

    # ------------------------------------------------------------------ labelling
    # The module that holds this task's Label Studio support (`config`, `pre_annotation`,
    # `read_labels`, `write_labelled`), imported on first use; "" when the task has none.
    labelling_module: ClassVar[str] = ""

    def _labelling(self) -> Any:
        if not self.labelling_module:
            raise DataError(f"the {self.name} task has no Label Studio support (Task.labelling_module)")
        return importlib.import_module(self.labelling_module)

    def labelling_config(self, class_names: Sequence[str]) -> str:
        """Label Studio's labelling config (XML) for this task's images and classes."""
        config: str = self._labelling().config(class_names)
        return config

    def pre_annotation(
        self, served: Mapping[str, Any], image: ImageContext
    ) -> tuple[list[dict[str, Any]], float]:
        """The served answer for one image (`served_answer`) as Label Studio result entries
        for `labelling_config`, and one score for the whole prediction."""
        result: tuple[list[dict[str, Any]], float] = self._labelling().pre_annotation(served, image)
        return result

    def read_labels(
        self, result: Sequence[Mapping[str, Any]], class_names: Sequence[str] | None
    ) -> ImageLabels | None:
        """A Label Studio annotation's result entries as this task's labels (None: the image
        is not labelled); a DataError names what is wrong with them."""
        labels: ImageLabels | None = self._labelling().read_labels(result, class_names)
        return labels

    def write_labelled(self, items: Sequence[LabelledImage], out_dir: Path) -> Path:
        """Labelled images as a source folder this task's ingest reads; returns it."""
        folder: Path = self._labelling().write_labelled(items, out_dir)
        return folder

    # The module whose `find_label_issues(results, class_names)` judges this task's labels;
    # "" when the task cannot.
    label_quality_module: ClassVar[str] = ""
    # Whether one label per image lets `label issues` judge labels from the served model's
    # embeddings (a classifier over them, no training); False: only K trainings of the model
    # (`--refit`) predict labels out of fold.
    labels_from_embeddings: ClassVar[bool] = False

    def find_label_issues(
        self, results: Sequence[tuple[Any, Any]], class_names: Sequence[str], *, top: int | None = None
    ) -> list[ImageLabelIssue]:
        """The images whose given labels their out-of-fold predictions contradict (confident
        learning), least likely first. `results` are one-image (outputs, targets) pairs as
        `image_result` keeps them, each from a model that never trained on that image; the
        findings' `item` indexes them. With `top`: the `top` least likely images, flagged or
        not (a review budget), instead of those confident learning flags."""
        if not self.label_quality_module:
            raise DataError(f"the {self.name} task cannot judge its labels (Task.label_quality_module)")
        module = importlib.import_module(self.label_quality_module)
        issues: list[ImageLabelIssue] = module.find_label_issues(results, class_names, top=top)
        return issues

    @abstractmethod
    def log_fields(self, outputs: Arrays, class_names: Sequence[str]) -> list[dict[str, Any]]:
        """Per image of a batch: what the prediction log records about the answer."""

    @abstractmethod
    def agreement(self, a: Arrays, b: Arrays) -> np.ndarray:
        """Per image: whether two models' raw outputs give the same answer (bool array); the
        shadow comparison counts it."""


def _join(values: Sequence[Any]) -> Any:
    """One-image batches as one batch (see `Task.join_results`)."""
    first = values[0]
    if hasattr(first, "detach") and hasattr(first, "cpu"):
        import torch

        return torch.cat(list(values))
    if isinstance(first, list):
        return [item for value in values for item in value]
    if isinstance(first, tuple):
        return tuple(_join([value[i] for value in values]) for i in range(len(first)))
    if isinstance(first, dict):
        return {key: _join([value[key] for value in values]) for key in first}
    raise TypeError(
        f"cannot join one-image results holding a {type(first).__name__} into a batch; "
        "override Task.join_results"
    )


def _to_cpu(value: Any) -> Any:
    """`value` with every tensor in it (nested in lists, tuples and dicts) detached and on the
    CPU; without importing torch (anything with `detach` and `cpu` is taken for a tensor)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value
