"""`visionloop demo --task detection`: the whole loop for an object detector, on 2 CPU cores in
a few minutes, with no download.

1. generate a detection dataset in the process: scikit-learn's bundled handwritten digits
   pasted onto textured backgrounds with scale changes, rotation, clutter and occlusion
   (the detection task's `demo_source`), written as a COCO source (`annotations/instances_*.json`
   beside `train/` and `val/`); the validation images use handwriting the training images
   never show;
2. ingest it with the real detection ingest (box checks, split from the source, shards,
   manifest with instance counts);
3. train the native detector (checkpointed, tracked in MLflow, evaluated with COCO mAP);
4. register it in the MLflow Model Registry as the `champion`;
5. export it to ONNX through the mAP gate (at most 1 mAP point below eager PyTorch);
6. benchmark eager PyTorch and ONNX Runtime on this CPU, with mAP in the table;
7. serve it on loopback with an API key and POST one held-out image to
   `/v2/models/shapes/detect`, then print the boxes and the counts per class.

Each step is the library call its command makes, so the output shows what a user would type.
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from visionloop.cli.console import err, out, print_wide

if TYPE_CHECKING:
    from visionloop.core.settings import Settings
    from visionloop.registry import ModelVersionInfo

MODEL_NAME = "digit-detector"
STEPS = 7
TARGET_MAP50 = 0.9
IMAGE_SIZE = 96
EPOCHS = 3
DEMO_SPEC = """\
# The detection demo's train spec: the native detector on 96x96 synthetic digit scenes.
task: detection
data:
  dataset: {dataset}
  batch_size: 32
  workers: {workers}
  image_size: {size}
  augment:
    random_resized_crop: false   # fresh generated images do what crops would
    hflip: 0.0                   # a mirrored 2 is not a 2
model:
  arch: native_detector
