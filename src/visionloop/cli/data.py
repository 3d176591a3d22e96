"""`visionloop data ...`: build and inspect datasets.

Thin over `visionloop.data.ingest` and `visionloop.data.manifest`: parse flags, show progress,
print what happened. The library modules are imported inside the commands so `--help` stays
instant.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import err, out
from visionloop.core.fsutil import json_objects, open_regular

if TYPE_CHECKING:
    from visionloop.data.ingest import IngestOptions, IngestReport
    from visionloop.data.ingest_options import ProgressFn
    from visionloop.data.manifest import DatasetManifest
    from visionloop.tasks.summaries import DatasetSummary, SummaryTable

app = typer.Typer(help="Build datasets from labelled images and inspect them.", no_args_is_help=True)

_SPLITS = ("train", "val", "test")
# A line of rejected.jsonl or duplicates.jsonl is a path and a reason: far below this.
_MAX_SIDE_LINE_BYTES = 64 * 1024


def _parse_rgb(value: str) -> tuple[int, int, int]:
    """'white', '#fafafa' or '250,250,250'."""
    text = value.strip()
    try:
        if "," in text:
            parts = [int(p) for p in text.split(",")]
            if len(parts) != 3 or not all(0 <= p <= 255 for p in parts):
                raise ValueError
            return parts[0], parts[1], parts[2]
        from PIL import ImageColor

        rgb = ImageColor.getrgb(text)
        return rgb[0], rgb[1], rgb[2]
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is not a colour; use a name (white), #RRGGBB (#ffffff) or R,G,B (255,255,255)."
        ) from None


_DETECTION_HELP = """\
Detection sources (found by their layout; --format forces one):

