"""API keys on a real inference server on loopback: tritonclient with `headers=`, raw HTTP on
every route, keys limited to a model, /metrics, a request refused before its body is read,
and keys created and revoked while the server runs (no restart)."""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from _servekit import NAME, ServeKit, infer_body, ort_logits, serve_kit
from visionloop.core.errors import ConfigError
from visionloop.core.settings import load_settings
from visionloop.serve.config import ServeConfig
from visionloop.serve.keys import KeyRing, KeyStore
from visionloop.serve.server import BackgroundServer
from visionloop.serve.source import StaticSource

__all__ = ["serve_kit"]

OTHER = "pets"  # a second model (the kit's v2 file under another name)


def _source(kit: ServeKit) -> StaticSource:
    src = StaticSource()
    src.add(NAME, 1, kit.v1, kit.card)
    src.add(OTHER, 1, kit.v2, kit.card)
    src.set_alias(NAME, "champion", 1)
    src.set_alias(OTHER, "champion", 1)
    return src


class Keys:
    def __init__(self, store: KeyStore, server: BackgroundServer) -> None:
        self.store = store
        self.server = server
        _, self.digits = store.create("digits-only", [NAME])
        _, self.all = store.create("everything", ["*"])
        # The server notices the changed file at its next poll and reloads it in a thread,
        # checking requests against the keys it has meanwhile: wait until both are taken.
        for key in (self.digits, self.all):
            _wait_until(functools.partial(self._answers, key), "the new keys loaded")

    def _answers(self, key: str) -> bool:
        return self.get(f"/v2/models/{NAME}", key).status_code == 200

    def get(self, path: str, key: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(f"{self.server.url}{path}", headers=headers)

    def post(self, path: str, key: str | None, **kw: object) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.server.url}{path}", headers=headers, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def keys(serve_kit: ServeKit, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keys]:
    home = tmp_path_factory.mktemp("keyhome")
    store = KeyStore(home)
    store.create("placeholder", [NAME])  # the file exists before the server starts
    ring = KeyRing.for_home(home, poll_s=0.05)
    cfg = ServeConfig(model=NAME, models=[OTHER], port=0)
    tmp = tmp_path_factory.mktemp("serve-keys")
    with BackgroundServer(cfg, _source(serve_kit), tmp / "predictions.jsonl", keys=ring) as server:
        yield Keys(store, server)  # keys made after start-up: the server reloads the file


def _wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def test_tritonclient_sends_the_key_with_headers(serve_kit: ServeKit, keys: Keys) -> None:
    client = triton.InferenceServerClient(keys.server.url.removeprefix("http://"))
    auth = {"Authorization": f"Bearer {keys.digits}"}
    try:
        # Health checks stay open for load balancers: no key needed.
        assert client.is_server_live() and client.is_server_ready()
        meta = client.get_model_metadata(NAME, headers=auth)
        assert meta["name"] == NAME
        x = serve_kit.batch(3)
        inp = triton.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        res = client.infer(NAME, [inp], headers=auth)
        np.testing.assert_allclose(res.as_numpy("logits"), ort_logits(serve_kit.v1, x), rtol=1e-5, atol=1e-5)

        with pytest.raises(InferenceServerException) as no_key:
            client.infer(NAME, [inp])
        assert no_key.value.status() == "401"
        assert "Authorization: Bearer" in no_key.value.message()
        with pytest.raises(InferenceServerException) as other:
            client.infer(OTHER, [inp], headers=auth)
        assert other.value.status() == "403"
        assert f"does not cover model {OTHER!r}" in other.value.message()
    finally:
        client.close()


