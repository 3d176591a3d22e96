"""The loop's rollout against a real `visionloop serve` on loopback that follows the registry,
with API keys on and clients sending images all along: a round's candidate is exported, set
as the challenger, given a canary and a shadow share through the routing API, watched on the
server's /metrics and promoted (a crash after every step acted, before its record was saved,
repeats nothing); the next round's candidate fails its watch and is rolled back. No client
request fails through either. A real control plane (SQLite) and real training."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from _cpkit import CP, TEAMS, cluster_config, control_plane
from _dbkit import fresh_database
from _loopkit import drive_through_crashes, labelled_folder
from _modelkit import ModelKit, onnx_model  # noqa: F401  (the session's exported champion)
from _trainkit import cli, spec_doc
from visionloop.core.settings import load_settings
from visionloop.data.shards import ShardReader
from visionloop.loop import state
from visionloop.loop.spec import LoopSpec, validate_loop_spec
from visionloop.registry import CHAMPION, alias_history, aliases
from visionloop.serve.config import ServeConfig
from visionloop.serve.keys import KeyRing, KeyStore
from visionloop.serve.server import BackgroundServer
from visionloop.serve.source import RegistrySource

ONE_GPU = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]


@dataclass
class Traffic:
    """Clients that keep sending the validation images to the model's bare name."""

    url: str
    key: str
    images: list[bytes]
    versions: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "image/png"}
        with httpx.Client(timeout=30, headers=headers) as c:
            k = 0
            while not self.stop.is_set():
                r = c.post(f"{self.url}/v2/models/digits/classify", content=self.images[k % len(self.images)])
                k += 1
                if r.status_code == 200:
                    self.versions[str(r.json()["model_version"])] += 1
                else:
                    self.failures.append(f"{r.status_code} {r.text[:200]}")
                time.sleep(0.005)


@dataclass
class World:
    kit: ModelKit
    cp: CP
    dataset: Path
    server: str
    traffic: Traffic

    def routing(self) -> dict[str, Any]:
        r = httpx.get(
            f"{self.server}/v2/models/digits/routing", headers={"Authorization": f"Bearer {self.traffic.key}"}
        )
        assert r.status_code == 200, r.text
        doc: dict[str, Any] = r.json()
        return doc


