"""The bodies the control-plane API accepts: every field bounded, unknown fields refused, so
a malformed request is a 422 that names the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field

from visionloop.core.strictbools import StrictBools


def _no_nul(value: str) -> str:
    # PostgreSQL refuses NUL in text: before, a NUL in a token label, a GPU name or a team
    # asked for was a 422 blaming the database ("check the database is reachable").
    if "\x00" in value:
        raise ValueError("contains a NUL character (\\x00); remove it")
    return value


def _team_name(value: str) -> str:
    if not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError(
            f"{value[:64]!r} is not a team name: use letters, digits, '-', '_' or '.' (e.g. vision)"
        )
    return value


# Free text the store keeps (labels, reasons, paths, keys): bounded by each field, never NUL.
Text = Annotated[str, AfterValidator(_no_nul)]
# A team's name, as cluster.toml and `visionloop admin team set` accept it.
TeamName = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_team_name)]


class SubmitBody(StrictBools):
    model_config = ConfigDict(extra="forbid")
    spec: dict[str, Any] = Field(description="a job spec, or a bare train spec (absolute paths)")
    team: TeamName | None = None
    priority: str | None = None
    gpus: int | None = Field(None, ge=0, le=1024)
    spot: Literal["never", "allowed", "preferred"] | None = None
    # Overrides the spec's `max_runtime` (6h, 90m, 2d or seconds); checked with the spec.
    max_runtime: str | float | None = None
    idempotency_key: Text | None = Field(None, min_length=1, max_length=200)


class ResumeBody(StrictBools):
    model_config = ConfigDict(extra="forbid")
    until_epoch: int | None = Field(None, ge=1, le=1_000_000, description="the next rung; null: the end")
    reason: Text | None = Field(None, max_length=500)


class PruneBody(StrictBools):
    model_config = ConfigDict(extra="forbid")
    reason: Text | None = Field(None, max_length=500)


class TeamBody(StrictBools):
    model_config = ConfigDict(extra="forbid")
    nominal_gpus: int = Field(ge=0, le=100_000)
    borrow_limit: int = Field(0, ge=0, le=100_000)
    weight: float = Field(1.0, gt=0, le=1000, allow_inf_nan=False)


class TokenBody(StrictBools):
    model_config = ConfigDict(extra="forbid")
    team: TeamName | None = None
    admin: bool = False
    label: Text = Field("", max_length=200)


class LabellingBody(StrictBools):
    model_config = ConfigDict(extra="forbid")
    dataset_version: str = Field(pattern=r"^[0-9a-f]{64}$", description="the version the labels produced")
    dataset_path: Text = Field(min_length=1, max_length=4096)
    parent_version: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    images: int = Field(ge=0, le=1_000_000_000, description="images labelled")
    cost: float = Field(ge=0, le=1e9, allow_inf_nan=False, description="in the price catalog's currency")
    team: TeamName | None = Field(None, description="who paid (admin tokens only)")


class SpotBody(StrictBools):
    model_config = ConfigDict(extra="forbid")
    target: Text = Field(min_length=1, max_length=200, description="a GPU id or a node name")
    reason: Text | None = Field(None, max_length=500)
