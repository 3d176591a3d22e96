"""The suite's warm CLI runner (tests/_warmcli.py) answers as a cold `python -m visionloop` does.

Most CLI tests fork their processes from a warm interpreter; this checks, against the cold
command, that nothing a test asserts on can differ: stdout, stderr, exit status, the
environment and the working directory the command sees, stdin, and a timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

import _warmcli


@pytest.mark.parametrize(
    "args",
    [
        ["runs", "list"],  # reads VISIONLOOP_HOME from the environment it is given; exit 0
        ["train", "missing.yaml"],  # a relative path from the working directory; exit 2, stderr
        ["no-such-command"],  # typer's usage error; exit 2
    ],
)
def test_a_warm_call_prints_and_exits_as_a_cold_one(args: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "VISIONLOOP_HOME": str(tmp_path / "home"), "COLUMNS": "100"}
    cold = _warmcli.run(args, env=env, cwd=tmp_path, timeout=120, start_cold=True)
    warm = _warmcli.run(args, env=env, cwd=tmp_path, timeout=120)
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert cold.stdout or cold.stderr


def test_the_environment_and_the_directory_are_the_callers_not_the_servers(tmp_path: Path) -> None:
    env = {**os.environ, "VISIONLOOP_HOME": str(tmp_path / "elsewhere")}
    r = _warmcli.run(["runs", "list"], env=env, cwd=tmp_path)
    assert r.returncode == 0 and str(tmp_path / "elsewhere" / "mlflow.db") in r.stdout
    r = _warmcli.run(["train", "missing.yaml"], env=env, cwd=tmp_path)
    assert r.returncode == 2 and "missing.yaml does not exist" in r.stderr
    (tmp_path / "broken.yaml").write_text("epochs: [\n")  # found only from tmp_path
    r = _warmcli.run(["train", "broken.yaml"], env=env, cwd=tmp_path)
    assert r.returncode == 2 and "does not exist" not in r.stderr and "broken.yaml" in r.stderr


def test_a_call_past_its_timeout_is_killed_and_raises(tmp_path: Path) -> None:
    env = {**os.environ, "VISIONLOOP_HOME": str(tmp_path / "home")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):  # the control plane serves until it is stopped
        _warmcli.run(["up", "--port", str(port)], env=env, cwd=tmp_path, timeout=3)
    assert time.monotonic() - started < 60
