"""The tune spec: a base train spec, a search space over its fields, and how to search it.

    name: digits-lr
    train: ../train/digits.yaml          # or the train spec itself, inline
    space:
      optimizer.lr: {loguniform: [1.0e-4, 1.0e-1]}
      model.arch: {choice: [small_cnn, resnet18]}
    trials: 40

Validation goes further than the field types: every path in `space` must name a field of the
train spec (or a key under the free-form `model.kwargs`), and the train spec must still
validate at every corner of the space (each range's ends, each choice), so that a trial never
fails on a spec the tuner made; a space that touches the model (`model.arch`, `model.kwargs.*`,
`data.image_size`) is also built, on PyTorch's meta device, through the task's own
`build_model`, which names the known architectures when one is not. Errors name the field,
the value and a valid example, as for every spec (`visionloop.spec_errors`).

The space's distributions are in `visionloop.tune.dimensions`, those checks in
`visionloop.tune.space_checks`. None of the three imports Optuna, nor torch but for a space
that touches the model; `visionloop.tune.space` turns a spec into Optuna's samplers, pruners
and suggestions.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    model_validator,
)

from visionloop.core.errors import SpecError
from visionloop.core.safeyaml import load_untrusted
from visionloop.spec_errors import example_for, fields_at, format_validation_error, shown_value, yaml_inline
from visionloop.spec_files import read_spec_text, resolve_paths
from visionloop.specs import (
    MAX_SEED,
    JobFields,
    JobSpec,
    TrainSpec,
    TrialFields,
    load_train_spec,
    validate_train_spec,
)
from visionloop.tasks.registry import get_task
from visionloop.tune.dimensions import (
    DISTRIBUTION_EXAMPLES,
    KIND_CLASSES,
    Dimension,
    TuneModel,
)
from visionloop.tune.space_checks import (
    pruner_problems,
    rung_epochs,
    sampler_problems,
    space_problems,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the other sections


class ObjectiveSpec(TuneModel):
    # Defaults (filled in by TuneSpec): the task's primary metric and its direction.
    metric: str = Field(pattern=r"^val/[A-Za-z0-9_.\-/]{1,128}$", examples=["val/accuracy"])
    direction: Literal["max", "min"] = Field(examples=["max"])


class SamplerSpec(TuneModel):
    name: Literal["tpe", "random", "grid", "cmaes"] = Field("tpe", examples=["tpe"])
    # Optuna's samplers take numpy's seeds, 0..2**32-1.
    seed: int | None = Field(
        0, ge=0, le=MAX_SEED, examples=[0], description="null: a different search each time"
    )


class PrunerSpec(TuneModel):
    """When to stop a trial early. Rungs are in epochs: asynchronous successive halving (asha)
    and Hyperband judge a trial at min_epochs × reduction_factor^k epochs; median from
    min_epochs on, at every evaluation. A trial pauses at each rung through a checkpoint
    (its GPUs go to the next trial at once) until the study decides.

    `promotion` (asha only, on by default): a trial paused at a rung waits there and goes on,
    from its checkpoint, when it is among the best 1/reduction_factor of the trials that
    reached that rung (ASHA as Li et al. 2020 describe it); the trials never promoted are
    pruned when the study ends. Off: each trial is judged once at each rung, against the
    trials that got there before it, and pruned or continued at once (Optuna's
    SuccessiveHalvingPruner), which stops more good late trials."""

    name: Literal["asha", "hyperband", "median", "none"] = Field("asha", examples=["asha"])
    min_epochs: int = Field(1, ge=1, examples=[1])
    reduction_factor: int = Field(3, ge=2, le=100, examples=[3])
    max_epochs: int | None = Field(
        None, ge=1, examples=[27], description="null: the train spec's epochs (Hyperband's max resource)"
    )
    promotion: bool = Field(True, examples=[True], description="asha only: pause and promote, not only stop")

    @model_validator(mode="after")
    def _promotion_is_asha(self) -> PrunerSpec:
        if self.promotion and self.name != "asha" and "promotion" in self.model_fields_set:
            raise ValueError(
                f"promotion is a feature of asha; the {self.name} pruner only stops trials. Use "
                "pruner: {name: asha} or leave promotion out."
            )
        return self

    @property
    def promotes(self) -> bool:
        """Whether trials wait at rungs to be promoted (asha with promotion)."""
        return self.name == "asha" and self.promotion


class BudgetSpec(TuneModel):
    """No new trial starts once the study has spent either."""

    gpu_hours: float | None = Field(None, gt=0.0, examples=[10])
    usd: float | None = Field(None, gt=0.0, examples=[50])

    @model_validator(mode="after")
    def _one(self) -> BudgetSpec:
        if self.gpu_hours is None and self.usd is None:
            raise ValueError("give gpu_hours, usd or both (e.g. budget: {gpu_hours: 10})")
        return self


# --------------------------------------------------------------------------- the tune spec


class TuneSpec(TuneModel):
    name: str = Field(
        pattern=r"^[A-Za-z][A-Za-z0-9_.\-]{0,99}$",
        examples=["digits-lr"],
        description="the study's name: letters, digits, '-', '_' and '.'",
    )
    # Always a validated train spec here; `load_tune_spec` reads a path and resolves the train
    # spec's relative paths (against its own file, or this spec's for an inline one).
    train: TrainSpec = Field(examples=["../train/digits.yaml"])
    space: dict[str, Dimension] = Field(
        min_length=1, examples=[{"optimizer.lr": {"loguniform": [1e-4, 1e-1]}}]
    )
    objective: ObjectiveSpec = Field(examples=[{"metric": "val/accuracy", "direction": "max"}])
    sampler: SamplerSpec = SamplerSpec()
    pruner: PrunerSpec = PrunerSpec()
    trials: int = Field(ge=1, le=100_000, examples=[40])
    concurrency: int = Field(1, ge=1, le=10_000, examples=[4])
    budget: BudgetSpec | None = Field(None, examples=[{"gpu_hours": 10}])
    # The queue's job fields of every trial (JobSpec's own type, less train and name).
    job: JobFields = Field(default_factory=JobFields, examples=[{"team": "vision", "spot": "preferred"}])

    @model_validator(mode="before")
    @classmethod
    def _default_objective(cls, data: Any) -> Any:
        """The objective defaults to the task's primary metric and direction; a metric without
        a direction gets the task's when it is the primary metric, min for val/loss."""
        if not isinstance(data, Mapping):
            return data
        objective = data.get("objective", {})
        if objective is None:
            objective = {}
        if not isinstance(objective, Mapping) or "direction" in objective:
            return data
        task_name = _task_name(data.get("train"))
        if task_name is None:
            return data
        try:
            task = get_task(task_name)
        except SpecError as e:
            raise ValueError(f"train.task: {e}") from None
        primary = f"val/{task.primary_metric}"
        metric = objective.get("metric", primary)
        direction = {primary: task.primary_mode, "val/loss": "min"}.get(metric)
        if direction is None:
            return data  # "objective.direction: field required", with an example
        return {**data, "objective": {**objective, "metric": metric, "direction": direction}}

    @model_validator(mode="after")
    def _consistent(self) -> TuneSpec:
        problems = [
            *space_problems(self),
            *sampler_problems(self),
            *pruner_problems(self),
        ]
        if self.concurrency > self.trials:
            problems.append(
                f"concurrency: {self.concurrency} trials at once, but only {self.trials} in all; "
                f"set concurrency to at most {self.trials} (e.g. concurrency: {min(4, self.trials)})."
            )
        problems.extend(_job_problems(self))
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def train_doc(self) -> dict[str, Any]:
        """The base train spec as a plain document, for `tune.space.apply`."""
        return self.train.model_dump(mode="json")

    def max_epochs(self) -> int | None:
        """The pruner's largest resource: `pruner.max_epochs`, else the train spec's epochs."""
        return self.pruner.max_epochs or self.train.epochs

    def rungs(self) -> list[int]:
        """The epochs at which a trial pauses for the study to judge it (before its last
        epoch); none without a pruner."""
        if self.pruner.name == "none":
            return []
        max_epochs = self.max_epochs()
        assert max_epochs is not None  # the spec refuses a pruner without epochs
        p = self.pruner
        return rung_epochs(p.min_epochs, p.reduction_factor, max_epochs, p.name)

    def next_rung(self, epoch: int | None) -> int | None:
        """The rung after `epoch` (None: the first one) where a trial pauses next; None when
        it runs to its end from there."""
        return next((r for r in self.rungs() if epoch is None or r > epoch), None)

    def trial_job(self, train: TrainSpec, name: str, trial: TrialFields | None = None) -> JobSpec:
        """The queue job of one trial: its own train spec, with this spec's job fields."""
        try:
            return JobSpec(train=train, name=name, trial=trial, **self.job.model_dump())
        except ValidationError as e:
            raise SpecError(format_validation_error(e, JobSpec, "the trial's job")) from e


