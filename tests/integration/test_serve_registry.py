"""The server on the real registry (RegistrySource over MLflow): it follows `models alias`
and `models rollback` while serving, without a restart and without failing a request."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np

from _modelkit import ModelKit, onnx_model
from _servekit import infer_body
from visionloop.export import export_model
from visionloop.registry import aliases, register, rollback, set_alias
from visionloop.serve.config import ServeConfig
from visionloop.serve.server import BackgroundServer
from visionloop.serve.source import RegistrySource

__all__ = ["onnx_model"]


def test_the_server_follows_promotion_and_rollback_in_the_registry_under_load(
    onnx_model: ModelKit, tmp_path: Path
) -> None:
    kit = onnx_model.copy_home(tmp_path / "home")
    v2 = register(kit.run_dir, name=kit.name, settings=kit.settings)
    export_model(v2, precision="fp32", settings=kit.settings)
    assert v2.version == kit.version + 1 and aliases(kit.name, kit.settings) == {"champion": kit.version}

    c, h, w = kit.info().card().input_size
    body = infer_body(np.zeros((1, c, h, w), np.float32))
    config = ServeConfig(model=kit.name, port=0, alias_poll_s=0.2, prediction_log=False)
    with BackgroundServer(config, RegistrySource(kit.settings)) as server:
        url = f"{server.url}/v2/models/{kit.name}/infer"
        answered: list[str] = []
        failures: list[str] = []
        stop = threading.Event()

        def load() -> None:  # a client that never stops asking while the aliases move
            with httpx.Client(timeout=30) as client:
                while not stop.is_set():
                    r = client.post(url, json=body)
                    if r.status_code == 200:
                        answered.append(r.json()["model_version"])
                    else:
                        failures.append(f"{r.status_code} {r.text}")

        clients = [threading.Thread(target=load) for _ in range(4)]
        for t in clients:
            t.start()
        try:

            def served_by(version: int, timeout: float = 30.0) -> None:
                deadline = time.monotonic() + timeout
                seen = len(answered)
                while time.monotonic() < deadline:
                    recent = answered[seen:]
                    if len(recent) >= 20 and set(recent[-10:]) == {str(version)}:
                        return
                    time.sleep(0.1)
                raise AssertionError(f"still not served by v{version}: last answers {answered[-10:]}")

            served_by(kit.version)
            set_alias(kit.name, v2.version, "champion", actor="test", settings=kit.settings)
            served_by(v2.version)
            rollback(kit.name, actor="test", settings=kit.settings)
            served_by(kit.version)
        finally:
            stop.set()
            for t in clients:
                t.join(30)
    assert failures == []
    assert {str(kit.version), str(v2.version)} <= set(answered)
