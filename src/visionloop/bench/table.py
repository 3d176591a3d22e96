"""The sweep as one Rich table (a row per batch size, configuration columns filled once),
with a note under it for every configuration that could not run, saying why. The reasons sit
under the table rather than in it, so the table fits a 120-column terminal."""

from __future__ import annotations

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

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
    return f"[{_STATUS_STYLE[row.status]}]{row.status}[/]"


def result_table(result: BenchResult) -> Group:
    """The table, then one line per configuration that was skipped or failed, with why."""
    notes = [
        Text.from_markup(f"[{_STATUS_STYLE[r.status]}]{escape(r.label)}[/]: {escape(r.status_text)}")
        for r in result.configs
        if r.status != "ok"
    ]
    return Group(_table(result), *notes)


def _table(result: BenchResult) -> Table:
    title = f"{result.model} ({result.arch}, input {'x'.join(map(str, result.input_size))})"
    # No outer edge: two columns fewer, so the whole table fits 120 columns.
    table = Table(title=escape(title), title_justify="left", show_edge=False)
    for name in ("format", "precision", "device", "status", "size", result.metric):
        table.add_column(name, no_wrap=True)
    for name in ("batch", "p50 ms", "p90 ms", "p99 ms", "images/s", "peak mem"):
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
