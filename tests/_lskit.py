"""A real Label Studio server on loopback for the labelling tests (the `label-studio` package,
in its own virtual environment: it pins its own Django stack; `.ci/run` installs it and names
its executable in VISIONLOOP_TEST_LABEL_STUDIO), and a scripted annotator's calls: what people
do in the browser, through Label Studio's own API."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from _cpkit import free_port
from _dbkit import in_ci

TOKEN = "0123456789abcdef0123456789abcdef01234567"  # a legacy token: 40 hex digits


@dataclass(frozen=True)
class Server:
    url: str
    token: str

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Token {self.token}"}, timeout=60)


def _install() -> str:
    """Label Studio from .ci/label_studio.sh (its own environment, reused once made); fail in
    CI, skip elsewhere, when it cannot be installed (no network to PyPI)."""
    script = Path(__file__).parents[2] / ".ci" / "label_studio.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=1200, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return lines[-1]
    why = f"{script} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    if in_ci():
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def label_studio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    exe = os.environ.get("VISIONLOOP_TEST_LABEL_STUDIO", "").strip() or _install()
    data = tmp_path_factory.mktemp("label-studio")
    # .ci/label_studio.sh leaves an already migrated data folder beside the executable: copying
    # it saves the ~50 CPU-s migration of a first start. Without it the server migrates itself.
    template = Path(exe).resolve().parents[1] / "data-template"
    if (template / "label_studio.sqlite3").is_file():
        shutil.copytree(template, data, dirs_exist_ok=True)
    port = free_port()
    log = open(data / "server.log", "wb")  # noqa: SIM115 - the server holds it
    proc = subprocess.Popen(
        [exe, "start", "--no-browser", "--host", "127.0.0.1", "--port", str(port),
         "--username", "admin@example.com", "--password", "Passw0rd!", "--user-token", TOKEN,
         "--enable-legacy-api-token"],
        env={**os.environ, "LABEL_STUDIO_BASE_DATA_DIR": str(data)},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # the first start migrates its database
        while True:
            assert proc.poll() is None, (data / "server.log").read_text(errors="replace")[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).json().get("status") == "UP":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, "Label Studio did not start within 300 s"
            time.sleep(0.5)
        yield Server(url, TOKEN)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def user(http: httpx.Client, email: str) -> int:
    r = http.post(
        "/api/users/", json={"email": email, "username": email.split("@")[0], "password": "Passw0rd!x"}
    )
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def annotate(http: httpx.Client, task_id: int, result: list[dict[str, Any]], user: int, **kw: Any) -> None:
    r = http.post(f"/api/tasks/{task_id}/annotations/", json={"result": result, "completed_by": user, **kw})
    assert r.status_code == 201, r.text


def project_tasks(http: httpx.Client, project: int) -> list[dict[str, Any]]:
    r = http.get("/api/tasks/", params={"project": project, "page_size": 1000})
    assert r.status_code == 200, r.text
    return list(r.json()["tasks"])


def choice(name: str) -> list[dict[str, Any]]:
    return [{"from_name": "label", "to_name": "image", "type": "choices", "value": {"choices": [name]}}]
