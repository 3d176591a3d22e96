"""`LOOP.yaml`: what a retraining loop watches, what it trains, and how a new model must prove
itself before it becomes the champion.

    name: digits-loop
    model: digits                 # the registered model; the loop improves its champion
    dataset: /data/digits         # the version the loop starts from; each round makes the next
    labels: /data/incoming        # `label import --out /data/incoming/round-3` drops labelled folders here
    trigger:                      # any one opens a round
      new_labels: 200             # labelled images waiting in `labels`
      drift_windows: 2            # consecutive drifting windows of `visionloop monitor`
      every_hours: 168            # a retrain on a schedule, with whatever labels are waiting
    train: train.yaml             # the train spec (a path, or inline); data.dataset is the round's
                                  # version and the champion's weights warm-start it
    job: {team: vision, priority: normal}   # what `visionloop submit` takes: resources, spot, ...
    gate: {max_drop: 1.0}         # `models promote`'s gate, on evaluations on the round's own data
    labelling_cost_per_image: 0.15
    rollout:                      # optional: a canary on the server before the champion moves
      server: http://10.0.0.5:8000  # a `visionloop serve` following this model's aliases
      key_env: VISIONLOOP_SERVE_KEY # the env var holding a key made with --routing (if keys are on)
      canary_percent: 10          # of bare-name requests the candidate answers
      shadow_percent: 50          # of requests mirrored to it, to measure agreement
      watch_minutes: 30
      min_requests: 200           # candidate answers needed to judge it
      max_error_rate_rise: 0.005  # failed answers (timeouts, full queue, NaN), over the champion's
      max_latency_ratio: 1.5      # candidate's p95 latency / the champion's
      min_agreement: 0.9          # top-1 agreement with the champion on mirrored requests

Without `rollout`, a candidate that passes the gate becomes the champion at once. With it, the
candidate is exported (the export gate), set as the challenger, given its canary share on the
server and watched; then it is promoted, or the challenger is removed and the round says why.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from visionloop.core.errors import SpecError
from visionloop.core.safeyaml import load_untrusted
from visionloop.core.strictbools import StrictBools
from visionloop.spec_files import read_spec_text, resolve_paths
from visionloop.specs import JobFields, TrainSpec, validate_train_spec

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
# What a missing LOOP.yaml's error shows.
MINIMAL_LOOP_SPEC = """name: digits-loop
model: digits                  # the registered model the loop retrains and promotes
dataset: /data/digits          # its dataset folder
labels: /data/digits-incoming  # where finished labels arrive
trigger: {new_labels: 200}
train: train.yaml              # a train spec, from this file's folder
"""


class _Strict(StrictBools):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TriggerSpec(_Strict):
    new_labels: int | None = Field(None, ge=1, description="labelled images waiting in `labels`")
    drift_windows: int | None = Field(None, ge=1, description="consecutive drifting monitor windows")
    every_hours: float | None = Field(None, gt=0, description="hours since the last round opened")

    @model_validator(mode="after")
    def _one(self) -> TriggerSpec:
        if self.new_labels is None and self.drift_windows is None and self.every_hours is None:
            raise ValueError("give at least one of new_labels, drift_windows, every_hours")
        return self


class GateSpec(_Strict):
    """The promotion gate (`visionloop models promote`), on evaluations of the candidate and
    the champion on the round's own evaluation split: how much worse the candidate may be."""

    max_drop: float = Field(1.0, ge=0, le=100, description="points of the clean primary metric")
    max_stress_drop: float = Field(2.0, ge=0, le=100, description="points of the stress mean")
    max_ece_rise: float = Field(0.02, ge=0, le=1, description="expected calibration error")
    stress: bool = Field(False, description="also evaluate under the corruptions (slower)")
    max_images: int | None = Field(None, ge=1, description="evaluate on at most this many images")


