"""`visionloop label issues MODEL`: likely label errors in a dataset split (confident learning
on out-of-fold predictions: `visionloop.label.issues` from the served model's embeddings,
`visionloop.label.refit` from K trainings of its recipe), for review in Label Studio."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import err, out, print_wide
from visionloop.core.errors import SpecError


def issues_command(
    model: str = typer.Argument(
        ...,
        help="The model version whose embeddings (with --refit: whose training recipe) judge the labels: "
        "NAME, NAME/V, NAME@ALIAS.",
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
    top: int | None = typer.Option(
        None,
        "--top",
        min=1,
        help="A review budget: the N images whose labels are least likely, flagged or not, instead of "
        "only those confident learning flags (with a detector's loose scores the ranking finds many "
        "more errors than the flags do).",
    ),
    out_dir: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="Write the flagged images, issues.json and selection.json here: `visionloop label export "
        "DIR/selection.json` sends them to Label Studio for review.",
    ),
    refit: bool = typer.Option(
        False,
        "--refit",
        help="Train the version's own recipe once per fold and predict each held-out fold (any task; "
        "the only way for detection): K trainings instead of one pass of the export.",
    ),
    work_dir: Path | None = typer.Option(
        None,
        "--work-dir",
        help="--refit: where the fold runs go (default: under the home's label-issues/). Run the same "
        "command again to resume interrupted folds; finished folds are not trained again.",
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="--refit: override a field of the recipe, e.g. --set epochs=5 (repeatable)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Find likely label errors in a dataset split by confident learning (cleanlab).

    The version's export embeds every image once; a logistic regression on the embeddings, fitted without each fold in turn, gives out-of-fold probabilities (a model's predictions on its own training images would hide the very mistakes looked for). cleanlab flags the images whose given label those probabilities contradict beyond the estimated noise rates, lowest probability of the given label first.

    Each finding lists the image (split, shard position, record index), its given label and the suggested one. With --out, the flagged images are written with their stored bytes beside a selection file: review them in Label Studio (`label export`), bring the labels back (`label import`), and `visionloop data add` turns them into relabels of these very records.

    Detection, or any task with --refit: the version's saved train spec is trained once per fold with that fold of the train split held out (data.holdout), each fold's model predicts its held-out images, and cleanlab's object detection module (ObjectLab) flags images with overlooked, swapped or badly located boxes, each listed with the given and the suggested box (the detector's scores calibrated first on the same predictions). This costs K trainings; --set epochs=N shortens them. With a detector whose scores are loose, --top N (the N least likely images, each with the box to look at first) finds many more errors than the flags.
    """  # noqa: E501 (one line per paragraph: Rich keeps the line breaks of a help text)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn

    from visionloop.core.settings import load_settings
    from visionloop.label.issues import find_issues, write_review
    from visionloop.registry import get_version

    with Progress(
        TextColumn("{task.description:>16}"), BarColumn(), MofNCompleteColumn(), console=err
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        settings = load_settings()
        runs: list[Any] = []
        # The version is looked up once, and named by its number from here on: an alias that
        # moves while the command runs (a promotion) must not split it between two versions.
        info = get_version(model, settings)
        model = f"{info.name}/{info.version}"
        if refit or not _embeddings_judge(info):
            from visionloop.label.refit import refit_issues

            if split != "train" or max_images is not None:
                raise SpecError(
                    "--refit judges the whole train split (every image is predicted by the fold that "
                    "left it out); leave --split and --max-images out."
                )
            folds_dir = work_dir or _default_work_dir(settings, info, folds, seed, overrides, dataset)
            err.print(f"fold runs in {escape(str(folds_dir))}", soft_wrap=True)
            report, runs = refit_issues(
                model,
                settings,
                work_dir=folds_dir,
                folds=folds,
                seed=seed,
                overrides=overrides,
                dataset=dataset,
                top=top,
                progress=progress,
            )
        else:
            report = find_issues(
                model,
                settings,
                dataset=dataset,
                split=split,
                folds=folds,
                max_images=max_images,
                seed=seed,
                precision=precision,
                top=top,
                progress=progress,
            )
    if out_dir is not None:
        report = write_review(report, out_dir)
    if as_json:
        doc = report.to_dict()
        if runs:
            doc["fold_runs"] = [vars(r) for r in runs]
        typer.echo(json.dumps(doc, indent=1))
        return
    if report.method == "refit":
        # The first two of the task's metrics (its primary first): the rest are in --json.
        judge = ", ".join(f"{k} {v:.3f}" for k, v in list((report.oof_metrics or {}).items())[:2])
        how = f"{report.folds} trainings of {escape(report.model)}'s recipe, out-of-fold {escape(judge)}"
    else:
        how = (
            f"{report.folds}-fold out-of-fold accuracy {report.oof_accuracy or 0:.1%}, embeddings of "
            f"{escape(report.model)}"
        )
    what = f"least likely labels (--top {top})" if top is not None else "likely label errors"
    out.print(
        f"[bold]{len(report.issues)}[/] {what} in {report.images:,} {escape(report.split)} "
        f"images of {escape(report.dataset)} ({how})",
        soft_wrap=True,
    )
    if report.issues and show:
        print_wide(_table(report, show))
    if out_dir is not None:
        where = escape(str(out_dir))
        out.print(f"images, issues.json and selection.json in {where}")
        out.print(f"Next: [bold]visionloop label export {where}/selection.json --to URL[/] to review them")


def _table(report: Any, show: int) -> Table:
    boxes = any(i.suggested_probability is None for i in report.issues)
    title = "the least likely labels first" if boxes else "the least likely given labels first"
    t = Table(title=f"{title} ({min(show, len(report.issues))} of {len(report.issues)})")
    cols = ["split/position", "index", "labelled", "suggested", "quality" if boxes else "p(labelled)"]
    cols += ["why"] if boxes else ["p(suggested)"]
    for col in cols:
        t.add_column(
            col, justify="right" if col in ("index", "quality", "p(labelled)", "p(suggested)") else "left"
        )
    for i in report.issues[:show]:
        last = _why(i) if boxes else f"{i.suggested_probability:.3f}"
        row = [f"{i.split}/{i.position}", str(i.index), escape(i.given), escape(i.suggested)]
        t.add_row(*row, f"{i.given_probability:.3f}", escape(last))
    return t


def _why(issue: Any) -> str:
    """The image's suspicious labels, one per line: 'swapped car -> truck at (x1, y1, x2, y2)'."""
    lines = []
    for f in issue.findings:
        box = f.given_box or f.suggested_box
        at = " at ({:.0f}, {:.0f}, {:.0f}, {:.0f})".format(*box) if box else ""
        if f.kind == "overlooked":
            lines.append(f"overlooked {f.suggested}{at}")
        elif f.kind == "swapped":
            lines.append(f"swapped {f.given} -> {f.suggested or '?'}{at}")
        else:
            lines.append(f"{f.kind} {f.given}{at}")
    return "\n".join(lines) or "-"


def _embeddings_judge(info: Any) -> bool:
    """Whether the version's task can judge labels from its embeddings (one label per image);
    a detector's boxes only --refit can judge."""
    from visionloop.tasks import get_task

    return get_task(info.card().task).labels_from_embeddings


def _default_work_dir(
    settings: Any, info: Any, folds: int, seed: int, overrides: list[str], dataset: Path | None
) -> Path:
    """One folder per (version, folds, seed, overrides, dataset): the same command resumes it,
    a different one does not collide with it."""
    key = json.dumps([folds, seed, overrides, str(dataset or "")]).encode()
    tag = hashlib.sha256(key).hexdigest()[:8]
    return Path(settings.home) / "label-issues" / f"{info.name}-v{info.version}-{folds}fold-{tag}"
