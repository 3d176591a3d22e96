"""`visionloop demo`: the whole spine on scikit-learn's bundled digits, in a couple of minutes.

1. write the 1,797 8x8 digits out as an ImageFolder of PNG files (no download: scikit-learn
   ships them);
2. ingest them with the real ingest code (validation, split, shards, manifest);
3. train a small CNN with checkpointing and MLflow tracking;
4-7. register it, export it to ONNX int8 through the accuracy gate, benchmark it, serve it and
   ask the server about one digit with tritonclient (cli/demo_deploy.py);
then print the validation accuracy, where everything is, and what to type next.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from visionloop.cli.console import err, out

TARGET_ACCURACY = 0.95
STEPS = 7
DEMO_SPEC = """\
# The demo's train spec: a small CNN on 32x32 digits, a few minutes on 2 CPU cores.
data:
  dataset: {dataset}
  batch_size: 64
  workers: {workers}
  image_size: 32
  augment:
    hflip: 0.0             # a mirrored 2 is not a 2
    scale: [0.6, 1.0]
model:
  arch: small_cnn
optimizer: {{name: adamw, lr: 0.003, weight_decay: 0.01}}
schedule: {{name: cosine, warmup_epochs: 1}}
epochs: {epochs}
seed: 0
deterministic: true        # same numbers on every run on this machine
checkpoint: {{every_steps: 50, keep_last: 3, keep_best: 1}}
tracking: {{experiment: demo, log_every_steps: 1}}
"""


def write_digits_imagefolder(root: Path, scale: int = 4) -> int:
    """Write scikit-learn's digits as root/<digit>/<n>.png (8x8 upscaled `scale` times, so a
    person can look at them). Returns the number of files written."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)  # 0..16 → 0..255
    for label in range(10):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
    for i, (img, label) in enumerate(zip(pixels, digits.target, strict=True)):
        pic = Image.fromarray(img, mode="L").resize((8 * scale, 8 * scale), Image.Resampling.NEAREST)
        pic.save(root / str(label) / f"{i:04d}.png")
    return len(pixels)