def test_every_route_but_health_needs_a_key(serve_kit: ServeKit, keys: Keys) -> None:
    x = serve_kit.batch(1)
    png = next(serve_kit.images.rglob("*.png")).read_bytes()
    routes: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/v2", {}),
        ("GET", "/v2/models", {}),
        ("GET", f"/v2/models/{NAME}", {}),
        ("GET", f"/v2/models/{NAME}/versions/1", {}),
        ("GET", f"/v2/models/{NAME}/ready", {}),
        ("GET", f"/v2/models/{NAME}/versions/1/ready", {}),
        ("POST", f"/v2/models/{NAME}/infer", {"json": infer_body(x)}),
        ("POST", f"/v2/models/{NAME}/versions/1/infer", {"json": infer_body(x)}),
        ("POST", f"/v2/models/{NAME}/classify", {"content": png, "headers": {"content-type": "image/png"}}),
        ("GET", "/metrics", {}),
    ]
    fake = "vlk_00000000_" + "A" * 43  # well formed, never issued
    for method, path, kw in routes:
        for bad in (None, "not-a-key", fake, keys.digits[:-1] + ("B" if keys.digits[-1] != "B" else "C")):
            headers = dict(kw.get("headers", {}))
            if bad is not None:
                headers["Authorization"] = f"Bearer {bad}"
            rest = {k: v for k, v in kw.items() if k != "headers"}
            r = httpx.request(method, f"{keys.server.url}{path}", headers=headers, **rest)
            assert r.status_code == 401, (method, path, bad, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert "error" in r.json()
        good = dict(kw.get("headers", {}))
        good["Authorization"] = f"Bearer {keys.all}"
        rest = {k: v for k, v in kw.items() if k != "headers"}
        r = httpx.request(method, f"{keys.server.url}{path}", headers=good, **rest)
        assert r.status_code == 200, (method, path, r.text)
    for path in ("/v2/health/live", "/v2/health/ready"):
        assert keys.get(path, None).status_code == 200


def test_a_key_limited_to_a_model(serve_kit: ServeKit, keys: Keys) -> None:
    x = serve_kit.batch(1)
    assert keys.get(f"/v2/models/{NAME}", keys.digits).status_code == 200
    for path in (f"/v2/models/{OTHER}", f"/v2/models/{OTHER}/ready", "/v2/models/nope"):
        r = keys.get(path, keys.digits)
        assert r.status_code == 403, r.text
        # The same answer for a served model and a missing one: it tells nothing about which exist.
        assert "does not cover model" in r.json()["error"]
    r = keys.post(f"/v2/models/{OTHER}/infer", keys.digits, json=infer_body(x))
    assert r.status_code == 403
    # The model list shows what the key covers; a key for all models sees both.
    names = [m["name"] for m in keys.get("/v2/models", keys.digits).json()["models"]]
    assert names == [NAME]
    names = [m["name"] for m in keys.get("/v2/models", keys.all).json()["models"]]
    assert sorted(names) == sorted([NAME, OTHER])
    # /metrics names every model: it needs a key for all of them.
    r = keys.get("/metrics", keys.digits)
    assert r.status_code == 403 and "/metrics" in r.json()["error"]
    r = keys.get("/metrics", keys.all)
    assert r.status_code == 200 and "visionloop" in r.text


def test_a_request_without_a_key_is_refused_before_its_body_is_read(keys: Keys) -> None:
    """Headers announcing 8 MiB, then nothing: a server that read the body first would wait
    for it (and an attacker could make it hold 32 MiB per connection before saying no)."""
    host, port = keys.server.url.removeprefix("http://").split(":")
    for auth in ("", "Authorization: Bearer vlk_00000000_" + "A" * 43 + "\r\n"):
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(
                (
                    f"POST /v2/models/{NAME}/infer HTTP/1.1\r\nHost: {host}\r\n{auth}"
                    f"Content-Type: application/json\r\nContent-Length: {8 * 2**20}\r\n\r\n"
                ).encode()
            )
            answer = s.recv(65536).decode("latin-1")  # raises TimeoutError if the server waits
        assert answer.startswith("HTTP/1.1 401"), answer


def test_keys_made_and_revoked_while_it_runs(serve_kit: ServeKit, keys: Keys) -> None:
    record, new = keys.store.create("late", [NAME])
    _wait_until(lambda: keys.get(f"/v2/models/{NAME}", new).status_code == 200, "the new key works")
    keys.store.revoke("late")
    _wait_until(lambda: keys.get(f"/v2/models/{NAME}", new).status_code == 401, "the revoked key is refused")
    assert keys.get(f"/v2/models/{NAME}", new).json()["error"] == "unknown or revoked API key"
    # The other keys still work.
    assert keys.get(f"/v2/models/{NAME}", keys.digits).status_code == 200
    # The file holds hashes, never a key.
    text = keys.store.path.read_text()
    assert new not in text and keys.digits not in text and keys.all not in text
    assert record.id not in text and '"late"' not in text


def test_the_first_request_with_a_key_made_while_it_runs_is_answered(keys: Keys) -> None:
    """The request that finds the keys file due for a check starts its reload in a thread; a
    key that only the reload brings waits for it instead of being refused (before: 401 for
    the first request with a new key, then 200)."""
    _, new = keys.store.create("fresh", [NAME])
    try:
        for _ in range(3):
            time.sleep(0.2)  # past the 0.05 s poll: this request starts the reload
            assert keys.get(f"/v2/models/{NAME}", new).status_code == 200
            keys.store.revoke("fresh")
            time.sleep(0.2)
            assert keys.get(f"/v2/models/{NAME}", new).status_code == 401  # revoked: refused
            _, new = keys.store.create("fresh", [NAME])
    finally:
        keys.store.revoke("fresh")


def test_a_damaged_keys_file_refuses_every_key_until_fixed(keys: Keys) -> None:
    path = keys.store.path
    good = path.read_text()
    path.write_text("{ not json")
    try:
        _wait_until(lambda: keys.get("/v2", keys.all).status_code == 401, "a damaged file denies all keys")
    finally:
        path.write_text(good)
    _wait_until(lambda: keys.get("/v2", keys.all).status_code == 200, "the fixed file is read again")


def test_keys_file_is_owner_only_and_scopes_are_recorded(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "home")
    ro, key = store.create("reader", ["digits", "pets"])
    rw, _ = store.create("operator", ["*"], routing=True)
    assert key.startswith(f"vlk_{ro.id}_")
    assert store.path.stat().st_mode & 0o777 == 0o600
    assert store.path.parent.stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "home").stat().st_mode & 0o777 == 0o700
    doc = json.loads(store.path.read_text())
    assert [k["name"] for k in doc["keys"]] == ["reader", "operator"]
    assert ro.allows("read") and not ro.allows("routing")
    assert rw.allows("routing") and rw.covers("anything")
    assert ro.covers("pets") and not ro.covers("cats")
    ring = KeyRing(store.path)
    assert ring.authenticate(key) == ro
    assert ring.authenticate(key.replace(ro.id, rw.id)) is None  # right id, wrong secret
    with pytest.raises(ConfigError, match="exists"):
        store.create("reader", ["digits"])


