"""`visionloop data add PARENT SOURCE --out DIR`: a new dataset version with newly labelled
images, and the lineage table `data info` shows. Thin over `visionloop.data.derive`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import err, out
from visionloop.cli.data import app

if TYPE_CHECKING:
    from visionloop.data.derive import AddReport
    from visionloop.data.manifest import DatasetManifest


@app.command("add")
def add_command(
    parent: Path = typer.Argument(
        ...,
        help="The dataset version to start from (a folder `data ingest` or `data add` made).",
        show_default=False,
    ),
    source: Path = typer.Argument(
        ...,
        help="Labelled images to add or relabel: what `visionloop label import` writes, or any source "
        "`data ingest` reads for the parent's task.",
        show_default=False,
    ),
    out_dir: Path = typer.Option(
        ...,
        "--out",
        "-o",
        help="Folder for the new version (created; must be new or empty).",
        show_default=False,
    ),
    selection: Path | None = typer.Option(
        None,
        "--selection",
        help="The file `visionloop label select --out` wrote for these images, recorded in the lineage.",
        show_default=False,
    ),
    cost_per_image: float | None = typer.Option(
        None,
        "--cost-per-image",
        help="What labelling one image cost (e.g. 0.15): the step's labelling cost, recorded in the lineage "
        "and the cost ledger. Default: the settings' price for the dataset's task "
        "([visionloop.labelling_cost_per_image] in visionloop.toml), else none.",
        show_default=False,
    ),
    workers: int | None = typer.Option(
        None, "--workers", "-j", help="Decode processes for the new images. Default: the CPUs available."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing dataset at --out."),
    team: str | None = typer.Option(
        None,
        "--team",
        "-t",
        help="The team the labelling is billed to (admin tokens only; a team token bills its own).",
    ),
) -> None:
    """Make a new version of PARENT with SOURCE's labelled images.

    Images PARENT does not hold are added (split by PARENT's split policy, unless SOURCE names
    splits); images it holds (the same stored bytes) take SOURCE's labels when they differ
    (relabelled; they keep their split). The new images are decoded and checked like any
    ingest, with PARENT's image policy; PARENT's images are not decoded or copied again (its
    unchanged shard files are hard-linked). The new version records its parent, what was added
    and relabelled, from where and by which selection: `visionloop data info DIR` shows the
    chain back to the first version, and a model trained on it carries that chain in its card.

    With --cost-per-image, the cost goes into the control plane's ledger against the new
    version (`visionloop cost report` lists it); if the control plane does not answer, the
    version is kept and `visionloop cost labelling DIR` records it later.

    PARENT is only read; DIR appears only once complete.
    """
    from visionloop.cli.data import progress_bar
    from visionloop.core.settings import load_settings
    from visionloop.data.derive import add_images
    from visionloop.data.manifest import read_manifest

    if cost_per_image is None:  # the settings' price for the dataset's task, if any
        cost_per_image = load_settings().labelling_cost_per_image(read_manifest(parent).task)

    with progress_bar(
        {"hash": "hashing files", "decode": "decoding images", "parent": "reading parent"}
    ) as bar:
        report = add_images(
            parent,
            source,
            out_dir,
            selection=selection,
            cost_per_image=cost_per_image,
            workers=workers,
            overwrite=overwrite,
            progress=bar,
        )
    _print_report(report)
    if cost_per_image is not None:
        _bill(report.out, team)


def _bill(dataset: Path, team: str | None) -> None:
    """Record the new version's labelling cost in the ledger; a control plane that is not
    there (or refuses) leaves the version as it is and says how to record it later."""
    from visionloop.api.client import Client
    from visionloop.core.errors import VisionloopError
    from visionloop.core.settings import load_settings

    try:
        with Client.from_settings(load_settings()) as client:
            record_labelling(client, dataset, team)
    except (VisionloopError, OSError) as e:
        err.print(
            f"[yellow]warning:[/] the labelling cost is in {escape(str(dataset))}/dataset.json but not in "
            f"the cost ledger ({escape(str(e))}); once the control plane answers, run "
            f"`visionloop cost labelling {escape(str(dataset))}`.",
            soft_wrap=True,
        )


def record_labelling(client: Any, dataset: Path, team: str | None) -> None:
    """Post DATASET's last lineage step's labelling cost to the ledger and say what it holds."""
    from visionloop.core.errors import DataError
    from visionloop.data.manifest import read_manifest

    m = read_manifest(dataset)
    bill = m.lineage[0].bill(m.version, Path(dataset).resolve()) if m.lineage else None
    if bill is None:
        raise DataError(
            f"{dataset} records no labelling cost: it was not made by `visionloop data add "
            "--cost-per-image`. Make the version with a price per image."
        )
    stored = client.record_labelling(**bill, team=team)
    _line(
        f"labelling of {m.version[:12]} in the cost ledger: {stored['images']:,} images, "
        f"{stored['cost']:,.2f} (team {stored['team']})"
    )


def _line(text: str) -> None:
    out.print(text, soft_wrap=True)


def _print_report(r: AddReport) -> None:
    m = r.manifest
    step = (m.lineage or [])[0]
    added = " · ".join(f"{s} {n:,}" for s, n in r.added.items() if n) or "none"
    _line(
        f"[bold green]New version[/] {m.version[:12]} of {step.parent[:12]}: "
        f"{sum(r.added.values()):,} images added, {r.relabelled:,} relabelled in {r.seconds:.1f} s"
    )
    _line(f"  added       {added}")
    _line(
        f"  relabelled  {r.relabelled:,}"
        + (f"  ({r.unchanged:,} already there with the same labels)" if r.unchanged else "")
    )
    _line(
        f"  shards      {r.linked_chunks} of the parent's chunk files linked, {r.rewritten_chunks} rewritten"
    )
    if m.rejected:
        reasons = ", ".join(f"{reason} {n}" for reason, n in r.ingest.rejected_by_reason.items())
        _line(
            f"  rejected    {m.rejected:,} of the new images ({reasons}) "
            f"→ {escape(str(r.out / 'rejected.jsonl'))}"
        )
    if step.labelling_cost is not None:
        _line(f"  labelling   {step.labelling_cost:,.2f}")
    _line("  total       " + " · ".join(f"{s} {i.count:,}" for s, i in m.splits.items() if i.count))
    _line(f"  version     {m.version}")
    for warning in [*r.ingest.warnings, *r.warnings]:
        err.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    where = escape(str(r.out))
    _line(
        f"Next: [bold]visionloop data info {where}[/]  (its lineage)\n"
        f"      and train on it:  data: {{dataset: {where}}}"
    )


def lineage_table(m: DatasetManifest) -> Table | None:
    """The version's history, newest step first, back to the first version (None without one)."""
    if not m.lineage:
        return None
    t = Table(title=f"lineage: {len(m.lineage)} step(s) back to the first version", title_justify="left")
    for name in ("version", "from", "added", "relabelled", "labelling cost", "source", "selection", "made"):
        t.add_column(
            name, overflow="fold", justify="right" if name in ("relabelled", "labelling cost") else "left"
        )
    version = m.version
    for step in m.lineage:
        added = " · ".join(f"{s} {n:,}" for s, n in step.added.items() if n) or "-"
        cost = "-" if step.labelling_cost is None else f"{step.labelling_cost:,.2f}"
        t.add_row(
            version[:12],
            f"{step.parent[:12]} ({escape(step.parent_path)})",
            added,
            f"{step.relabelled:,}",
            cost,
            escape(step.source),
            escape(step.selection or "-"),
            step.created_at,
        )
        version = step.parent
    t.add_row(version[:12], "ingested", "", "", "", "", "", "")
    return t