def _job_problems(spec: TuneSpec) -> list[str]:
    try:
        JobSpec(train=spec.train, **spec.job.model_dump())
    except ValidationError as e:
        lines = format_validation_error(e, JobSpec, "").splitlines()[1:]
        return [f"job.{line.strip().removeprefix('- ')}" for line in lines]
    return []


def _task_name(train: Any) -> str | None:
    if isinstance(train, TrainSpec):
        return train.task
    if isinstance(train, Mapping):
        name = train.get("task", TrainSpec.model_fields["task"].default)
        return name if isinstance(name, str) else None
    return None


# --------------------------------------------------------------------------- loading


MINIMAL_TUNE_SPEC = """\
name: digits-lr
train: digits.yaml             # a train spec file (relative to this file), or the spec inline
space:
  optimizer.lr: {loguniform: [1.0e-4, 1.0e-1]}
trials: 20
"""


def validate_tune_spec(
    doc: Mapping[str, Any], source: str = "the tune spec", base_dir: Path | None = None
) -> TuneSpec:
    """Validate a tune spec document. `train` is a path (relative to `base_dir`) or an inline
    train spec whose relative paths are resolved against `base_dir` (default: the current
    folder)."""
    base_dir = Path.cwd() if base_dir is None else Path(base_dir)
    doc = dict(doc)
    train = doc.get("train")
    if isinstance(train, str):
        train_path = Path(train).expanduser()
        train_path = train_path if train_path.is_absolute() else base_dir / train_path
        try:
            doc["train"], _ = load_train_spec(train_path)
        except SpecError as e:
            raise SpecError(f"{source}: train: {e}") from e
    elif isinstance(train, Mapping):
        spec = validate_train_spec(train, f"the train spec in {source}")
        doc["train"] = resolve_paths(spec, base_dir)
    elif train is not None:
        raise SpecError(
            f"{source}: train: give the path of a train spec file (e.g. train: digits.yaml) or the "
            f"train spec itself as a mapping; got {train!r}."
        )
    try:
        return TuneSpec.model_validate(doc)
    except ValidationError as e:
        raise SpecError(format_tune_error(e, source)) from e