def test_no_keys_beyond_loopback_is_refused(serve_kit: ServeKit, tmp_path: Path) -> None:
    cfg = ServeConfig(model=NAME, host="0.0.0.0", port=0)
    with pytest.raises(ConfigError) as e:
        BackgroundServer(cfg, serve_kit.source(), tmp_path / "p.jsonl")
    assert "--keys" in str(e.value) and "--insecure-no-auth" in str(e.value)
    # Loopback without keys stays open (the tests and the demo rely on it).
    with serve_kit.server(serve_kit.source(), tmp_path) as s:
        assert httpx.get(f"{s.url}/v2/models/{NAME}").status_code == 200
    from visionloop.serve.server import resolve_keys

    settings = load_settings()
    assert resolve_keys(settings) is None  # no keys file: open
    KeyStore(settings.home).create("k", [NAME])
    ring = resolve_keys(settings)
    assert ring is not None and len(ring) == 1  # a key exists: keys are on
    assert resolve_keys(settings, insecure_no_auth=True) is None


def test_a_keys_file_that_is_a_fifo_not_utf8_or_huge_is_refused_in_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server reads the keys file at start and whenever it changes, and `serve keys` on
    every call. A FIFO in its place waited for a writer forever (the server never started);
    bytes that are not UTF-8 were a UnicodeDecodeError traceback."""
    from _hangkit import in_thread
    from visionloop.serve import keys as keys_module

    store = KeyStore(tmp_path / "home")
    store.create("reader", ["digits"])
    path = store.path
    path.unlink()
    os.mkfifo(path)
    got = in_thread(lambda: KeyRing(path))
    assert isinstance(got, ConfigError), got
    assert str(got).startswith(f"cannot read the API keys file {path}: ") and "FIFO" in str(got)

    path.unlink()
    path.write_bytes(b'{"version": 1, "keys": []}\xff\n')
    with pytest.raises(ConfigError) as e:
        store.keys()
    assert f"the API keys file {path} is damaged (not UTF-8" in str(e.value)
    assert "visionloop serve keys create" in str(e.value)

    monkeypatch.setattr(keys_module, "MAX_KEYS_FILE_BYTES", 64)
    path.write_text('{"version": 1, "keys": []}' + " " * 64)
    with pytest.raises(ConfigError, match="larger than 64 bytes, the limit for an API keys file"):
        store.keys()
