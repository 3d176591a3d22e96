"""`visionloop label issues MODEL`: likely label errors in a dataset split (confident learning
on out-of-fold predictions, `visionloop.label.issues`), for review in Label Studio."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import err, out, print_wide


def issues_command(
    model: str = typer.Argument(
        ..., help="The model version whose embeddings judge the labels: NAME, NAME/V, NAME@ALIAS."
    ),
    dataset: Path | None = typer.Option(
        None, "--dataset", help="The dataset to check (default: the one the version was trained on)."
    ),
    split: str = typer.Option("train", "--split", help="The split to check."),
    folds: int = typer.Option(5, "--folds", help="Cross-validation folds of the out-of-fold predictions."),
    max_images: int | None = typer.Option(
        None, "--max-images", min=2, help="Check at most this many images, spread over the split."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the folds."),
    precision: str = typer.Option("fp32", "--precision", help="Which export embeds the images."),
    show: int = typer.Option(20, "--show", min=0, help="How many findings the table shows."),
    out_dir: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="Write the flagged images, issues.json and selection.json here: `visionloop label export "
        "DIR/selection.json` sends them to Label Studio for review.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Find likely label errors in a dataset split by confident learning (cleanlab).

    The version's export embeds every image once; a logistic regression on the embeddings, fitted without each fold in turn, gives out-of-fold probabilities (a model's predictions on its own training images would hide the very mistakes looked for). cleanlab flags the images whose given label those probabilities contradict beyond the estimated noise rates, lowest probability of the given label first.

    Each finding lists the image (split, shard position, record index), its given label and the suggested one. With --out, the flagged images are written with their stored bytes beside a selection file: review them in Label Studio (`label export`), bring the labels back (`label import`), and `visionloop data add` turns them into relabels of these very records.

    One class per image (a classifier's dataset).
    """  # noqa: E501 (one line per paragraph: Rich keeps the line breaks of a help text)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn

    from visionloop.core.settings import load_settings
    from visionloop.label.issues import find_issues, write_review

    with Progress(
        TextColumn("{task.description:>16}"), BarColumn(), MofNCompleteColumn(), console=err
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        report = find_issues(
            model,
            load_settings(),
            dataset=dataset,
            split=split,
            folds=folds,
            max_images=max_images,
            seed=seed,
            precision=precision,
            progress=progress,
        )
    if out_dir is not None:
        report = write_review(report, out_dir)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=1))
        return
    out.print(
        f"[bold]{len(report.issues)}[/] likely label errors in {report.images:,} {escape(report.split)} "
        f"images of {escape(report.dataset)} ({report.folds}-fold out-of-fold accuracy "
        f"{report.oof_accuracy:.1%}, embeddings of {escape(report.model)})",
        soft_wrap=True,
    )
    if report.issues and show:
        t = Table(title=f"the {min(show, len(report.issues))} least likely given labels first")
        for col in ("split/position", "index", "labelled", "suggested", "p(labelled)", "p(suggested)"):
            t.add_column(col, justify="right" if col.startswith("p(") or col == "index" else "left")
        for i in report.issues[:show]:
            t.add_row(
                f"{i.split}/{i.position}",
                str(i.index),
                escape(i.given),
                escape(i.suggested),
                f"{i.given_probability:.3f}",
                f"{i.suggested_probability:.3f}",
            )
        print_wide(t)
    if out_dir is not None:
        where = escape(str(out_dir))
        out.print(f"images, issues.json and selection.json in {where}")
        out.print(f"Next: [bold]visionloop label export {where}/selection.json --to URL[/] to review them")
