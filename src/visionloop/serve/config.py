"""The serving config: one YAML document that says what `visionloop serve` serves and how.

    model: digits                 # NAME (champion), NAME@ALIAS or NAME/VERSION
    precision: fp32               # which export to serve (run `visionloop export` first)
    max_batch_size: 8
    max_queue_delay_ms: 2.0
    queue_capacity: 256
    request_timeout_ms: 5000
    canary_percent: 10            # of bare-name requests answered by the challenger
    shadow_percent: 0             # of bare-name requests mirrored to the challenger, never returned
    collect:                      # keep a sample of the images sent, for labelling (off by default)
      enabled: true
      sample_rate: 0.01           # share of image-endpoint requests kept at random
      below_confidence: 0.5       # also keep every answer less confident than this
      max_bytes: 1073741824       # the whole store; past it nothing new is kept (and it is counted)
      retention_days: 30          # an image is deleted this long after it was last seen
      # dir: /data/collected      # default: $VISIONLOOP_HOME/serve/collected

`visionloop bench --latency-budget` writes one of these for the hardware it measured; every
field but `model` has a default. Unknown fields are errors (a typo must not silently fall back
to a default), and a bad value gets a message naming the field and a valid example.

`collect` stores the image file of a request to the image endpoint (classify, detect) as it
was sent, by content hash, beside its prediction record (`serve.collect`). It is off unless
`enabled`: a team may not be allowed to keep images of people. KServe v2 tensor requests are
never collected: there is no image file to keep.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from visionloop.core.errors import SpecError
from visionloop.core.strictbools import StrictBools
from visionloop.spec_errors import format_validation_error
from visionloop.spec_files import parse_yaml_mapping, read_spec_text

Precision = Literal["fp32", "fp16", "int8"]
# What an error shows when the file is missing or empty (`visionloop bench --latency-budget`
# writes a full one).
MINIMAL_SERVE_CONFIG = (
    "model: digits          # NAME (champion), NAME@ALIAS or NAME/VERSION\nprecision: int8\n"
)


class CollectConfig(StrictBools):
    """The `collect:` section: which answered image requests the server keeps for labelling,
    and for how long (see the module docstring; `serve.collect` does the keeping)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, examples=[True], description="off by default: images may show people")
    sample_rate: float = Field(
        0.0, ge=0.0, le=1.0, examples=[0.01], description="share of image requests kept at random"
    )
    below_confidence: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        examples=[0.5],
        description="also keep every request whose answer's confidence (a detector's best score) is below it",
    )
    max_bytes: int = Field(
        2**30, ge=1, examples=[1073741824], description="the whole store's size; past it nothing new is kept"
    )
    retention_days: float = Field(
        30.0, gt=0.0, examples=[30], description="images not seen for this long are deleted"
    )
    dir: Path | None = Field(
        None, examples=["/data/collected"], description="default: $VISIONLOOP_HOME/serve/collected"
    )

    @field_validator("dir")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser()

    @model_validator(mode="after")
    def _check(self) -> CollectConfig:
        if self.enabled and self.sample_rate == 0.0 and self.below_confidence is None:
            raise ValueError(
                "collect.enabled is true but no rule keeps anything: set collect.sample_rate (e.g. 0.01) "
                "and/or collect.below_confidence (e.g. 0.5), or set enabled: false"
            )
        return self


