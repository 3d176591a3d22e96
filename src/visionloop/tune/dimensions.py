"""The dimensions of a tune spec's search space: one distribution per `space:` entry
(`loguniform`, `uniform`, `int`, `float`, `choice`), each validated as it is written, and what
a sampler needs to know of it (`kind_of`, `grid_size`). `visionloop.tune.spec` holds the spec
around them; `visionloop.tune.space` turns them into Optuna's suggestions."""

from __future__ import annotations

import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Annotated, Any, TypeAlias

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from visionloop.core.strictbools import StrictBools

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


class TuneModel(StrictBools):
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


class LogUniform(TuneModel):
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


class Uniform(TuneModel):
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


class IntRange(TuneModel):
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


class FloatRange(TuneModel):
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


class Choice(TuneModel):
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
        for kind, cls in KIND_CLASSES.items():
            if isinstance(value, cls):
                return kind
    return None


KIND_CLASSES: dict[str, type[TuneModel]] = {
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
