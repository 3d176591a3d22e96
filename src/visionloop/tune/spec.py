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
the value and a valid example, as for every spec (`visionloop.specs`).

This module imports neither Optuna nor torch (torch only for a space that touches the model);
`visionloop.tune.space` turns a spec into Optuna's samplers, pruners and suggestions.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import logging
import math
from collections.abc import Iterator, Mapping
from decimal import Decimal
from pathlib import Path
from types import NoneType, UnionType
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from visionloop.core.errors import SpecError
from visionloop.core.safeyaml import load_untrusted
from visionloop.core.strictbools import StrictBools
from visionloop.specs import (
    MAX_SEED,
    JobFields,
    JobSpec,
    TrainSpec,
    TrialFields,
    example_for,
    fields_at,
    format_validation_error,
    load_train_spec,
    read_spec_text,
    resolve_paths,
    shown_value,
    validate_train_spec,
    yaml_inline,
)
from visionloop.tasks.registry import get_task

if TYPE_CHECKING:
    from visionloop.tasks.base import Task

log = logging.getLogger(__name__)

DISTRIBUTIONS = ("loguniform", "uniform", "int", "float", "choice")
# A space entry of each distribution, for error messages.
DISTRIBUTION_EXAMPLES = {
    "loguniform": "optimizer.lr: {loguniform: [1.0e-4, 0.1]}",
    "uniform": "optimizer.weight_decay: {uniform: [0.0, 0.1]}",
    "int": "data.batch_size: {int: [16, 128], step: 16}",
    "float": "optimizer.momentum: {float: [0.8, 0.95], step: 0.05}",
    "choice": "model.arch: {choice: [small_cnn, resnet18]}",
}
# The shapes, for saying which distributions a field takes.
DISTRIBUTION_FORMS = {
    "loguniform": "{loguniform: [lo, hi]}",
    "uniform": "{uniform: [lo, hi]}",
    "int": "{int: [lo, hi], step: k}",
    "float": "{float: [lo, hi], step: x}",
    "choice": "{choice: [...]}",
}
# A grid larger than this is a mistake (a float range with a tiny step): GridSampler lists it.
MAX_GRID_POINTS = 100_000
# Up to this many corner combinations are validated together (catching fields that constrain
# each other, such as warmup_steps and warmup_epochs); a larger space, one dimension at a time.
MAX_CORNER_COMBINATIONS = 256
MAX_MODEL_BUILDS = 32
# Paths that decide what the objective and the model build are: never searched.
_FIXED_PATHS = {"task": "the objective and the model depend on the task"}
# The pruner's resource is the epoch, read at every evaluation: a space must not move them.
_PRUNER_PATHS = ("epochs", "steps", "eval.every_epochs")
# Paths whose values the task's build_model sees: a space over them is built on the meta device.
_MODEL_PATHS = ("model.arch", "data.image_size")
_MODEL_PREFIXES = ("model.kwargs.",)


class _TuneModel(StrictBools):
    # Unknown keys are errors, as in every spec: `sampler: {nme: grid}` must not mean TPE. NaN
    # and infinity are never a setting (`budget: {usd: .inf}`, `choice: [.inf]`).
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)


# --------------------------------------------------------------------------- distributions


def _check_range(lo: float, hi: float, *, log_scale: bool) -> tuple[float, float]:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("needs finite bounds")
    if not lo < hi:
        raise ValueError("needs low < high (a single value belongs in the train spec)")
    if log_scale and lo <= 0:
        raise ValueError("is on a log scale, so it needs 0 < low < high")
    return lo, hi


def _steps_between(lo: float, hi: float, step: float) -> int | None:
    """How many steps from lo to hi, or None when hi is not lo plus a whole number of steps.
    Decimal on the shortest repr: 0.3 - 0.1 is 2 steps of 0.1, not 1.9999999999999998."""
    n = (Decimal(repr(hi)) - Decimal(repr(lo))) / Decimal(repr(step))
    return int(n) if n == n.to_integral_value() else None


