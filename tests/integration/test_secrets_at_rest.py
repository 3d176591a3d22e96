"""Secrets at rest and in answers: the admin token and API keys are owner-only from their
first byte, a new home is 0700, the job store's URL never travels in argv, and a 500 from
either server says an error id while the exception's text goes to the log only."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from _cpkit import cluster_config, control_plane, free_port
from _servekit import NAME, ServeKit, serve_kit
from _trainkit import cli
from visionloop.core.errors import ConfigError
from visionloop.core.fsutil import atomic_write_text
from visionloop.core.settings import Settings, load_settings

__all__ = ["serve_kit"]


class FsyncSpy:
    """Records the permission bits of every file fsynced: atomic_write fsyncs its temporary
    file after writing the content and before renaming it, so this is the mode the secret had
    while it was on disk under any name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.modes: list[int] = []
        real = os.fsync

        def spy(fd: int) -> None:
            st = os.fstat(fd)
            if not (st.st_mode & 0o040000):  # a file, not the directory synced after the rename
                self.modes.append(st.st_mode & 0o777)
            real(fd)

        monkeypatch.setattr(os, "fsync", spy)


def test_atomic_write_text_mode_is_the_files_mode_from_the_first_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = FsyncSpy(monkeypatch)
    atomic_write_text(tmp_path / "secret", "s3cret\n", mode=0o600)
    atomic_write_text(tmp_path / "plain", "hello\n")
    assert spy.modes[0] == 0o600
    assert (tmp_path / "secret").stat().st_mode & 0o777 == 0o600
    # Without a mode a file gets open()'s permissions, so the team can read datasets.
    from visionloop.core.fsutil import UMASK

    assert spy.modes[1] == 0o666 & ~UMASK


def test_admin_token_is_owner_only_from_the_first_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    from visionloop.api.server import build_plane, ensure_admin_token

    settings = load_settings().ensure()
    plane = build_plane(settings, cluster_config(), None)
    try:
        spy = FsyncSpy(monkeypatch)
        path = ensure_admin_token(plane, settings.home)
    finally:
        plane.store.close()
    assert spy.modes == [0o600]
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_new_home_is_0700_and_an_existing_one_keeps_its_mode(tmp_path: Path) -> None:
    fresh = Settings(home=tmp_path / "a" / "home", tracking_uri="sqlite://").ensure()
    assert fresh.home.stat().st_mode & 0o777 == 0o700
    assert fresh.runs_dir.is_dir()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o750)
    shared.chmod(0o750)
    Settings(home=shared, tracking_uri="sqlite://").ensure()
    assert shared.stat().st_mode & 0o777 == 0o750


def test_a_database_password_is_refused_on_the_command_line(tmp_path: Path) -> None:
    from visionloop.api.server import resolve_db_url

    url = "postgresql+psycopg://vl:hunter2@db.internal/visionloop"
    with pytest.raises(ConfigError, match="VISIONLOOP_DB_URL") as e:
        resolve_db_url(url)
    assert "--db-url-file" in str(e.value) and "hunter2" not in str(e.value)
    assert resolve_db_url("postgresql+psycopg://vl@db.internal/visionloop") is not None  # no password: fine
    f = tmp_path / "db-url"
    f.write_text(url + "\n")
    f.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        resolve_db_url(db_url_file=f)
    f.chmod(0o600)
    assert resolve_db_url(db_url_file=f) == url
    # The CLI says the same, in one line, and exits non-zero.
    r = cli("up", "--db", url, "--port", str(free_port()))
    assert r.returncode != 0
    assert "VISIONLOOP_DB_URL" in r.stderr and "hunter2" not in r.stderr + r.stdout


