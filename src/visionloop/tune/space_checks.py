"""The checks a tune spec's search space goes through beyond its field types: every path names
a field of the train spec (or a key under the free-form `model.kwargs`), the train spec still
validates at every corner of the space, a space that touches the model builds on PyTorch's
meta device, and the sampler and pruner fit the space and the train spec's epochs. Each check
returns the problems it found, worded for the user (`visionloop.tune.spec` raises them)."""

from __future__ import annotations

import copy
import difflib
import itertools
import logging
import math
from collections.abc import Iterator, Mapping
from types import NoneType, UnionType
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ValidationError,
)

from visionloop.core.errors import SpecError
from visionloop.spec_errors import example_for, format_validation_error, yaml_inline
from visionloop.spec_files import NotASectionError, set_dotted
from visionloop.specs import TrainSpec
from visionloop.tasks.registry import get_task
from visionloop.tune.dimensions import (
    DISTRIBUTION_EXAMPLES,
    DISTRIBUTION_FORMS,
    DISTRIBUTIONS,
    MAX_GRID_POINTS,
    AnyDimension,
    Choice,
    grid_size,
    kind_of,
)

if TYPE_CHECKING:
    from visionloop.tasks.base import Task
    from visionloop.tune.spec import TuneSpec

log = logging.getLogger(__name__)

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


def space_problems(spec: TuneSpec) -> list[str]:
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


def with_params(train_doc: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `train_doc` with each dotted path in `params` set to its value."""
    doc = copy.deepcopy(dict(train_doc))
    for path, value in params.items():
        try:
            set_dotted(doc, path, value)
        except NotASectionError as e:
            raise SpecError(f"{path}: `{e.key}` is a value in the train spec, not a section.") from None
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


def sampler_problems(spec: TuneSpec) -> list[str]:
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


def pruner_problems(spec: TuneSpec) -> list[str]:
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