class LogUniform(_TuneModel):
    """A float between the bounds, sampled uniformly in log space."""

    bounds: tuple[float, float] = Field(alias="loguniform", examples=[[1e-4, 1e-1]])

    @field_validator("bounds")
    @classmethod
    def _bounds(cls, v: tuple[float, float]) -> tuple[float, float]:
        return _check_range(*v, log_scale=True)

    def corners(self) -> list[Any]:
        return list(self.bounds)

    def grid(self) -> list[Any] | None:
        return None


class Uniform(_TuneModel):
    """A float between the bounds, sampled uniformly."""

    bounds: tuple[float, float] = Field(alias="uniform", examples=[[0.0, 0.3]])

    @field_validator("bounds")
    @classmethod
    def _bounds(cls, v: tuple[float, float]) -> tuple[float, float]:
        return _check_range(*v, log_scale=False)

    def corners(self) -> list[Any]:
        return list(self.bounds)

    def grid(self) -> list[Any] | None:
        return None


class IntRange(_TuneModel):
    """An integer from low to high inclusive, every `step`; on a log scale with `log: true`."""

    bounds: tuple[int, int] = Field(alias="int", examples=[[16, 128]])
    step: int = Field(1, ge=1, examples=[16])
    log: bool = Field(False, examples=[False])

    @model_validator(mode="after")
    def _check(self) -> IntRange:
        lo, hi = _check_range(*self.bounds, log_scale=self.log)
        if self.log and self.step != 1:
            raise ValueError("takes log: true or a step, not both (Optuna samples log ranges with step 1)")
        if (hi - lo) % self.step:
            last = lo + (hi - lo) // self.step * self.step
            raise ValueError(
                f"[{lo}, {hi}] with step {self.step} would never reach {hi}; make high {last} "
                f"or {last + self.step}"
            )
        return self

    def corners(self) -> list[Any]:
        return list(self.bounds)

    def grid(self) -> list[Any] | None:
        lo, hi = self.bounds
        return list(range(lo, hi + 1, self.step))

    def grid_size(self) -> int:
        lo, hi = self.bounds
        return (hi - lo) // self.step + 1


class FloatRange(_TuneModel):
    """A float from low to high, every `step` when given (then the grid sampler can take it);
    on a log scale with `log: true`."""

    bounds: tuple[float, float] = Field(alias="float", examples=[[0.0, 0.5]])
    step: float | None = Field(None, gt=0.0, examples=[0.1])
    log: bool = Field(False, examples=[False])

    @model_validator(mode="after")
    def _check(self) -> FloatRange:
        lo, hi = _check_range(*self.bounds, log_scale=self.log)
        if self.step is not None:
            if self.log:
                raise ValueError("takes log: true or a step, not both (Optuna allows only one)")
            if _steps_between(lo, hi, self.step) is None:
                raise ValueError(
                    f"[{lo}, {hi}] with step {self.step} would never reach {hi}; make high low plus "
                    "a whole number of steps"
                )
        return self

    def corners(self) -> list[Any]:
        return list(self.bounds)

    def grid(self) -> list[Any] | None:
        if self.step is None:
            return None
        lo, hi = self.bounds
        n = _steps_between(lo, hi, self.step)
        assert n is not None  # checked at validation
        start, step = Decimal(repr(lo)), Decimal(repr(self.step))
        return [float(start + k * step) for k in range(n + 1)]

    def grid_size(self) -> int | None:
        if self.step is None:
            return None
        n = _steps_between(*self.bounds, self.step)
        return None if n is None else n + 1


