"""Routing changed at run time over HTTP on a real server: a key with the routing scope moves
the canary share and rolls the champion back (the server switches at once, not at its next
alias poll); a read-only key may look but not change; bad bodies change nothing."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from _servekit import NAME, ServeKit, infer_body, serve_kit
from visionloop.serve.config import ServeConfig
from visionloop.serve.keys import KeyRing, KeyStore
from visionloop.serve.server import BackgroundServer
from visionloop.serve.source import StaticSource

__all__ = ["serve_kit"]


@dataclass
class Routed:
    url: str
    source: StaticSource
    viewer: str  # a read-only key for NAME
    ops: str  # a key for NAME with the routing scope

    def call(
        self, method: str, path: str, key: str | None, headers: dict[str, str] | None = None, **kw: object
    ) -> httpx.Response:
        headers = dict(headers or {})
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=60, **kw)  # type: ignore[arg-type]

    def versions(self, kit: ServeKit, n: int) -> list[int]:
        x = kit.batch(1, seed=3)
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.viewer}"}) as c:
            rs = [c.post(f"/v2/models/{NAME}/infer", json=infer_body(x)) for _ in range(n)]
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
        return [int(r.json()["model_version"]) for r in rs]


@pytest.fixture
def routed(serve_kit: ServeKit, tmp_path: Path) -> Iterator[Routed]:
    src = serve_kit.source(champion=1)
    src.set_alias(NAME, "champion", 2)  # v2 is the champion now; v1 was before it
    src.set_alias(NAME, "challenger", 1)
    store = KeyStore(tmp_path / "home")
    _, viewer = store.create("viewer", [NAME])
    _, ops = store.create("ops", [NAME], routing=True)
    # An hour between alias polls: whatever changes during the test was made by the request.
    cfg = ServeConfig(model=NAME, port=0, alias_poll_s=3600)
    ring = KeyRing.for_home(tmp_path / "home")
    with BackgroundServer(cfg, src, tmp_path / "predictions.jsonl", keys=ring) as server:
        yield Routed(server.url, src, viewer, ops)


def test_a_routing_key_moves_the_canary_and_rolls_back_a_read_only_key_cannot(
    serve_kit: ServeKit, routed: Routed
) -> None:
    path = f"/v2/models/{NAME}/routing"
    r = routed.call("GET", path, routed.viewer)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "model": NAME,
        "follows": "champion",
        "primary": 2,
        "challenger": 1,
        "canary_percent": 0.0,
        "shadow_percent": 0.0,
    }
    assert set(routed.versions(serve_kit, 20)) == {2}

    # Read-only: refused, with the fix named, and nothing moved.
    for method, where, body in (
        ("PUT", path, {"canary_percent": 50}),
        ("POST", f"/v2/models/{NAME}/rollback", None),
    ):
        r = routed.call(method, where, routed.viewer, json=body)
        assert r.status_code == 403, r.text
        assert "'viewer'" in r.json()["error"] and "--routing" in r.json()["error"]
    assert routed.call("GET", path, routed.viewer).json()["canary_percent"] == 0.0
    assert routed.source.aliases(NAME)["champion"] == 2
    assert routed.call("PUT", path, None, json={"canary_percent": 50}).status_code == 401

    # The canary takes (almost) everything, then nothing again.
    r = routed.call("PUT", path, routed.ops, json={"canary_percent": 99.999})
    assert r.status_code == 200, r.text
    assert r.json()["canary_percent"] == 99.999 and r.json()["shadow_percent"] == 0.0
    assert routed.versions(serve_kit, 40).count(1) >= 36  # P(fewer) < 1e-20
    assert routed.call("PUT", path, routed.ops, json={"canary_percent": 0}).json()["canary_percent"] == 0.0
    assert set(routed.versions(serve_kit, 20)) == {2}

    # Rollback: the registry's alias moves back, and the server answers with v1 at once.
    r = routed.call("POST", f"/v2/models/{NAME}/rollback", routed.ops)
    assert r.status_code == 200, r.text
    assert r.json()["primary"] == 1 and r.json()["challenger"] is None  # v1 was the challenger too
    assert routed.source.aliases(NAME)["champion"] == 1
    assert set(routed.versions(serve_kit, 20)) == {1}
    r = routed.call("POST", f"/v2/models/{NAME}/rollback", routed.ops)
    assert r.status_code == 409 and "no previous version" in r.json()["error"]
    assert set(routed.versions(serve_kit, 5)) == {1}


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b'{"canary_percent": 150}', 400, "canary_percent must be a number from 0 to 99.999"),
        (b'{"canary_percent": 100}', 400, "canary_percent must be a number from 0 to 99.999"),
        (b'{"shadow_percent": -1}', 400, "shadow_percent must be a number from 0 to 100"),
        (b'{"canary_percent": true}', 400, "canary_percent must be a number"),
        (b'{"canary_percent": "10"}', 400, "canary_percent must be a number"),
        (b'{"canary": 10}', 400, "unknown field(s) ['canary']"),
        (b"{}", 400, "canary_percent and/or shadow_percent"),
        (b"[10]", 400, "canary_percent and/or shadow_percent"),
        (b"canary=10", 400, "not JSON"),
        (b'{"canary_percent": 1' + b" " * 5000 + b"}", 413, "small JSON object"),
    ],
)
def test_a_bad_routing_change_is_refused_and_changes_nothing(
    routed: Routed, body: bytes, status: int, says: str
) -> None:
    path = f"/v2/models/{NAME}/routing"
    before = routed.call("GET", path, routed.ops).json()
    r = routed.call("PUT", path, routed.ops, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert says in r.json()["error"]
    assert routed.call("GET", path, routed.ops).json() == before


def test_a_model_served_pinned_to_a_version_has_nothing_to_roll_back(
    serve_kit: ServeKit, tmp_path: Path
) -> None:
    with serve_kit.server(serve_kit.source(champion=2), tmp_path, model=f"{NAME}/2") as s:
        r = httpx.post(f"{s.url}/v2/models/{NAME}/rollback")  # loopback, no keys: open
    assert r.status_code == 409
    assert "pinned to version 2" in r.json()["error"]
