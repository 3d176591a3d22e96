"""The sweep as one Rich table: a row per batch size, configuration columns filled once."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from visionloop.bench.result import BenchResult, ConfigResult

_STATUS_STYLE = {"ok": "green", "skipped": "yellow", "failed": "red"}


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _status(row: ConfigResult) -> str:
    return f"[{_STATUS_STYLE[row.status]}]{escape(row.status_text)}[/]"


def result_table(result: BenchResult) -> Table:
    title = f"{result.model} ({result.arch}, input {'x'.join(map(str, result.input_size))})"
    table = Table(title=escape(title), title_justify="left")
    # The configuration never wraps (a narrow terminal squeezes the status text instead).
    for name in ("format", "precision", "device"):
        table.add_column(name, no_wrap=True)
    table.add_column("status", overflow="fold", ratio=1)
    for name in ("size", "accuracy"):
        table.add_column(name, no_wrap=True)
    for name in ("batch", "p50 ms", "p90 ms", "p99 ms", "throughput img/s", "peak mem"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in result.configs:
        head = [
            row.format,
            row.precision,
            row.device,
            _status(row),
            human_bytes(row.size_bytes),
            f"{row.accuracy:.4f}" if row.accuracy is not None else "-",
        ]
        if not row.points:
            table.add_row(*head, "-", "-", "-", "-", "-", "-")
            continue
        for i, p in enumerate(row.points):
            cells = head if i == 0 else [""] * len(head)
            table.add_row(
                *cells,
                str(p.batch_size),
                f"{p.p50_ms:.2f}",
                f"{p.p90_ms:.2f}",
                f"{p.p99_ms:.2f}",
                f"{p.throughput_ips:,.0f}",
                human_bytes(p.peak_memory_bytes),
            )
        table.rows[-1].end_section = True
    return table
