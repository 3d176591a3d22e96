"""`visionloop models ...` as a user runs it, on a really trained run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from _modelkit import ModelKit, registered_model  # noqa: F401  (session fixture)
from _trainkit import cli
from visionloop import registry


def test_register_list_show_alias_rollback(registered_model: ModelKit, tmp_path: Path) -> None:  # noqa: F811
    kit = registered_model.copy_home(tmp_path / "home")
    env = kit.env()
    r = cli("models", "register", "digits-cnn", "--name", "digits", env=env)  # a run name under <home>/runs
    assert r.returncode == 0, r.stderr
    assert "registered digits/2" in r.stdout and str(kit.home / "models" / "digits" / "v2") in r.stdout

    r = cli("models", "list", "--json", env=env)
    assert r.returncode == 0, r.stderr
    (model,) = json.loads(r.stdout)
    assert (model["name"], model["versions"], model["latest"], model["aliases"]) == (
        "digits",
        2,
        2,
        {"champion": 1},
    )

    r = cli("models", "alias", "digits", "2", "champion", "--actor", "alice", env=env)
    assert r.returncode == 0 and "digits@champion -> v2" in r.stdout
    r = cli("models", "rollback", "digits", "--actor", "bob", env=env)
    assert r.returncode == 0 and "digits@champion: v2 -> v1" in r.stdout

    r = cli("models", "show", "digits", env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "digits/1  champion" in out  # NAME alone is the champion
    for text in (
        "v1",
        "v2",
        "small_cnn",
        str(kit.run_dir),
        str(kit.dataset),
        "alias history",
        "alice",
        "bob",
    ):
        assert text in out, text
    assert "rollback" in out and "exports        none" in out

    r = cli("models", "show", "digits/2", "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["version"] == 2 and doc["aliases"] == [] and doc["tags"]["visionloop.arch"] == "small_cnn"
    assert doc["lineage"]["dataset_path"] == str(kit.dataset)
    assert [e["action"] for e in doc["alias_history"]] == ["set", "set", "rollback"]
    assert [v["version"] for v in doc["versions"]] == [1, 2]

    # A challenger set and removed again; the champion cannot be removed, a missing alias is named.
    r = cli("models", "alias", "digits", "2", "challenger", env=env)
    assert r.returncode == 0, r.stderr
    r = cli(
        "models", "unalias", "digits", "challenger", "--actor", "carol", "--reason", "trial over", env=env
    )
    assert r.returncode == 0 and "digits@challenger removed (it was v2)" in r.stdout, r.stderr
    assert registry.aliases("digits", kit.settings) == {"champion": 1}
    last = registry.alias_history("digits", kit.settings)[-1]
    assert (last.action, last.alias, last.version, last.actor, last.reason) == (
        "unset",
        "challenger",
        2,
        "carol",
        "trial over",
    )
    r = cli("models", "unalias", "digits", "challenger", env=env)
    assert r.returncode == 1 and "has no alias 'challenger'" in r.stderr and "Traceback" not in r.stderr
    r = cli("models", "unalias", "digits", "champion", env=env)
    assert r.returncode == 1 and "rather than remove it" in r.stderr
    assert registry.aliases("digits", kit.settings) == {"champion": 1}


def test_errors_are_one_clear_line_and_change_nothing(registered_model: ModelKit, tmp_path: Path) -> None:  # noqa: F811
    kit = registered_model.copy_home(tmp_path / "home")
    env = kit.env()
    r = cli("models", "rollback", "digits", env=env)
    assert r.returncode == 1
    assert "no previous champion to roll back to" in r.stderr and "Traceback" not in r.stderr

    r = cli("models", "show", "nope", env=env)
    assert r.returncode == 1 and "no registered model 'nope' (models: digits)" in r.stderr

    r = cli("models", "show", "digits/0", env=env)
    assert r.returncode == 2 and "must be a positive whole number" in r.stderr

    r = cli("models", "alias", "digits", "7", "champion", env=env)
    assert r.returncode == 1 and "has no version 7 (versions: 1)" in r.stderr

    unfinished = tmp_path / "unfinished"
    shutil.copytree(kit.run_dir, unfinished, ignore=shutil.ignore_patterns(".lock", "final.safetensors"))
    r = cli("models", "register", str(unfinished), "--name", "digits", env=env)
    assert r.returncode == 1 and "only a finished run can be registered" in r.stderr

    assert [v.version for v in registry.list_versions("digits", kit.settings)] == [1]
    assert registry.aliases("digits", kit.settings) == {"champion": 1}
