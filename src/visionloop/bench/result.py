"""What a benchmark sweep measured, as data: the JSON file is `BenchResult.model_dump_json()`.

One `ConfigResult` per (format, precision, device); a configuration that could not run is
still there, with status "skipped" or "failed" and the reason, so the table and the file show
what was *not* measured and why instead of silently leaving it out.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from visionloop.bench.stats import LatencyStats
from visionloop.core.errors import VisionloopError

RESULT_FORMAT_VERSION = 1
# A sweep's bench.json is tens of kB; far more is not one.
MAX_RESULT_BYTES = 16 * 2**20

Format = Literal["pytorch", "onnx"]
Precision = Literal["fp32", "fp16", "int8"]
Device = Literal["cpu", "cuda"]
Status = Literal["ok", "skipped", "failed"]

FORMATS: tuple[str, ...] = get_args(Format)
PRECISIONS: tuple[str, ...] = get_args(Precision)
DEVICES: tuple[str, ...] = get_args(Device)


class BenchError(VisionloopError):
    """A benchmark cannot start: bad options, or nothing to measure."""

    exit_code = 2


class SweepSettings(BaseModel):
    """What to sweep and how long to time each point. Build it with `sweep_settings()`,
    which checks every option with a message a user can act on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    formats: tuple[Format, ...] = ("pytorch", "onnx")
    precisions: tuple[Precision, ...] = ("fp32", "fp16", "int8")
    devices: tuple[Device, ...] = ("cpu",)
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    # Exactly this many timed calls per batch size when set; otherwise as many as fit in
    # duration_s (at least min_iterations): a fixed count keeps tests tiny, a duration keeps
    # a big model at batch 32 from taking minutes.
    iterations: int | None = None
    duration_s: float = 2.0
    min_iterations: int = 10
    warmup: int = 3
    # Preprocessed images are held in memory as float32: 1000 at 3x224x224 is ~600 MB.
    max_eval_images: int | None = 1000
    accuracy: bool = True
    threads: int | None = None


# Upper bounds on what a sweep may be asked for. Without them --batch-sizes 99999999 tried to
# allocate a 99999999-image batch (tens of TB) and --warmup 10**9 ran for days.
MAX_BATCH_SIZE = 4096
MAX_WARMUP = 10_000
MAX_ITERATIONS = 100_000  # = sweep.MAX_CALLS: more would be silently cut there
MAX_DURATION_S = 3600.0
MAX_THREADS = 1024


