"""`visionloop serve` as a user runs it, on a model trained, registered and exported for real:
it serves the champion's ONNX export to tritonclient and the image endpoint, follows an alias
move in the registry, and refuses a missing export or model with a message saying what to do."""

from __future__ import annotations

import io
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from PIL import Image

from _modelkit import ModelKit, onnx_model
from _trainkit import cli, popen

__all__ = ["onnx_model"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def kit(onnx_model: ModelKit, tmp_path: Path) -> ModelKit:
    return onnx_model.copy_home(tmp_path / "home")


@pytest.fixture
def served(kit: ModelKit) -> Iterator[tuple[str, list[str]]]:
    port = _free_port()
    proc = popen(
        "serve", kit.name, "--port", str(port), "--max-batch-size", "4", env={**os.environ, **kit.env()}
    )
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:  # the command prints its models, then the address it listens on
        lines.append(line)
        if line.startswith("listening on"):
            break
    else:
        proc.wait(30)
        pytest.fail("visionloop serve exited early:\n" + "".join(lines))
    try:
        yield f"127.0.0.1:{port}", lines
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        # uvicorn shuts down gracefully (queues drained, log written), then re-raises the signal.
        assert proc.wait(60) == -signal.SIGTERM
        log = kit.home / "serve" / "predictions" / f"127.0.0.1-{port}.jsonl"
        records = log.read_text().splitlines() if log.is_file() else []
        assert len(records) == 4, records  # the test's 3 tensor rows and 1 image, each summarised
        # Its last words say what it did and where the predictions are.
        rest = proc.stdout.read()
        assert f"stopped: answered 2 requests, 0 with an error; predictions logged to {log}" in rest, rest


def test_serve_answers_tritonclient_and_images(kit: ModelKit, served: tuple[str, list[str]]) -> None:
    import onnxruntime as ort

    address, lines = served
    assert any(line.startswith("serving digits: v1 primary") for line in lines), lines
    info = kit.info()
    onnx_path = info.export_path("onnx", "fp32")
    assert onnx_path is not None
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    x = np.random.default_rng(0).standard_normal((3, *info.card().input_size)).astype(np.float32)
    client = triton.InferenceServerClient(address)
    inp = triton.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    res = client.infer(kit.name, [inp])
    out_name = session.get_outputs()[0].name
    np.testing.assert_allclose(res.as_numpy(out_name), session.run(None, {name: x})[0], rtol=1e-5, atol=1e-5)
    assert res.get_response()["model_version"] == "1"

    digit = next(iter(sorted((kit.dataset.parent / "digits-images").rglob("*.png"))))
    buf = io.BytesIO()
    Image.open(digit).save(buf, "PNG")
    r = httpx.post(f"http://{address}/v2/models/{kit.name}/classify?top_k=2", content=buf.getvalue())
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    assert (
        len(preds) == 2
        and preds[0]["label"] in info.card().class_names
        and preds[0]["score"] >= preds[1]["score"]
    )
    metrics = httpx.get(f"http://{address}/metrics").text
    assert 'visionloop_serve_requests_total{endpoint="infer",model="digits",version="1"} 1.0' in metrics


def test_serve_refuses_missing_export_and_unknown_model(kit: ModelKit) -> None:
    env = kit.env()
    r = cli("serve", kit.name, "--precision", "int8", "--port", str(_free_port()), env=env, timeout=120)
    assert r.returncode != 0
    assert (
        "no passing onnx int8 export" in r.stderr
        and "visionloop export digits/1 --precision int8" in r.stderr
    )
    assert "Traceback" not in r.stderr
    r = cli("serve", "nosuch", env=env, timeout=120)
    assert r.returncode != 0 and "no registered model 'nosuch'" in r.stderr and "Traceback" not in r.stderr
    bad = kit.home / "serving.yaml"
    bad.write_text("model: digits\nmax_batchsize: 4\n")
    r = cli("serve", "--config", str(bad), env=env, timeout=120)
    assert r.returncode == 2 and "max_batchsize: unknown field. Did you mean `max_batch_size`?" in r.stderr
    # A missing or empty serving config gets an example of a serving config, not of a train spec.
    r = cli("serve", "--config", str(kit.home / "nope.yaml"), env=env, timeout=120)
    assert r.returncode == 2 and "serving config file" in r.stderr and "does not exist" in r.stderr
    assert "A minimal serving config:\nmodel: digits" in r.stderr and "train spec" not in r.stderr
    bad.write_text("")
    r = cli("serve", "--config", str(bad), env=env, timeout=120)
    assert r.returncode == 2 and "is empty. A minimal serving config" in r.stderr
