"""The README tells the truth: its first commands, its spec reference and its settings file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from visionloop.core.settings import load_settings
from visionloop.specs import validate_train_spec

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_exactly_the_two_commands() -> None:
    first = blocks("bash")[0].strip().splitlines()
    assert first == ['pip install -e ".[dev]" && visionloop demo', "pytest"]


def test_the_spec_reference_validates_and_documents_the_real_defaults() -> None:
    (reference,) = [b for b in blocks("yaml") if "task: classification" in b]
    documented = validate_train_spec(yaml.safe_load(reference), "README").model_dump(mode="json")
    minimal = validate_train_spec(
        {
            "data": {"dataset": "~/datasets/pets"},
            "model": {"arch": "resnet18"},
            "epochs": 10,
            "tracking": {"experiment": "pets"},
        }
    ).model_dump(mode="json")
    # Every value the README shows is the default (the ratio is shown rounded).
    documented["data"]["augment"]["ratio"] = minimal["data"]["augment"]["ratio"]
    assert documented == minimal


def test_the_settings_example_is_a_valid_visionloop_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = [b for b in blocks("toml") if "[visionloop]" in b]
    (toml,) = [b for b in found if "home =" in b]  # "Where state lives"
    (tmp_path / "visionloop.toml").write_text(toml)
    monkeypatch.delenv("VISIONLOOP_HOME")
    s = load_settings(cwd=tmp_path)
    assert str(s.home) == "/data/visionloop" and s.tracking_uri == "http://mlflow.internal:5000"
    assert s.experiment == "pets" and s.checkpoint_store == "s3://vl-runs/team-a"
    (store,) = [b for b in found if "s3_endpoint_url" in b]  # checkpoints in an object store
    (tmp_path / "visionloop.toml").write_text(store)
    s = load_settings(cwd=tmp_path)
    assert s.checkpoint_store == "s3://vl-runs/team-a" and s.s3_endpoint_url == "http://minio.internal:9000"


def test_the_cluster_config_example_parses_with_its_documented_values() -> None:
    import tomllib

    from visionloop.sched.config import parse_cluster_config

    (toml,) = [b for b in blocks("toml") if "[[inventory]]" in b]
    cfg = parse_cluster_config(tomllib.loads(toml))
    assert cfg.timings.grace_s == 120 and cfg.timings.order == "las"
    assert cfg.priorities == {"low": 10, "normal": 50, "high": 100}
    assert [(t.name, t.nominal_gpus, t.borrow_limit) for t in cfg.teams] == [
        ("vision", 2, 2),
        ("research", 2, 0),
    ]
    assert cfg.inventory is not None
    assert [(g.id, g.price_class) for g in cfg.inventory] == [
        ("local/0", "owned"),
        ("local/1", "owned"),
        ("spot-a/0", "spot"),
        ("spot-a/1", "spot"),
    ]


def test_every_local_link_in_the_readme_and_docs_points_into_the_repository() -> None:
    # A clone has only the repository: a link to ../shared/ or a missing file is a dead end.
    root = README.parent
    for doc in [README, *sorted((root / "docs").glob("*.md"))]:
        text = doc.read_text()
        targets = re.findall(r"\]\(([^)#\s]+)", text) + re.findall(r"`(\.\./[^`]+)`", text)
        local = [t for t in targets if "://" not in t]
        assert local, f"{doc.name} has no local links to check"
        for target in local:
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(root), f"{doc.name} links outside the repository: {target}"
            assert path.exists(), f"{doc.name} links to {target}, which does not exist"
