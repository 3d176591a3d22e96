"""The sweep: every (device, format, precision) of a model, timed at every batch size.

For each configuration: load it (a failure to load is that row's "failed"), measure the
task's gate metric (top-1 accuracy, mAP: `Task.metric_label`) on the evaluation images, then
per batch size warm up (first calls allocate buffers, pick kernels and, on CUDA, initialise
the context), time calls that each end synchronised,
and read the peak memory. Configurations run one after another in this process, never
concurrently: two would compete for the same cores and both numbers would be wrong.
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from visionloop.bench.evalset import EvalSet, load_eval_set, score, synthetic_inputs
from visionloop.bench.result import (
    BatchPoint,
    BenchResult,
    ConfigResult,
    Device,
    Format,
    Precision,
    SweepSettings,
)
from visionloop.bench.runners import OrtRunner, Runner, SkippedError, TorchRunner, cuda_available
from visionloop.bench.stats import summarize
from visionloop.bench.target import BenchTarget
from visionloop.registry.export_record import read_passing_export
from visionloop.tasks import get_task

log = logging.getLogger(__name__)

MAX_CALLS = 100_000  # a duration-bounded loop on a tiny model must still end
Progress = Callable[[str], None]


def time_calls(
    call: Callable[[], object],
    *,
    warmup: int,
    iterations: int | None,
    duration_s: float,
    min_iterations: int,
) -> list[float]:
    """Seconds per call: `iterations` calls if given, else calls for `duration_s` (at least
    `min_iterations`), after `warmup` untimed calls."""
    for _ in range(warmup):
        call()
    timings: list[float] = []
    deadline = time.perf_counter() + duration_s
    while len(timings) < MAX_CALLS:
        t0 = time.perf_counter()
        call()
        timings.append(time.perf_counter() - t0)
        if iterations is not None:
            if len(timings) >= iterations:
                break
        elif len(timings) >= min_iterations and time.perf_counter() >= deadline:
            break
    return timings


def fill_batch(inputs: np.ndarray, batch_size: int) -> np.ndarray:
    """`batch_size` images taken round-robin from `inputs` (repeats when there are fewer)."""
    idx = np.arange(batch_size) % len(inputs)
    return np.ascontiguousarray(inputs[idx])


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), for result files."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, str | int | float | None]:
    import onnxruntime as ort
    import torch

    return {
        "cpu": cpu_name(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "onnxruntime": ort.__version__,
        "python": platform.python_version(),
    }


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def _file_size(path: Path) -> int:
    # An ONNX model over 2 GB keeps its weights in external data files beside it.
    size = path.stat().st_size
    for extra in path.parent.glob(path.name + ".data"):
        size += extra.stat().st_size
    return size


def _make_runner(
    target: BenchTarget, fmt: str, precision: str, device: str, settings: SweepSettings
) -> tuple[Runner, Path]:
    if fmt == "pytorch":
        if target.weights is None:
            raise SkippedError("no final.safetensors beside the model card")
        if settings.threads is not None and device == "cpu":
            import torch

            torch.set_num_threads(settings.threads)
        # A registered version's weights are checked against the sha256 recorded at
        # registration (`verify_weights`: RegistryError, a "failed" row naming the file), as
        # export checks them: the row is reported under the version's name. The runner loads
        # the checked bytes, never the path, which could be swapped after the check; it reads
        # them itself, after its memory baseline. A bare folder (a run directory) has no
        # registration to check against; its weights are what it holds.
        weights = target.verify_weights if target.verify_weights is not None else target.weights
        return TorchRunner(target.card, weights, precision=precision, device=device), target.weights
    entry = target.onnx.get(precision, f"no onnx {precision} export")
    if isinstance(entry, str):
        raise SkippedError(entry)
    # Every ONNX entry is an export folder's model.onnx beside the export.json that passed
    # (bench.target): ORT gets the bytes the gate passed, read once and checked against the
    # report's sha256, never the path, which could be swapped between a check and the load.
    data = read_passing_export(entry.parent, ref=target.label if target.name is not None else None)
    return OrtRunner(entry, device=device, threads=settings.threads, data=data), entry


def _release() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # cleanup only: never let it turn a measured row into an error
        log.debug("could not empty the CUDA cache", exc_info=True)


def bench_config(
    target: BenchTarget,
    fmt: Format,
    precision: Precision,
    device: Device,
    settings: SweepSettings,
    inputs: np.ndarray,
    evalset: EvalSet | None,
    progress: Progress | None = None,
) -> ConfigResult:
    """One row group of the table; never raises for a configuration that cannot run."""
    row = ConfigResult(format=fmt, precision=precision, device=device, status="ok")
    if device == "cuda":
        ok, why = cuda_available()
        if not ok:
            row.status, row.reason = "skipped", why
            return row
    try:
        runner, path = _make_runner(target, fmt, precision, device, settings)
    except SkippedError as e:
        row.status, row.reason = "skipped", str(e)
        return row
    except Exception as e:
        log.debug("loading %s failed", row.label, exc_info=True)
        row.status, row.reason = "failed", f"could not load: {_first_line(e)}"
        return row
    row.model_path, row.size_bytes = str(path), _file_size(path)
    row.provider, row.memory_kind = runner.provider, runner.meter.kind  # type: ignore[assignment]
    try:
        if evalset is not None:
            row.accuracy = score(runner.predict, evalset)
            row.eval_images = len(evalset.images)
        for batch_size in settings.batch_sizes:
            if progress:
                progress(f"{row.label}: batch {batch_size}")
            call = runner.prepare(fill_batch(inputs, batch_size))
            runner.meter.start_point()
            timings = time_calls(
                call,
                warmup=settings.warmup,
                iterations=settings.iterations,
                duration_s=settings.duration_s,
                min_iterations=settings.min_iterations,
            )
            stats = summarize(batch_size, timings)
            row.points.append(BatchPoint(**stats.model_dump(), peak_memory_bytes=runner.meter.peak_bytes()))
            del call
    except Exception as e:  # out of memory at a big batch, a kernel the provider lacks, ...
        log.debug("running %s failed", row.label, exc_info=True)
        at = (
            f"batch {settings.batch_sizes[len(row.points)]}: "
            if len(row.points) < len(settings.batch_sizes)
            else ""
        )
        row.status, row.reason = "failed", f"{at}{_first_line(e)}"
    finally:
        del runner
        _release()
    return row


def run_sweep(
    target: BenchTarget, settings: SweepSettings | None = None, *, progress: Progress | None = None
) -> BenchResult:
    """Benchmark every configuration `settings` names; rows that cannot run say why."""
    settings = settings or SweepSettings()
    evalset: EvalSet | None = None
    eval_source: str | None = None
    if settings.accuracy and target.dataset is not None and not target.dataset.exists():
        # The dataset recorded at training time has moved or gone: latency is still worth
        # measuring, and the row says how to get accuracy back.
        eval_source = f"none: the training dataset {target.dataset} is gone; give one with --dataset DIR"
    elif settings.accuracy and target.dataset is not None:
        if progress:
            progress(f"loading evaluation images from {target.dataset}")
        evalset = load_eval_set(target.card, target.dataset, max_images=settings.max_eval_images)
        eval_source = evalset.source
    elif settings.accuracy:
        eval_source = "none: no dataset recorded with the model; give one with --dataset DIR"
    inputs = evalset.images if evalset is not None else synthetic_inputs(target.card)
    result = BenchResult(
        model=target.label,
        name=target.name,
        version=target.version,
        arch=target.card.arch,
        input_size=target.card.input_size,
        machine=machine_info(),
        settings=settings,
        eval_source=eval_source,
        eval_images=0 if evalset is None else len(evalset.labels),
        metric=get_task(target.card.task).metric_label,
    )
    for device in settings.devices:
        for fmt in settings.formats:
            for precision in settings.precisions:
                row = bench_config(target, fmt, precision, device, settings, inputs, evalset, progress)
                result.configs.append(row)
    return result
