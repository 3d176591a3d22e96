"""`visionloop label ...`: pick the unlabelled images worth labelling (visionloop.label)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import err, out, print_wide
from visionloop.cli.label_issues import issues_command
from visionloop.cli.label_studio import export_command, import_command

app = typer.Typer(
    help=(
        "The labelling loop: `label select` ranks a folder of unlabelled images (or the server's "
        "collected sample) by what the model would learn from them and picks a budget of them; "
        "`label export` sends the picks to Label Studio with the model's predictions as "
        "pre-annotations; `label import` brings the finished annotations back as a labelled "
        "folder, with agreement and contradictions for review; `label issues` finds likely label "
        "errors in a dataset by confident learning."
    ),
    no_args_is_help=True,
)
app.command("export")(export_command)
app.command("import")(import_command)
app.command("issues")(issues_command)

_STRATEGY_HELP = (
    "hybrid (default: the most uncertain, spread by k-center on the embeddings), entropy, "
    "margin, least_confidence, kcenter, balanced (over predicted classes) or random."
)


@app.command("select")
def select_command(
    model: str = typer.Argument(
        ..., help="The model version that scores the images: NAME, NAME/V, NAME@ALIAS."
    ),
    source: Path = typer.Option(
        ...,
        "--from",
        help="A folder of unlabelled images (searched recursively), e.g. the server's collected "
        "sample: <home>/serve/collected.",
    ),
    budget: int = typer.Option(..., "--budget", "-n", help="How many images to pick.", min=1),
    strategy: str = typer.Option("hybrid", "--strategy", "-s", help=_STRATEGY_HELP),
    seed: int = typer.Option(0, "--seed", help="Seed of the random choices (ties, random)."),
    precision: str = typer.Option("fp32", "--precision", help="Which export scores the images."),
    keep_duplicates: bool = typer.Option(
        False,
        "--keep-duplicates",
        help="Keep near-duplicates (pHash within 6 bits) of training images and of each other.",
    ),
    output: Path | None = typer.Option(
        None, "--out", "-o", help="Write the selection as JSON here (the chosen files, scores, reasons)."
    ),
    copy_to: Path | None = typer.Option(
        None, "--copy-to", help="Copy the chosen images into this folder (for the annotators)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the selection as JSON."),
) -> None:
    """Pick BUDGET images from a folder to label next, the ones the model is least sure of and
    that are least like what it was trained on.

    Each image is scored by the model's served export the way the server scores it; images
    that are near-copies of training images or of each other are left out (--keep-duplicates
    keeps them). Prints the picks with the reason for each; --out writes them as JSON and
    --copy-to copies the files for labelling.
    """
    from visionloop.label.scoring import needs, score_folder
    from visionloop.label.select import STRATEGIES, SelectionError, SelectOptions, select

    if strategy not in STRATEGIES:
        raise SelectionError(f"--strategy {strategy!r} is not one of {', '.join(STRATEGIES)}.")
    if copy_to is not None and copy_to.exists() and any(copy_to.iterdir()):
        raise SelectionError(f"--copy-to {copy_to} is not empty; give a new or empty folder.")
    if not as_json:
        err.print(f"scoring the images under {escape(str(source))} with {escape(model)} ...")
    scored = score_folder(
        model, source, precision=precision, labelled=not keep_duplicates or strategy in ("kcenter", "hybrid")
    )
    needs(strategy, scored)
    train = scored.labelled
    selection = select(
        scored.pool,
        strategy,
        budget,
        seed,
        labelled_embeddings=train.embeddings,
        exclude_near_duplicates_of=None if keep_duplicates else train.hash_map(),
        options=SelectOptions(dedupe_within_pool=not keep_duplicates),
    )
    doc = {
        "model": scored.model,
        "source": str(source),
        "images": len(scored.pool),
        "skipped": [{"file": f, "why": why} for f, why in scored.skipped],
        **selection.to_dict(),
    }
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(doc, indent=2) + "\n")
    if copy_to is not None:
        copy_to.mkdir(parents=True, exist_ok=True)
        for c in selection.chosen:
            target = copy_to / c.id.replace("/", "__")
            shutil.copy2(source / c.id, target)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    table = Table(title=f"{len(selection.chosen)} of {len(scored.pool)} images ({strategy})")
    table.add_column("#", justify="right")
    table.add_column("image")
    table.add_column("score", justify="right")
    table.add_column("why")
    for i, c in enumerate(selection.chosen, 1):
        table.add_row(str(i), escape(c.id), f"{c.score:.4g}", escape(c.reason))
    print_wide(table)
    dups = list(selection.near_duplicates)
    if dups:
        training = sum(d.of_training for d in dups)
        out.print(
            f"left out {len(dups)} near-duplicates ({training} of training images, "
            f"{len(dups) - training} of other pool images)"
        )
    for note in selection.notes:
        out.print(escape(note))
    if scored.skipped:
        first, why = scored.skipped[0]
        out.print(f"skipped {len(scored.skipped)} unreadable files, e.g. {escape(first)}: {escape(why)}")
    if output is not None:
        out.print(f"selection written to {escape(str(output))}")
    if copy_to is not None:
        out.print(f"copied {len(selection.chosen)} images to {escape(str(copy_to))}")