optimizer: {{name: adamw, lr: 0.004, weight_decay: 0.0001}}
schedule: {{name: cosine, warmup_epochs: 0.3}}
epochs: {epochs}
seed: 0
deterministic: true
checkpoint: {{every_steps: 200, keep_last: 2, keep_best: 1}}
tracking: {{experiment: demo-detection, log_every_steps: 10}}
"""


@dataclass(frozen=True)
class DetectionDemoResult:
    map50: float
    map_: float
    model: str
    served: dict[str, Any]


def generate_coco_source(root: Path, n_train: int, n_val: int) -> tuple[int, int]:
    """Write the demo's COCO source under `root` (the detection task's `demo_source`).
    Returns the number of images of each split."""
    from visionloop.tasks.registry import get_task

    get_task("detection").demo_source(root, n_train, n_val, image_size=IMAGE_SIZE)
    return n_train, n_val


def _generate_with_progress(root: Path, n_train: int, n_val: int) -> None:
    """Generation runs in a thread; the bar counts the image files as they appear."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    failure: list[BaseException] = []

    def work() -> None:
        try:
            generate_coco_source(root, n_train, n_val)
        except BaseException as e:  # re-raised in the calling thread
            failure.append(e)

    thread = threading.Thread(target=work, name="generate", daemon=True)
    thread.start()
    with Progress(
        TextColumn("{task.description:>16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err,
    ) as bar:
        task = bar.add_task("drawing images", total=n_train + n_val)
        while thread.is_alive():
            thread.join(0.5)
            done = sum(1 for d in root.glob(".gen-*/images") for _ in d.iterdir()) if root.exists() else 0
            done += sum(
                1 for split in ("train", "val") if (root / split).is_dir() for _ in (root / split).iterdir()
            )
            bar.update(task, completed=min(done, n_train + n_val))
        bar.update(task, completed=n_train + n_val)
    if failure:
        raise failure[0]


def run_demo(settings: Settings, *, images: int, epochs: int | None, workers: int) -> None:
    """What `visionloop demo --task detection` runs (`epochs` None: the demo's default)."""
    run_detection_demo(settings, n_train=images, n_val=300, epochs=epochs or EPOCHS, workers=workers)


def run_detection_demo(
    settings: Settings, *, n_train: int, n_val: int, epochs: int, workers: int
) -> DetectionDemoResult:
    from visionloop.cli.data import ingest_with_progress
    from visionloop.cli.demo_train import train_demo_spec
    from visionloop.data.ingest import IngestOptions
    from visionloop.registry import register, set_alias

    started = time.monotonic()
    source_dir = settings.home / "demo" / "digit-scenes"
    dataset_dir = settings.datasets_dir / "digit-scenes"

    err.rule(f"[bold]1/{STEPS}  draw a detection dataset: digits on textured, cluttered backgrounds")
    _generate_with_progress(source_dir, n_train, n_val)
    out.print(
        f"wrote {n_train:,} training and {n_val:,} validation images (handwriting the training set never "
        f"shows) as COCO under {source_dir}",
        soft_wrap=True,
    )

    err.rule(f"[bold]2/{STEPS}  ingest: check every box, split, shard")
    report = ingest_with_progress(source_dir, dataset_dir, IngestOptions(seed=0, overwrite=True))
    out.print(f"  $ visionloop data ingest {source_dir} --out {dataset_dir}", soft_wrap=True)

    err.rule(f"[bold]3/{STEPS}  train the native detector (checkpointed, tracked in MLflow, COCO mAP)")
    spec_text = DEMO_SPEC.format(dataset=dataset_dir, workers=workers, epochs=epochs, size=IMAGE_SIZE)
    spec_path = settings.home / "demo" / "digit-scenes.yaml"
    run_dir = settings.runs_dir / f"demo-detection-{time.strftime('%Y%m%d-%H%M%S')}"
    result = train_demo_spec(settings, spec_path, spec_text, run_dir)
    map50 = float(result.final_metrics.get("mAP50", 0.0))
    map_ = float(result.final_metrics.get("mAP", 0.0))
    out.print(
        f"validation mAP50 [bold]{map50:.3f}[/], mAP@[.5:.95] {map_:.3f} on "
        f"{report.manifest.splits['val'].count} held-out images",
        soft_wrap=True,
    )

    err.rule(f"[bold]4/{STEPS}  register the run in the MLflow Model Registry")
    info = register(result.run_dir, name=MODEL_NAME, settings=settings)
    set_alias(info.name, info.version, "champion", actor="visionloop demo", settings=settings)
    ref = f"{info.name}/{info.version}"
    out.print(f"registered {ref} and made it the champion", soft_wrap=True)
    out.print(f"  $ visionloop models register {result.run_dir} --name {MODEL_NAME}", soft_wrap=True)

    err.rule(f"[bold]5/{STEPS}  export to ONNX through the mAP gate")
    _export(info, settings)

    err.rule(f"[bold]6/{STEPS}  benchmark eager PyTorch and ONNX Runtime on this CPU")
    _bench(ref, settings)

    err.rule(f"[bold]7/{STEPS}  serve it and ask /detect about one held-out image")
    served = _serve_and_ask(settings, source_dir)

    err.rule("[bold]summary")
    ok = map50 >= TARGET_MAP50
    out.print(
        f"validation mAP50 [bold {'green' if ok else 'red'}]{map50:.3f}[/] (target ≥ {TARGET_MAP50}), "
        f"mAP {map_:.3f}; took {time.monotonic() - started:.0f} s",
        soft_wrap=True,
    )
    rows = [
        ("dataset", f"{dataset_dir}  (version {report.manifest.version[:12]})"),
        ("run", str(result.run_dir)),
        ("eval plots", str(result.run_dir / "eval")),
        ("model", f"{ref} (champion)"),
        ("MLflow run", str(result.run_id)),
    ]
    for key, value in rows:
        out.print(f"  {key:<12}{value}", soft_wrap=True)
    out.print(
        f"Next: `visionloop serve {MODEL_NAME}@champion` and POST an image to "
        f"/v2/models/{MODEL_NAME}/detect, or ingest your own COCO, YOLO, VOC or Label Studio export "
        "with `visionloop data ingest SOURCE --out DATASET` and train with a spec like " + str(spec_path),
        soft_wrap=True,
    )
    if not ok:
        err.print(
            f"[red]the demo missed its mAP50 target ({map50:.3f} < {TARGET_MAP50}); on a loaded machine "
            "try --epochs with one more epoch, and report it with the run directory above if it persists.[/]"
        )
        raise typer.Exit(1)
    return DetectionDemoResult(map50=map50, map_=map_, model=ref, served=served)


def _export(info: ModelVersionInfo, settings: Settings) -> None:
    from visionloop.bench.table import human_bytes
    from visionloop.export import export_model

    r = export_model(info, precision="fp32", settings=settings)  # raises if the gate refuses it
    out.print(f"{r.summary()}; {human_bytes(r.size_bytes)}", soft_wrap=True)
    out.print(f"  $ visionloop export {info.name}/{info.version} --precision fp32", soft_wrap=True)


def _bench(ref: str, settings: Settings) -> None:
    from visionloop.bench.output import default_out_dir, write_result
    from visionloop.bench.result import sweep_settings
    from visionloop.bench.sweep import run_sweep
    from visionloop.bench.table import result_table
    from visionloop.bench.target import resolve_target

    target = resolve_target(ref, settings=settings)
    sweep = sweep_settings(
        formats="pytorch,onnx",
        precisions="fp32",
        batch_sizes="1,16",
        duration_s=0.5,
        warmup=2,
        max_eval_images=200,
    )
    result = run_sweep(target, sweep)
    written = write_result(result, default_out_dir(settings.home, result))
    print_wide(result_table(result))
    out.print(f"results: {written['result']}", soft_wrap=True)
    out.print(f"  $ visionloop bench {ref}", soft_wrap=True)


def _serve_and_ask(settings: Settings, source_dir: Path) -> dict[str, Any]:
    import httpx

    from visionloop.serve.config import ServeConfig
    from visionloop.serve.keys import KeyRing, KeyStore
    from visionloop.serve.server import BackgroundServer, predictions_path
    from visionloop.serve.source import RegistrySource

    config = ServeConfig(model=f"{MODEL_NAME}@champion", precision="fp32", port=0)
    source = RegistrySource(settings, fmt="onnx", precision="fp32")
    image_path = _busy_val_image(source_dir)
    with tempfile.TemporaryDirectory(prefix="visionloop-demo-keys-") as keys_home:
        _, key = KeyStore(Path(keys_home)).create("demo", [MODEL_NAME])
        keys = KeyRing.for_home(Path(keys_home))
        predictions = predictions_path(settings, config.host, 0)
        with BackgroundServer(config, source, predictions, keys=keys) as server:
            out.print(f"server listening on {server.url} (KServe v2 protocol + /detect; API key needed)")
            t0 = time.perf_counter()
            response = httpx.post(
                f"{server.url}/v2/models/{MODEL_NAME}/detect",
                params={"score_threshold": "0.3"},
                content=image_path.read_bytes(),
                headers={"Authorization": f"Bearer {key}", "Content-Type": "image/png"},
                timeout=60,
            )
            ms = (time.perf_counter() - t0) * 1000
    if response.status_code != 200:
        raise typer.Exit(_fail(f"the server answered {response.status_code}: {response.text[:300]}"))
    body: dict[str, Any] = response.json()
    truth = _truth(source_dir, image_path)
    out.print(
        f"POST {image_path.name} to /v2/models/{MODEL_NAME}/detect?score_threshold=0.3 → "
        f"{len(body.get('detections', []))} boxes in {ms:.0f} ms; the image holds {truth}",
        soft_wrap=True,
    )
    for d in body.get("detections", []):
        box = ", ".join(f"{v:.0f}" for v in d["box"])
        out.print(f"  {d['label']:>3}  score {d['score']:.2f}  box [{box}]")
    out.print(f"  counts: {body.get('counts', {})}")
    out.print("server stopped")
    out.print(f"  $ visionloop serve {MODEL_NAME}@champion", soft_wrap=True)
    return body


def _busy_val_image(source_dir: Path) -> Path:
    """A validation image with three or more digits: a more telling answer than an empty one."""
    import json

    coco = json.loads((source_dir / "annotations" / "instances_val.json").read_text())
    per_image: dict[int, int] = {}
    for a in coco["annotations"]:
        per_image[a["image_id"]] = per_image.get(a["image_id"], 0) + 1
    best = max(coco["images"], key=lambda im: (min(per_image.get(im["id"], 0), 3), -im["id"]))
    return source_dir / "val" / str(best["file_name"])


def _truth(source_dir: Path, image_path: Path) -> str:
    import json
    from collections import Counter

    coco = json.loads((source_dir / "annotations" / "instances_val.json").read_text())
    names = {c["id"]: c["name"] for c in coco["categories"]}
    image_id = next(im["id"] for im in coco["images"] if im["file_name"] == image_path.name)
    counts = Counter(names[a["category_id"]] for a in coco["annotations"] if a["image_id"] == image_id)
    return ", ".join(f"{n}×{name}" for name, n in sorted(counts.items())) or "no digit"


def _fail(message: str) -> int:
    err.print(f"[red]{message}[/]")
    return 1
