"""`visionloop archs [PATTERN]`: the model architectures a train spec can name."""

from __future__ import annotations

import typer
from rich.table import Table

from visionloop.cli.console import out


def archs(
    pattern: str = typer.Argument("*", help="A shell-style pattern, e.g. 'resnet*' or '*mobilenet*'."),
) -> None:
    """List the architectures `model.arch` accepts, with their default input size and source.

    visionloop's own small models (for CPUs) plus every torchvision classification model,
    always built without downloading weights; pass local weights with `model.pretrained`.
    """
    from visionloop.models import list_models, model_defaults, model_source
    from visionloop.models.registry import IMAGENET_MEAN

    names = list_models(pattern)
    if not names:
        out.print(f"no architecture matches {pattern!r}; try `visionloop archs` for the full list.")
        raise typer.Exit(1)
    table = Table(title=f"{len(names)} architecture(s)", title_justify="left")
    for col in ("arch", "source", "input", "mean / std"):
        table.add_column(col)
    for name in names:
        d = model_defaults(name)
        size = "x".join(str(v) for v in d.input_size)
        stats = "ImageNet" if tuple(d.mean) == IMAGENET_MEAN else f"{d.mean} / {d.std}"
        table.add_row(name, model_source(name), size, stats)
    out.print(table)
