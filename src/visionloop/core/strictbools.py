"""Booleans stay booleans in user-written documents (specs, config files, request bodies).

Pydantic's lax mode turns `true` into 1 for an integer field and 1 or "yes" into `true` for a
boolean one: `epochs: true` trained for one epoch and `spot: "no"`-style typos in a flag were
read as something. Strict mode would fix that but also refuses a YAML list for a tuple field;
so this refuses only those two coercions, naming the field as pydantic does."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationInfo, field_validator


def bool_kinds(annotation: Any) -> tuple[bool, bool]:
    """(a bool is refused: the field takes a number and no bool; nothing but a bool is taken,
    besides None)."""
    if annotation is bool:
        return False, True
    if annotation in (int, float):
        return True, False
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        return bool_kinds(get_args(annotation)[0])
    if origin is Literal:
        values = get_args(annotation)
        return False, bool(values) and all(isinstance(v, bool) for v in values)
    if origin in (typing.Union, types.UnionType):
        parts = [bool_kinds(a) for a in get_args(annotation) if a is not type(None)]
        takes_bool = any(a is bool or _literal_bool(a) for a in get_args(annotation))
        return (any(p[0] for p in parts) and not takes_bool), bool(parts) and all(p[1] for p in parts)
    return False, False


def _literal_bool(annotation: Any) -> bool:
    return get_origin(annotation) is Literal and any(isinstance(v, bool) for v in get_args(annotation))


class StrictBools(BaseModel):
    """A base model whose number fields refuse true/false and whose flags take only them."""

    @field_validator("*", mode="before")
    @classmethod
    def _bools_stay_bools(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None:
            return value
        field = cls.model_fields.get(info.field_name)
        if field is None:
            return value
        no_bool, only_bool = bool_kinds(field.annotation)
        if no_bool and isinstance(value, bool):
            raise ValueError(f"should be a number, not {str(value).lower()}")
        if only_bool and value is not None and not isinstance(value, bool):
            raise ValueError("should be true or false")
        return value