class RolloutSpec(_Strict):
    """The canary: how much traffic the candidate gets, for how long, and what it must show."""

    server: str = Field(description="the base URL of a `visionloop serve` following the model's aliases")
    key_env: str | None = Field(
        "VISIONLOOP_SERVE_KEY", description="the environment variable holding a --routing key (or unset)"
    )
    served_as: str | None = Field(None, description="the model's name on the server (default: model)")
    challenger_alias: str = Field("challenger", description="the server's challenger_alias")
    precision: Literal["fp32", "fp16", "int8"] = Field("fp32", description="the export the server serves")
    canary_percent: float = Field(10.0, ge=0, lt=100)
    shadow_percent: float = Field(0.0, ge=0, le=100)
    watch_minutes: float = Field(30.0, gt=0, le=7 * 24 * 60)
    # Past watch_minutes without min_requests answers, the watch goes on up to this long.
    max_watch_minutes: float | None = Field(None, gt=0, le=30 * 24 * 60)
    min_requests: int = Field(100, ge=1)
    max_error_rate_rise: float = Field(0.005, ge=0, le=1)
    max_latency_ratio: float | None = Field(1.5, gt=0)
    min_agreement: float | None = Field(None, ge=0, le=1)
    # The server must load the challenger within this long (it polls the registry).
    load_timeout_s: float = Field(300.0, gt=0, le=24 * 3600)

    @field_validator("server")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+/?$", v):
            raise ValueError("must be the server's base URL, like http://10.0.0.5:8000")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _measurable(self) -> RolloutSpec:
        if self.canary_percent == 0 and self.shadow_percent == 0:
            raise ValueError("give canary_percent or shadow_percent: with neither, nothing is watched")
        if self.min_agreement is not None and self.shadow_percent == 0:
            raise ValueError("min_agreement is measured on mirrored requests: set shadow_percent too")
        if self.max_watch_minutes is not None and self.max_watch_minutes < self.watch_minutes:
            raise ValueError("max_watch_minutes must be at least watch_minutes")
        return self

    @property
    def longest_watch_s(self) -> float:
        return 60.0 * (self.max_watch_minutes or 4 * self.watch_minutes)


class LoopSpec(_Strict):
    name: str
    model: str
    dataset: Path
    labels: Path
    trigger: TriggerSpec
    train: TrainSpec
    job: JobFields = Field(default_factory=JobFields)
    gate: GateSpec = Field(default_factory=GateSpec)
    labelling_cost_per_image: float | None = Field(None, ge=0, le=1000)
    # Where each round's dataset version goes (a folder the team's jobs may read). Default:
    # <home>/datasets/<name>/.
    datasets_dir: Path | None = None
    rollout: RolloutSpec | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(
                "must be lowercase letters, digits, - and _ (up to 64), starting with a letter or digit"
            )
        return v


def load_loop_spec(path: Path) -> LoopSpec:
    """Read and check LOOP.yaml; relative paths are taken from the file's folder (the train
    spec's own, from that spec's folder)."""
    path = Path(path).expanduser()
    text = read_spec_text(path, what="loop spec", example=MINIMAL_LOOP_SPEC)  # bounded, no FIFO
    try:
        doc = load_untrusted(text)  # no aliases: a few bytes can stand for billions
    except yaml.YAMLError as e:
        raise SpecError(f"{path} is not valid YAML: {e}") from e
    if not isinstance(doc, dict):
        raise SpecError(f"{path} must hold a mapping (name:, model:, dataset:, labels:, trigger:, train:)")
    return validate_loop_spec(doc, path.parent.resolve(), str(path))


def validate_loop_spec(doc: dict[str, Any], base: Path, where: str = "the loop spec") -> LoopSpec:
    doc = dict(doc)
    train = doc.get("train")
    if isinstance(train, str):
        train_path = (base / train).expanduser()
        try:
            train_doc = load_untrusted(read_spec_text(train_path))
        except SpecError as e:
            raise SpecError(f"{where}: {e}") from e
        except yaml.YAMLError as e:
            raise SpecError(f"{where}: cannot read the train spec {train_path}: {e}") from e
        train_base = train_path.parent
    else:
        train_doc, train_base = train, base
    if not isinstance(train_doc, dict):
        raise SpecError(f"{where}: train must be a train spec (a path to one, or the spec itself)")
    # The dataset is the loop's (each round's version): a placeholder keeps the train spec valid.
    train_doc = {
        **train_doc,
        "data": {**(train_doc.get("data") or {}), "dataset": str(doc.get("dataset", "."))},
    }
    train_spec = resolve_paths(validate_train_spec(train_doc, f"{where} (train)"), train_base)
    doc["train"] = train_spec.model_dump(mode="json")
    for key in ("dataset", "labels", "datasets_dir"):
        if isinstance(doc.get(key), str):
            doc[key] = str((base / doc[key]).expanduser().resolve())
    try:
        return LoopSpec.model_validate(doc)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise SpecError(f"{where}: {problems}") from e
