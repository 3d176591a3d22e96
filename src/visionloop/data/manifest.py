"""`dataset.json`: what a built dataset is, in one small typed document.

The manifest is the contract between ingest (which writes it) and everything that reads a
dataset (the loader, the trainer, the model card). Its `version` is a content hash over the
images and labels, so "which data trained this model" has a one-word answer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from visionloop.core.errors import DataError
from visionloop.core.fsutil import TooLargeError, atomic_write_text, read_capped

MANIFEST_NAME = "dataset.json"
REJECTED_NAME = "rejected.jsonl"
DUPLICATES_NAME = "duplicates.jsonl"
SHARDS_DIR = "shards"
METADATA_DIR = "metadata"  # per-image metadata, one JSON-lines file per split (`data.metadata`)
FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")
# A manifest is a few KiB; a bigger file is not one, and must not be parsed into memory.
MAX_MANIFEST_BYTES = 4 * 2**20
# shard_dir is a relative path of plain names (none starts with a dot): never absolute, never
# `..`, so a manifest can only point inside its own dataset folder.
_PLAIN_RELATIVE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(?:/[A-Za-z0-9_][A-Za-z0-9_.-]*)*")
# Per-image metadata columns (camera, site, time_of_day): at most this many, each a simple name.
MAX_METADATA_COLUMNS = 32
METADATA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
METADATA_NAME_RULE = "letters, digits, _ . - (up to 64 characters, starting with a letter or _)"

SplitName = Literal["train", "val", "test"]
# What a source was read as: "imagefolder", "csv", or a format a task reads (`Task.source_formats`).
SourceKind = str


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImagePolicy(_Strict):
    """How every stored image was normalised at ingest."""

    mode: Literal["RGB"] = "RGB"
    max_side: int | None = Field(None, description="longest side after ingest; None keeps the source size")
    alpha_background: tuple[int, int, int] = (255, 255, 255)
    lossy_quality: int = Field(95, description="JPEG quality used when a lossy source must be re-encoded")
    min_side: int = 1
    max_pixels: int = 100_000_000
    max_aspect: float = 100.0


class SourceInfo(_Strict):
    kind: SourceKind = Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")
    path: str
    files_seen: int


class SplitPolicy(_Strict):
    seed: int
    val_fraction: float
    test_fraction: float
    from_source: bool = Field(
        description="True when the source gave the split (train/ val/ test/ or a CSV column)"
    )


class SplitInfo(_Strict):
    count: int
    per_class: dict[str, int]
    shard_dir: str = Field(description="litdata chunk folder, relative to the dataset folder")
    bytes: int

    @field_validator("shard_dir")
    @classmethod
    def _inside(cls, v: str) -> str:
        if not _PLAIN_RELATIVE.fullmatch(v):
            raise ValueError(
                f"shard_dir must be a relative path of plain names inside the dataset folder, like "
                f"'shards/train', got {v!r}"
            )
        return v


class ChannelStats(_Strict):
    """Per-channel pixel statistics of the stored train split, in [0, 1]."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]


class SizeStats(_Strict):
    """Stored image sizes (after --max-side), as (width, height)."""

    min: tuple[int, int]
    median: tuple[int, int]
    max: tuple[int, int]


class LineageStep(_Strict):
    """One step of a dataset's history (`visionloop data add`): the version it started from,
    and what the step added and relabelled, from which folder, picked by which selection."""

    parent: str = Field(description="the version this step started from")
    parent_path: str = Field(description="where that version was when this one was made")
    added: dict[SplitName, int] = Field(description="new images per split")
    relabelled: int = Field(ge=0, description="images of the parent stored with new labels")
    source: str = Field(description="the labelled folder the new images and labels came from")
    # The `visionloop label select --out` file that picked the images, when one was given.
    selection: str | None = None
    # What the labels cost (`--cost-per-image` times the images labelled), in the ledger's
    # currency; None when no price was given.
    labelling_cost: float | None = Field(None, ge=0.0)
    created_at: str

    @property
    def labelled(self) -> int:
        """The images a person labelled for this step: the new ones and the relabelled."""
        return sum(self.added.values()) + self.relabelled

    def bill(self, version: str, path: Path) -> dict[str, Any] | None:
        """The cost ledger's entry for this step (`Client.record_labelling`'s arguments), or
        None when no price was given."""
        if self.labelling_cost is None:
            return None
        return {
            "dataset_version": version,
            "dataset_path": str(path),
            "images": self.labelled,
            "cost": self.labelling_cost,
            "parent_version": self.parent,
        }