def test_detached_control_plane_gets_its_database_url_through_the_environment(tmp_path: Path) -> None:
    from visionloop.api.server import detach, running_server, stop

    settings = load_settings()
    db = tmp_path / "elsewhere" / "jobs.db"
    db.parent.mkdir()
    url = f"sqlite:///{db}"
    detach(settings, settings.home / "cluster.toml", url, "127.0.0.1", free_port())
    try:
        state = running_server(settings)
        assert state is not None
        argv = Path(f"/proc/{state['pid']}/cmdline").read_bytes().split(b"\0")
        assert not any(b"sqlite" in a or a == b"--db" for a in argv), argv
        environ = Path(f"/proc/{state['pid']}/environ").read_bytes().split(b"\0")
        assert f"VISIONLOOP_DB_URL={url}".encode() in environ
        # ...and it is the store the control plane uses.
        assert db.is_file() and not (settings.home / "state.db").exists()
        token = (settings.home / "admin.token").read_text().strip()
        r = httpx.get(f"{state['url']}/v1/cluster", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200
    finally:
        stop(settings)


def _error_id(detail: str) -> str:
    m = re.search(r"\bid ([0-9a-f]{12})\b", detail)
    assert m is not None, detail
    return m.group(1)


def test_control_plane_500_says_an_error_id_and_logs_the_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with control_plane(f"sqlite:///{tmp_path / 'state.db'}", cluster_config(), run_scheduler=False) as cp:

        def broken(*_: Any, **__: Any) -> Any:
            raise RuntimeError("could not connect to postgresql://vl:hunter2@db.internal/visionloop")

        monkeypatch.setattr(cp.plane.store, "list_gpus", broken)
        with caplog.at_level(logging.ERROR, logger="visionloop.api.app"), cp.client() as c:
            r = c.get("/v1/cluster")
    assert r.status_code == 500
    detail = r.json()["detail"]
    assert "hunter2" not in r.text and "RuntimeError" not in r.text
    assert detail.startswith("internal error, id ") and "control plane log" in detail
    error_id = _error_id(detail)
    logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert logged and logged[0].exc_info is not None and "hunter2" in str(logged[0].exc_info[1])


def _model_failing_beyond_batch_1(path: Path, kit: ServeKit) -> None:
    """A real ONNX model with the digits signature that adds a bias looked up in a 2-entry
    table at index N (the batch size): ONNX Runtime loads it and its batch-1 warm-up runs, but
    a batch of 2 fails in the node named below (ORT's message names it: the kind of text a 500
    must not show)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    c, h, w = kit.card.input_size
    k = kit.card.num_classes

    def const(name: str, value: list[int]) -> onnx.TensorProto:
        return numpy_helper.from_array(np.array(value, dtype=np.int64), name)

    weights = numpy_helper.from_array(np.zeros((c * h * w, k), dtype=np.float32), "w")
    nodes = [
        helper.make_node("Flatten", ["input"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "w"], ["scores"]),
        helper.make_node("Shape", ["input"], ["in_shape"]),
        helper.make_node("Slice", ["in_shape", "zero", "one"], ["n"]),
        helper.make_node("Gather", ["table", "n"], ["bias"], axis=0, name="private_node_opt_models_x"),
        helper.make_node("Add", ["scores", "bias"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "fails",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", c, h, w])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", k])],
        [
            weights,
            const("zero", [0]),
            const("one", [1]),
            numpy_helper.from_array(np.zeros(2, np.float32), "table"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_inference_server_500_says_an_error_id_and_logs_the_exception(
    serve_kit: ServeKit, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from _servekit import infer_body
    from visionloop.serve.source import StaticSource

    model = tmp_path / "fails.onnx"
    _model_failing_beyond_batch_1(model, serve_kit)
    src = StaticSource()
    src.add(NAME, 1, model, serve_kit.card)
    src.set_alias(NAME, "champion", 1)
    with serve_kit.server(src, tmp_path, max_queue_delay_ms=0.0) as s:
        ok = httpx.post(f"{s.url}/v2/models/{NAME}/infer", json=infer_body(serve_kit.batch(1)))
        assert ok.status_code == 200, ok.text
        with caplog.at_level(logging.ERROR, logger="visionloop.serve.app"):
            r = httpx.post(f"{s.url}/v2/models/{NAME}/infer", json=infer_body(serve_kit.batch(2)))
    assert r.status_code == 500
    error = r.json()["error"]
    assert error.startswith("inference failed, error id ") and "server log" in error
    assert "private_node" not in r.text and "Gather" not in r.text
    error_id = _error_id(error)
    logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert logged and "private_node_opt_models_x" in str(logged[0].exc_info[1])  # type: ignore[index]
