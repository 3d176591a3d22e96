"""The whole loop, closed, as a team runs it: a served champion keeps what it sees; the traffic
turns to night; the monitor flags the drift and the alert fires; the images worth labelling are
picked from what the server kept, labelled in a real Label Studio by a scripted annotator and
imported; the loop makes the next dataset version, retrains on the queue from the champion,
passes the gates and the canary on the live server, and promotes; and the new champion is
better than the old on night images neither was trained on. Nothing here is mocked: the
server, Label Studio, the control plane and the trainer are the real ones."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from _cpkit import CP, TEAMS, cluster_config, control_plane
from _dbkit import fresh_database
from _loopkit import drive
from _lskit import Server, annotate, choice, label_studio, project_tasks, user
from _modelkit import ModelKit, onnx_model
from _trainkit import cli, spec_doc
from visionloop.alerts import parse_config, run_check
from visionloop.core.settings import load_settings
from visionloop.data.manifest import read_manifest, shard_dir_of
from visionloop.data.shards import ShardReader
from visionloop.eval.api import evaluate_model
from visionloop.eval.corruptions import corrupt, image_seed
from visionloop.eval.options import EvalOptions
from visionloop.label.studio import ID_KEY
from visionloop.loop.spec import validate_loop_spec
from visionloop.monitor.reference import build_reference
from visionloop.monitor.service import MonitorOptions, new_windows
from visionloop.monitor.windows import WindowSpec
from visionloop.registry import CHAMPION, aliases
from visionloop.serve.config import ServeConfig
from visionloop.serve.server import BackgroundServer
from visionloop.serve.source import RegistrySource

__all__ = ["label_studio", "onnx_model"]

ONE_GPU = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]
WINDOW = 120  # requests per monitor window
BUDGET = 48  # images labelled


def _png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def _night(data: bytes, seed: int) -> bytes:
    rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    return _png(corrupt(rgb, "night", 4, image_seed(0, seed)))


class Clients:
    """Image requests to the model's bare name, from a thread, until stopped."""

    def __init__(self, url: str, images: list[bytes]) -> None:
        self.url, self.images = url, images
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            k = 0
            while not self.stop.is_set():
                r = c.post(
                    self.url, content=self.images[k % len(self.images)], headers={"Content-Type": "image/png"}
                )
                if r.status_code != 200:
                    self.failures.append(f"{r.status_code} {r.text[:200]}")
                k += 1
                time.sleep(0.01)

    def __enter__(self) -> Clients:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


@pytest.fixture
def home(
    onnx_model: ModelKit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ModelKit, CP]]:
    kit = onnx_model.copy_home(tmp_path / "home")
    monkeypatch.setenv("VISIONLOOP_HOME", str(kit.home))
    monkeypatch.setenv("VISIONLOOP_TRACKING_URI", kit.settings.tracking_uri)
    monkeypatch.delenv("VISIONLOOP_ALERTS_WEBHOOK", raising=False)
    monkeypatch.delenv("VISIONLOOP_SERVE_KEY", raising=False)
    with (
        fresh_database("sqlite", tmp_path) as url,
        control_plane(url, cluster_config(inventory=ONE_GPU, teams=TEAMS)) as cp,
    ):
        yield kit, cp


