"""The bodies the control-plane API accepts: every field bounded, unknown fields refused, so
a malformed request is a 422 that names the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class SubmitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: dict[str, Any] = Field(description="a job spec, or a bare train spec (absolute paths)")
    team: str | None = None
    priority: str | None = None
    gpus: int | None = Field(None, ge=0, le=1024)
    spot: Literal["never", "allowed", "preferred"] | None = None
    # Overrides the spec's `max_runtime` (6h, 90m, 2d or seconds); checked with the spec.
    max_runtime: str | float | None = None
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)


class ResumeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    until_epoch: int | None = Field(None, ge=1, le=1_000_000, description="the next rung; null: the end")
    reason: str | None = Field(None, max_length=500)


class PruneBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str | None = Field(None, max_length=500)


class TeamBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nominal_gpus: int = Field(ge=0, le=100_000)
    borrow_limit: int = Field(0, ge=0, le=100_000)
    weight: float = Field(1.0, gt=0, le=1000)


class TokenBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    team: str | None = Field(None, min_length=1, max_length=64)
    admin: bool = False
    label: str = Field("", max_length=200)


class LabellingBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dataset_version: str = Field(pattern=r"^[0-9a-f]{64}$", description="the version the labels produced")
    dataset_path: str = Field(min_length=1, max_length=4096)
    parent_version: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    images: int = Field(ge=0, le=1_000_000_000, description="images labelled")
    cost: float = Field(ge=0, le=1e9, allow_inf_nan=False, description="in the price catalog's currency")
    team: str | None = Field(None, min_length=1, max_length=64, description="who paid (admin tokens only)")


class SpotBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: str = Field(min_length=1, max_length=200, description="a GPU id or a node name")
    reason: str | None = Field(None, max_length=500)
