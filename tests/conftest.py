"""Shared fixtures. Every test runs against its own temporary VISIONLOOP_HOME."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Markers come from the folder, as in LitServe: tests/unit -> unit, and so on.
    for item in items:
        # Under pytest-xdist (`-n 2 --dist loadgroup`, the README's command): a file's tests
        # run on one worker, so its module fixtures are built once, and every test on the
        # session's Ray cluster (tests/_raysession.py) runs on the same worker as the others.
        if item.get_closest_marker("xdist_group") is None:
            uses_ray = "ray_cluster" in getattr(item, "fixturenames", ())
            item.add_marker(pytest.mark.xdist_group("ray" if uses_ray else item.nodeid.split("::")[0]))
        parts = Path(str(item.fspath)).parts
        for kind in ("unit", "integration", "e2e"):
            if kind in parts:
                item.add_marker(getattr(pytest.mark, kind))
        if "gpu" in item.keywords:
            import torch

            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


# Seconds per test file (setup, call and teardown of its tests), printed at the end: the suite
# runs a file's tests on one xdist worker, so a long file is what stretches the run's wall time.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FILE_SECONDS:
        return
    top = sorted(_FILE_SECONDS.items(), key=lambda kv: kv[1], reverse=True)[:20]
    terminalreporter.write_sep("=", f"slowest {len(top)} test files (of {len(_FILE_SECONDS)})")
    for path, seconds in top:
        terminalreporter.write_line(f"{seconds:8.1f}s {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}s in all")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist, in the controller: tell each worker whether COLUMNS was set here."""
    node.workerinput["visionloop_columns"] = os.environ.get("COLUMNS")


@pytest.fixture(autouse=True)
def vl_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[Path]:
    """A private visionloop home (and MLflow store) for each test."""
    home = tmp_path_factory.mktemp("vlhome")
    monkeypatch.setenv("VISIONLOOP_HOME", str(home))
    monkeypatch.delenv("VISIONLOOP_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    worker = getattr(request.config, "workerinput", None)
    if worker is not None and worker.get("visionloop_columns") is None:
        # An xdist worker has COLUMNS=80 and LINES=24 in its environment (a terminal library
        # sets them there), which the CLIs under test would inherit and narrow their tables to.
        monkeypatch.delenv("COLUMNS", raising=False)
        monkeypatch.delenv("LINES", raising=False)
    yield home


@pytest.fixture(scope="session")
def digits_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real dataset made by the real ingest from scikit-learn's digits (16x16), shared by
    the trainer tests (read-only)."""
    from _trainkit import build_digits_dataset

    return build_digits_dataset(tmp_path_factory.mktemp("digits"))
