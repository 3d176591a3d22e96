"""What one request can make the inference server do is bounded: the pixels it decodes (and a
large image is decoded reduced, to what the model card's resize needs), the images decoded at
once, the parts and header lines of a multipart form, and the structure of a JSON tensor; a
large body is parsed in a worker thread, so the event loop answers a health check meanwhile."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

import visionloop.serve.app as app_module
import visionloop.serve.state as state
from _servekit import NAME, ServeKit, serve_kit
from visionloop.models.card import EvalPreprocess
from visionloop.serve.images import decode, needed_side, preprocess

__all__ = ["serve_kit"]

PRE = EvalPreprocess(
    channels=3,
    resize_size=36,
    crop_size=(32, 32),
    interpolation="bilinear",
    mean=(0.485, 0.456, 0.406),
    std=(0.229, 0.224, 0.225),
)


def _picture(w: int, h: int) -> Image.Image:
    """A smooth, asymmetric RGB picture (gradients and a bright block near one corner), so a
    wrong orientation or a wrong crop shows in the pixels."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    rgb = np.stack([x / w * 255, y / h * 255, (x + y) / (w + h) * 255], axis=-1)
    rgb[h // 10 : h // 4, w // 10 : w // 3] = (250, 30, 30)
    return Image.fromarray(rgb.astype(np.uint8))


def _encode(im: Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _full(data: bytes) -> np.ndarray:
    """The old path: a full decode, then the card's transform."""
    out: np.ndarray = PRE.to_transform()(Image.open(io.BytesIO(data))).numpy()[None]
    return out


# ------------------------------------------------------------------ decoding, in process


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_small_image_takes_exactly_the_old_path(fmt: str) -> None:
    data = _encode(_picture(90, 70), fmt)
    x = preprocess(data, PRE.to_transform(), np.dtype(np.float32), needed_side(PRE))
    assert x.shape == (1, 3, 32, 32)
    assert np.array_equal(x, _full(data))  # bit for bit


@pytest.mark.parametrize(
    ("fmt", "size", "decoded"),
    [("JPEG", (4000, 3000), (100, 75)), ("PNG", (3000, 2000), (111, 74))],
)
def test_a_large_image_is_decoded_reduced_and_stays_close(
    fmt: str, size: tuple[int, int], decoded: tuple[int, int]
) -> None:
    # EXIF orientation 6 (rotate 90°) must survive the reduction: a lost rotation would
    # transpose the picture and the comparison below would fail by far.
    exif = Image.Exif()
    exif[0x0112] = 6
    data = _encode(_picture(*size), fmt, exif=exif.tobytes())
    im = decode(data, needed_side(PRE))
    # JPEG: the DCT decoder scaled by 1/8, then a box filter by 5; PNG: decoded whole, then
    # a box filter by 27 (to about twice the 36 px the card's resize needs).
    assert im.size == decoded and min(im.size) >= 2 * needed_side(PRE)
    x = preprocess(data, PRE.to_transform(), np.dtype(np.float32), needed_side(PRE))
    full = _full(data)
    assert x.shape == full.shape == (1, 3, 32, 32)
    # Normalised units (a pixel step is about 0.017): the same picture, to a few steps.
    assert np.abs(x - full).mean() < 0.01
    assert np.abs(x - full).max() < 0.2


def test_palette_and_bilevel_images_reduce_in_a_faithful_mode() -> None:
    for mode in ("P", "1", "L"):
        data = _encode(_picture(800, 600).convert(mode), "PNG")
        x = preprocess(data, PRE.to_transform(), np.dtype(np.float32), needed_side(PRE))
        assert decode(data, needed_side(PRE)).size[0] < 800
        assert np.abs(x - _full(data)).mean() < 0.1, mode


# ------------------------------------------------------------------ a real server


@pytest.fixture(scope="module")
def server(serve_kit: ServeKit, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("limits")
    with serve_kit.server(serve_kit.source(), tmp, max_image_pixels=1_000_000, max_concurrent_decodes=2) as s:
        yield s


def _classify(url: str, body: bytes, content_type: str = "image/png") -> httpx.Response:
    return httpx.post(
        f"{url}/v2/models/{NAME}/classify", content=body, headers={"Content-Type": content_type}, timeout=60
    )


def _form(parts: list[tuple[list[str], bytes]]) -> bytes:
    return (
        b"".join(
            b"--b\r\n" + "".join(h + "\r\n" for h in headers).encode() + b"\r\n" + payload + b"\r\n"
            for headers, payload in parts
        )
        + b"--b--\r\n"
    )


def test_image_limits_on_a_real_server(server: Any) -> None:
    png = _encode(_picture(120, 100), "PNG")
    file_part = (['Content-Disposition: form-data; name="file"; filename="x.png"'], png)
    text_part = (['Content-Disposition: form-data; name="caption"'], b"hi")

    r = _classify(server.url, _encode(_picture(1001, 1000), "PNG"))
    assert r.status_code == 413 and "max_image_pixels" in r.json()["error"], r.text
    assert _classify(server.url, _encode(_picture(1000, 1000), "PNG")).status_code == 200

    form = "multipart/form-data; boundary=b"
    r = _classify(server.url, _form([text_part, file_part]), form)
    assert r.status_code == 200, r.text
    r = _classify(server.url, _form([text_part] * 16 + [file_part]), form)
    assert r.status_code == 413 and "more than 16 parts" in r.json()["error"], r.text
    # 200,000 tiny parts (10 MB) took the old parser 32 s: now refused at the 17th.
    r = _classify(server.url, _form([text_part] * 200_000), form)
    assert r.status_code == 413 and "more than 16 parts" in r.json()["error"], r.text
    many = ([f"X-H{i}: v" for i in range(64)] + file_part[0], png)
    r = _classify(server.url, _form([many]), form)
    assert r.status_code == 400 and "more than 64 header lines" in r.json()["error"], r.text
    r = _classify(server.url, _form([(many[0][1:], png)]), form)
    assert r.status_code == 200, r.text


def test_at_most_max_concurrent_decodes_images_decode_at_once(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = 0
    most = 0
    lock = threading.Lock()
    real = state.decode_image  # type: ignore[attr-defined]  # the name serve.state calls, patched below

    def counting(*args: Any) -> Any:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            time.sleep(0.3)  # long enough that six requests overlap
            return real(*args)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(state, "decode_image", counting)
    png = _encode(_picture(200, 200), "PNG")
    statuses: list[int] = []

    def one() -> None:
        statuses.append(_classify(server.url, png).status_code)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200] * 6
    assert most == 2  # max_concurrent_decodes


# ------------------------------------------------------------------ parsing off the event loop


def _dynamic_model(path: Path) -> None:
    """A model whose input has two dynamic dimensions: FP32 [batch, -1, -1] → its mean, [batch]."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["input"], ["mean"], axes=[1, 2], keepdims=0)],
        "dynamic",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "h", "w"])],
        [helper.make_tensor_value_info("mean", TensorProto.FLOAT, ["batch"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_a_health_check_is_answered_while_a_large_body_is_parsed(
    serve_kit: ServeKit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from visionloop.serve.source import StaticSource

    _dynamic_model(tmp_path / "dynamic.onnx")
    src = StaticSource()
    src.add("dynamic", 1, tmp_path / "dynamic.onnx", serve_kit.card)
    src.set_alias("dynamic", "champion", 1)
    # 16.8M values, 34 MB of JSON, the last one not a number: the server reads and checks
    # all of it before it can refuse it (then answers at once, with no inference to wait for).
    rows, cols = 256, 65536
    head = b'{"inputs": [{"name": "input", "shape": [1, %d, %d], "datatype": "FP32", "data": [' % (rows, cols)
    values = b"1," * (rows * cols - 1) + b'"x"'
    body = head + values + b"]}]}"
    parsing = threading.Event()
    done: list[str] = []
    answers: dict[str, httpx.Response] = {}
    real = app_module.parse_infer_request  # type: ignore[attr-defined]  # the name the route calls

    def parse(*args: Any) -> Any:
        parsing.set()  # the body is read; its parse (orjson, checks, conversion) begins
        return real(*args)

    monkeypatch.setattr(app_module, "parse_infer_request", parse)

    def hostile(url: str) -> None:
        r = httpx.post(f"{url}/v2/models/dynamic/infer", content=body, timeout=120)
        answers["hostile"] = r
        done.append("hostile")

    with serve_kit.server(src, tmp_path, model="dynamic", max_body_bytes=64 * 2**20) as s:
        t = threading.Thread(target=hostile, args=(s.url,))
        t.start()
        assert parsing.wait(120)
        r = httpx.get(f"{s.url}/v2/health/live", timeout=120)
        done.append("health")
        t.join(120)
    assert r.status_code == 200
    assert answers["hostile"].status_code == 400, answers["hostile"].text
    assert (
        f"input 'input' declares FP32 but element {rows * cols - 1} is a string ('x'), not a number"
        in answers["hostile"].json()["error"]
    )
    # The health check, sent once the large body's parse had begun, is answered before that
    # parse is done: the parse did not hold the event loop.
    assert done == ["health", "hostile"]
