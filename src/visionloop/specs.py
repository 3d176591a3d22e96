"""User-facing spec documents, as pydantic models.

A YAML spec validates into `TrainSpec`; a bad field gets an error that names the field, the
value given and a valid example (`load_train_spec`). Specs are saved verbatim with every run.

The error messages are worded in `visionloop.spec_errors`; reading, overriding and
path-resolving a spec file is in `visionloop.spec_files`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from visionloop.core.errors import SpecError
from visionloop.core.strictbools import StrictBools
from visionloop.spec_errors import format_validation_error
from visionloop.spec_files import apply_overrides, parse_yaml_mapping, read_spec_text, resolve_paths

Precision = Literal["auto", "fp32", "bf16", "fp16"]

# Seeds go to torch, numpy and Python's random, and are combined with step counts: the range
# every one of them takes.
MAX_SEED = 2**32 - 1
# Past these a run never ends, and its step counts overflow the job store's 64-bit integers.
MAX_EPOCHS = 100_000
MAX_STEPS = 10**12


def _no_nul(v: Path | None) -> Path | None:
    # A NUL byte cannot be in a file name: the OS refuses it (Python raises ValueError).
    if v is not None and "\x00" in str(v):
        raise ValueError("holds a NUL character, which no file name can; give the file's path")
    return v


class _Spec(StrictBools):
    # Unknown keys are errors: a typo such as `batchsize` must not silently fall back to a default.
    # NaN and infinity are never a setting (`lr: .inf` trains to NaN, `warmup_epochs: .inf`
    # cannot be counted): refused as a number "should be a finite number".
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class AugmentSpec(_Spec):
    """Training-time augmentation (all randomness is seeded per sample). Classification and
    detection read the same fields; detection applies them to the boxes too (box-aware crops),
    and reads `zoom_out` and `iou_crop`, which classification ignores."""

    random_resized_crop: bool = Field(True, examples=[True])
    scale: tuple[float, float] = Field((0.35, 1.0), examples=[[0.08, 1.0]])
    ratio: tuple[float, float] = Field((3 / 4, 4 / 3), examples=[[0.75, 1.333]])
    hflip: float = Field(0.5, ge=0.0, le=1.0, examples=[0.5])
    color_jitter: float = Field(0.0, ge=0.0, le=1.0, examples=[0.2])
    zoom_out: float = Field(
        0.0, ge=0.0, le=1.0, examples=[0.5], description="detection: probability of a zoom-out (SSD)"
    )
    iou_crop: bool = Field(
        False, examples=[True], description="detection: SSD's IoU crop instead of a random resized crop"
    )

    @field_validator("scale", "ratio")
    @classmethod
    def _ordered(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 < v[0] <= v[1]:
            raise ValueError("needs 0 < low <= high")
        return v

    @field_validator("scale")
    @classmethod
    def _scale_at_most_one(cls, v: tuple[float, float]) -> tuple[float, float]:
        if v[1] > 1.0:
            raise ValueError("is a fraction of the image area, so high must be <= 1")
        return v


class HoldoutSpec(_Spec):
    """One fold of a K-fold split of the train split, left out of training: the fold's images
    are never in a training batch, so a model trained this way predicts them out of sample
    (`visionloop label issues --refit` trains one model per fold). Which images a fold holds is
    a pure function of (train images, folds, seed): `data.sampler.holdout_positions`."""

    folds: int = Field(ge=2, le=20, examples=[5])
    fold: int = Field(ge=0, examples=[0], description="which fold is held out, 0..folds-1")
    seed: int = Field(0, ge=0, le=MAX_SEED, examples=[0], description="seed of the fold assignment")

    @model_validator(mode="after")
    def _fold_in_range(self) -> HoldoutSpec:
        if self.fold >= self.folds:
            raise ValueError(f"fold {self.fold} is not one of 0..{self.folds - 1}")
        return self


class DataSpec(_Spec):
    dataset: Path = Field(examples=["~/.visionloop/datasets/digits"])
    batch_size: int = Field(64, ge=1, examples=[64], description="global batch size, over all processes")
    eval_batch_size: int | None = Field(None, ge=1, examples=[256])
    workers: int = Field(2, ge=0, le=64, examples=[2])
    image_size: int = Field(224, ge=8, le=4096, examples=[224])
    crop_pct: float = Field(
        1.0, gt=0.0, le=1.0, examples=[0.875], description="eval: resize to size/crop_pct, centre-crop size"
    )
    normalize: Literal["auto", "dataset", "imagenet"] = Field("auto", examples=["dataset"])
    augment: AugmentSpec = AugmentSpec()
    shuffle_window: int = Field(
        8, ge=1, examples=[8], description="shuffle among this many shard chunks at a time"
    )
    holdout: HoldoutSpec | None = Field(
        None,
        examples=[{"folds": 5, "fold": 0, "seed": 0}],
        description="leave one fold of the train split out of training (out-of-fold predictions)",
    )

    _dataset_path = field_validator("dataset")(_no_nul)


class ModelSpec(_Spec):
    arch: str = Field(examples=["resnet18"])
    pretrained: Path | None = Field(None, examples=["weights/resnet18.safetensors"])
    pretrained_backbone: Path | None = Field(
        None,
        examples=["weights/mobilenet_v3_large-imagenet.safetensors"],
        description="detection: an ImageNet classifier's weights for the detector's backbone (local file)",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, examples=[{"dropout": 0.2}])
    channels_last: bool = Field(False, examples=[True])
    compile: bool = Field(False, examples=[False], description="torch.compile the model (CUDA)")

    _weights_paths = field_validator("pretrained", "pretrained_backbone")(_no_nul)


class OptimizerSpec(_Spec):
    name: Literal["sgd", "adamw", "adam"] = Field("adamw", examples=["sgd"])
    lr: float = Field(1e-3, gt=0.0, examples=[0.1])
    weight_decay: float = Field(0.0, ge=0.0, examples=[0.05])
    momentum: float = Field(0.9, ge=0.0, lt=1.0, examples=[0.9])
    nesterov: bool = Field(False, examples=[True])
    betas: tuple[float, float] = Field((0.9, 0.999), examples=[[0.9, 0.999]])
    grad_clip_norm: float | None = Field(None, gt=0.0, examples=[1.0])

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("are decay rates: each needs 0 <= beta < 1")
        return v


class ScheduleSpec(_Spec):
    name: Literal["cosine", "linear", "constant", "step"] = Field("cosine", examples=["cosine"])
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, examples=[100])
    warmup_epochs: float = Field(0.0, ge=0.0, examples=[1.0])
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, examples=[0.01])
    step_epochs: float = Field(
        30.0, gt=0.0, examples=[30], description="'step': decay every this many epochs"
    )
    gamma: float = Field(0.1, gt=0.0, le=1.0, examples=[0.1])

    @model_validator(mode="after")
    def _one_warmup(self) -> ScheduleSpec:
        if self.warmup_steps and self.warmup_epochs:
            raise ValueError("give warmup_steps or warmup_epochs, not both (e.g. warmup_epochs: 1)")
        return self


class CheckpointSpec(_Spec):
    every_steps: int | None = Field(None, ge=1, le=MAX_STEPS, examples=[500])
    every_minutes: float | None = Field(10.0, gt=0.0, examples=[10])
    keep_last: int = Field(3, ge=1, examples=[3])
    keep_best: int = Field(1, ge=0, examples=[1])
    # None: the task's primary metric and its direction (val/accuracy max for
    # classification, val/mAP max for detection).
    best_metric: str | None = Field(None, examples=["val/accuracy", "val/mAP"])
    best_mode: Literal["max", "min"] | None = Field(None, examples=["max"])


class EvalSpec(_Spec):
    every_epochs: int = Field(1, ge=1, examples=[1])


_MLFLOW_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_TAG_KEY = re.compile(r"^[A-Za-z0-9][\w./ -]{0,249}$")
MAX_TRACKING_TAGS = 32
MAX_TRACKING_TAG_VALUE = 1000


class TrackingSpec(_Spec):
    # false: the run is recorded in its run directory only (run.json, train.log, eval/), not
    # in MLflow, as with `visionloop train --no-track`; for a job or a study's trials. A
    # resumed run may switch it: it changes what is recorded, not what is computed.
    enabled: bool = Field(True, examples=[True])
    experiment: str | None = Field(None, examples=["digits"])
    run_name: str | None = Field(None, examples=["digits-small-cnn"])
    log_every_steps: int = Field(1, ge=1, examples=[1])
    system_metrics_every_s: float = Field(10.0, gt=0.0, examples=[10])
    # The MLflow run this run is nested under (MLflow's own `mlflow.parentRunId` tag): a
    # tuning study's parent run for each of its trials.
    parent_run_id: str | None = Field(None, examples=["5f0c3a9be0a54d0e9c8f3b2a1d4e6f70"])
    # Extra tags on the run (e.g. visionloop.study / visionloop.trial). The trainer's own tags
    # win over these, and `mlflow.*` is MLflow's: nesting goes through parent_run_id.
    tags: dict[str, str] = Field(default_factory=dict, examples=[{"visionloop.study": "digits-lr"}])

    @field_validator("parent_run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        if v is not None and not _MLFLOW_RUN_ID.match(v):
            raise ValueError("must be an MLflow run id: 32 lowercase hex characters")
        return v

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > MAX_TRACKING_TAGS:
            raise ValueError(f"takes at most {MAX_TRACKING_TAGS} tags")
        for key, value in v.items():
            if not _TAG_KEY.match(key):
                raise ValueError(
                    f"tag key {key!r} is not usable: 1-250 letters, digits, '_', '.', '-', '/' or ' ', "
                    "starting with a letter or digit"
                )
            if key.startswith("mlflow."):
                raise ValueError(f"tag key {key!r} is MLflow's own; nest a run with parent_run_id instead")
            if len(value) > MAX_TRACKING_TAG_VALUE:
                raise ValueError(f"tag {key!r} is longer than {MAX_TRACKING_TAG_VALUE} characters")
        return v


class LossSpec(_Spec):
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, examples=[0.1])


class TrainSpec(_Spec):
    # A registered task's name (`visionloop.tasks.list_tasks()`); the trainer checks it
    # against the dataset's manifest and looks the task up there.
    task: str = Field(
        "classification", pattern=r"^[a-z][a-z0-9_]{0,63}$", examples=["classification", "detection"]
    )
    data: DataSpec
    model: ModelSpec
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    loss: LossSpec = LossSpec()
    epochs: int | None = Field(None, ge=1, le=MAX_EPOCHS, examples=[10])
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, examples=[2000])
    precision: Precision = Field("auto", examples=["bf16"])
    seed: int = Field(0, ge=0, le=MAX_SEED, examples=[0])
    deterministic: bool = Field(False, examples=[True])
    device: str = Field("auto", examples=["auto", "cpu", "cuda", "cuda:1"])
    distributed: Literal["ddp", "fsdp"] = Field(
        "ddp",
        examples=["fsdp"],
        description=(
            "How several training processes share the model. ddp: every process holds the whole model "
            "and optimizer state. fsdp: parameters, gradients and optimizer state are sharded over the "
            "processes (FSDP2), for a model that does not fit on one device; checkpoints are then "
            "directories written by every process (one run directory all nodes share), and the run "
            "still ends with one final.safetensors."
        ),
    )
    checkpoint: CheckpointSpec = CheckpointSpec()
    eval: EvalSpec = EvalSpec()
    tracking: TrackingSpec = TrackingSpec()

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        ok = v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit())
        if not ok:
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return v

    @model_validator(mode="after")
    def _length(self) -> TrainSpec:
        if (self.epochs is None) == (self.steps is None):
            raise ValueError("give exactly one of `epochs` or `steps` (e.g. epochs: 10)")
        return self


class ResourcesSpec(_Spec):
    """What a job needs. `gpus`, `cpus` and `memory_gb` are the job's totals; `nodes` spreads
    one training run (one DDP process group) over that many machines, evenly:

    - `gpus = nodes * gpus_per_node`: give either (`gpus_per_node` alone sets `gpus`) or
      both, consistent. Each node runs one process per GPU.
    - A CPU job (`gpus: 0`) with `nodes: N` runs one process per node.
    - `cpus` and `memory_gb` are split evenly over the nodes.

    Only the Ray executor places a job on several nodes."""

    gpus: int = Field(1, ge=0, le=1024, examples=[1], description="GPUs for the job (0: CPU only)")
    cpus: float = Field(2.0, gt=0.0, le=4096, examples=[4])
    memory_gb: float = Field(8.0, gt=0.0, le=65536, examples=[16])
    nodes: int = Field(1, ge=1, le=256, examples=[2], description="machines one run spans (DDP)")
    gpus_per_node: int | None = Field(None, ge=1, le=64, examples=[8])

    @model_validator(mode="before")
    @classmethod
    def _gpus_from_per_node(cls, data: Any) -> Any:
        # `gpus` defaults to 1, which would contradict a bare `gpus_per_node`: derive it instead.
        if isinstance(data, Mapping) and data.get("gpus_per_node") is not None and "gpus" not in data:
            per_node, nodes = data["gpus_per_node"], data.get("nodes", 1)
            if isinstance(per_node, int) and isinstance(nodes, int):
                return {**data, "gpus": per_node * nodes}
        return data

    @model_validator(mode="after")
    def _layout(self) -> ResourcesSpec:
        if self.gpus_per_node is not None and self.gpus != self.nodes * self.gpus_per_node:
            raise ValueError(
                f"gpus ({self.gpus}) must equal nodes ({self.nodes}) x gpus_per_node ({self.gpus_per_node}); "
                f"give gpus_per_node alone (gpus is then {self.nodes * self.gpus_per_node}), "
                "or fix one of them"
            )
        if self.gpus % self.nodes:
            fitting = max(self.gpus // self.nodes, 1) * self.nodes
            raise ValueError(
                f"gpus ({self.gpus}) must divide evenly over nodes ({self.nodes}): every node runs the same "
                f"number of processes; use e.g. gpus: {fitting}, or gpus_per_node instead"
            )
        return self

    @property
    def procs_per_node(self) -> int:
        """DDP processes on each node: one per GPU, or one on a CPU job."""
        return max(self.gpus // self.nodes, 1)


# A job's `max_runtime` bounds: under a minute is shorter than a start takes (a typo of
# units: `max_runtime: 6` is six seconds), over a year is no estimate at all.
MIN_RUNTIME_S, MAX_RUNTIME_S = 60.0, 365 * 86400.0


class JobFields(_Spec):
    """What the scheduler needs to place a job, whatever it runs: its resources, priority,
    team, spot policy, restart budget and time estimate (a tuning study gives every trial
    the same)."""

    resources: ResourcesSpec = ResourcesSpec()
    priority: str = Field("normal", min_length=1, max_length=64, examples=["normal"])
    team: str | None = Field(None, min_length=1, max_length=64, examples=["detection"])
    spot: Literal["never", "allowed", "preferred"] = Field("allowed", examples=["allowed"])
    max_restarts: int = Field(3, ge=0, le=100, examples=[3])
    # Like Slurm's --time, but a planning estimate, not a kill switch: how long one run of
    # the job (one allocation) should take at most. Reservations plan with it until the job
    # reports a pace, and EASY backfill lets the job start on GPUs held for a reservation
    # only if it ends first. The control plane never stops a job at it (a training job
    # resumes from checkpoints; killing it at a guess would only lose work). Seconds.
    max_runtime: float | None = Field(
        None, examples=["6h"], description="expected longest run: 6h, 90m, 2d or seconds"
    )

    @field_validator("max_runtime", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        if v is None:
            return None
        from visionloop.core.durations import parse_duration

        seconds = parse_duration(v)  # its ValueError names the value and gives examples
        if not MIN_RUNTIME_S <= seconds <= MAX_RUNTIME_S:
            raise ValueError(
                f"must be between 1 minute and 365 days (e.g. 6h, 90m or 2d); {seconds:g} seconds is not"
            )
        return seconds

    @field_validator("priority", "team")
    @classmethod
    def _identifier(cls, v: str | None) -> str | None:
        if v is not None and not all(c.isalnum() or c in "-_." for c in v):
            raise ValueError("may contain only letters, digits, '-', '_' and '.'")
        return v


class TrialFields(_Spec):
    """Marks a job as one trial of a tuning study (`visionloop tune` sets it). The job pauses
    after `until_epoch` epochs, through a checkpoint (exit 76), at a rung of the study's
    pruner, and waits there, holding no GPU, for the study to promote it (it goes on to the
    next rung) or prune it. None: it runs to its end."""

    study: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_.\-]{0,99}$", examples=["digits-lr"])
    number: int = Field(ge=0, le=10_000_000, examples=[3])
    until_epoch: int | None = Field(None, ge=1, examples=[1])


class JobSpec(JobFields):
    """A queued training job: a train spec plus what the scheduler needs to place it.

    `visionloop submit` accepts this document, or a bare train spec that it wraps with the
    defaults below and the command-line flags."""

    train: TrainSpec
    name: str | None = Field(None, min_length=1, max_length=200, examples=["resnet50-baseline"])
    trial: TrialFields | None = Field(None, examples=[{"study": "digits-lr", "number": 3, "until_epoch": 1}])

    @model_validator(mode="after")
    def _trial_fits(self) -> JobSpec:
        if self.trial is None or self.trial.until_epoch is None:
            return self
        if self.train.epochs is None:
            raise ValueError(
                "trial.until_epoch pauses the job after that many epochs, but its train spec runs "
                f"{self.train.steps} steps; give the train spec `epochs`, or leave until_epoch out."
            )
        return self


def validate_train_spec(doc: Mapping[str, Any], source: str = "the spec") -> TrainSpec:
    try:
        return TrainSpec.model_validate(doc)
    except ValidationError as e:
        raise SpecError(format_validation_error(e, TrainSpec, source)) from e


def load_train_spec(path: Path, overrides: Sequence[str] = ()) -> tuple[TrainSpec, dict[str, Any]]:
    """Read, override and validate a train spec; return the model and the effective document.

    Relative paths in the spec (dataset, pretrained weights) are resolved against the spec
    file's folder, so a spec works from any working directory.
    """
    path = Path(path)
    doc = apply_overrides(parse_yaml_mapping(read_spec_text(path), str(path)), overrides)
    spec = validate_train_spec(doc, str(path))
    return resolve_paths(spec, path.parent), doc