class Choice(_TuneModel):
    """One of the listed values (null, true/false, numbers or strings)."""

    values: list[Any] = Field(alias="choice", min_length=1, examples=[["small_cnn", "resnet18"]])

    @field_validator("values")
    @classmethod
    def _scalars(cls, v: list[Any]) -> list[Any]:
        for i, value in enumerate(v):
            if value is not None and not isinstance(value, bool | int | float | str):
                raise ValueError(
                    f"value {i} is a {type(value).__name__}: Optuna stores a choice as it is, so the "
                    "values must be null, true/false, numbers or strings"
                )
        seen: list[Any] = []
        for value in v:
            # 1 == 1.0 == True in Python: compare with the type, so [1, true] is two choices.
            if any(type(value) is type(s) and value == s for s in seen):
                raise ValueError(f"lists {value!r} twice; give each value once")
            seen.append(value)
        return v

    def corners(self) -> list[Any]:
        return list(self.values)

    def grid(self) -> list[Any] | None:
        return list(self.values)

    def grid_size(self) -> int:
        return len(self.values)


def _distribution_of(value: Any) -> str | None:
    if isinstance(value, Mapping):
        kinds = [k for k in DISTRIBUTIONS if k in value]
        return kinds[0] if len(kinds) == 1 else None
    if isinstance(value, BaseModel):
        for kind, cls in _KIND_CLASSES.items():
            if isinstance(value, cls):
                return kind
    return None


_KIND_CLASSES: dict[str, type[_TuneModel]] = {
    "loguniform": LogUniform,
    "uniform": Uniform,
    "int": IntRange,
    "float": FloatRange,
    "choice": Choice,
}

Dimension = Annotated[
    Annotated[LogUniform, Tag("loguniform")]
    | Annotated[Uniform, Tag("uniform")]
    | Annotated[IntRange, Tag("int")]
    | Annotated[FloatRange, Tag("float")]
    | Annotated[Choice, Tag("choice")],
    Discriminator(
        _distribution_of,
        custom_error_type="distribution",
        custom_error_message=(
            "needs exactly one distribution: {loguniform: [lo, hi]}, {uniform: [lo, hi]}, "
            "{int: [lo, hi], step: k, log: false}, {float: [lo, hi], step: x} or {choice: [...]}"
        ),
    ),
]
AnyDimension: TypeAlias = LogUniform | Uniform | IntRange | FloatRange | Choice


def kind_of(dim: AnyDimension) -> str:
    """The distribution's name as a spec writes it (`loguniform`, `int`, `choice`, ...)."""
    kind = _distribution_of(dim)
    assert kind is not None
    return kind


def grid_size(dim: AnyDimension) -> int | None:
    """How many grid points the dimension has, or None for a continuous range."""
    if isinstance(dim, LogUniform | Uniform):
        return None
    return dim.grid_size()


# --------------------------------------------------------------------------- the other sections


class ObjectiveSpec(_TuneModel):
    # Defaults (filled in by TuneSpec): the task's primary metric and its direction.
    metric: str = Field(pattern=r"^val/[A-Za-z0-9_.\-/]{1,128}$", examples=["val/accuracy"])
    direction: Literal["max", "min"] = Field(examples=["max"])


class SamplerSpec(_TuneModel):
    name: Literal["tpe", "random", "grid", "cmaes"] = Field("tpe", examples=["tpe"])
    # Optuna's samplers take numpy's seeds, 0..2**32-1.
    seed: int | None = Field(
        0, ge=0, le=MAX_SEED, examples=[0], description="null: a different search each time"
    )


class PrunerSpec(_TuneModel):
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


class BudgetSpec(_TuneModel):
    """No new trial starts once the study has spent either."""

    gpu_hours: float | None = Field(None, gt=0.0, examples=[10])
    usd: float | None = Field(None, gt=0.0, examples=[50])

    @model_validator(mode="after")
    def _one(self) -> BudgetSpec:
        if self.gpu_hours is None and self.usd is None:
            raise ValueError("give gpu_hours, usd or both (e.g. budget: {gpu_hours: 10})")
        return self


# --------------------------------------------------------------------------- the tune spec


class TuneSpec(_TuneModel):
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
            *_space_problems(self),
            *_sampler_problems(self),
            *_pruner_problems(self),
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


# --------------------------------------------------------------------------- space checks


