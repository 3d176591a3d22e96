"""Rich rendering of a training run: live bars on a terminal, periodic lines otherwise."""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from visionloop.train.report import Reporter, StartInfo, TrainResult


class RichReporter(Reporter):
    def __init__(self, console: Console, line_every_s: float = 30.0) -> None:
        self.console = console
        self.live = console.is_terminal
        self.line_every_s = line_every_s
        self._last_line = 0.0
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._eval_task: TaskID | None = None
        self._epochs = 0
        self._total = 0
        self._first = 0

    def __enter__(self) -> RichReporter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop_progress()

    def _stop_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def start(self, info: StartInfo) -> None:
        self._epochs, self._total = info.epochs, info.total_steps
        where = f"{info.device}, {info.precision}" + (
            f", {info.world_size} processes" if info.world_size > 1 else ""
        )
        self.console.print(
            f"[bold]training[/] {info.num_params:,} parameters on {where}: {info.total_steps} steps "
            f"({info.steps_per_epoch}/epoch, {info.epochs} epoch(s)), {info.train_images} train / "
            f"{info.val_images} eval images, dataset {info.dataset_version[:12]}"
        )
        self.console.print(f"  run dir  {info.run_dir}")
        if info.run_id:
            self.console.print(f"  MLflow   run {info.run_id}")
        if self.live:
            self._progress = Progress(
                TextColumn("[bold blue]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=info.total_steps, status="", completed=0)

    def epoch_start(self, epoch: int, first_step: int, last_step: int) -> None:
        self._first = first_step
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task, description=f"epoch {epoch + 1}/{self._epochs}", completed=first_step - 1
            )

    def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
        status = f"loss {loss:.4f}  lr {lr:.2e}" if loss is not None else ""
        if images_per_s:
            status += f"  {images_per_s:,.0f} img/s"
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step, status=status)
        elif time.monotonic() - self._last_line >= self.line_every_s:
            self._last_line = time.monotonic()
            self.console.print(f"step {step}/{self._total}  {status}")

    def eval_start(self, epoch: int, batches: int) -> None:
        if self._progress is not None:
            self._eval_task = self._progress.add_task("  eval", total=batches, status="")

    def eval_batch(self) -> None:
        if self._progress is not None and self._eval_task is not None:
            self._progress.advance(self._eval_task)

    def eval_end(self, epoch: float, step: int, metrics: dict[str, float], summary: str) -> None:
        if self._progress is not None and self._eval_task is not None:
            self._progress.remove_task(self._eval_task)
            self._eval_task = None
        shown = f"{epoch:.0f}" if float(epoch).is_integer() else f"{epoch:.2f}"
        self.console.print(f"  [green]eval[/] epoch {shown} (step {step}): {summary}")

    def checkpoint(self, step: int, stall_s: float) -> None:
        if not self.live:
            self.console.print(
                f"  checkpoint at step {step} (loop paused {stall_s * 1000:.0f} ms)", style="dim"
            )

    def message(self, text: str) -> None:
        self.console.print(f"  {text}", style="yellow")

    def finish(self, result: TrainResult) -> None:
        self._stop_progress()
