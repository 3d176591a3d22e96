"""`visionloop serve keys` as a user drives it: create a key, serve with it, answer
tritonclient only with the key, revoke it while the server runs; and the refusal to listen
beyond loopback without keys."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

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


def test_keys_create_serve_and_revoke(kit: ModelKit) -> None:
    env = kit.env()
    # No keys yet: listening beyond loopback is refused, naming both ways out.
    r = cli("serve", kit.name, "--host", "0.0.0.0", "--port", str(_free_port()), env=env, timeout=120)
    assert r.returncode != 0 and "--keys" in r.stderr and "--insecure-no-auth" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr

    r = cli("serve", "keys", "create", "frontend", "--models", kit.name, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    assert key.startswith("vlk_") and "shown once" in r.stderr
    r = cli("serve", "keys", "list", env=env, timeout=60)
    assert r.returncode == 0 and "frontend" in r.stdout and kit.name in r.stdout and key not in r.stdout
    keys_file = kit.home / "serve" / "keys.json"
    assert keys_file.stat().st_mode & 0o777 == 0o600 and key not in keys_file.read_text()

    port = _free_port()
    proc = popen("serve", kit.name, "--port", str(port), env={**os.environ, **env})
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("listening on"):
            break
    else:
        proc.wait(30)
        pytest.fail("visionloop serve exited early:\n" + "".join(lines))
    try:
        assert any("API keys: on (1 key(s)" in line for line in lines), lines  # on: a key exists
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        x = np.zeros((1, *kit.info().card().input_size), dtype=np.float32)
        meta = client.get_model_metadata(kit.name, headers={"Authorization": f"Bearer {key}"})
        inp = triton.InferInput(meta["inputs"][0]["name"], list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        res = client.infer(kit.name, [inp], headers={"Authorization": f"Bearer {key}"})
        assert res.get_response()["model_version"] == "1"
        with pytest.raises(InferenceServerException) as e:
            client.infer(kit.name, [inp])
        assert e.value.status() == "401"
        assert client.is_server_ready()  # health stays open

        r = cli("serve", "keys", "revoke", "frontend", env=env, timeout=60)
        assert r.returncode == 0 and "revoked" in r.stderr
        deadline = time.monotonic() + 30
        while True:  # the server rereads the file within a second; no restart
            try:
                client.infer(kit.name, [inp], headers={"Authorization": f"Bearer {key}"})
            except InferenceServerException as refused:
                assert refused.status() == "401" and "revoked" in refused.message()
                break
            assert time.monotonic() < deadline, "the revoked key was still accepted after 30 s"
            time.sleep(0.1)
        client.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    r = cli("serve", "keys", "revoke", "frontend", env=env, timeout=60)
    assert r.returncode != 0 and "no API key named 'frontend'" in r.stderr