def test_night_traffic_is_caught_labelled_retrained_canaried_and_the_new_champion_sees_at_night(
    home: tuple[ModelKit, CP], label_studio: Server, tmp_path: Path
) -> None:
    kit, cp = home
    settings = load_settings()
    dataset = tmp_path / "digits"
    shutil.copytree(kit.dataset, dataset)  # under the jobs' allowed root
    manifest = read_manifest(dataset)
    reader = ShardReader(shard_dir_of(dataset, manifest.splits["val"]))
    val = reader.read_many(list(range(len(reader))))
    truth: dict[str, str] = {}  # sha256 of an image file sent -> its class

    def sent(data: bytes, label: int) -> bytes:
        truth[hashlib.sha256(data).hexdigest()] = manifest.classes[label]
        return data

    day = [sent(bytes(r["image"]), int(r["label"])) for r in val[:WINDOW]]
    night = [sent(_night(bytes(r["image"]), i), int(r["label"])) for i, r in enumerate(val[:WINDOW])]
    build_reference(kit.ref, settings=settings)

    collected, logs = tmp_path / "collected", tmp_path / "predictions"
    config = ServeConfig(
        model="digits", port=0, alias_poll_s=0.2, max_queue_delay_ms=1.0,
        collect={"enabled": True, "sample_rate": 1.0, "dir": str(collected)},
    )  # fmt: skip
    with BackgroundServer(config, RegistrySource(settings), logs / "server-0.jsonl") as server:
        url = f"{server.url}/v2/models/digits/classify"
        state = server.app.state.server
        # 1. A window of day traffic, then a window of night traffic.
        for data in [*day, *night]:
            resp = httpx.post(url, content=data, headers={"Content-Type": "image/png"}, timeout=30)
            assert resp.status_code == 200, resp.text
        state.predlog.flush()
        state.collector.flush()

        # 2. The monitor judges both windows; the drift alert fires on the night one.
        from visionloop.monitor.reference import load_reference

        judged, _, _ = new_windows(
            load_reference(kit.info().dir),
            MonitorOptions(window=WindowSpec(requests=WINDOW), logs=logs),
            settings,
        )
        assert [w.drift for w in judged] == [False, True], [(w.status, w.p_value) for w in judged]
        alerts = run_check(parse_config({"rules": {"drift": {"windows": 1}}}, "test"), settings)
        firing = [n for n in alerts.changes if n.status == "firing" and n.rule == "drift"]
        assert len(firing) == 1 and "digits" in firing[0].key, alerts.changes

        # 3. Pick what is worth labelling from what the server kept: mostly the night.
        stored = {p.relative_to(collected).as_posix(): p for p in collected.rglob("*.png")}
        assert len(stored) == 2 * WINDOW
        night_ids = {i for i, p in stored.items() if hashlib.sha256(p.read_bytes()).hexdigest() in
                     {hashlib.sha256(d).hexdigest() for d in night}}  # fmt: skip
        env = {**kit.env(), "LABEL_STUDIO_API_KEY": label_studio.token}
        sel = tmp_path / "selection.json"
        r = cli("label", "select", "digits", "--from", str(collected), "--budget", str(BUDGET),
                "--out", str(sel), env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr
        chosen = [c["id"] for c in json.loads(sel.read_text())["chosen"]]
        assert len(chosen) == BUDGET and len(set(chosen) & night_ids) >= 0.75 * BUDGET, len(
            set(chosen) & night_ids
        )

        # 4. Label Studio, both ways, with a scripted annotator who gives the true class.
        r = cli("label", "export", str(sel), "--to", label_studio.url, "--title", "night", env=env)
        assert r.returncode == 0, r.stderr
        project = int(re.search(r"project (\d+):", " ".join(r.stdout.split())).group(1))  # type: ignore[union-attr]
        with label_studio.http() as http:
            annotator = user(http, "night-shift@example.com")
            for t in project_tasks(http, project):
                image = stored[t["data"][ID_KEY]]
                annotate(
                    http, t["id"], choice(truth[hashlib.sha256(image.read_bytes()).hexdigest()]), annotator
                )
        incoming = tmp_path / "incoming"
        r = cli("label", "import", "--from", label_studio.url, "--project", str(project),
                "--images", str(collected), "--out", str(incoming / "night-1"), env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr

        # 5. The loop: a round on the new labels, trained on the queue, gated, canaried, promoted.
        held_out = [_night(bytes(r["image"]), 10_000 + i) for i, r in enumerate(val[WINDOW:])]
        spec = validate_loop_spec(
            {
                "name": "night",
                "model": "digits",
                "dataset": str(dataset),
                "labels": str(incoming),
                "trigger": {"new_labels": BUDGET},
                "train": spec_doc(dataset, epochs=3, data__workers=0, tracking__enabled=False),
                "job": {"team": "vision"},
                "gate": {"max_drop": 2.0},
                "labelling_cost_per_image": 0.12,
                "rollout": {
                    "server": server.url, "canary_percent": 30, "shadow_percent": 100,
                    "watch_minutes": 0.05, "min_requests": 30, "max_latency_ratio": 20.0,
                },
            },
            tmp_path,
        )  # fmt: skip
        with Clients(url, held_out) as clients:  # the night goes on while the loop works
            result = drive(spec, cp, deadline_s=600)
        rnd = result.state.rounds[-1]
        assert rnd.outcome == "promoted", (
            rnd.outcome,
            rnd.reason,
            {s: r.reason for s, r in rnd.steps.items()},
        )
        assert clients.failures == []
        figures = rnd.steps["canary"].outputs["verdict"]["figures"]
        assert figures["candidate_answered"] > 0 and figures["candidate_mirrored"] > 0, figures
        assert aliases("digits", settings) == {CHAMPION: 2}
        # The new version: the night images added; the day ones chosen are the parent's already.
        version = read_manifest(Path(rnd.steps["dataset"].outputs["dataset"]))
        step = version.lineage[0] if version.lineage else None
        chosen_night = len(set(chosen) & night_ids)
        assert step is not None and sum(step.added.values()) == chosen_night, step
        assert step.labelling_cost == pytest.approx(0.12 * chosen_night)
        with cp.client() as c:
            ledger = c.get("/v1/cost").json()["labelling"]
        assert [(e["dataset_version"], e["images"]) for e in ledger] == [(version.version, chosen_night)], (
            ledger
        )

    # 6. Better at night than the old champion, on night images neither was trained on.
    holdout = tmp_path / "night-holdout"
    for i, (record, data) in enumerate(zip(val[WINDOW:], held_out, strict=True)):
        split = "train" if i < 20 else "val"
        folder = holdout / split / manifest.classes[int(record["label"])]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i}.png").write_bytes(data)
    r = cli("data", "ingest", str(holdout), "--out", str(tmp_path / "night-ds"), env=kit.env())
    assert r.returncode == 0, r.stderr
    options = EvalOptions(dataset=tmp_path / "night-ds", split="val", calibrate=False, track=False)
    old = evaluate_model("digits/1", options, settings=settings).clean
    new = evaluate_model("digits/2", options, settings=settings).clean
    print(f"night accuracy: champion v1 {old:.3f}, v2 {new:.3f}")
    assert new > old + 0.02, (old, new)
