"""Settings: environment over ./visionloop.toml over <home>/visionloop.toml."""

from __future__ import annotations

from pathlib import Path

import pytest

from visionloop.core.errors import ConfigError
from visionloop.core.settings import load_settings


def test_defaults_live_under_the_home(vl_home: Path, tmp_path: Path) -> None:
    s = load_settings(cwd=tmp_path)
    assert s.home == vl_home.resolve() and s.tracking_uri == f"sqlite:///{vl_home.resolve() / 'mlflow.db'}"
    assert s.experiment == "default"


def test_local_file_points_at_a_home_whose_own_file_fills_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VISIONLOOP_HOME")
    home = tmp_path / "home"
    home.mkdir()
    (home / "visionloop.toml").write_text(
        '[visionloop]\nexperiment = "from-home"\ntracking_uri = "http://h:1"\n'
    )
    work = tmp_path / "work"
    work.mkdir()
    (work / "visionloop.toml").write_text(f'[visionloop]\nhome = "{home}"\ntracking_uri = "http://local:2"\n')
    s = load_settings(cwd=work)
    assert s.home == home and s.experiment == "from-home" and s.tracking_uri == "http://local:2"
    monkeypatch.setenv("VISIONLOOP_TRACKING_URI", "http://env:3")
    assert load_settings(cwd=work).tracking_uri == "http://env:3"


def test_labelling_prices_per_task(vl_home: Path, tmp_path: Path) -> None:
    (tmp_path / "visionloop.toml").write_text(
        '[visionloop]\nexperiment = "e"\n'
        "[visionloop.labelling_cost_per_image]\nclassification = 0.1\ndetection = 1\n"
    )
    s = load_settings(cwd=tmp_path)
    assert (
        s.labelling_cost_per_image("classification") == 0.1 and s.labelling_cost_per_image("detection") == 1.0
    )
    assert s.labelling_cost_per_image("segmentation") is None and hash(s)  # still hashable
    assert load_settings(cwd=vl_home).labelling_cost_per_image("classification") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[visionloop]\nhome = 5\n", "must be non-empty strings"),
        ("[visionloop]\nhom = '/x'\n", "unknown setting"),
        ("[visionloop\n", "not valid TOML"),
        ("[visionloop]\nlabelling_cost_per_image = 0.1\n", "must be a table of task = price"),
        ("[visionloop.labelling_cost_per_image]\ndetection = -1\n", "detection must be a price per image"),
        (
            "[visionloop.labelling_cost_per_image]\ndetection = 'cheap'\n",
            "detection must be a price per image",
        ),
    ],
)
def test_bad_settings_files_are_explained(tmp_path: Path, text: str, expected: str) -> None:
    (tmp_path / "visionloop.toml").write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_settings(cwd=tmp_path)


def test_an_open_existing_home_gets_a_warning_and_a_private_one_none(tmp_path: Path) -> None:
    from visionloop.core.settings import open_home_warning

    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    warning = open_home_warning(home)
    assert warning is not None and "mode 0755" in warning and f"chmod 700 {home}" in warning
    home.chmod(0o750)
    assert "mode 0750" in (open_home_warning(home) or "")
    home.chmod(0o700)
    assert open_home_warning(home) is None
    assert open_home_warning(tmp_path / "missing") is None


def test_a_checkpoint_store_comes_from_the_home_file_or_the_environment(
    vl_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_settings(cwd=tmp_path).checkpoint_store is None
    (vl_home / "visionloop.toml").write_text(
        '[visionloop]\ncheckpoint_store = "s3://vl-runs/team-a/"\ns3_endpoint_url = "http://minio.internal:9000/"\n'
    )
    s = load_settings(cwd=tmp_path)
    assert s.checkpoint_store == "s3://vl-runs/team-a" and s.s3_endpoint_url == "http://minio.internal:9000"
    monkeypatch.setenv("VISIONLOOP_CHECKPOINT_STORE", "file:///mnt/nas/vl")
    monkeypatch.setenv("VISIONLOOP_S3_ENDPOINT_URL", "https://s3.example.com")
    s = load_settings(cwd=tmp_path)
    assert s.checkpoint_store == "file:///mnt/nas/vl" and s.s3_endpoint_url == "https://s3.example.com"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("gs://bucket/x", "unsupported scheme 'gs'"),
        ("/mnt/nas", "unsupported scheme '(none)'"),
        ("s3://UPPER/x", "'UPPER' is not a valid S3 bucket name"),
        ("s3://ab/x", "'ab' is not a valid S3 bucket name"),
        ("s3://bucket/../other", "the path segment '..'"),
        ("s3://bucket/x?versionId=1", "no ?query or #fragment"),
        ("file://server/share", "names a folder on this machine, not 'server'"),
        ("s3://bucket/a b", "the path segment 'a b'"),
    ],
)
def test_a_bad_checkpoint_store_is_refused_at_once_saying_where_it_came_from(
    vl_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, expected: str
) -> None:
    monkeypatch.setenv("VISIONLOOP_CHECKPOINT_STORE", value)
    with pytest.raises(ConfigError) as e:
        load_settings(cwd=tmp_path)
    assert expected in str(e.value) and "VISIONLOOP_CHECKPOINT_STORE" in str(e.value)
    assert "e.g. checkpoint_store = " in str(e.value)
    monkeypatch.delenv("VISIONLOOP_CHECKPOINT_STORE")
    (tmp_path / "visionloop.toml").write_text(f'[visionloop]\ncheckpoint_store = "{value}"\n')
    with pytest.raises(ConfigError, match=f"checkpoint_store in {tmp_path / 'visionloop.toml'}"):
        load_settings(cwd=tmp_path)


@pytest.mark.parametrize("value", ["minio:9000", "http://h:9000/bucket", "ftp://h", "http://h:9000?x=1"])
def test_an_s3_endpoint_must_be_a_bare_http_url(
    vl_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("VISIONLOOP_S3_ENDPOINT_URL", value)
    with pytest.raises(ConfigError, match="VISIONLOOP_S3_ENDPOINT_URL must be an http"):
        load_settings(cwd=tmp_path)
