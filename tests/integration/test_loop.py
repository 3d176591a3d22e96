"""`visionloop loop`: labelled folders arrive, a round opens, the next dataset version is made,
a queue job trains on it from the champion's weights, the run is registered, evaluated with
the champion on the round's data and promoted through the gate (or rejected by it); a loop
that crashes after every step acted, before its record was saved, ends with the same
dataset versions, job, registered version and promotion as one that never crashed; and
`loop status` says
where it stands. A real control plane (SQLite) and real training."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _cpkit import CP, TEAMS, cluster_config, control_plane
from _dbkit import fresh_database
from _loopkit import drive, drive_through_crashes, labelled_folder
from _modelkit import ModelKit, registered_model  # noqa: F401  (the session's champion)
from _trainkit import cli, spec_doc
from visionloop.api.client import Client
from visionloop.core.settings import load_settings
from visionloop.data.manifest import read_manifest
from visionloop.loop import state
from visionloop.loop.runner import advance
from visionloop.loop.spec import LoopSpec, validate_loop_spec
from visionloop.registry import CHAMPION, alias_history, aliases, list_versions

ONE_GPU = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]


@pytest.fixture
def world(
    registered_model: ModelKit,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[ModelKit, CP, Path]]:
    kit = registered_model.copy_home(tmp_path / "home")
    monkeypatch.setenv("VISIONLOOP_HOME", str(kit.home))
    monkeypatch.setenv("VISIONLOOP_TRACKING_URI", kit.settings.tracking_uri)
    dataset = tmp_path / "digits"
    shutil.copytree(kit.dataset, dataset)  # under the jobs' allowed root (tmp_path)
    with (
        fresh_database("sqlite", tmp_path) as url,
        control_plane(url, cluster_config(inventory=ONE_GPU, teams=TEAMS)) as cp,
    ):
        yield kit, cp, dataset


def _spec(tmp_path: Path, dataset: Path, **gate: Any) -> LoopSpec:
    train = spec_doc(dataset, epochs=None, steps=4, data__workers=0, tracking__enabled=False)
    doc = {
        "name": "digits-loop",
        "model": "digits",
        "dataset": str(dataset),
        "labels": str(tmp_path / "incoming"),
        "trigger": {"new_labels": 20},
        "train": train,
        "job": {"team": "vision"},
        "gate": {"max_images": 150, **gate},
        "labelling_cost_per_image": 0.2,
    }
    return validate_loop_spec(doc, tmp_path)


def test_a_round_makes_the_version_trains_registers_and_promotes_through_crashes(
    world: tuple[ModelKit, CP, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kit, cp, dataset = world
    spec = _spec(tmp_path, dataset, max_drop=100.0)
    settings = load_settings()
    (tmp_path / "incoming").mkdir()
    labelled_folder(dataset, tmp_path / "incoming" / "round-a", 12, seed=1)
    assert advance(spec, settings, lambda: Client(cp.url, cp.admin_token)).stopped == "idle"  # 12 < 20
    labelled_folder(dataset, tmp_path / "incoming" / "round-b", 12, seed=2)
    (tmp_path / "incoming" / "half-copied").mkdir()  # no report beside it: not finished, not taken

    # Every record the loop is about to write for the first time is lost once: the process
    # "dies" after the step acted and before the record of it reached the disk, at every step.
    result, crashed = drive_through_crashes(spec, cp, monkeypatch)
    print(f"{len(crashed)} crashes")
    # At least: each step running, (train waiting,) done or skipped; the round closed.
    assert len(crashed) >= 16, crashed
    assert "promoted" in result.reason, result.reason
    rnd = result.state.rounds[-1]
    assert rnd.number == 1 and rnd.outcome == "promoted" and "24 labelled images waiting" in rnd.trigger
    assert [rnd.steps[s].status for s in state.STEPS] == [
        "done",
        "done",
        "done",
        "done",
        "done",
        "skipped",
        "skipped",
        "done",
    ]  # no rollout in the spec: no export, no canary
    # The dataset: two versions, one per folder, the second the round's, its lineage back to v1.
    made = Path(rnd.steps["dataset"].outputs["dataset"])
    m = read_manifest(made)
    assert (
        made.parent == settings.datasets_dir / "digits-loop"
        and m.ancestry[-1] == read_manifest(dataset).version
    )
    assert len(m.ancestry) == 2 and sum(m.lineage[0].added.values()) == 12  # type: ignore[index]
    assert result.state.dataset == str(made) and len(result.state.consumed) == 2
    # The job: the round's version, warm-started from the champion's weights, its normalisation kept.
    job_id = rnd.steps["train"].outputs["job"]
    with cp.client() as c:
        job = c.get(f"/v1/jobs/{job_id}").json()["job"]
    train = job["train_doc"]
    assert train["data"]["dataset"] == str(made) and train["data"]["normalize"] == "dataset"
    assert (
        Path(train["model"]["pretrained"]).read_bytes()
        == (kit.home / "models" / "digits" / "v1" / "final.safetensors").read_bytes()
    )
    # Registered once, promoted through the gate (evaluations of both on the round's data).
    versions = list_versions("digits", settings)
    assert [v.version for v in versions] == [1, 2] and aliases("digits", settings)[CHAMPION] == 2
    # However often it died: one version per folder, one job, one promotion.
    made_dirs = sorted(
        p.name for p in (settings.datasets_dir / "digits-loop").iterdir() if not p.name.startswith(".")
    )
    assert made_dirs == ["round-1-1", "round-1-2"], made_dirs
    with cp.client() as c:
        jobs = c.get("/v1/jobs").json()
    assert len(jobs["jobs"] if isinstance(jobs, dict) else jobs) == 1, jobs
    moves = [
        (e.action, e.alias, e.version)
        for e in alias_history("digits", settings)
        if e.actor.startswith("loop")
    ]
    assert moves == [("set", "champion", 2)], moves  # a promotion whose record was lost is read back
    evaluated = rnd.steps["evaluate"].outputs
    assert evaluated["candidate"]["version"] == 2 and evaluated["champion"]["version"] == 1
    # The labelling was billed to the team, per version.
    with cp.client() as c:
        ledger = c.get("/v1/cost").json()["labelling"]
    assert sorted(e["images"] for e in ledger) == [12, 12] and {e["team"] for e in ledger} == {"vision"}
    # Nothing waits now: the next pass is idle; `loop status` tells the story.
    assert advance(spec, settings, lambda: Client(cp.url, cp.admin_token)).stopped == "idle"
    spec_file = tmp_path / "loop.yaml"
    spec_file.write_text(
        json.dumps({**json.loads(spec.model_dump_json()), "train": json.loads(spec.train.model_dump_json())})
    )
    r = cli("loop", "status", str(spec_file), env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert (
        "round 1: promoted" in r.stdout
        and "digits/2 is the champion" in r.stdout
        and "half-copied" not in r.stdout
    )


def test_a_worse_candidate_is_rejected_by_the_gate(world: tuple[ModelKit, CP, Path], tmp_path: Path) -> None:
    _, cp, dataset = world
    spec = _spec(tmp_path, dataset, max_drop=0.0)
    # A round whose two steps wreck the champion's weights (AdamW moves every weight by about
    # the learning rate): worse on any machine. Two steps at a tiny rate left the weights as
    # they were, so the candidate tied a champion that scores 1.0 on the gate's images on
    # some CPUs and passed (max_drop 0 refuses only what is worse).
    train = spec.train.model_copy(
        update={"epochs": None, "steps": 2, "optimizer": spec.train.optimizer.model_copy(update={"lr": 1.0})}
    )
    spec = spec.model_copy(update={"train": train})
    (tmp_path / "incoming").mkdir()
    labelled_folder(dataset, tmp_path / "incoming" / "round-a", 24, seed=3)
    result = drive(spec, cp)
    rnd = result.state.rounds[-1]
    assert rnd.outcome == "rejected" and "may not become digits@champion" in rnd.reason, rnd.reason
    assert rnd.reason.startswith("gate: ")
    assert aliases("digits", load_settings())[CHAMPION] == 1  # unchanged
    # The gate step said no; nothing after it ran.
    assert rnd.steps["gate"].outputs == {"champion": 1, "outcome": "refused", "rejected": True}
    assert [rnd.steps[s].status for s in ("gate", "export", "canary", "promote")] == [
        "done",
        "skipped",
        "skipped",
        "skipped",
    ]
    # The labels are in the loop's dataset all the same: the next round builds on them.
    assert result.state.dataset == rnd.steps["dataset"].outputs["dataset"]


def test_the_cli_as_a_user_runs_it_and_bad_specs_are_named(digits_dataset: Path, tmp_path: Path) -> None:
    base = {
        "name": "digits-loop",
        "model": "digits",
        "dataset": str(digits_dataset),
        "labels": str(tmp_path / "incoming"),
        "trigger": {"new_labels": 20},
        "train": {"model": {"arch": "small_cnn"}, "epochs": 1},
    }
    good = tmp_path / "loop.yaml"
    good.write_text(json.dumps(base))
    r = cli("loop", "status", str(good))
    assert r.returncode == 0 and "has not run yet" in r.stdout and f"loop run {good}" in r.stdout, r.stdout
    r = cli("loop", "run", str(good), "--once")
    assert r.returncode == 0 and "no trigger fired" in r.stdout, (r.stdout, r.stderr)
    r = cli("loop", "status", str(good), env={"COLUMNS": "200"})
    assert r.returncode == 0 and "when a trigger fires" in r.stdout and "0 labelled images" in r.stdout

    cases: list[tuple[str, str]] = [
        ("missing.yaml", "does not exist. A minimal loop spec"),
        ("bad.yaml", "is not valid YAML"),
        ("list.yaml", "must hold a mapping"),
        ("big.yaml", "a loop spec is a few lines"),
        ("rollout.yaml", "give canary_percent or shadow_percent"),
        ("trigger.yaml", "give at least one of new_labels"),
    ]
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "big.yaml").write_text("#" * (1024 * 1024 + 10))
    (tmp_path / "rollout.yaml").write_text(
        json.dumps({**base, "rollout": {"server": "http://127.0.0.1:1", "canary_percent": 0}})
    )
    (tmp_path / "trigger.yaml").write_text(json.dumps({**base, "trigger": {}}))
    for name, says in cases:
        r = cli("loop", "run", str(tmp_path / name), "--once")
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, (name, r.stderr)
    # Nothing was made for them: only the good loop has a state.
    assert sorted(p.name for p in (load_settings().home / "loops").iterdir()) == ["digits-loop"]


def test_a_full_team_queue_makes_the_train_step_wait_not_fail(
    registered_model: ModelKit,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The team may queue one job and has one waiting (no scheduler: nothing starts). The
    round's train step is refused a place in the queue: the round waits, saying why, instead
    of failing; once there is room the next pass submits its job."""
    kit = registered_model.copy_home(tmp_path / "home")
    monkeypatch.setenv("VISIONLOOP_HOME", str(kit.home))
    monkeypatch.setenv("VISIONLOOP_TRACKING_URI", kit.settings.tracking_uri)
    dataset = tmp_path / "digits"
    shutil.copytree(kit.dataset, dataset)
    jobs = {"allowed_roots": [str(tmp_path)], "max_queued_per_team": 1}
    config = cluster_config(inventory=ONE_GPU, teams=TEAMS, jobs=jobs)
    spec = _spec(tmp_path, dataset, max_drop=100.0)
    settings = load_settings()
    (tmp_path / "incoming").mkdir()
    labelled_folder(dataset, tmp_path / "incoming" / "round-a", 24, seed=1)
    with (
        fresh_database("sqlite", tmp_path) as url,
        control_plane(url, config, run_scheduler=False) as cp,
        Client(cp.url, cp.admin_token) as client,
    ):
        blocker = client.submit({"train": spec_doc(dataset, epochs=1), "team": "vision"})
        result = advance(spec, settings, lambda: Client(cp.url, cp.admin_token))
        assert result.stopped == "waiting", result.reason
        rnd = result.state.rounds[-1]
        assert rnd.outcome is None and rnd.steps["train"].status == "waiting"
        assert "team 'vision' already has 1 job waiting" in rnd.steps["train"].reason
        assert "job" not in rnd.steps["train"].outputs
        client.cancel(int(blocker["id"]))
        result = advance(spec, settings, lambda: Client(cp.url, cp.admin_token))
        rnd = result.state.rounds[-1]
        assert result.stopped == "waiting" and rnd.steps["train"].status == "waiting"
        queued = client.job(int(rnd.steps["train"].outputs["job"]))["job"]
        assert queued["state"] == "queued" and queued["team"] == "vision"
