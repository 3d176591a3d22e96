"""The model registry on a real MLflow SQLite store with a really trained run: register, list,
show, aliases, rollback with history, bad references, unfinished runs, concurrency."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _modelkit import ModelKit, registered_model  # noqa: F401  (session fixture)
from visionloop import registry
from visionloop.core.errors import NotFoundError
from visionloop.registry import store as rstore
from visionloop.registry.files import sha256_file
from visionloop.registry.layout import ModelRefError


def _mlflow_versions(kit: ModelKit, name: str) -> list[int]:
    return [int(v.version) for v in rstore.versions(rstore.client(kit.settings), name)]


def test_registered_version_has_files_tags_and_lineage(registered_model: ModelKit) -> None:  # noqa: F811
    kit = registered_model
    info = kit.info()
    assert (info.name, info.version, info.aliases) == ("digits", 1, ("champion",))
    assert info.dir == kit.home / "models" / "digits" / "v1"
    assert sorted(p.name for p in info.dir.iterdir()) == [
        "final.safetensors",
        "lineage.json",
        "model_card.json",
        "spec.resolved.yaml",
        "spec.yaml",
    ]
    run_sha = sha256_file(kit.run_dir / "final.safetensors")
    assert sha256_file(info.weights) == run_sha
    assert info.tags[rstore.WEIGHTS_SHA_TAG] == run_sha
    run_meta = json.loads((kit.run_dir / "run.json").read_text())
    assert info.run_id == run_meta["mlflow_run_id"]
    card = info.card()
    assert info.tags[rstore.ARCH_TAG] == card.arch == "small_cnn"
    assert info.tags[rstore.DATASET_VERSION_TAG] == card.dataset_version
    assert card.metrics is not None and card.metrics["accuracy"] is not None
    assert float(info.tags["visionloop.metric.accuracy"]) == pytest.approx(card.metrics["accuracy"], abs=1e-5)
    mv = rstore.client(kit.settings).get_model_version("digits", "1")
    assert mv.run_id == run_meta["mlflow_run_id"]
    assert mv.source == f"runs:/{run_meta['mlflow_run_id']}/model"
    lineage = info.lineage()
    assert lineage["dataset_path"] == str(kit.dataset)
    assert lineage["run_dir"] == str(kit.run_dir)
    assert lineage["weights_sha256"] == run_sha
    assert (info.dir / "spec.yaml").read_text() == (kit.run_dir / "spec.yaml").read_text()
    assert info.export_path() is None  # never exported


def test_versions_aliases_and_rollback_with_history(registered_model: ModelKit, tmp_path: Path) -> None:  # noqa: F811
    kit = registered_model.copy_home(tmp_path / "home")
    s = kit.settings
    v2 = registry.register(kit.run_dir, name="digits", settings=s)
    v3 = registry.register("digits-cnn", name="digits", settings=s)  # by run name under <home>/runs
    assert (v2.version, v3.version) == (2, 3)
    assert [v.version for v in registry.list_versions("digits", s)] == [1, 2, 3]
    # NAME alone is the champion (v1) even though v3 is newer.
    assert registry.get_version("digits", s).version == 1
    summary = {m.name: m for m in registry.list_models(s)}["digits"]
    assert (summary.versions, summary.latest, summary.aliases) == (3, 3, {"champion": 1})

    registry.set_alias("digits", 2, "champion", actor="alice", settings=s)
    registry.set_alias("digits", 3, "champion", actor="bob", settings=s)
    registry.set_alias("digits", 3, "challenger", actor="bob", settings=s)
    assert registry.aliases("digits", s) == {"champion": 3, "challenger": 3}
    assert registry.get_version("digits@challenger", s).aliases == ("challenger", "champion")

    assert registry.rollback("digits", actor="carol", settings=s).version == 2
    assert registry.rollback("digits", actor="carol", settings=s).version == 1
    with pytest.raises(registry.RegistryError, match=r"no previous champion"):
        registry.rollback("digits", settings=s)
    assert registry.aliases("digits", s) == {"champion": 1, "challenger": 3}

    events = [
        (e.action, e.alias, e.version, e.previous, e.actor) for e in registry.alias_history("digits", s)
    ]
    assert events == [
        ("set", "champion", 1, None, "modelkit"),
        ("set", "champion", 2, 1, "alice"),
        ("set", "champion", 3, 2, "bob"),
        ("set", "challenger", 3, None, "bob"),
        ("rollback", "champion", 2, 3, "carol"),
        ("rollback", "champion", 1, 2, "carol"),
    ]


def test_name_without_champion_is_the_newest_and_register_by_mlflow_run_id(
    registered_model: ModelKit,  # noqa: F811
    tmp_path: Path,
) -> None:
    kit = registered_model.copy_home(tmp_path / "home")
    run_id = kit.info().run_id
    assert run_id is not None
    registry.register(kit.run_dir, name="other", settings=kit.settings)
    second = registry.register(run_id, name="other", settings=kit.settings)
    assert second.run_id == run_id and second.version == 2
    assert registry.get_version("other", kit.settings).version == 2


def test_bad_references_and_unknown_names(registered_model: ModelKit) -> None:  # noqa: F811
    s = registered_model.settings
    for bad, needle in [
        ("digits/0", "positive whole number"),
        ("digits/x", "positive whole number"),
        ("digits@v2", "not of the form v<number>"),
        ("no such", "is not usable"),
    ]:
        with pytest.raises(ModelRefError, match=needle):
            registry.get_version(bad, s)
    with pytest.raises(NotFoundError, match=r"no registered model 'nope' \(models: digits\)"):
        registry.get_version("nope", s)
    with pytest.raises(NotFoundError, match=r"has no version 9 \(versions: 1\)"):
        registry.get_version("digits/9", s)
    with pytest.raises(NotFoundError, match=r"no alias 'staging' \(aliases: champion -> v1\)"):
        registry.get_version("digits@staging", s)
    with pytest.raises(NotFoundError, match=r"no registered model 'nope'"):
        registry.set_alias("nope", 1, "champion", settings=s)


def test_unfinished_and_unknown_runs_are_refused_and_leave_nothing(
    registered_model: ModelKit,  # noqa: F811
    tmp_path: Path,
) -> None:
    kit = registered_model.copy_home(tmp_path / "home")
    unfinished = tmp_path / "unfinished"
    shutil.copytree(kit.run_dir, unfinished, ignore=shutil.ignore_patterns(".lock"))
    (unfinished / "final.safetensors").unlink()
    with pytest.raises(registry.UnfinishedRunError, match=r"no final model \(final.safetensors missing"):
        registry.register(unfinished, name="digits", settings=kit.settings)
    with pytest.raises(NotFoundError, match=r"no run 'missing-run'.*not a directory"):
        registry.register("missing-run", name="digits", settings=kit.settings)
    assert _mlflow_versions(kit, "digits") == [1]
    left = sorted(p.name for p in (kit.home / "models" / "digits").iterdir() if p.name != ".lock")
    assert left == ["alias_history.json", "v1"]


def test_failed_registration_leaves_no_half_version(registered_model: ModelKit, tmp_path: Path) -> None:  # noqa: F811
    kit = registered_model.copy_home(tmp_path / "home")
    # A v2 folder that does not belong to this store: registration must stop, remove its own
    # MLflow version again, and touch neither that folder nor anything else.
    squatter = kit.home / "models" / "digits" / "v2"
    squatter.mkdir()
    (squatter / "note.txt").write_text("not ours")
    with pytest.raises(registry.RegistryError, match=r"v2 already exists"):
        registry.register(kit.run_dir, name="digits", settings=kit.settings)
    assert _mlflow_versions(kit, "digits") == [1]
    assert [p.name for p in squatter.iterdir()] == ["note.txt"]
    assert not list((kit.home / "models" / "digits").glob(".staging-*"))
    assert [v.version for v in registry.list_versions("digits", kit.settings)] == [1]


def test_concurrent_registrations_get_distinct_complete_versions(
    registered_model: ModelKit,  # noqa: F811
    tmp_path: Path,
) -> None:
    kit = registered_model.copy_home(tmp_path / "home")
    code = (
        "import sys; from pathlib import Path; from visionloop.core.settings import Settings; "
        "from visionloop.registry import register; "
        "s = Settings(home=Path(sys.argv[1]), tracking_uri=sys.argv[2]); "
        "print(register(Path(sys.argv[3]), name='digits', settings=s).version)"
    )
    args = [sys.executable, "-c", code, str(kit.home), kit.settings.tracking_uri, str(kit.run_dir)]
    procs = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert sorted(int(o.strip()) for o, _ in outs) == [2, 3]
    sha = sha256_file(kit.run_dir / "final.safetensors")
    infos = registry.list_versions("digits", kit.settings)
    assert [i.version for i in infos] == [1, 2, 3]
    for info in infos:
        assert sha256_file(info.weights) == sha
        assert info.lineage()["version"] == info.version
    assert _mlflow_versions(kit, "digits") == [1, 2, 3]


def test_a_version_left_unready_by_a_killed_registration_is_removed_once_abandoned(
    registered_model: ModelKit,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kit = registered_model.copy_home(tmp_path / "home")
    c = rstore.client(kit.settings)
    # What a registration killed between MLflow's create and the folder's rename leaves behind:
    # an MLflow version with no ready tag and no folder.
    c.create_model_version("digits", source=(kit.home / "models" / "digits").as_uri(), tags={})
    assert _mlflow_versions(kit, "digits") == [1, 2]
    assert [v.version for v in registry.list_versions("digits", kit.settings)] == [1]  # readers skip it

    # Younger than ABANDONED_AFTER_S it may be a registration still running through another
    # home: it stays.
    info = registry.register(kit.run_dir, name="digits", settings=kit.settings)
    assert info.version == 3 and _mlflow_versions(kit, "digits") == [1, 2, 3]

    # Once abandoned, the next registration deletes it, and nothing else.
    monkeypatch.setattr(registry.api, "ABANDONED_AFTER_S", 0.0)
    info = registry.register(kit.run_dir, name="digits", settings=kit.settings)
    assert info.version == 4 and _mlflow_versions(kit, "digits") == [1, 3, 4]
    assert [v.version for v in registry.list_versions("digits", kit.settings)] == [1, 3, 4]
    assert all(v.weights.is_file() for v in registry.list_versions("digits", kit.settings))
