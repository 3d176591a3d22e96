"""What the executor tests share: waiting on and reading any `Executor`'s attempts, and
whether Ray can be tested here. The session's Ray cluster is the `ray_cluster` fixture of
tests/_raysession.py."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time

import pytest

from visionloop.sched.executors.base import AttemptStatus, Executor, Handle

WAIT_S = 90.0  # generous bound for a loaded 2-core machine; a hang fails with a message


def require_ray(*, allow_module_level: bool = False) -> None:
    """Skip (or, under CI, fail) when Ray's job SDK cannot be imported."""
    if importlib.util.find_spec("ray") is not None:
        with contextlib.suppress(ImportError):
            import ray.job_submission  # noqa: F401

            return
    why = "Ray cannot be imported"
    if os.environ.get("CI") == "true":
        pytest.fail(
            f"{why}, so the Ray executor is untested: CI installs it with the dev extra "
            "(`pip install -e '.[dev]'`, which includes ray[default]).",
            pytrace=False,
        )
    pytest.skip(
        f"{why}: `pip install 'visionloop[ray]'` to test the Ray executor",
        allow_module_level=allow_module_level,
    )


# -- helpers for any executor -----------------------------------------------------------------


def log_text(executor: Executor, handle: Handle, offset: int = 0) -> str:
    return b"".join(executor.read_log(handle, offset)).decode("utf-8", "replace")


def wait_exited(executor: Executor, handle: Handle, timeout: float = WAIT_S) -> AttemptStatus:
    deadline = time.monotonic() + timeout
    while (status := executor.poll(handle)).state == "running":
        if time.monotonic() > deadline:
            log = log_text(executor, handle)
            raise AssertionError(
                f"{handle} still running after {timeout:.0f} s ({status.detail}); log:\n{log}"
            )
        time.sleep(0.2)  # each poll of a Ray attempt is an HTTP call
    return status


def wait_log(executor: Executor, handle: Handle, text: str, timeout: float = WAIT_S) -> str:
    """Wait for `text` in the log (a job's signal handlers are installed once it says so).
    Jobs print their markers in pieces (`print("parent", "ready")`): Ray's log starts with
    the entrypoint, so a marker spelled out in the source would be found at once."""
    deadline = time.monotonic() + timeout
    while text not in (log := log_text(executor, handle)):
        status = executor.poll(handle)
        if status.state != "running" or time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} in the log of {handle} ({status}); log:\n{log}")
        time.sleep(0.2)  # each poll of a Ray attempt is an HTTP call
    return log
