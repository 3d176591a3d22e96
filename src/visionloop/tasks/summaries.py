"""What the CLI shows of a dataset beyond its image counts, in a task's own terms
(`Task.dataset_summary`): plain text in a headline, labelled lines and a table, which
`visionloop data ingest` and `data info` render without knowing the task.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SummaryTable:
    """A plain table the CLI renders (cells are plain text, no markup)."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    footer: tuple[str, ...] = ()


@dataclass(frozen=True)
class DatasetSummary:
    """What `visionloop data ingest` and `data info` show of a dataset beyond its image counts:
    words after "Ingested N images" (`headline`, e.g. "with 1,234 boxes"), labelled lines
    under it (`lines`, e.g. ("background", "12 images with no box (kept)")), and a table that
    replaces the per-class image counts (`table`; None keeps them)."""

    headline: str = ""
    lines: tuple[tuple[str, str], ...] = ()
    table: SummaryTable | None = None