class _Leaf:
    """What a space path names in the train spec: a typed field, or a key of a free mapping."""

    def __init__(self, annotation: Any, *, free: bool) -> None:
        self.annotation = annotation
        self.free = free

    def allowed(self) -> tuple[str, ...]:
        """The distributions that can only produce values of this field's type."""
        if self.free or self.annotation is float:
            return DISTRIBUTIONS
        if self.annotation is int:
            return ("int", "choice")
        return ("choice",)

    def describe(self) -> str:
        if self.annotation is int:
            return "an integer field"
        if self.annotation is bool:
            return "a true/false field"
        if get_origin(self.annotation) is Literal:
            return "one of " + ", ".join(str(a) for a in get_args(self.annotation))
        if get_origin(self.annotation) is tuple:
            return "a pair of values"
        return f"a {getattr(self.annotation, '__name__', 'non-numeric')} field"


def _strip_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not NoneType]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def resolve_path(path: str) -> _Leaf:
    """The train-spec field at the dotted `path`, or a SpecError saying what is there instead."""
    parts = path.split(".")
    if any(not p for p in parts):
        raise SpecError(f"is not a dotted field path (e.g. optimizer.lr); got {path!r}")
    model: type[BaseModel] = TrainSpec
    for i, part in enumerate(parts):
        where = ".".join(parts[:i]) or "the train spec"
        field = model.model_fields.get(part)
        if field is None:
            known = list(model.model_fields)
            close = difflib.get_close_matches(part, known, n=1)
            hint = f" Did you mean `{close[0]}`?" if close else f" Its fields: {', '.join(known)}."
            raise SpecError(f"{where} has no field `{part}`.{hint}")
        annotation = _strip_optional(field.annotation)
        rest = parts[i + 1 :]
        here = ".".join(parts[: i + 1])
        if _is_model(annotation):
            if not rest:
                example = next(iter(annotation.model_fields))
                raise SpecError(f"`{here}` is a section; name a field in it (e.g. {here}.{example}).")
            model = annotation
            continue
        if get_origin(annotation) is dict:
            if not rest:
                raise SpecError(f"`{here}` is a mapping; name a key in it (e.g. {here}.width).")
            return _Leaf(Any, free=True)
        if rest:
            raise SpecError(f"`{here}` is a value, not a section, so it has no field `{rest[0]}`.")
        return _Leaf(annotation, free=False)
    raise AssertionError("unreachable: the loop returns or raises")


def _space_problems(spec: TuneSpec) -> list[str]:
    problems: list[str] = []
    fine: dict[str, AnyDimension] = {}
    pruning = spec.pruner.name != "none"
    for path, dim in spec.space.items():
        kind = kind_of(dim)
        example = _path_example(path)
        if path in _FIXED_PATHS:
            why = _FIXED_PATHS[path]
            problems.append(f"space.{path}: cannot be searched ({why}); fix it in the train spec.")
            continue
        if pruning and path in _PRUNER_PATHS:
            problems.append(
                f"space.{path}: cannot be searched while the {spec.pruner.name} pruner stops trials by "
                f"epochs; fix it in the train spec, or set pruner: {{name: none}}."
            )
            continue
        try:
            leaf = resolve_path(path)
        except SpecError as e:
            problems.append(f"space.{path}: {e}{example}")
            continue
        if kind not in leaf.allowed():
            ok = " or ".join(DISTRIBUTION_FORMS[k] for k in leaf.allowed() if k != "loguniform")
            problems.append(
                f"space.{path}: is {leaf.describe()}, so {kind} cannot sample it; use {ok}.{example}"
            )
            continue
        fine[path] = dim
    if not problems:
        problems.extend(_corner_problems(spec.train, fine))
    if not problems:
        problems.extend(_model_problems(spec.train, fine))
    return problems


def _path_example(path: str) -> str:
    """' Example: lr: 0.1', the train spec's own example of the field, when it has one."""
    value = example_for(TrainSpec, path.split("."))
    return f" Example value: {path}: {yaml_inline(value)}" if value is not None else ""


