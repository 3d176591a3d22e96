"""`visionloop bench MODEL`: latency/throughput sweep, and a serving config for a budget."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from visionloop.cli.console import err, out, print_wide
from visionloop.core.errors import VisionloopError


class BudgetNotMetError(VisionloopError):
    """No measured configuration meets the latency budget."""

    exit_code = 3


@contextlib.contextmanager
def _status() -> Iterator[Any]:
    if err.is_terminal:
        with err.status("benchmarking ...") as status:
            yield lambda text: status.update(f"benchmarking {text}")
    else:
        yield lambda text: None


def bench(
    model: str = typer.Argument(
        ..., help="NAME, NAME@ALIAS or NAME/VERSION of a registered model, or the folder of a trained one."
    ),
    formats: str = typer.Option("pytorch,onnx", "--formats", help="Comma-separated: pytorch, onnx."),
    precisions: str = typer.Option(
        "fp32,fp16,int8",
        "--precisions",
        help="Comma-separated: fp32, fp16, int8. ONNX precisions need an export that passed its gate.",
    ),
    batch_sizes: str = typer.Option(
        "1,8,32", "--batch-sizes", help="Comma-separated batch sizes, e.g. 1,8,32."
    ),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, or both: cpu,cuda."),
    latency_budget: float | None = typer.Option(
        None,
        "--latency-budget",
        metavar="MS",
        help="Pick the fastest ONNX configuration whose p99 meets MS milliseconds and write it as "
        "serving.yaml; exit 3 if none does.",
    ),
    out_dir: Path | None = typer.Option(
        None, "--out", help="Where results go. Default: $VISIONLOOP_HOME/bench/<name>-v<version>-<time>/."
    ),
    iterations: int | None = typer.Option(
        None, "--iterations", help="Timed calls per batch size (default: as many as fit in --duration)."
    ),
    duration: float = typer.Option(2.0, "--duration", help="Seconds of timed calls per batch size."),
    warmup: int = typer.Option(3, "--warmup", help="Untimed calls before timing each batch size."),
    eval_images: int = typer.Option(
        1000,
        "--eval-images",
        help="At most this many validation images for accuracy, spread evenly over the split; they are "
        "held in memory preprocessed (1000 at 224 px: about 600 MB).",
    ),
    no_accuracy: bool = typer.Option(False, "--no-accuracy", help="Skip the accuracy column (faster)."),
    dataset: Path | None = typer.Option(
        None, "--dataset", help="The dataset folder for accuracy (default: the one the model was trained on)."
    ),
    threads: int | None = typer.Option(
        None,
        "--threads",
        help="CPU threads for PyTorch and ONNX Runtime (default: theirs, usually all cores).",
    ),
) -> None:
    """Latency, throughput, memory, accuracy and size per format, precision, device, batch size.

    Writes bench.json and a plot of throughput against p99 latency.

    --latency-budget MS also writes serving.yaml for `visionloop serve`.

    It holds the fastest ONNX configuration whose p99 meets the budget, and the queue delay that fits.

    Exit codes: 0 done; 2 bad options; 3 nothing meets the budget.
    """
    from visionloop.bench import (
        BenchError,
        choose,
        default_out_dir,
        resolve_target,
        result_table,
        run_sweep,
        sweep_settings,
        write_result,
        write_serving_config,
    )
    from visionloop.bench.choose import to_serve_config
    from visionloop.core.settings import load_settings

    # Every option is checked before anything slow (loading torch models, reading images).
    settings = sweep_settings(
        formats=formats,
        precisions=precisions,
        devices=device,
        batch_sizes=batch_sizes,
        iterations=iterations,
        duration_s=duration,
        warmup=warmup,
        max_eval_images=eval_images,
        accuracy=not no_accuracy,
        threads=threads,
    )
    if latency_budget is not None and not (math.isfinite(latency_budget) and latency_budget > 0):
        raise BenchError(
            f"--latency-budget must be a positive number of milliseconds, got {latency_budget:g}; e.g. 50."
        )
    if latency_budget is not None and "onnx" not in settings.formats:
        raise BenchError(
            "--latency-budget chooses among ONNX configurations (the server serves ONNX); "
            "add onnx to --formats."
        )
    if dataset is not None and not dataset.is_dir():
        raise BenchError(
            f"--dataset {dataset} is not a folder; give a dataset made by `visionloop data ingest`."
        )
    vl = load_settings()
    target = resolve_target(model, dataset=dataset, settings=vl)
    if latency_budget is not None and target.name is None:
        raise BenchError(
            f"{model} is a folder, not a registered model, and a serving config must name one; "
            "register it (`visionloop models register RUN_DIR --name NAME`) and bench NAME/VERSION, "
            "or drop --latency-budget."
        )
    with _status() as progress:
        result = run_sweep(target, settings, progress=progress)
    print_wide(result_table(result))
    if result.eval_source:
        out.print(f"{escape(result.metric)} measured on {escape(result.eval_source)}")
    where = (out_dir or default_out_dir(vl.home, result)).expanduser().resolve()
    written = write_result(result, where, budget_ms=latency_budget)
    for path in written.values():
        out.print(f"wrote {escape(str(path))}")
    if not any(result.ok_configs()):
        raise BenchError(
            "no configuration could run (the lines under the table say why); export the model "
            f"(`visionloop export {result.model}`) or choose other --formats/--precisions/--device."
        )
    if latency_budget is None:
        return
    choice = choose(result, latency_budget)
    config = to_serve_config(result, choice)
    if config is None:
        raise BudgetNotMetError(choice.explain() + " No serving config was written.")
    path = write_serving_config(config, where)
    out.print(escape(choice.explain()))
    out.print(escape(f"wrote {path}; serve it with `visionloop serve {path}`"))
