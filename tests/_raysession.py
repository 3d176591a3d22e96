"""The session's one Ray cluster for the tests (tests/_raykit.py): the `ray_cluster` fixture.

Use it from a test module with

    pytest_plugins = ["_raysession"]

so that the fixture is registered once for the whole session (importing it into several
modules would give each module its own cluster). The cluster starts when the first test asks
for it and stops right after the last test that uses it, rather than idling through the rest
of the suite on CI's two cores; a failed start is reported once, not retried per test.
Test modules name it in `pytest_plugins` and never import it (pytest would warn that it
cannot rewrite a plugin module imported before it was registered).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from _execkit import require_ray
from _raykit import RayCluster, start_cluster

FIXTURE = "ray_cluster"
KIND_PARAM = "executor_kind"  # the parameter of tests that run against every executor


class _Shared:
    cluster: RayCluster | None = None
    last_user: str | None = None  # nodeid of the last collected test that uses the cluster


def _stop() -> None:
    cluster, _Shared.cluster = _Shared.cluster, None
    if cluster is not None:
        cluster.stop()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A real two-node Ray cluster on loopback (4 fake GPUs: 2 spot L4 on the head, 2
    on-demand A100 on the worker), shared by every test of the session."""
    require_ray()
    _Shared.cluster = start_cluster()
    try:
        yield _Shared.cluster
    finally:
        _stop()


def _uses_cluster(item: pytest.Item) -> bool:
    """Whether `item` needs the cluster: `ray_cluster` among its fixtures, or (tests that run
    against every executor and ask for the cluster only for Ray) parametrized with
    `executor_kind` "ray"."""
    if FIXTURE in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None) if isinstance(item, pytest.Function) else None
    return callspec is not None and callspec.params.get(KIND_PARAM) == "ray"


def pytest_collection_finish(session: pytest.Session) -> None:
    users = [item.nodeid for item in session.items if _uses_cluster(item)]
    _Shared.last_user = users[-1] if users else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if item.nodeid == _Shared.last_user:
        _stop()
