"""`visionloop eval MODEL`: the task's metrics on a dataset split, under seeded corruptions
(--stress) and with the calibration of the model's confidences (visionloop.eval)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import out, print_wide


def _csv(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(v.strip() for v in value.split(",") if v.strip())


def evaluate(
    model: str = typer.Argument(
        ..., help="NAME (the champion, else the newest), NAME@ALIAS or NAME/VERSION."
    ),
    dataset: Path | None = typer.Option(
        None,
        "--dataset",
        help="An ingested dataset with the model's classes (default: the one it was trained on).",
    ),
    split: str | None = typer.Option(None, "--split", help="train, val or test (default: val, else test)."),
    stress: bool = typer.Option(
        False,
        "--stress",
        help="Also score under seeded corruptions at severities 1-5 (night, glare, ...).",
    ),
    corruptions: str | None = typer.Option(
        None,
        "--corruptions",
        help="With --stress: a comma-separated subset, e.g. night,glare.",
    ),
    severities: str | None = typer.Option(
        None, "--severities", help="With --stress: a comma-separated subset of 1-5 (default: all)."
    ),
    seed: int = typer.Option(
        0, "--seed", help="Seed of the corruptions and the slices' bootstrap: same seed, same results."
    ),
    max_images: int | None = typer.Option(
        None, "--max-images", help="Score at most this many images, spread over the split."
    ),
    batch_size: int = typer.Option(64, "--batch-size", help="Images per forward pass."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when visible), cpu or cuda."),
    no_calibrate: bool = typer.Option(
        False, "--no-calibrate", help="Measure temperature scaling but do not store it with the model."
    ),
    no_track: bool = typer.Option(
        False,
        "--no-track",
        help="Do not record the evaluation as an MLflow run (experiment visionloop-eval).",
    ),
    slices: str | None = typer.Option(
        None,
        "--slices",
        help="Metadata column(s) of the dataset, comma-separated (e.g. camera,time_of_day): the "
        "metric per value, worst first, with a 95% bootstrap interval.",
    ),
    slice_resamples: int = typer.Option(
        200, "--slice-resamples", help="With --slices: bootstrap resamples per value (seeded by --seed)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Evaluate a registered model: its metrics, how it fails under corruption, how well its confidences are calibrated.

    Scores the model on a dataset split with the task's own metrics (accuracy, per-class precision and recall; mAP for a detector). With --stress, every image is also scored under nine seeded, reproducible corruptions (night, glare, motion blur, defocus blur, fog, gaussian noise, JPEG, pixelation, occlusion) at five severities: the metric per corruption and severity, its mean, and the corrupted error relative to clean (ImageNet-C's measure, with the clean model as reference).

    A classifier's calibration is measured (expected calibration error over 15 bins, maximum calibration error, Brier score, reliability diagram), and temperature scaling is fitted and measured on held-out halves of the split. On the model's own validation data the temperature is stored with the model version, and `visionloop serve` applies it to served confidences.

    With --slices COLUMN, the metric is also reported per value of a per-image metadata column the dataset was ingested with (a CSV's extra columns, a COCO image's fields: `visionloop data info` lists them), worst first, with a 95% percentile-bootstrap interval; images without a value form the slice (missing), and a value with fewer than 5 images gets no interval.

    The report (eval.json and PNG plots) goes to the version's folder under evals/; `visionloop models show` lists it.
    """  # noqa: E501 (one line per paragraph: Rich keeps the line breaks of a help text)
    from visionloop.eval.options import CORRUPTIONS, SEVERITIES, EvalOptions, check_options

    sev: tuple[int, ...] = SEVERITIES
    if severities is not None:
        try:
            sev = tuple(int(s) for s in _csv(severities) or ())
        except ValueError:
            raise typer.BadParameter(
                # cut short: a pasted file is not echoed back whole
                f"{severities[:40]!r} is not a list of severities; write e.g. 1,3,5",
                param_hint="--severities",
            ) from None
    options = EvalOptions(
        dataset=dataset,
        split=split,
        stress=stress,
        corruptions=_csv(corruptions) or CORRUPTIONS,
        severities=sev,
        seed=seed,
        max_images=max_images,
        batch_size=batch_size,
        device=device,
        calibrate=not no_calibrate,
        track=not no_track,
        slices=_csv(slices) or (),
        slice_resamples=slice_resamples,
    )
    check_options(options)  # before torch and MLflow load: a typo is answered at once
    from visionloop.eval.api import evaluate_model

    report = evaluate_model(model, options)
    if as_json:
        out.print_json(json.dumps(report.to_dict()))
        return
    where = escape(f"{report.dataset} [{report.split}], {report.images} images")
    out.print(f"[bold]{escape(report.model)}[/] on {where}")
    out.print(f"  {escape(report.summary)}")
    if report.errors:
        kinds = report.errors.get("kinds") or {}
        if kinds:
            out.print("  errors: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in kinds.items()))
        confused = report.errors.get("confused") or []
        if confused:
            shown = "; ".join(
                f"{escape(p['true'])} → {escape(p['predicted'])} {p['count']} ({p['share']:.0%})"
                for p in confused[:5]
            )
            out.print(f"  most confused (true → predicted): {shown}")
    if report.calibration is not None:
        c = report.calibration
        line = f"  calibration: ECE {c['ece']:.4f}  MCE {c['mce']:.4f}  Brier {c['brier']:.4f}"
        if "temperature" in c:
            line += (
                f"  →  temperature {c['temperature']:.3f}: ECE {c['ece_after']:.4f} on held-out halves"
                + (" (stored with the model)" if c.get("stored") else "")
            )
        out.print(line)
    if report.calibration_note:
        out.print(f"  [dim]{escape(report.calibration_note)}[/]")
    if report.corruptions:
        table = Table(
            title=f"{report.metric} under corruption (clean {report.clean:.4f})", title_justify="left"
        )
        table.add_column("corruption")
        for severity in report.corruptions[0].severities:
            table.add_column(f"sev {severity}", justify="right")
        table.add_column("mean", justify="right")
        table.add_column("drop (pts)", justify="right")
        table.add_column("error ÷ clean", justify="right")
        for s in sorted(report.corruptions, key=lambda s: -s.drop_points):
            rel = "n/a" if s.relative_error is None else f"{s.relative_error:.2f}"
            table.add_row(
                s.corruption, *(f"{v:.4f}" for v in s.values), f"{s.mean:.4f}", f"{s.drop_points:.1f}", rel
            )
        print_wide(table)
        assert report.stress_mean is not None
        mre = "n/a" if report.mean_relative_error is None else f"{report.mean_relative_error:.2f}"
        out.print(f"  stress mean {report.stress_mean:.4f}; mean error relative to clean {mre}")
    for column, rows in (report.slices or {}).items():
        print_wide(_slice_table(report.metric, column, rows, report.slice_bootstrap or {}))
    out.print(f"report: {escape(report.path)}")
    if report.mlflow_run_id:
        out.print(f"MLflow run: {report.mlflow_run_id} (experiment visionloop-eval)")


def _slice_table(metric: str, column: str, rows: list[dict[str, Any]], bootstrap: dict[str, Any]) -> Table:
    """One column's slices, worst first, with their intervals."""
    from visionloop.data.metadata import MISSING_LABEL

    confidence = f"{bootstrap.get('confidence', 0.95):.0%}"
    table = Table(
        title=f"{metric} by {escape(column)} (worst first; {confidence} bootstrap interval, "
        f"{bootstrap.get('resamples', '?')} resamples)",
        title_justify="left",
    )
    table.add_column(escape(column))
    table.add_column("images", justify="right")
    table.add_column(metric, justify="right")
    table.add_column(f"{confidence} interval", justify="right")
    for r in rows:
        value = MISSING_LABEL if r["value"] is None else str(r["value"])
        score = "n/a" if r["metric"] is None else f"{r['metric']:.4f}"
        if r["ci_low"] is not None:
            interval = f"{r['ci_low']:.4f} – {r['ci_high']:.4f}"
            if r["resampled"] < r["images"]:
                interval += f" (from {r['resampled']} images)"
        elif r["metric"] is not None:
            interval = f"too few images (< {bootstrap.get('min_images', 5)})"
        else:
            interval = ""
        table.add_row(escape(value), f"{r['images']:,}", score, interval)
    return table