class ServeConfig(StrictBools):
    """What to serve and how; see the module docstring for an example file."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = Field(examples=["digits"], description="NAME, NAME@ALIAS or NAME/VERSION")
    models: list[str] = Field(
        default_factory=list, examples=[["pets@champion"]], description="more models served beside `model`"
    )
    format: Literal["onnx"] = Field("onnx", examples=["onnx"])
    precision: Precision = Field("fp32", examples=["fp16"])
    device: Literal["cpu", "cuda"] = Field("cpu", examples=["cpu"])
    max_batch_size: int = Field(8, ge=1, le=1024, examples=[8])
    max_queue_delay_ms: float = Field(
        2.0, ge=0.0, le=10_000.0, examples=[2.0], description="how long a batch waits to fill up"
    )
    batch_concurrency: int = Field(
        2, ge=1, le=64, examples=[2], description="batches of one version computing at once"
    )
    queue_capacity: int = Field(256, ge=1, le=1_000_000, examples=[256], description="per model version")
    request_timeout_ms: float = Field(5000.0, gt=0.0, examples=[5000.0])
    head_timeout_s: float = Field(
        30.0,
        gt=0.0,
        le=3600.0,
        examples=[30.0],
        description="how long a request's line and headers may take to arrive (then 408 and closed)",
    )

    host: str = Field("127.0.0.1", examples=["0.0.0.0"])
    port: int = Field(8000, ge=0, le=65535, examples=[8000])

    champion_alias: str = Field("champion", examples=["champion"])
    challenger_alias: str = Field("challenger", examples=["challenger"])
    canary_percent: float = Field(0.0, ge=0.0, le=100.0, examples=[10.0])
    shadow_percent: float = Field(0.0, ge=0.0, le=100.0, examples=[100.0])
    alias_poll_s: float = Field(1.0, gt=0.0, le=3600.0, examples=[1.0])
    drain_timeout_s: float = Field(
        30.0, ge=0.0, examples=[30.0], description="how long a replaced version may finish its queue"
    )

    max_body_bytes: int = Field(32 * 2**20, ge=1024, examples=[33554432])
    top_k: int | None = Field(
        None,
        ge=1,
        le=1000,
        examples=[5],
        description="items (classes, boxes) the image endpoint returns when a request gives no top_k; "
        "none: the task's default",
    )
    max_image_pixels: int = Field(
        24_000_000, ge=1, le=1_000_000_000, examples=[24000000], description="largest image decoded"
    )
    max_concurrent_decodes: int = Field(
        0, ge=0, le=256, examples=[2], description="images decoded at once; 0 = min(4, CPUs)"
    )
    max_concurrent_parses: int = Field(
        0,
        ge=0,
        le=256,
        examples=[2],
        description="large bodies parsed (or responses encoded) at once; 0 = min(4, CPUs)",
    )
    intra_op_threads: int = Field(0, ge=0, le=256, examples=[2], description="ONNX Runtime threads; 0 = auto")

    prediction_log: bool = Field(True, examples=[True])
    prediction_log_max_mb: float = Field(
        64.0, gt=0.0, examples=[64.0], description="per file, before rotating"
    )
    prediction_log_backups: int = Field(4, ge=0, le=1000, examples=[4])
    prediction_log_monitor: bool = Field(
        True,
        examples=[True],
        description="record what `visionloop monitor` compares in each prediction record: the task's drift "
        "outputs (a classifier's probabilities) and an image request's statistics (brightness, ...)",
    )
    collect: CollectConfig = Field(
        default_factory=CollectConfig,
        examples=[{"enabled": True, "sample_rate": 0.01}],
        description="keep a sample of the images sent, for labelling (off by default)",
    )

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        from visionloop.registry.layout import check_alias, parse_ref

        # The references must parse now, not at the first request.
        for ref in (self.model, *self.models):
            parse_ref(ref)
        names = [parse_ref(r).name for r in (self.model, *self.models)]
        if len(set(names)) != len(names):
            raise ValueError(f"each model may be served once, got {names}; serve one reference per name")
        check_alias(self.champion_alias)
        check_alias(self.challenger_alias)
        if self.champion_alias == self.challenger_alias:
            raise ValueError("champion_alias and challenger_alias must differ")
        if self.canary_percent == 100.0:
            # 100% canary is a promotion: say so rather than serve the champion to nobody.
            raise ValueError("canary_percent 100 sends nothing to the champion; promote instead")
        return self

    @property
    def refs(self) -> list[str]:
        return [self.model, *self.models]


def validate_serve_config(doc: dict[str, Any], source: str = "the serving config") -> ServeConfig:
    try:
        return ServeConfig.model_validate(doc)
    except ValidationError as e:
        raise SpecError(format_validation_error(e, ServeConfig, source)) from e


def load_serve_config(path: Path, **overrides: Any) -> ServeConfig:
    """Read a serving config YAML file; `overrides` (unset = None) win over the file."""
    text = read_spec_text(Path(path), what="serving config", example=MINIMAL_SERVE_CONFIG)
    if not text.strip():
        raise SpecError(f"{path} is empty. A minimal serving config:\n{MINIMAL_SERVE_CONFIG}")
    doc = parse_yaml_mapping(text, str(path))
    doc.update({k: v for k, v in overrides.items() if v is not None})
    return validate_serve_config(doc, str(path))


def dump_serve_config(config: ServeConfig) -> str:
    """The config as YAML, fields in declaration order (what `bench` writes)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