def load_tune_spec(path: Path) -> tuple[TuneSpec, str]:
    """Read and validate a tune spec file; return the model and the file's text (saved
    verbatim with the study). A train spec path in it is relative to the file's folder."""
    path = Path(path)
    text = read_spec_text(path, what="tune spec", example=MINIMAL_TUNE_SPEC)
    try:
        doc = load_untrusted(text)  # no object-building tags, no aliases (core.safeyaml)
    except yaml.YAMLError as e:
        raise SpecError(f"{path} is not valid YAML: {e}") from e
    if not isinstance(doc, dict):
        got = "empty" if doc is None else f"a {type(doc).__name__}, not a mapping of fields"
        raise SpecError(f"{path} is {got}. A minimal tune spec:\n{MINIMAL_TUNE_SPEC}")
    return validate_tune_spec(doc, str(path), path.parent), text


def format_tune_error(e: ValidationError, source: str) -> str:
    """spec_errors.format_validation_error's style, for a TuneSpec: a space entry's distribution
    (the union's tag) is not repeated in the field's name, its example is a distribution's,
    and the cross-field checks (already complete sentences) print as they are."""
    lines = [f"{source} is not a valid TuneSpec:"]
    for err in e.errors():
        loc: list[int | str] = list(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if not loc:
            lines.extend(line if line.startswith("    ") else f"  - {line}" for line in msg.splitlines())
            continue
        kind: str | None = None
        if loc[0] == "space" and len(loc) >= 3 and loc[2] in KIND_CLASSES:
            kind = str(loc[2])
            loc = [*loc[:2], *loc[3:]]
        dotted = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden":
            if kind is not None:
                fields = KIND_CLASSES[kind].model_fields.items()
                known = [field.alias or name for name, field in fields]
            else:
                known = fields_at(TuneSpec, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f" Did you mean `{close[0]}`?" if close else f" Known fields here: {', '.join(known)}."
            lines.append(f"  - {dotted}: unknown field.{hint}")
            continue
        shown = "missing" if err["type"] == "missing" else f"got {shown_value(err.get('input'))}"
        line = f"  - {dotted}: {msg} ({shown})."
        if loc[0] == "space" and len(loc) >= 2:
            line += f" Example: {DISTRIBUTION_EXAMPLES[kind or 'loguniform']}"
        else:
            names = [p for p in loc if isinstance(p, str)]
            example = example_for(TuneSpec, names)
            if example is not None and names:
                line += f" Example: {names[-1]}: {yaml_inline(example)}"
        lines.append(line)
    return "\n".join(lines)
