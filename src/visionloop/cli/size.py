"""`visionloop size train SPEC`: which GPU type and how many for a training job, and what it costs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import err, out, print_wide

if TYPE_CHECKING:
    from visionloop.size.api import SizingReport

app = typer.Typer(
    help="Size a job before running it: which GPU, how many, how long and at what cost.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


_TRAIN_HELP = "\n\n".join(
    (
        "For every GPU type in the device catalog and 1 to 8 GPUs: does the job fit in memory, how long "
        "will it train, what does it cost on demand and on spot. Recommends the cheapest option that meets "
        "--deadline and --budget, on spot (training resumes from checkpoints after an interruption), and "
        "says why every other option loses.",
        "Memory and FLOPs are measured with a real forward and backward pass of the spec's model on a few "
        "of its training images, on this machine's CPU (seconds). The time assumes the catalog's sustained "
        "share of peak throughput, replaced by what earlier runs of the same architecture and image size "
        "measured on a GPU type when the tracking store has any.",
        "Exit codes: 0 an option meets the limits; 3 none does (the closest one and what to change are "
        "printed); 1 or 2 a bad spec, catalog or dataset.",
    )
)


@app.command("train", help=_TRAIN_HELP, context_settings={"help_option_names": ["-h", "--help"]})
def size_train(
    spec: Path = typer.Argument(..., help="The YAML train spec to size (its dataset must exist here)."),
    deadline: str | None = typer.Option(
        None, "--deadline", help="Wall-clock time the training may take, e.g. 12h, 90m, 2d."
    ),
    budget: float | None = typer.Option(
        None, "--budget", metavar="USD", min=0.0, help="Most the job may cost, in USD (spot prices)."
    ),
    catalog: Path | None = typer.Option(
        None,
        "--catalog",
        help="Device catalog (TOML). Default: $VISIONLOOP_HOME/devices.toml if it exists, else the "
        "one shipped with visionloop (T4, A10G, L4, A100 40/80 GB, H100).",
    ),
    prices: Path | None = typer.Option(
        None, "--prices", help="Price catalog (TOML). Default: the one shipped with visionloop."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a spec field, e.g. --set data.batch_size=512 (repeatable)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    from visionloop.core.settings import load_settings
    from visionloop.sched.prices import load_catalog
    from visionloop.size.api import device_catalog, size_training
    from visionloop.size.recommend import NothingMeetsError, parse_deadline
    from visionloop.specs import load_train_spec

    deadline_h = parse_deadline(deadline) if deadline is not None else None
    settings = load_settings()
    devices = device_catalog(catalog, settings)
    price_catalog = load_catalog(prices)
    train_spec, _ = load_train_spec(spec, overrides)
    if not as_json and err.is_terminal:
        with err.status("measuring the model (one forward and backward pass) ..."):
            report = size_training(
                train_spec,
                devices,
                price_catalog,
                deadline_h=deadline_h,
                budget_usd=budget,
                settings=settings,
            )
    else:
        report = size_training(
            train_spec, devices, price_catalog, deadline_h=deadline_h, budget_usd=budget, settings=settings
        )
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        _render(report)
    rec = report.recommendation
    if rec.choice is None:
        raise NothingMeetsError(rec.advice)


def _hours(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 60:.1f} min" if v < 1 else f"{v:,.1f} h"


def _render(report: SizingReport) -> None:
    from visionloop.size.recommend import money

    rec = report.recommendation
    out.print(
        f"[bold]{escape(report.spec_arch)}[/] ({report.task}), {report.num_params:,} parameters, "
        f"{report.image_size}x{report.image_size} images, global batch {report.global_batch}, "
        f"precision {report.precision}"
    )
    out.print(
        f"  {report.images:,} images to train ({report.train_images:,} in the train split), "
        f"{report.flops_per_image / 1e9:,.2f} GFLOPs per training image (3 x forward)"
    )
    for name, m in report.measured.items():
        out.print(f"  {name}: sustained fraction {m.fraction:.2f} measured by {m.runs} earlier run(s)")
    if not report.measured:
        out.print(
            "  no earlier runs of this architecture and image size: times use the catalog's "
            + "sustained fraction"
        )
    for note in report.notes:
        out.print(f"  note: {escape(note)}")
    table = Table(title="options (whole job; spot and on-demand prices)")
    for col in ("GPU", "n", "memory/GPU", "time", "spot", "on demand", "verdict"):
        right = col in ("n", "memory/GPU", "time", "spot", "on demand")
        table.add_column(col, justify="right" if right else "left")
    undivided: list[int] = []
    unpriced: set[str] = set()
    for o in rec.options:
        # Counts the batch does not divide over, and a device without a price, would repeat
        # one line per row: said once under the table instead.
        if o.problem.startswith("data.batch_size"):
            undivided.append(o.gpus)
            continue
        if o.problem.startswith("no price"):
            if o.device not in unpriced:
                unpriced.add(o.device)
                table.add_row(o.device, "any", "-", "-", "-", "-", escape(o.problem), style="dim")
            continue
        mem = f"{o.memory.total_gib:.1f}/{o.device_memory_gib:.0f} GiB" if o.memory is not None else "-"
        style = "bold green" if o is rec.choice else ("dim" if o.problem else "")
        table.add_row(
            o.device,
            str(o.gpus),
            mem,
            _hours(o.time.hours if o.time else None),
            money(o.spot_usd),
            money(o.on_demand_usd),
            escape(o.verdict),
            style=style,
        )
    if undivided:
        counts = ", ".join(str(n) for n in sorted(set(undivided)))
        table.caption = (
            f"not shown: {counts} GPUs (data.batch_size {report.global_batch} does not divide over them)"
        )
    print_wide(table)
    if rec.choice is not None:
        c = rec.choice
        assert c.time is not None
        out.print(
            f"[bold green]recommended[/]: {c.label} on spot, {_hours(c.time.hours)}, {money(c.spot_usd)} "
            f"({money(c.on_demand_usd)} on demand). Spot is safe: training resumes from its latest "
            "checkpoint after an interruption."
        )
    out.print(f"[dim]devices: {escape(report.devices_source)}; prices: {escape(report.prices_source)}[/]")
