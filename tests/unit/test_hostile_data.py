"""Hostile and careless input to the readers of what users hand in: dataset sources, annotation
files, Label Studio exports and selections, the alert rule file, `visionloop monitor`'s options.

Each answer is a one-line error (or a rejection) that names the file and what to do: never a
hang, a traceback or memory spent without bound. FIFOs stand for every non-regular file named
like a data file (an extracted archive, a shared drive): opening one for reading waits for a
writer that never comes, so each of those tests has a timeout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from _imgfactory import noise, png, write
from visionloop.alerts.rules import load_config
from visionloop.cli.label_studio import _selection
from visionloop.cli.main import app
from visionloop.core.errors import ConfigError, DataError
from visionloop.data.imageio import Rejection, RejectReason, max_file_bytes, normalise_file
from visionloop.data.ingest_pool import hash_file
from visionloop.data.manifest import ImagePolicy
from visionloop.data.sources import list_source
from visionloop.label.importer import model_of
from visionloop.label.studio import ID_KEY, image_path, load_export, read_tasks
from visionloop.tasks.detection.annotations import IssueReason, read_coco, read_detection_source, read_voc
from visionloop.tasks.detection.annotations.yolo import read_yolo

# Nine levels of nine aliases: ~200 bytes of YAML that stand for 9**10 values.
_ALIAS_ITEMS = ["&a0 [1,1,1,1,1,1,1,1,1]"] + [f"&a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
ALIAS_BOMB_LIST = "[" + ", ".join(_ALIAS_ITEMS) + "]"


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


# ---------------------------------------------------------------------------------------------
# FIFOs named like data files


@pytest.mark.timeout(20)
def test_a_fifo_named_like_an_image_is_rejected_not_waited_on(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path / "cat" / "frame.jpg")
    for outcome in (hash_file(str(fifo)), normalise_file(str(fifo), ImagePolicy())):
        assert isinstance(outcome, Rejection)
        assert outcome.reason == RejectReason.UNREADABLE
        assert "FIFO" in outcome.message and "not a regular file" in outcome.message


@pytest.mark.timeout(20)
def test_a_file_bigger_than_any_image_within_the_pixel_limit_is_refused_unread(tmp_path: Path) -> None:
    policy = ImagePolicy(max_pixels=100)
    limit = max_file_bytes(policy)
    assert limit == 100 * 8 + 64 * 2**20
    big = tmp_path / "video.jpg"
    with big.open("wb") as f:  # sparse: no disk used, and a read of it would take 64 MiB
        f.truncate(limit + 1)
    outcome = normalise_file(str(big), policy)
    assert isinstance(outcome, Rejection) and outcome.reason is RejectReason.TOO_LARGE
    assert f"is {limit + 1:,} bytes" in outcome.message and "raise --max-pixels" in outcome.message
    # at the limit the file is read and judged by what it holds (zeros: not an image)
    with big.open("r+b") as f:
        f.truncate(limit)
    outcome = normalise_file(str(big), policy)
    assert isinstance(outcome, Rejection) and outcome.reason is RejectReason.NOT_AN_IMAGE


def test_a_fifo_named_like_a_csv_source_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"labels\.csv: is a FIFO .*not a regular file"):
        list_source(_fifo(tmp_path / "labels.csv"))


@pytest.mark.timeout(20)
def test_a_fifo_named_like_a_coco_file_is_a_data_error(tmp_path: Path) -> None:
    write(tmp_path / "a.png", png(noise(16, 16, seed=1)))
    fifo = _fifo(tmp_path / "instances_train.json")
    with pytest.raises(DataError, match="FIFO"):
        read_coco(tmp_path, fifo)
    with pytest.raises(DataError, match="FIFO"):  # the format sniffing reads it too
        read_detection_source(tmp_path)


@pytest.mark.timeout(20)
def test_a_fifo_named_like_a_voc_annotation_is_an_issue_and_the_rest_is_read(tmp_path: Path) -> None:
    write(tmp_path / "JPEGImages" / "a.png", png(noise(16, 16, seed=1)))
    write(tmp_path / "JPEGImages" / "b.png", png(noise(16, 16, seed=2)))
    (tmp_path / "Annotations" / "b.xml").parent.mkdir(parents=True)
    (tmp_path / "Annotations" / "b.xml").write_text(
        "<annotation><filename>b.png</filename><object><name>cat</name>"
        "<bndbox><xmin>1</xmin><ymin>1</ymin><xmax>8</xmax><ymax>8</ymax></bndbox></object></annotation>"
    )
    _fifo(tmp_path / "Annotations" / "a.xml")
    src = read_voc(tmp_path)
    assert [s.rel for s in src.samples] == ["JPEGImages/b.png"]
    [issue] = [i for i in src.issues if i.file == "Annotations/a.xml"]
    assert issue.reason == IssueReason.UNREADABLE_ANNOTATION_FILE and "FIFO" in issue.message


@pytest.mark.timeout(20)
def test_a_fifo_given_as_a_label_studio_export_or_selection_is_a_data_error(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path / "export.json")
    with pytest.raises(DataError, match="FIFO"):
        load_export(fifo)
    with pytest.raises(DataError, match="FIFO"):
        _selection(fifo)


# ---------------------------------------------------------------------------------------------
# YAML: aliases and values Python cannot convert


@pytest.mark.timeout(60)
def test_a_yaml_alias_bomb_in_a_yolo_data_yaml_is_refused_not_expanded(tmp_path: Path) -> None:
    (tmp_path / "data.yaml").write_text(f"names: {ALIAS_BOMB_LIST}\ntrain: images\n")
    with pytest.raises(DataError, match=r"alias \*a0"):
        read_yolo(tmp_path / "data.yaml")


@pytest.mark.parametrize(
    ("value", "says"), [("9" * 5000, "5000 digits"), ("2024-13-45", "month must be in 1..12")]
)
def test_a_yolo_data_yaml_value_python_cannot_convert_is_a_data_error(
    tmp_path: Path, value: str, says: str
) -> None:
    (tmp_path / "data.yaml").write_text(f"names: [cat]\nnc: {value}\n")
    with pytest.raises(DataError, match=says) as e:
        read_yolo(tmp_path / "data.yaml")
    assert "set_int_max_str_digits" not in str(e.value)  # advice for programmers, not users


# ---------------------------------------------------------------------------------------------
# The alert rule file


@pytest.fixture
def _no_env_webhook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VISIONLOOP_ALERTS_WEBHOOK", raising=False)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("_no_env_webhook")
def test_a_yaml_alias_bomb_in_the_alert_config_is_refused_not_expanded(tmp_path: Path) -> None:
    config = tmp_path / "alerts.yaml"
    config.write_text(f"rules:\n  drift:\n    windows: {ALIAS_BOMB_LIST}\n")
    with pytest.raises(ConfigError, match=r"alerts\.yaml is not valid YAML: .*alias"):
        load_config(config, tmp_path)


@pytest.mark.usefixtures("_no_env_webhook")
@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("alerts.toml", b"\xff\xfe[rules.drift]\n", "is not UTF-8 text"),
        ("alerts.toml", b"x = " + b"[" * 100_000 + b"]" * 100_000, "is not valid TOML"),
        ("alerts.toml", b"[rules.drift]\nwindows = " + b"9" * 5000, "is not valid TOML: .*5000 digits"),
        ("alerts.toml", b"#" * (2 * 1024 * 1024), "larger than 1024 KiB"),
        ("alerts.yaml", b"rules: {drift: {windows: " + b"9" * 5000 + b"}}", "is not valid YAML"),
        ("alerts.yaml", b"rules: {drift: {windows: 2024-13-45}}", "is not valid YAML"),
    ],
)
def test_an_alert_config_that_cannot_be_read_is_a_config_error(
    tmp_path: Path, name: str, content: bytes, says: str
) -> None:
    config = tmp_path / name
    config.write_bytes(content)
    with pytest.raises(ConfigError, match=says) as e:
        load_config(config, tmp_path)
    assert str(config) in str(e.value)


# ---------------------------------------------------------------------------------------------
# Label Studio exports


@pytest.mark.parametrize(
    "task",
    [
        {"id": 1, "data": {ID_KEY: "a.png"}, "predictions": 5, "annotations": []},
        {"id": 1, "data": {ID_KEY: "a.png"}, "predictions": True},
        {"id": 1, "data": {ID_KEY: "a.png"}, "annotations": 5},
        {"id": 1, "data": {ID_KEY: "a.png"}, "annotations": {"result": []}},
    ],
)
def test_an_export_whose_predictions_or_annotations_are_not_lists_does_not_crash(
    task: dict[str, Any],
) -> None:
    assert model_of([task]) is None
    tasks, left_out = read_tasks([task], "export.json")
    assert len(tasks) + len(left_out) == 1


def test_an_export_image_id_with_a_nul_byte_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="is not a path inside"):
        image_path(tmp_path, "a\x00b.png")


def test_a_deeply_nested_export_is_a_data_error(tmp_path: Path) -> None:
    export = tmp_path / "export.json"
    export.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="is not a JSON file"):
        load_export(export)
    with pytest.raises(DataError, match="cannot read the selection"):
        _selection(export)


def test_a_selection_that_is_not_json_still_says_what_to_do(tmp_path: Path) -> None:
    selection = tmp_path / "selection.json"
    selection.write_text(json.dumps({"chosen": "all"}))
    with pytest.raises(DataError, match="label select --out"):
        _selection(selection)


# ---------------------------------------------------------------------------------------------
# `visionloop monitor` options, refused before any work


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--thin", "²"], "auto or a whole number"),  # str.isdigit() is true of it; int() fails
        (["--follow", "--interval", "0s"], "at least 1s"),  # a busy loop over every log
        (["--metrics-port", "99999"], "not a TCP port"),
    ],
)
def test_monitor_refuses_bad_options_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], says: str
) -> None:
    monkeypatch.setenv("VISIONLOOP_HOME", str(tmp_path))
    r = CliRunner().invoke(app, ["monitor", "digits", *args])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert says in " ".join(r.output.replace("│", " ").split())