def demo(
    epochs: int = typer.Option(
        8,
        "--epochs",
        min=1,
        help="Training epochs (8 reach about 97% validation accuracy in under a minute on 2 CPU cores).",
    ),
    workers: int = typer.Option(2, "--workers", min=0, help="DataLoader worker processes."),
    home: Path | None = typer.Option(
        None, "--home", help="Put everything under this folder instead of $VISIONLOOP_HOME."
    ),
    task: str = typer.Option(
        "classification",
        "--task",
        help="classification: scikit-learn's digits, one per image. detection: digits drawn on "
        "cluttered backgrounds, found and boxed by the native detector (a few minutes on 2 cores).",
    ),
    images: int = typer.Option(
        8000,
        "--images",
        min=100,
        help="detection: training images to draw (fresh images help more than epochs).",
    ),
) -> None:
    """The whole loop on scikit-learn's digits: ingest → train → register → export → bench → serve.

    `--task classification` (the default) classifies the digits; `--task detection` draws them
    onto textured backgrounds as a COCO dataset and trains, exports, benchmarks and serves a
    detector that boxes them. Nothing is downloaded.

    Everything lands under $VISIONLOOP_HOME (default ~/.visionloop).

    Images go to demo/, the dataset to datasets/digits, the run to runs/demo-<time>, MLflow to
    mlflow.db, the model to models/digits/v<N> (with its ONNX exports), the benchmark to bench/.
    The server runs on a free loopback port only while the demo sends it one image.
    """
    import os

    if home is not None:
        os.environ["VISIONLOOP_HOME"] = str(home.expanduser().resolve())
    from visionloop.cli.data import ingest_with_progress
    from visionloop.cli.demo_train import train_demo_spec
    from visionloop.core.settings import load_settings
    from visionloop.data.ingest import IngestOptions

    settings = load_settings().ensure()
    # The demos by task name: a table, not a branch per task (tasks/ owns what a task does;
    # the CLI only picks which walkthrough to print).
    demos = {"classification": None, "detection": "visionloop.cli.demo_detection"}
    if task not in demos:
        err.print(f"[red]--task {task!r} has no demo; use one of {', '.join(demos)}.[/]")
        raise typer.Exit(2)
    module = demos[task]
    if module is not None:
        import importlib

        # --epochs' default is the classification demo's; the other demos have their own.
        importlib.import_module(module).run_demo(
            settings, images=images, epochs=None if epochs == 8 else epochs, workers=workers
        )
        return
    started = time.monotonic()
    images_dir = settings.home / "demo" / "digits-images"
    dataset_dir = settings.datasets_dir / "digits"

    err.rule(f"[bold]1/{STEPS}  write scikit-learn's digits as PNG files")
    if images_dir.exists():
        import shutil

        shutil.rmtree(images_dir)
    n = write_digits_imagefolder(images_dir)
    out.print(f"wrote {n:,} PNG files in 10 class folders under {images_dir}", soft_wrap=True)

    err.rule(f"[bold]2/{STEPS}  ingest: validate, split, shard")
    report = ingest_with_progress(
        images_dir, dataset_dir, IngestOptions(val_fraction=0.2, seed=0, overwrite=True)
    )

    err.rule(f"[bold]3/{STEPS}  train a small CNN (checkpointed, tracked in MLflow)")
    spec_text = DEMO_SPEC.format(dataset=dataset_dir, workers=workers, epochs=epochs)
    spec_path = settings.home / "demo" / "digits.yaml"
    run_dir = settings.runs_dir / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    result = train_demo_spec(settings, spec_path, spec_text, run_dir)

    acc = result.final_metrics.get("accuracy", 0.0)
    ok = acc >= TARGET_ACCURACY
    deployed = None
    if ok:  # a model that missed its target is not worth deploying; the summary says why
        from visionloop.cli.demo_deploy import deploy

        deployed = deploy(settings, result.run_dir, images_dir, first_step=4, steps=STEPS)
    err.rule("[bold]summary")
    out.print(
        f"validation accuracy  [bold {'green' if ok else 'red'}]{acc:.2%}[/] "
        f"(target ≥ {TARGET_ACCURACY:.0%}) on {report.manifest.splits['val'].count} held-out digits"
    )
    rows = [
        ("dataset", f"{dataset_dir}  (version {report.manifest.version[:12]})"),
        ("run", str(result.run_dir)),
        ("checkpoints", f"{result.run_dir / 'checkpoints'}  ({len(result.checkpoints)} kept)"),
        ("final model", str(result.final_weights)),
        ("model card", str(result.model_card)),
        ("MLflow run", str(result.run_id)),
        ("open the UI", str(result.ui_command)),
    ]
    if deployed is not None:
        rows += [
            ("model", f"{deployed.model} (champion) in the MLflow Model Registry"),
            (
                "int8 export",
                f"accuracy {deployed.int8_accuracy:.2%} (fp32 {deployed.reference_accuracy:.2%}); gate ok",
            ),
            ("benchmark", str(deployed.bench_dir)),
            (
                "served answer",
                f"{deployed.answer} for a {deployed.truth} (p={deployed.confidence:.2f}), via tritonclient",
            ),
        ]
    rows.append(("took", f"{time.monotonic() - started:.0f} s"))
    for key, value in rows:
        out.print(f"  {key:<15}{value}", soft_wrap=True)
    out.print(
        "Next: `visionloop runs show " + str(result.run_id)[:8] + "`, `visionloop models show digits`, "
        "`visionloop serve digits --precision int8`, or train on your own images with "
        "`visionloop data ingest DIR --out DATASET` and a spec like " + str(spec_path),
        soft_wrap=True,
    )
    if not ok:
        err.print(
            f"[red]the demo missed its accuracy target ({acc:.2%} < {TARGET_ACCURACY:.0%}); "
            "something is wrong with this installation — please report it with the run directory above.[/]"
        )
        raise typer.Exit(1)
