"""Where a sweep's files go: the JSON result, the plot and (with a budget) serving.yaml."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from visionloop.bench.plot import plot_result
from visionloop.bench.result import BenchResult
from visionloop.core.fsutil import atomic_write_text

if TYPE_CHECKING:
    from visionloop.serve.config import ServeConfig

RESULT_FILE = "bench.json"
PLOT_FILE = "throughput_vs_p99.png"
SERVING_FILE = "serving.yaml"


def default_out_dir(home: Path, result: BenchResult) -> Path:
    """<home>/bench/<name>-v<version>-<time>/ (a folder target uses the folder's name)."""
    if result.name is not None and result.version is not None:
        stem = f"{result.name}-v{result.version}"
    else:
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(result.model).name) or "model"
    return home / "bench" / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def write_result(result: BenchResult, out_dir: Path, *, budget_ms: float | None = None) -> dict[str, Path]:
    """Write bench.json and, when anything ran, the plot; return what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {"result": result.save(out_dir / RESULT_FILE)}
    plot = plot_result(result, out_dir / PLOT_FILE, budget_ms=budget_ms)
    if plot is not None:
        written["plot"] = plot
    return written


def write_serving_config(config: ServeConfig, out_dir: Path) -> Path:
    from visionloop.serve.config import dump_serve_config

    path = out_dir / SERVING_FILE
    header = "# written by `visionloop bench --latency-budget`; see bench.json beside it for the numbers\n"
    atomic_write_text(path, header + dump_serve_config(config))
    return path
