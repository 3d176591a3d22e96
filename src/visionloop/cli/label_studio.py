"""`visionloop label export` and `label import`: the Label Studio round trip (visionloop.label.studio)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import err, out, print_wide
from visionloop.core.errors import DataError
from visionloop.core.fsutil import TooLargeError, read_capped

TOKEN_ENV = "LABEL_STUDIO_API_KEY"
MAX_SELECTION_BYTES = 256 * 1024 * 1024  # `label select` writes a few hundred bytes per image


def _selection(path: Path) -> dict[str, Any]:
    """A `label select --out` file: its model, folder and chosen images."""
    try:  # a regular file only: a FIFO would hang the read
        doc = json.loads(read_capped(path, MAX_SELECTION_BYTES, what="a selection"))
    except (OSError, ValueError, RecursionError) as e:  # TooLargeError is a ValueError
        why = f"larger than {MAX_SELECTION_BYTES // 2**20} MiB" if isinstance(e, TooLargeError) else e
        raise DataError(
            f"cannot read the selection {path}: {why}; write one with `label select --out`"
        ) from e
    chosen = doc.get("chosen") if isinstance(doc, dict) else None
    if not isinstance(chosen, list) or not all(
        isinstance(c, dict) and isinstance(c.get("id"), str) for c in chosen
    ):
        raise DataError(
            f"{path} is not a selection (no `chosen` list of images); write one with `label select --out`"
        )
    return dict(doc)


def _token() -> str:
    return os.environ.get(TOKEN_ENV, "").strip()


def export_command(
    selection: Path = typer.Argument(..., help="The selection `visionloop label select --out` wrote."),
    out_dir: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="Write tasks.json and config.xml here (to import into Label Studio by hand).",
    ),
    to: str | None = typer.Option(
        None,
        "--to",
        help="A Label Studio server (e.g. http://localhost:8080): make a project there and import the "
        f"tasks. The token comes from ${TOKEN_ENV}.",
    ),
    title: str | None = typer.Option(None, "--title", help="The new project's title (with --to)."),
    model: str | None = typer.Option(
        None, "--model", help="The version whose predictions pre-annotate (default: the selection's)."
    ),
    source: Path | None = typer.Option(
        None, "--images", help="Where the selected images are (default: the selection's folder)."
    ),
    image_url: str | None = typer.Option(
        None,
        "--image-url",
        help="How Label Studio loads an image: a template with {path}, the image's path under the "
        "folder, e.g. '/data/local-files/?d=unlabelled/{path}' or 's3://bucket/{path}'. "
        "Default: the image inline in the task (no storage to set up).",
    ),
    precision: str = typer.Option("fp32", "--precision", help="Which export scores the images."),
) -> None:
    """Send the selected images to Label Studio, each with the model's prediction as a
    pre-annotation (the class for a classifier, the boxes for a detector) so that annotators
    correct rather than start from nothing.

    With --out, writes `tasks.json` (Label Studio's import format) and `config.xml` (the
    labelling config that fits them); with --to, creates a project on the server and imports
    the tasks there. Each task keeps the image's path as `visionloop_id`, which is how
    `visionloop label import` finds the image again.
    """
    from visionloop.label.studio import data_uri, export_tasks

    if (out_dir is None) == (to is None):
        raise DataError(
            "give --out DIR (files to import by hand) or --to URL (a Label Studio server), one of them"
        )
    if out_dir is not None and out_dir.exists() and any(out_dir.iterdir()):
        raise DataError(f"--out {out_dir} is not empty; give a new or empty folder")
    if to is not None and not _token():
        raise DataError(
            f"--to needs a Label Studio token in ${TOKEN_ENV} (Account & Settings → Access Token)"
        )
    if image_url is not None and "{path}" not in image_url:
        raise DataError("--image-url needs {path} where the image's path goes, e.g. 's3://bucket/{path}'")
    doc = _selection(selection)
    ref = model or doc.get("model")
    folder = source or (Path(doc["source"]) if isinstance(doc.get("source"), str) else None)
    if not isinstance(ref, str) or folder is None:
        raise DataError(f"{selection} names no model or folder; give --model and --images")
    ids = [c["id"] for c in doc["chosen"]]

    def url(image_id: str, path: Path, data: bytes) -> str:
        if image_url is None:
            return data_uri(path, data)
        return image_url.replace("{path}", quote(image_id.replace("\\", "/")))

    err.print(f"pre-annotating {len(ids)} images with {escape(ref)} ...")
    exported = export_tasks(ref, folder, ids, image_url=url, precision=precision)
    for image_id, why in exported.skipped:
        err.print(f"[yellow]skipped[/] {escape(image_id)}: {escape(why)}")
    if out_dir is not None:
        from visionloop.core.fsutil import atomic_write_text

        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / "tasks.json", json.dumps(exported.tasks) + "\n")
        atomic_write_text(out_dir / "config.xml", exported.config)
        out.print(f"{len(exported.tasks)} tasks written to {escape(str(out_dir / 'tasks.json'))}")
        config_file = escape(str(out_dir / "config.xml"))
        out.print(
            f"in Label Studio: create a project with the labelling config in {config_file} "
            "(Settings → Labeling Interface → Code), then Import tasks.json"
        )
        return
    from visionloop.label.studio_client import LabelStudio

    assert to is not None
    with LabelStudio(to, _token()) as ls:
        project = ls.create_project(title or f"visionloop {exported.model}", exported.config)
        made = ls.import_tasks(project, exported.tasks)
    out.print(f"project {project}: {made} tasks imported, pre-annotated by {escape(exported.model)}")
    out.print(f"label them at {escape(to.rstrip('/'))}/projects/{project}")
    out.print(
        f"then: visionloop label import --from {escape(to)} --project {project} "
        f"--images {escape(str(folder))} --out DIR"
    )


def import_command(
    export_file: Path | None = typer.Argument(
        None, help="Label Studio's JSON export (Export → JSON) of the project; or use --from and --project."
    ),
    images: Path = typer.Option(..., "--images", help="The folder the images were selected from."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="A new folder for the labelled images."),
    server: str | None = typer.Option(
        None, "--from", help=f"Read the annotations from this Label Studio server (token in ${TOKEN_ENV})."
    ),
    project: int | None = typer.Option(
        None, "--project", help="The project's id on the server (with --from)."
    ),
    model: str | None = typer.Option(
        None, "--model", help="The version the tasks were exported for (default: the one that pre-annotated)."
    ),
    confident: float = typer.Option(
        0.9, "--confident", min=0.0, max=1.0, help="Flag annotations that contradict a prediction this sure."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Bring finished annotations back from Label Studio as a labelled folder that
    `visionloop data ingest` (or `data add`) reads: an ImageFolder for a classifier, a Label
    Studio export with its images for a detector.

    The annotation that counts for an image is the one marked ground truth, else the last one
    not cancelled. Prints per-class agreement (Fleiss' kappa) where several annotators labelled
    an image, and each annotation that contradicts a confident prediction, for review. The
    report is written beside the folder (<out>.visionloop-labels.json).
    """
    from visionloop.label.importer import import_annotations, model_of
    from visionloop.label.studio import load_export
    from visionloop.registry import get_version
    from visionloop.tasks import get_task

    if (export_file is None) == (server is None):
        raise DataError("give an export file or --from URL --project ID, one of them")
    if server is not None:
        if project is None:
            raise DataError("--from needs --project ID (the number in the project's URL)")
        if not _token():
            raise DataError(f"--from needs a Label Studio token in ${TOKEN_ENV}")
        from visionloop.label.studio_client import LabelStudio

        with LabelStudio(server, _token()) as ls:
            doc = ls.export(project)
            users = ls.users()
        where = f"project {project} on {server}"
    else:
        assert export_file is not None
        doc = load_export(export_file)
        users = {}
        where = str(export_file)
    ref = model or model_of(doc)
    if ref is None:
        raise DataError(f"{where} has no prediction naming its model; give --model NAME/VERSION")
    card = get_version(ref).card()
    result = import_annotations(
        doc,
        where,
        task=get_task(card.task),
        classes=list(card.class_names),
        images=images,
        out_dir=out_dir,
        confident=confident,
        users=users,
    )
    if as_json:
        typer.echo(json.dumps(result.report(), indent=2))
        return
    counts = result.report()["classes"]
    out.print(
        f"{len(result.labelled)} images labelled by {len(result.annotators)} annotator(s) into "
        f"{escape(str(out_dir))}: " + ", ".join(f"{escape(k)} {v}" for k, v in counts.items())
    )
    if result.unlabelled:
        out.print(f"{len(result.unlabelled)} images not labelled yet (left out)")
    for line in result.left_out[:20]:
        out.print(f"[yellow]left out[/] {escape(line)}")
    rated = [a for a in result.agreement if a.images]
    if rated:
        table = Table(title=f"agreement over {rated[0].images} images labelled by 2+ annotators")
        table.add_column("class")
        table.add_column("Fleiss' kappa", justify="right")
        table.add_column("said", justify="right")
        for a in rated:
            table.add_row(escape(a.label), "—" if a.kappa is None else f"{a.kappa:.3f}", str(a.said))
        print_wide(table)
    if result.contradictions:
        table = Table(
            title=f"{len(result.contradictions)} annotations contradict a confident model (review them)"
        )
        table.add_column("image")
        table.add_column("model says", justify="left")
        table.add_column("annotator says")
        table.add_column("by")
        for c in result.contradictions:
            table.add_row(
                escape(c.image_id),
                f"{escape(c.model_label)} ({c.model_score:.2f})",
                escape(", ".join(c.annotated) or "(nothing)"),
                escape(c.annotator),
            )
        print_wide(table)
    out.print(f"next: visionloop data ingest {escape(str(out_dir))} --out DATASET")