def _cut(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _shown(raw: str) -> str:
    return repr(_cut(raw))  # a pasted file is not echoed back whole


def _split(values: Sequence[str] | str) -> list[str]:
    if isinstance(values, str):
        values = [values]
    return [v.strip().lower() for item in values for v in str(item).split(",") if v.strip()]


def _choices(option: str, values: Sequence[str] | str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    picked = _split(values)
    if not picked:
        raise BenchError(f"{option} needs at least one value, e.g. {option} {','.join(allowed)}.")
    bad = [v for v in picked if v not in allowed]
    if bad:
        raise BenchError(
            f"{option}: unknown value(s) {', '.join(map(_shown, bad[:5]))}; choose from {', '.join(allowed)} "
            f"(e.g. {option} {','.join(allowed[:2])})."
        )
    return tuple(dict.fromkeys(picked))  # keep the user's order, drop repeats


def sweep_settings(
    *,
    formats: Sequence[str] | str = FORMATS,
    precisions: Sequence[str] | str = PRECISIONS,
    devices: Sequence[str] | str = ("cpu",),
    batch_sizes: Sequence[int | str] | str = (1, 8, 32),
    iterations: int | None = None,
    duration_s: float = 2.0,
    warmup: int = 3,
    max_eval_images: int | None = 1000,
    accuracy: bool = True,
    threads: int | None = None,
) -> SweepSettings:
    """Checked sweep settings; lists may also be given as "a,b,c" strings (the CLI's form)."""
    sizes: list[int] = []
    for raw in _split(batch_sizes if isinstance(batch_sizes, str) else [str(b) for b in batch_sizes]):
        try:
            size = int(raw)
        except ValueError:
            raise BenchError(
                f"--batch-sizes: {_shown(raw)} is not a whole number; e.g. --batch-sizes 1,8,32."
            ) from None
        if not 1 <= size <= MAX_BATCH_SIZE:
            raise BenchError(
                f"--batch-sizes: {_cut(str(size))} is not a batch size; use whole numbers from 1 to "
                f"{MAX_BATCH_SIZE}, e.g. 1,8,32."
            )
        sizes.append(size)
    if not sizes:
        raise BenchError("--batch-sizes needs at least one value, e.g. --batch-sizes 1,8,32.")
    if iterations is not None and not 1 <= iterations <= MAX_ITERATIONS:
        raise BenchError(
            f"--iterations must be >= 1 and at most {MAX_ITERATIONS} (got {iterations}); "
            "e.g. --iterations 20."
        )
    # `0 < d <= max` is False for nan as well as inf: neither is a duration.
    if not 0 < duration_s <= MAX_DURATION_S:
        raise BenchError(
            f"--duration must be > 0 and at most {MAX_DURATION_S:g} seconds (got {duration_s}); "
            "e.g. --duration 2."
        )
    if not 0 <= warmup <= MAX_WARMUP:
        raise BenchError(
            f"--warmup must be >= 0 and at most {MAX_WARMUP} calls (got {warmup}); e.g. --warmup 3."
        )
    if max_eval_images is not None and max_eval_images < 1:
        raise BenchError(f"--eval-images must be >= 1 (got {max_eval_images}); e.g. --eval-images 1000.")
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise BenchError(
            f"--threads must be >= 1 and at most {MAX_THREADS} (got {threads}); e.g. --threads 2."
        )
    return SweepSettings(
        formats=_choices("--formats", formats, FORMATS),
        precisions=_choices("--precisions", precisions, PRECISIONS),
        devices=_choices("--device", devices, DEVICES),
        batch_sizes=tuple(sorted(set(sizes))),
        iterations=iterations,
        duration_s=duration_s,
        warmup=warmup,
        max_eval_images=max_eval_images,
        accuracy=accuracy,
        threads=threads,
    )


class BatchPoint(LatencyStats):
    """Latency and throughput at one batch size, and the memory it took."""

    peak_memory_bytes: int | None = Field(
        None,
        description="CPU: resident-set high-water mark above the RSS before the model loaded; "
        "CUDA: device memory high-water mark",
    )


class ConfigResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Format
    precision: Precision
    device: Device
    status: Status
    reason: str | None = None
    model_path: str | None = None
    size_bytes: int | None = None
    accuracy: float | None = Field(
        None,
        description="the task's gate metric on the evaluation images, 0..1 (BenchResult.metric names it: "
        "top-1 accuracy, or mAP)",
    )
    eval_images: int | None = None
    provider: str | None = Field(None, description="what ran it: torch, or the ONNX Runtime provider")
    memory_kind: Literal["rss", "cuda"] | None = None
    points: list[BatchPoint] = Field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.format} {self.precision} {self.device}"

    @property
    def status_text(self) -> str:
        return self.status if self.status == "ok" or not self.reason else f"{self.status}: {self.reason}"

    @property
    def peak_memory_bytes(self) -> int | None:
        peaks = [p.peak_memory_bytes for p in self.points if p.peak_memory_bytes is not None]
        return max(peaks) if peaks else None


class BenchResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format_version: int = RESULT_FORMAT_VERSION
    model: str = Field(description="what was benchmarked: NAME/VERSION, or a path")
    name: str | None = None
    version: int | None = None
    arch: str
    input_size: tuple[int, int, int]
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    machine: dict[str, str | int | float | None] = Field(default_factory=dict)
    settings: SweepSettings
    eval_source: str | None = Field(None, description="dataset split the accuracy was measured on")
    # How the task names the gate metric in the accuracy column (Task.metric_label).
    metric: str = "top-1"
    eval_images: int = 0
    configs: list[ConfigResult] = Field(default_factory=list)

    def ok_configs(self) -> Iterator[ConfigResult]:
        return (c for c in self.configs if c.status == "ok")

    def save(self, path: Path) -> Path:
        from visionloop.core.fsutil import atomic_write_text

        atomic_write_text(path, self.model_dump_json(indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> BenchResult:
        # read_json: bounded, never waits on a FIFO, and turns non-UTF-8 bytes and deep nesting
        # into an error (read_text + json.loads hung on a FIFO and raised UnicodeDecodeError and
        # RecursionError as tracebacks); a ValidationError is cut to its first problem, one line.
        from visionloop.registry.files import UnreadableFileError, read_json

        hint = "rerun `visionloop bench`."
        try:
            doc = read_json(Path(path), MAX_RESULT_BYTES)
        except FileNotFoundError:
            raise BenchError(f"{path} does not exist; {hint}") from None
        except UnreadableFileError as e:
            raise BenchError(f"{e}; {hint}") from e
        try:
            return cls.model_validate(doc)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the top level"
            raise BenchError(f"{path} is not a benchmark result ({where}: {first['msg']}); {hint}") from e