\b
  coco          SOURCE/annotations/instances_train.json + SOURCE/train/ (images),
                or SOURCE/instances.json + SOURCE/images/, or the .json file itself
  yolo          SOURCE/data.yaml + SOURCE/images/... + SOURCE/labels/...
  voc           SOURCE/Annotations/*.xml + SOURCE/JPEGImages/ (+ ImageSets/Main/<split>.txt)
  label_studio  SOURCE/export.json (Label Studio's JSON export) + the images under SOURCE

A detection dataset stores each image with its boxes, scaled with the image by --max-side and
clipped to it. Boxes and images left out (out of bounds, unknown class, missing image, ...)
are listed in DIR/rejected.jsonl with a reason; images with no box are kept as background.
The split comes from the source when it names one (train/val/test files or folders), else it
is seeded and stratified by each image's rarest class.
"""


@app.command("ingest", epilog=_DETECTION_HELP)
def ingest_command(
    source: Path = typer.Argument(
        ...,
        help="An ImageFolder (SOURCE/<class>/*.jpg, optionally under train/ val/ test/), "
        "a CSV file with the header path,label[,split], or a detection source "
        "(COCO, YOLO, Pascal VOC, Label Studio: see below).",
        show_default=False,
    ),
    out_dir: Path = typer.Option(
        ...,
        "--out",
        "-o",
        help="Folder to build the dataset in (created; must be new or empty).",
        show_default=False,
    ),
    val_fraction: float = typer.Option(
        0.1,
        "--val-fraction",
        help="Share of each class held out for validation (ignored when the source gives splits).",
    ),
    test_fraction: float = typer.Option(
        0.0,
        "--test-fraction",
        help="Share of each class held out for test (ignored when the source gives splits).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the split and of the shard write order."),
    max_side: int | None = typer.Option(
        None,
        "--max-side",
        help="Shrink images so the longest side is at most this many pixels (never enlarges). "
        "Default: keep the size.",
        show_default=False,
    ),
    min_side: int = typer.Option(1, "--min-side", help="Reject images whose shortest side is below this."),
    max_pixels: int = typer.Option(
        100_000_000,
        "--max-pixels",
        help="Reject images declaring more pixels (checked before decoding: bomb-safe).",
    ),
    max_aspect: float = typer.Option(
        100.0,
        "--max-aspect",
        help="Reject images whose long side / short side exceeds this (slivers, strips).",
    ),
    workers: int | None = typer.Option(
        None, "--workers", "-j", help="Decode processes. Default: the CPUs available.", show_default=False
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace an existing dataset at --out (swapped in only once the new one is done).",
    ),
    keep_duplicates: bool = typer.Option(
        False,
        "--keep-duplicates",
        help="Keep byte-identical files (they are always reported). "
        "Default: keep only the first in path order.",
    ),
    alpha_background: str = typer.Option(
        "white",
        "--alpha-background",
        help="Colour transparent pixels are composited onto: name, #RRGGBB or R,G,B.",
    ),
    jpeg_quality: int = typer.Option(
        95, "--jpeg-quality", help="JPEG quality when a lossy source (JPEG, WebP) must be re-encoded."
    ),
    follow_links: bool = typer.Option(
        False,
        "--follow-links",
        help="Follow symbolic links that lead outside the source folder. Default: skip them "
        "(listed in rejected.jsonl as link_outside_source).",
    ),
    format: str | None = typer.Option(
        None,
        "--format",
        "-f",
        help="Read SOURCE in this format, one a task reads (detection: coco, yolo, voc or "
        "label_studio). Default: recognised from the layout; a source no task recognises is read "
        "as an ImageFolder or CSV (classification).",
        show_default=False,
    ),
) -> None:
    """Build a dataset (shards + dataset.json) from labelled images: classification from an
    ImageFolder or CSV, object detection from COCO, YOLO, Pascal VOC or Label Studio.

    Every image is decoded and checked; bad ones are listed in DIR/rejected.jsonl, not stored.

    The source is only ever read. DIR appears only once complete.
    """
    from visionloop.data.ingest import IngestOptions, default_workers

    options = IngestOptions(
        val_fraction=val_fraction,
        test_fraction=test_fraction,
        seed=seed,
        max_side=max_side,
        min_side=min_side,
        max_pixels=max_pixels,
        max_aspect=max_aspect,
        workers=workers if workers is not None else default_workers(),
        overwrite=overwrite,
        keep_duplicates=keep_duplicates,
        alpha_background=_parse_rgb(alpha_background),
        lossy_quality=jpeg_quality,
        follow_links=follow_links,
        format=format,
    )
    ingest_with_progress(source, out_dir, options)


@contextmanager
def progress_bar(labels: dict[str, str]) -> Iterator[ProgressFn]:
    """A Rich progress bar on stderr, one row per stage a `ProgressFn` reports (named by
    `labels`), for the commands that build a dataset in front of a user."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("{task.description:>16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=False,
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(labels.get(stage, stage), total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield progress


def ingest_with_progress(source: Path, out_dir: Path, options: IngestOptions) -> IngestReport:
    """`ingest` with a Rich progress bar on stderr and the summary on stdout; for commands
    (`data ingest`, `demo`) that build a dataset in front of a user."""
    from visionloop.data.ingest import ingest

    with progress_bar({"hash": "hashing files", "decode": "decoding images"}) as progress:
        report = ingest(source, out_dir, options, progress=progress)
    _print_summary(report)
    return report


def _line(text: str) -> None:
    # soft_wrap: a path broken across lines can't be copied or grepped.
    out.print(text, soft_wrap=True)


def _task_summary(m: DatasetManifest) -> DatasetSummary | None:
    """What the dataset's task adds to its summary (boxes, ...); None when it adds nothing."""
    from visionloop.tasks import get_task

    return get_task(m.task).dataset_summary(m)


def _render(table: SummaryTable) -> Table:
    t = Table(title=escape(table.title), title_justify="left", show_footer=bool(table.footer))
    for i, name in enumerate(table.columns):
        footer = escape(table.footer[i]) if i < len(table.footer) else ""
        t.add_column(escape(name), justify="left" if i == 0 else "right", footer=footer)
    for row in table.rows:
        t.add_row(*(escape(cell) for cell in row))
    return t


def _print_summary(report: IngestReport) -> None:
    m = report.manifest
    summary = _task_summary(m)
    splits = " · ".join(f"{s} {m.splits[s].count:,}" for s in _SPLITS if s in m.splits)
    what = f" {escape(summary.headline)}" if summary is not None and summary.headline else ""
    _line(
        f"[bold green]Ingested[/] {report.kept:,} images{what} in {m.num_classes} classes "
        f"from {escape(m.source.path)} ({m.source.kind}) in {report.seconds:.1f} s"
    )
    _line(f"  kept        {splits}" + ("  (split from the source)" if m.split_policy.from_source else ""))
    if report.skipped:
        _line(f"  skipped     {report.skipped:,} files without an image extension")
    for label, text in summary.lines if summary is not None else ():
        _line(f"  {escape(label):<11} {escape(text)}")
    if m.rejected:
        reasons = ", ".join(f"{reason} {n}" for reason, n in report.rejected_by_reason.items())
        _line(f"  rejected    {m.rejected:,} ({reasons}) → {escape(str(report.rejected_file))}")
    else:
        _line("  rejected    0")
    if m.duplicates:
        fate = "kept (--keep-duplicates)" if report.duplicates_kept else "dropped, first in path order kept"
        conflict = (
            f", {report.conflicting_duplicates} with conflicting labels"
            if report.conflicting_duplicates
            else ""
        )
        _line(
            f"  duplicates  {m.duplicates:,} byte-identical{conflict}; {fate} "
            f"→ {escape(str(report.duplicates_file))}"
        )
    if m.metadata_columns:
        where = escape(str(report.out / "metadata"))
        _line(f"  metadata    {escape(', '.join(m.metadata_columns))} (per image) → {where}/")
    _line(f"  version     {m.version}")
    if summary is not None and summary.table is not None:
        out.print(_render(summary.table))
    for warning in report.warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    where = escape(str(report.out))
    _line(f"Next: [bold]visionloop data info {where}[/]")
    _line(f"      and point a train spec at it:  data: {{dataset: {where}}}")


def _iter_jsonl(path: Path) -> Iterator[dict[str, object]]:
    """Rows of a JSON-lines side file; unreadable lines are skipped (it is informational).
    Read line by line, a FIFO or folder in its place refused rather than waited on, and a
    line longer than ingest writes skipped without being held whole."""
    try:
        f = open_regular(path)
    except OSError:
        return
    with f:
        yield from json_objects(f, _MAX_SIDE_LINE_BYTES)


def _summary_table(m: DatasetManifest) -> Table:
    t = Table(title=f"dataset {m.version[:12]}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    policy = m.image_policy
    shown = ", ".join(escape(c) for c in m.classes[:20]) + (
        f", … ({m.num_classes - 20} more)" if m.num_classes > 20 else ""
    )
    split = (
        "from the source"
        if m.split_policy.from_source
        else f"stratified, seed {m.split_policy.seed}, val {m.split_policy.val_fraction:g}, "
        f"test {m.split_policy.test_fraction:g}"
    )
    t.add_row("version", m.version)
    t.add_row("task", m.task)
    t.add_row("source", f"{m.source.kind}: {escape(m.source.path)} ({m.source.files_seen:,} files seen)")
    t.add_row("classes", f"{m.num_classes}: {shown}")
    t.add_row("split", split)
    t.add_row(
        "image policy",
        f"{policy.mode}, max side {policy.max_side or 'unchanged'}, alpha onto {policy.alpha_background}, "
        f"JPEG quality {policy.lossy_quality}; reject sides < {policy.min_side}, "
        f"> {policy.max_pixels:,} pixels, aspect > {policy.max_aspect:g}",
    )
    fmt = ", ".join
    t.add_row("channel mean", fmt(f"{v:.4f}" for v in m.channel_stats.mean))
    t.add_row("channel std", fmt(f"{v:.4f}" for v in m.channel_stats.std))
    s = m.size_stats
    t.add_row(
        "size (w×h)",
        f"min {s.min[0]}×{s.min[1]}, median {s.median[0]}×{s.median[1]}, max {s.max[0]}×{s.max[1]}",
    )
    t.add_row("created", f"{m.created_at} by visionloop {m.visionloop_version}")
    return t


def _counts_table(m: DatasetManifest) -> Table:
    splits = [s for s in _SPLITS if s in m.splits]
    t = Table(title="images per split and class", title_justify="left", show_footer=True)
    t.add_column("class", footer="total")
    for s in splits:
        t.add_column(s, justify="right", footer=f"{m.splits[s].count:,}")
    t.add_column("total", justify="right", footer=f"{sum(m.splits[s].count for s in splits):,}")
    for cls in m.classes:
        counts = [m.splits[s].per_class.get(cls, 0) for s in splits]
        t.add_row(escape(cls), *(f"{c:,}" for c in counts), f"{sum(counts):,}")
    return t


def _metadata_table(dataset: Path, m: DatasetManifest) -> Table:
    """Per metadata column: distinct values, images without one, the most common values."""
    from visionloop.data.metadata import MISSING_LABEL, summarize_metadata

    t = Table(
        title="per-image metadata (visionloop eval --slices COLUMN reports the metric per value)",
        title_justify="left",
    )
    t.add_column("column")
    t.add_column("distinct values", justify="right")
    t.add_column(f"{MISSING_LABEL}", justify="right")
    t.add_column("most common", overflow="fold")
    for c in summarize_metadata(dataset, m):
        common = ", ".join(f"{escape(str(v))} ({n:,})" for v, n in c.common)
        t.add_row(escape(c.name), f"{c.distinct:,}", f"{c.missing:,}", common)
    return t


@app.command("info")
def info_command(
    dataset: Path = typer.Argument(
        ..., help="A dataset folder made by `visionloop data ingest`.", show_default=False
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the raw manifest (dataset.json) as JSON."),
) -> None:
    """Show a dataset: version, source, classes, counts per split, rejections and duplicates."""
    from visionloop.data.manifest import DUPLICATES_NAME, REJECTED_NAME, read_manifest

    m = read_manifest(dataset)
    if as_json:
        typer.echo(m.model_dump_json(indent=2))
        return
    out.print(_summary_table(m))
    summary = _task_summary(m)
    out.print(_counts_table(m) if summary is None or summary.table is None else _render(summary.table))

    if m.metadata_columns:
        out.print(_metadata_table(dataset, m))
    from visionloop.cli.data_add import lineage_table

    lineage = lineage_table(m)
    if lineage is not None:
        out.print(lineage)

    if m.rejected:
        by_reason: Counter[str] = Counter()
        example: dict[str, str] = {}  # the first of each reason
        for r in _iter_jsonl(dataset / REJECTED_NAME):
            reason = str(r.get("reason"))
            by_reason[reason] += 1
            example.setdefault(reason, str(r.get("message", r.get("path"))))
        t = Table(
            title=f"rejected: {m.rejected:,} ({escape(str(dataset / REJECTED_NAME))})", title_justify="left"
        )
        t.add_column("reason")
        t.add_column("count", justify="right")
        t.add_column("example", overflow="fold")
        for reason, n in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])):
            t.add_row(escape(reason), f"{n:,}", escape(example[reason]))
        out.print(t)
    else:
        out.print("rejected: none")

    if m.duplicates:
        conflicts, dropped = 0, False
        for d in _iter_jsonl(dataset / DUPLICATES_NAME):
            conflicts += bool(d.get("labels_conflict"))
            dropped = dropped or bool(d.get("dropped"))
        out.print(
            f"duplicates: {m.duplicates:,} byte-identical files ({conflicts} with conflicting labels), "
            f"{'dropped' if dropped else 'kept'}; see {escape(str(dataset / DUPLICATES_NAME))}"
        )
    else:
        out.print("duplicates: none")