@pytest.fixture
def world(
    onnx_model: ModelKit,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[World]:
    kit = onnx_model.copy_home(tmp_path / "home")
    monkeypatch.setenv("VISIONLOOP_HOME", str(kit.home))
    monkeypatch.setenv("VISIONLOOP_TRACKING_URI", kit.settings.tracking_uri)
    dataset = tmp_path / "digits"
    shutil.copytree(kit.dataset, dataset)
    keys = KeyStore(kit.home)
    _, app_key = keys.create("app", ["digits"])
    _, loop_key = keys.create("loop", ["*"], routing=True)
    monkeypatch.setenv("VISIONLOOP_SERVE_KEY", loop_key)  # the rollout's key_env
    images = [r["image"] for r in ShardReader(dataset / "shards" / "val").read_many(list(range(60)))]
    config = ServeConfig(model="digits", port=0, alias_poll_s=0.2, prediction_log=False)
    with (
        fresh_database("sqlite", tmp_path) as url,
        control_plane(url, cluster_config(inventory=ONE_GPU, teams=TEAMS)) as cp,
        BackgroundServer(config, RegistrySource(kit.settings), keys=KeyRing.for_home(kit.home)) as server,
    ):
        traffic = Traffic(server.url, app_key, images)
        clients = [threading.Thread(target=traffic.run) for _ in range(2)]
        for t in clients:
            t.start()
        try:
            yield World(kit, cp, dataset, server.url, traffic)
        finally:
            traffic.stop.set()
            for t in clients:
                t.join(30)


def _spec(tmp_path: Path, w: World, **rollout: Any) -> LoopSpec:
    doc = {
        "name": "digits-loop",
        "model": "digits",
        "dataset": str(w.dataset),
        "labels": str(tmp_path / "incoming"),
        "trigger": {"new_labels": 20},
        "train": spec_doc(w.dataset, epochs=None, steps=6, data__workers=0, tracking__enabled=False),
        "job": {"team": "vision"},
        "gate": {"max_images": 150, "max_drop": 100.0},
        "rollout": {
            "server": w.server,
            "canary_percent": 50,
            "shadow_percent": 100,
            "watch_minutes": 0.05,
            "min_requests": 40,
            "max_latency_ratio": 20.0,  # the same architecture; a loaded CI machine is noisy
            "min_agreement": 0.5,
            **rollout,
        },
    }
    return validate_loop_spec(doc, tmp_path)


def test_a_canary_that_holds_is_promoted_and_one_that_fails_is_rolled_back(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = world
    settings = load_settings()
    spec = _spec(tmp_path, w)
    (tmp_path / "incoming").mkdir()
    labelled_folder(w.dataset, tmp_path / "incoming" / "round-a", 24, seed=5)

    # Round 1, with every record the loop is about to write for the first time lost once.
    result, crashed = drive_through_crashes(spec, w.cp, monkeypatch)
    rnd = result.state.rounds[-1]
    assert rnd.outcome == "promoted", (rnd.outcome, rnd.reason)
    assert [rnd.steps[s].status for s in state.STEPS] == ["done"] * 8
    canary = rnd.steps["canary"].outputs
    assert canary["champion"] == 1 and canary["candidate"] == 2 and "rolled_back" not in canary
    figures = canary["verdict"]["figures"]
    assert canary["verdict"]["passed"] is True
    assert figures["candidate_answered"] + figures["candidate_mirrored"] >= 40
    assert figures["candidate_answered"] > 0 and figures["candidate_mirrored"] > 0
    assert figures["agreement"] >= 0.5 and 0 < figures["latency_ratio"] <= 20, figures
    assert "the canary held" in rnd.steps["canary"].reason
    # The candidate answered clients during its canary; it is the champion now, alone.
    assert aliases("digits", settings) == {CHAMPION: 2}
    deadline = time.monotonic() + 30
    while (routing := w.routing())["primary"] != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert routing == {
        "model": "digits", "follows": "champion", "primary": 2, "challenger": None,
        "canary_percent": 0.0, "shadow_percent": 0.0,
    }  # fmt: skip
    history = [(e.action, e.alias, e.version, e.actor) for e in alias_history("digits", settings)]
    loop_moves = [h for h in history if h[3] == "loop digits-loop"]
    # Set once however often the loop died around it, then promoted, then removed.
    assert loop_moves == [
        ("set", "challenger", 2, "loop digits-loop"),
        ("set", "champion", 2, "loop digits-loop"),
        ("unset", "challenger", 2, "loop digits-loop"),
    ], history
    assert len(crashed) >= 16, crashed

    # Round 2: its candidate's p95 latency cannot be 1% of the champion's: rolled back.
    answered_before = dict(w.traffic.versions)
    spec2 = _spec(tmp_path, w, max_latency_ratio=0.01)
    labelled_folder(w.dataset, tmp_path / "incoming" / "round-b", 24, seed=6)
    result, crashed = drive_through_crashes(spec2, w.cp, monkeypatch)  # the rollback through crashes too
    rnd = result.state.rounds[-1]
    assert rnd.number == 2 and rnd.outcome == "rejected", (rnd.outcome, rnd.reason)
    assert rnd.reason.startswith("canary: rolled back: the canary failed"), rnd.reason
    assert "p95 latency" in rnd.reason and "(at most 0.01x)" in rnd.reason, rnd.reason
    assert rnd.steps["canary"].outputs["rolled_back"] is True
    assert rnd.steps["promote"].status == "skipped"
    assert aliases("digits", settings) == {CHAMPION: 2}  # the challenger alias is gone
    moves = [(e.action, e.alias, e.version) for e in alias_history("digits", settings)]
    assert moves[-2:] == [("set", "challenger", 3), ("unset", "challenger", 3)], moves
    assert len(crashed) >= 14, crashed
    deadline = time.monotonic() + 30
    while (routing := w.routing())["challenger"] is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (routing["primary"], routing["challenger"], routing["canary_percent"]) == (2, None, 0.0)
    # v3 answered some clients during its canary, and none after it was rolled back.
    assert w.traffic.versions["3"] > answered_before.get("3", 0) == 0
    after = w.traffic.versions["3"]
    time.sleep(1.0)
    assert w.traffic.versions["3"] == after
    assert w.traffic.failures == []

    # What a user sees.
    spec_file = tmp_path / "loop.yaml"
    spec_file.write_text(
        json.dumps(
            {**json.loads(spec2.model_dump_json()), "train": json.loads(spec2.train.model_dump_json())}
        )
    )
    r = cli("loop", "status", str(spec_file), env={"COLUMNS": "220"})
    assert r.returncode == 0, r.stderr
    assert "round 2: rejected" in r.stdout and "rolled back" in r.stdout, r.stdout
    assert "round 1: promoted" in r.stdout and "the canary held" in r.stdout, r.stdout