def _set_path(doc: dict[str, Any], path: str, value: Any) -> None:
    keys = path.split(".")
    node = doc
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise SpecError(f"{path}: `{key}` is a value in the train spec, not a section.")
        node = child
    node[keys[-1]] = value


def with_params(train_doc: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `train_doc` with each dotted path in `params` set to its value."""
    doc = copy.deepcopy(dict(train_doc))
    for path, value in params.items():
        _set_path(doc, path, value)
    return doc


def _combinations(space: Mapping[str, AnyDimension], cap: int) -> Iterator[dict[str, Any]]:
    """Every combination of the dimensions' corners when there are at most `cap`; otherwise
    each dimension's corners alone (the others at the base spec's values)."""
    corners = {path: dim.corners() for path, dim in space.items()}
    if math.prod(len(v) for v in corners.values()) <= cap:
        for combination in itertools.product(*corners.values()):
            yield dict(zip(corners, combination, strict=True))
        return
    for path, values in corners.items():
        for value in values:
            yield {path: value}


def _assignments(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{path} = {yaml_inline(value)}" for path, value in params.items())


def _corner_problems(train: TrainSpec, space: Mapping[str, AnyDimension]) -> list[str]:
    base = train.model_dump(mode="json")
    problems: list[str] = []
    for params in _combinations(space, MAX_CORNER_COMBINATIONS):
        try:
            TrainSpec.model_validate(with_params(base, params))
        except ValidationError as e:
            details = format_validation_error(e, TrainSpec, "").splitlines()[1:]
            blamed = sorted({str(err["loc"][0]) for err in e.errors() if err["loc"]} & _roots(params))
            where = f"space.{next(iter(params))}" if len(params) == 1 else "space"
            problems.append(
                f"{where}: with {_assignments(params)} the train spec is invalid"
                + (f" (in {', '.join(blamed)})" if blamed else "")
                + ":\n"
                + "\n".join(f"    {d.strip()}" for d in details)
            )
            if len(problems) >= 3:
                break
    return problems


def _roots(params: Mapping[str, Any]) -> set[str]:
    return {path.split(".", 1)[0] for path in params}


def _model_problems(train: TrainSpec, space: Mapping[str, AnyDimension]) -> list[str]:
    """Build the model at the corners of the dimensions it depends on, on the meta device (no
    memory, no weights, milliseconds): the task's build_model refuses an unknown architecture
    (naming the known ones), a kwarg the architecture does not take, or an image size it cannot
    use, exactly as the trainer would at the start of a trial."""
    touched = {
        path: dim for path, dim in space.items() if path in _MODEL_PATHS or path.startswith(_MODEL_PREFIXES)
    }
    if not touched:
        return []
    import torch

    task = get_task(train.task)
    base = train.model_dump(mode="json")
    problems: dict[str, str] = {}
    for params in _combinations(touched, MAX_MODEL_BUILDS):
        spec = TrainSpec.model_validate(with_params(base, params))
        error = _build_error(task, spec, torch.device("meta"))
        if error is not None and error not in problems:
            where = f"space.{next(iter(params))}" if len(params) == 1 else "space"
            problems[error] = f"{where}: with {_assignments(params)} the model cannot be built: {error}"
            if len(problems) >= 3:
                break
    return list(problems.values())


def _build_error(task: Task, spec: TrainSpec, device: Any) -> str | None:
    try:
        with device:
            task.build_model(
                spec.model.arch,
                ["a", "b"],  # the dataset's classes are not read here; any two classes do
                kwargs=spec.model.kwargs,
                image_size=spec.data.image_size,
            )
    except SpecError as e:
        return str(e)
    except Exception as e:
        # Not the user's spec: a module that cannot be built on the meta device (it reads a
        # tensor's values while it initialises). The trial's own build will judge it.
        log.debug("could not check %s on the meta device: %s", spec.model.arch, e)
    return None


def _sampler_problems(spec: TuneSpec) -> list[str]:
    name = spec.sampler.name
    if name == "grid":
        continuous = [p for p, d in spec.space.items() if grid_size(d) is None]
        if continuous:
            return [
                f"sampler: the grid sampler needs every dimension to be a choice or a stepped range; "
                f"{', '.join(continuous)} {'is' if len(continuous) == 1 else 'are'} continuous. Give each "
                f"a step (e.g. {DISTRIBUTION_EXAMPLES['float']}) or a choice, or use sampler: {{name: tpe}}."
            ]
        points = math.prod(grid_size(d) or 1 for d in spec.space.values())
        if points > MAX_GRID_POINTS:
            return [
                f"sampler: the grid has {points} points (more than {MAX_GRID_POINTS}); use larger steps, "
                "fewer choices, or sampler: {name: tpe}."
            ]
        if spec.trials > points:
            return [
                f"trials: {spec.trials}, but the grid has only {points} points and the grid sampler "
                f"tries each once; set trials: {points}."
            ]
    if name == "cmaes":
        categorical = [p for p, d in spec.space.items() if isinstance(d, Choice)]
        if categorical:
            # Optuna's CmaEsSampler would sample them at random, independently of everything
            # else (with a warning per trial): not the search the spec asks for.
            return [
                f"sampler: CMA-ES searches numeric ranges only; {', '.join(categorical)} "
                f"{'is a choice' if len(categorical) == 1 else 'are choices'} (Optuna would sample "
                "them at random). Use sampler: {name: tpe}, or make them ranges."
            ]
    return []


def _pruner_problems(spec: TuneSpec) -> list[str]:
    pruner = spec.pruner
    if pruner.name == "none":
        return []
    if spec.train.epochs is None:
        return [
            f"pruner: the {pruner.name} pruner judges trials by epochs, but the train spec runs "
            f"{spec.train.steps} steps; give the train spec `epochs` instead, or set pruner: {{name: none}}."
        ]
    max_epochs = spec.max_epochs()
    assert max_epochs is not None
    if max_epochs > spec.train.epochs:
        return [
            f"pruner.max_epochs: {max_epochs} is more than the {spec.train.epochs} epochs a trial runs; "
            f"leave it out or set at most pruner.max_epochs: {spec.train.epochs}."
        ]
    if pruner.min_epochs >= max_epochs:
        return [
            f"pruner.min_epochs: {pruner.min_epochs}, but trials run {max_epochs} epochs, so none would "
            f"ever be stopped early; set min_epochs below {max_epochs} (e.g. min_epochs: "
            f"{max(1, max_epochs // pruner.reduction_factor)})."
        ]
    every = spec.train.eval.every_epochs
    for epoch in rung_epochs(pruner.min_epochs, pruner.reduction_factor, max_epochs, pruner.name):
        if epoch % every:
            return [
                f"pruner: a trial is judged after {epoch} epochs, but the train spec evaluates every "
                f"{every} epochs, so it has no metric then; set train.eval.every_epochs to a divisor "
                f"of the rungs (e.g. 1), or pruner.min_epochs to a multiple of {every}."
            ]
    return []


def rung_epochs(min_epochs: int, reduction_factor: int, max_epochs: int, name: str = "asha") -> list[int]:
    """The epochs at which the pruner judges a trial (before its last): min_epochs ×
    reduction_factor^k for successive halving and Hyperband (every bracket's rungs are among
    them); every epoch from min_epochs on for the median pruner."""
    if name == "median":
        return list(range(min_epochs, max_epochs))
    rungs, epoch = [], min_epochs
    while epoch < max_epochs:
        rungs.append(epoch)
        epoch *= reduction_factor
    return rungs


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
    """specs.format_validation_error's style, for a TuneSpec: a space entry's distribution
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
        if loc[0] == "space" and len(loc) >= 3 and loc[2] in _KIND_CLASSES:
            kind = str(loc[2])
            loc = [*loc[:2], *loc[3:]]
        dotted = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden":
            if kind is not None:
                fields = _KIND_CLASSES[kind].model_fields.items()
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
