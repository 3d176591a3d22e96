"""Error messages for a spec that does not validate: `format_validation_error` turns pydantic's
errors into lines that name each field, the value given (cut short by `shown_value`) and a
valid example taken from the field's `examples` (`example_for`), or, for an unknown field, the
closest known one. Generic over any spec model: the train, job, tune, loop and serving specs
all word their errors through it."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError


def example_for(model: type[BaseModel], loc: Sequence[int | str]) -> Any:
    """The `examples` of the field at `loc`, walking nested spec models."""
    current: Any = model
    example: Any = None
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return example
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        example = field.examples[0] if field.examples else None
        # `BudgetSpec | None`: the section's own fields have the examples.
        models = [a for a in (field.annotation, *get_args(field.annotation)) if _is_model(a)]
        current = models[0] if models else None
    return example


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def fields_at(model: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    current: Any = model
    for part in loc:
        field = current.model_fields.get(str(part)) if _is_model(current) else None
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return []
        current = field.annotation
    return list(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []


def format_validation_error(e: ValidationError, model: type[BaseModel], source: str) -> str:
    lines = [f"{source} is not a valid {model.__name__}:"]
    for err in e.errors():
        loc = list(err["loc"])
        dotted = ".".join(str(p) for p in loc) or "(top level)"
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            known = fields_at(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f" Did you mean `{close[0]}`?" if close else f" Known fields here: {', '.join(known)}."
            lines.append(f"  - {dotted}: unknown field.{hint}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        shown = "missing" if err["type"] == "missing" else f"got {shown_value(value)}"
        line = f"  - {dotted}: {msg} ({shown})."
        names = [p for p in loc if isinstance(p, str)]
        example = example_for(model, names)
        if example is not None and names:  # `betas.0`: the example is the field's, betas
            line += f" Example: {names[-1]}: {yaml_inline(example)}"
        lines.append(line)
    return "\n".join(lines)


MAX_SHOWN_CHARS = 200


def shown_value(value: Any) -> str:
    """`repr(value)` for an error message, cut short: a 100 kB string or a list of thousands
    given where a number goes is named, not printed whole."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else f"{text[:MAX_SHOWN_CHARS]}... ({len(text):,} characters)"


def yaml_inline(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("...\n").strip()