# A history longer than this is not a dataset's: each step is ~300 bytes of the manifest.
MAX_LINEAGE = 1000


class DatasetManifest(_Strict):
    format_version: int = FORMAT_VERSION
    version: str = Field(description="content hash over images, labels and splits: the dataset's version")
    # The registered task that reads this dataset (`visionloop.tasks.get_task`).
    task: str = Field("classification", pattern=r"^[a-z][a-z0-9_]{0,63}$")
    classes: list[str]
    splits: dict[SplitName, SplitInfo]
    image_policy: ImagePolicy
    source: SourceInfo
    split_policy: SplitPolicy
    channel_stats: ChannelStats
    size_stats: SizeStats
    rejected: int = 0
    duplicates: int = 0
    created_at: str
    visionloop_version: str
    # What the dataset's task counts beyond images per class (objects per class and size, ...):
    # JSON that the task alone reads, with its own model (`Task.dataset_stats`). Left out of
    # the JSON when None, so that a manifest without it is written exactly as before (older
    # readers forbid extra keys).
    task_stats: dict[str, JsonValue] | None = None
    # The per-image metadata columns ingest kept (a CSV's extra columns, a COCO image's own
    # fields), in order; their values are in METADATA_DIR/<split>.jsonl (`data.metadata`).
    # Left out of the JSON when None, as task_stats: a dataset without metadata keeps the
    # manifest and the version it had before metadata existed.
    metadata_columns: list[str] | None = None
    # How this version came from earlier ones (`visionloop data add`), nearest step first: the
    # first entry's parent is this version's parent, the last entry's parent the first
    # version, ingested from a source. None (left out of the JSON, as task_stats) for a
    # version ingested directly.
    lineage: list[LineageStep] | None = Field(None, max_length=MAX_LINEAGE)

    @field_validator("metadata_columns")
    @classmethod
    def _simple_columns(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v or len(v) > MAX_METADATA_COLUMNS:
            raise ValueError(f"metadata_columns must list 1 to {MAX_METADATA_COLUMNS} names, got {len(v)}")
        bad = [name for name in v if not METADATA_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"metadata column {bad[0][:80]!r} is not a simple name ({METADATA_NAME_RULE})")
        if len(set(v)) != len(v):
            raise ValueError("metadata_columns names a column twice")
        return v

    @model_validator(mode="before")
    @classmethod
    def _task_stats_of_older_manifests(cls, data: Any) -> Any:
        # Manifests written before the task owned its statistics keep them under the task's
        # own key (`"<task name>": {...}`): still readable, now as task_stats.
        if isinstance(data, dict) and "task_stats" not in data:
            task = data.get("task")
            if isinstance(task, str) and task in data and task not in cls.model_fields:
                data = dict(data)
                data["task_stats"] = data.pop(task)
        return data

    @model_serializer(mode="wrap")
    def _drop_absent_optional_fields(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for key in ("task_stats", "metadata_columns", "lineage"):
                if key in data and data[key] is None:
                    del data[key]
        return data

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def ancestry(self) -> list[str]:
        """The versions this one came from, its parent first, back to the first version
        (empty for a version ingested directly)."""
        return [step.parent for step in self.lineage or ()]


# The split every stage evaluates on: validation when the dataset has one, else test. Train's
# per-epoch evaluation, export's gate and bench's accuracy must all measure the same images.
EVAL_SPLIT_ORDER: tuple[SplitName, ...] = ("val", "test")


def eval_split(manifest: DatasetManifest) -> SplitName | None:
    """The split to evaluate on ("val", else "test"); None when the dataset has neither."""
    for split in EVAL_SPLIT_ORDER:
        info = manifest.splits.get(split)
        if info is not None and info.count > 0:
            return split
    return None


def manifest_path(dataset_dir: Path) -> Path:
    return Path(dataset_dir) / MANIFEST_NAME


def shard_dir_of(dataset_dir: Path, info: SplitInfo) -> Path:
    """The split's shard folder, refused when it resolves outside the dataset folder (a link
    to another folder would let a dataset read shards that its owner may not)."""
    path = Path(dataset_dir) / info.shard_dir
    if not path.resolve().is_relative_to(Path(dataset_dir).resolve()):
        raise DataError(
            f"{path} leads outside the dataset folder {dataset_dir} (a symbolic link?); a dataset's "
            "shards must lie inside it. Re-run `visionloop data ingest` to rebuild the dataset."
        )
    return path


def write_manifest(dataset_dir: Path, manifest: DatasetManifest) -> None:
    atomic_write_text(manifest_path(dataset_dir), manifest.model_dump_json(indent=2) + "\n")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a manifest may hold")


def read_manifest(dataset_dir: Path) -> DatasetManifest:
    """Load and validate `DIR/dataset.json`, with errors that say how to get a good one."""
    path = manifest_path(dataset_dir)
    # exists(), not is_file(): a dataset.json that is a FIFO or a folder is named as such below
    # (read_capped) instead of being reported missing.
    if not path.exists():
        hint = (
            f"{dataset_dir} does not exist"
            if not Path(dataset_dir).exists()
            else f"{dataset_dir} has no {MANIFEST_NAME}"
        )
        raise DataError(
            f"{hint}: it is not a visionloop dataset. Build one with "
            f"`visionloop data ingest SOURCE --out {dataset_dir}`."
        )
    if not path.resolve().is_relative_to(Path(dataset_dir).resolve()):
        # As shard_dir_of: a manifest linked from elsewhere would describe another dataset (or
        # quote a file its owner may not read) under this folder's name.
        raise DataError(
            f"{path} is a link leading outside the dataset folder {dataset_dir}; a dataset's manifest "
            "must lie inside it. Re-run `visionloop data ingest` to rebuild the dataset."
        )
    try:
        # read_capped: a FIFO or device under the manifest's name must not hang the reader.
        data = read_capped(path, MAX_MANIFEST_BYTES, what="a dataset manifest")
        # NaN and Infinity are not JSON (ingest never writes them): a NaN channel mean would
        # pass validation and normalise every image to NaN.
        raw = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except TooLargeError:
        raise DataError(
            f"{path} is over {MAX_MANIFEST_BYTES // 2**20} MiB, far more than a dataset manifest "
            "holds; it is not one. Re-run `visionloop data ingest`."
        ) from None
    except (OSError, ValueError) as e:  # also UnicodeDecodeError, JSONDecodeError, 5000 digits
        why = str(e).split("; use sys.set_int_max_str_digits")[0]
        raise DataError(f"{path} cannot be read as JSON ({why}); re-run `visionloop data ingest`.") from e
    except RecursionError as e:
        raise DataError(f"{path} nests too deeply to be a manifest; re-run `visionloop data ingest`.") from e
    version = raw.get("format_version", FORMAT_VERSION) if isinstance(raw, dict) else FORMAT_VERSION
    if not isinstance(version, int) or isinstance(version, bool):
        # compared with > below: a string would raise TypeError (a traceback), not this error.
        raise DataError(
            f"{path} has format_version {str(version)[:40]!r}, not a number; re-run `visionloop data ingest`."
        )
    if version > FORMAT_VERSION:
        raise DataError(
            f"{path} has format_version {version}, newer than this visionloop understands "
            f"({FORMAT_VERSION}); upgrade visionloop."
        )
    try:
        return DatasetManifest.model_validate(raw)
    except ValidationError as e:
        raise DataError(
            f"{path} is not a valid dataset manifest:\n{e}\nRe-run `visionloop data ingest`."
        ) from e
