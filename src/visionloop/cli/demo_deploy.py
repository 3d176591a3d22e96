"""The second half of `visionloop demo`: from the trained run to an answered request.

4. register the run in the MLflow Model Registry and make it the `champion`;
5. export it to ONNX fp32 and int8 (static QDQ, calibrated on its own training images), each
   through the accuracy gate;
6. benchmark eager PyTorch and both exports on this machine's CPU;
7. serve the int8 champion on loopback with an API key (made in a temporary folder, so the
   home's keys are untouched), send one held-out digit with `tritonclient.http` and the key
   in `headers=` (binary tensors, exactly as against Triton), print the answer, stop the server.

Each step is the library call its command makes (`models register`, `export`, `bench`,
`serve`), so the demo shows what a user would type and gets the same result.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from visionloop.cli.console import err, out, print_wide

if TYPE_CHECKING:
    from visionloop.core.settings import Settings
    from visionloop.export.report import ExportReport, Precision
    from visionloop.models.card import ModelCard
    from visionloop.registry import ModelVersionInfo

MODEL_NAME = "digits"
SERVED_PRECISION: Final = "int8"


@dataclass(frozen=True)
class DeployOutcome:
    model: str  # NAME/VERSION
    int8_accuracy: float
    reference_accuracy: float
    bench_dir: Path
    answer: int
    truth: int
    confidence: float


def deploy(settings: Settings, run_dir: Path, images_dir: Path, first_step: int, steps: int) -> DeployOutcome:
    """Steps `first_step`..`steps` of the demo; raises VisionloopError with what to do if one fails."""
    from visionloop.registry import register, set_alias

    n = first_step
    err.rule(f"[bold]{n}/{steps}  register the run in the MLflow Model Registry")
    info = register(run_dir, name=MODEL_NAME, settings=settings)
    set_alias(info.name, info.version, "champion", actor="visionloop demo", settings=settings)
    ref = f"{info.name}/{info.version}"
    out.print(f"registered {ref} from {run_dir} and made it the champion", soft_wrap=True)
    out.print(f"  $ visionloop models register {run_dir} --name {MODEL_NAME}", soft_wrap=True)

    n += 1
    err.rule(f"[bold]{n}/{steps}  export to ONNX: fp32, and int8 through the accuracy gate")
    int8 = _export(info, settings)

    n += 1
    err.rule(f"[bold]{n}/{steps}  benchmark eager PyTorch and the ONNX exports on this CPU")
    bench_dir = _bench(ref, settings)

    n += 1
    err.rule(f"[bold]{n}/{steps}  serve the int8 champion and ask it about one held-out digit")
    answer, truth, confidence = _serve_and_ask(settings, images_dir, info.card())
    return DeployOutcome(ref, int8.accuracy, int8.reference_accuracy, bench_dir, answer, truth, confidence)


def _export(info: ModelVersionInfo, settings: Settings) -> ExportReport:
    from visionloop.bench.table import human_bytes
    from visionloop.export import export_model

    reports = []
    precisions: tuple[Precision, ...] = ("fp32", SERVED_PRECISION)
    for precision in precisions:
        r = export_model(info, precision=precision, settings=settings)  # raises if the gate fails
        out.print(f"{r.summary()}; {human_bytes(r.size_bytes)}", soft_wrap=True)
        reports.append(r)
    out.print(f"  $ visionloop export {info.name}/{info.version} --precision int8", soft_wrap=True)
    return reports[-1]


def _bench(ref: str, settings: Settings) -> Path:
    from visionloop.bench.output import default_out_dir, write_result
    from visionloop.bench.result import sweep_settings
    from visionloop.bench.sweep import run_sweep
    from visionloop.bench.table import result_table
    from visionloop.bench.target import resolve_target

    target = resolve_target(ref, settings=settings)
    # A short sweep: the demo shows the table, `visionloop bench` measures for real.
    sweep = sweep_settings(
        formats="pytorch,onnx",
        precisions=f"fp32,{SERVED_PRECISION}",
        batch_sizes="1,32",
        duration_s=0.5,
        warmup=2,
        max_eval_images=400,
    )
    result = run_sweep(target, sweep)
    out_dir = default_out_dir(settings.home, result)
    written = write_result(result, out_dir)
    print_wide(result_table(result))
    out.print(f"results: {written['result']}", soft_wrap=True)
    out.print(f"  $ visionloop bench {ref} --latency-budget 10", soft_wrap=True)
    return out_dir


def _serve_and_ask(settings: Settings, images_dir: Path, card: ModelCard) -> tuple[int, int, float]:
    import numpy as np
    import tritonclient.http as httpclient
    from PIL import Image

    from visionloop.serve.config import ServeConfig
    from visionloop.serve.keys import KeyRing, KeyStore
    from visionloop.serve.server import BackgroundServer, predictions_path
    from visionloop.serve.source import RegistrySource

    config = ServeConfig(model=f"{MODEL_NAME}@champion", precision=SERVED_PRECISION, port=0)
    source = RegistrySource(settings, fmt="onnx", precision=SERVED_PRECISION)
    # A held-out image: the last file of a class folder falls in the validation split often
    # enough, and the answer is checked against its folder either way.
    truth = 7
    image_path = sorted((images_dir / str(truth)).glob("*.png"))[-1]
    # The secure path, as `visionloop serve keys create demo --models digits` would set it up,
    # but in a folder of its own: the demo must not turn keys on for the user's later `serve`.
    with tempfile.TemporaryDirectory(prefix="visionloop-demo-keys-") as keys_home:
        _, key = KeyStore(Path(keys_home)).create("demo", [MODEL_NAME])
        keys = KeyRing.for_home(Path(keys_home))
        auth = {"Authorization": f"Bearer {key}"}
        predictions = predictions_path(settings, config.host, 0)
        with BackgroundServer(config, source, predictions, keys=keys) as server:
            out.print(f"server listening on {server.url} (KServe v2 / Triton HTTP protocol; API key needed)")
            client = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))
            meta = client.get_model_metadata(MODEL_NAME, headers=auth)
            tensor = card.eval_preprocess().to_transform()(Image.open(image_path))
            batch = tensor.unsqueeze(0).numpy().astype(np.float32)
            inp = httpclient.InferInput(meta["inputs"][0]["name"], list(batch.shape), "FP32")
            inp.set_data_from_numpy(batch, binary_data=True)
            wanted = httpclient.InferRequestedOutput(meta["outputs"][0]["name"], binary_data=True)
            t0 = time.perf_counter()
            result = client.infer(MODEL_NAME, [inp], outputs=[wanted], headers=auth)
            ms = (time.perf_counter() - t0) * 1000
            logits = result.as_numpy(meta["outputs"][0]["name"])
            client.close()
    assert logits is not None
    z = logits[0].astype(np.float64)
    probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    answer = int(probs.argmax())
    version = result.get_response().get("model_version", "?")
    out.print(
        f"sent {image_path} (a {truth}) with tritonclient.http and an API key: "
        f"the model ({MODEL_NAME} v{version}, int8) "
        f"answered [bold]{card.class_names[answer]}[/] with p={probs[answer]:.2f} in {ms:.1f} ms",
        soft_wrap=True,
    )
    out.print("server stopped")
    out.print(f"  $ visionloop serve keys create app --models {MODEL_NAME}", soft_wrap=True)
    out.print(f"  $ visionloop serve {MODEL_NAME}@champion --precision int8", soft_wrap=True)
    return int(card.class_names[answer]), truth, float(probs[answer])
