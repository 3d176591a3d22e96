"""A dataset never runs code. A real ingested dataset whose shards were replaced by a litdata
`BinaryWriter` folder of objects whose `__reduce__` writes a marker file (litdata records them
as `pickle`): train (library and CLI), export, bench and a queue job each refuse it with an
error that names the index, the pickle and the fix, and the marker is never written."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _cpkit import TEAMS, cluster_config, control_plane, train_doc
from _dbkit import fresh_database
from _modelkit import ModelKit, registered_model  # noqa: F401  (a session fixture)
from _trainkit import cli, spec_doc, write_spec
from visionloop.core.errors import DataError

ONE_GPU = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]
REFUSAL = "data_format ['pickle', 'int', 'int']"
FIX = "visionloop data ingest"


class WritesMarker:
    """Unpickling this object writes `marker` (pathlib's own method: no test code needed)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.write_text, (self.marker, "a dataset ran code"))


def hostile_shards(folder: Path, marker: Path, n: int = 8) -> None:
    """What anyone can write with litdata: records whose image field is a pickled object."""
    from litdata.streaming.writer import BinaryWriter

    shutil.rmtree(folder, ignore_errors=True)
    writer = BinaryWriter(str(folder), chunk_bytes="1MB")
    for i in range(n):
        writer[i] = {"image": WritesMarker(marker), "label": i % 10, "index": i}
    writer.done()
    writer.merge()
    assert json.loads((folder / "index.json").read_text())["config"]["data_format"][0] == "pickle"


def hostile_dataset(
    root: Path, digits: Path, splits: tuple[str, ...] = ("train", "val")
) -> tuple[Path, Path]:
    """A copy of the real digits dataset (manifest and version unchanged) with `splits`' shards
    replaced. Returns (dataset folder, marker file)."""
    dataset, marker = root / "hostile-ds", root / "marker"
    shutil.copytree(digits, dataset)
    manifest = json.loads((dataset / "dataset.json").read_text())
    for split in splits:
        # as many records as the manifest says, so nothing but the shards' format is wrong
        hostile_shards(dataset / "shards" / split, marker, n=manifest["splits"][split]["count"])
    return dataset, marker


def assert_refused(message: str, dataset: Path) -> None:
    assert REFUSAL in message, message
    assert str(dataset / "shards") in message and "index.json" in message
    assert FIX in message


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, digits_dataset: Path) -> Iterator[tuple[Path, Path]]:
    dataset, marker = hostile_dataset(tmp_path_factory.mktemp("hostile"), digits_dataset)
    yield dataset, marker
    assert not marker.exists(), "a command unpickled the hostile dataset"


def test_the_hostile_shards_do_run_code_when_litdata_opens_them_unchecked(tmp_path: Path) -> None:
    """The control: the threat is real, so the refusals below are what stops it."""
    from litdata import StreamingDataset

    marker = tmp_path / "marker"
    hostile_shards(tmp_path / "shards", marker)
    StreamingDataset(str(tmp_path / "shards"))[0]
    assert marker.read_text() == "a dataset ran code"


def test_past_the_index_check_the_serializer_table_still_never_unpickles(tmp_path: Path) -> None:
    """The second wall, for an index swapped after it was checked: litdata itself, given only
    the table shards are opened with, refuses the pickle field."""
    from litdata import StreamingDataset

    from visionloop.data.shardcheck import safe_serializers

    marker = tmp_path / "marker"
    hostile_shards(tmp_path / "shards", marker)
    with pytest.raises(DataError, match="litdata's 'pickle' serializer"):
        StreamingDataset(str(tmp_path / "shards"), serializers=safe_serializers())[0]
    assert not marker.exists()


@pytest.mark.parametrize("split", ["train", "val"])
def test_train_in_process_refuses_it(tmp_path: Path, digits_dataset: Path, split: str) -> None:
    from visionloop.specs import validate_train_spec
    from visionloop.train.api import train

    dataset, marker = hostile_dataset(tmp_path, digits_dataset, splits=(split,))
    doc = spec_doc(dataset, epochs=None, steps=2, data__workers=0)
    with pytest.raises(DataError) as e:
        train(validate_train_spec(doc), tmp_path / "run", track=False)
    assert_refused(str(e.value), dataset)
    assert f"shards/{split}/index.json" in str(e.value)
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["status"] == "failed" and REFUSAL in meta["error"]
    assert not marker.exists()


def test_train_cli_refuses_it_without_a_traceback(tmp_path: Path, hostile: tuple[Path, Path]) -> None:
    dataset, marker = hostile
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(dataset, epochs=None, steps=2, data__workers=0))
    p = cli("train", str(spec), "--run-dir", str(tmp_path / "run"), "--no-track")
    assert p.returncode == 1, p.stdout + p.stderr
    assert_refused(p.stderr, dataset)
    assert "Traceback" not in p.stderr
    assert not marker.exists()


def test_export_refuses_it(registered_model: ModelKit, hostile: tuple[Path, Path]) -> None:  # noqa: F811
    from visionloop.export import export_model

    dataset, marker = hostile
    with pytest.raises(DataError) as e:
        export_model(registered_model.ref, dataset=dataset, settings=registered_model.settings)
    assert_refused(str(e.value), dataset)
    assert not marker.exists()


def test_bench_refuses_it(registered_model: ModelKit, hostile: tuple[Path, Path]) -> None:  # noqa: F811
    from visionloop.bench import resolve_target, run_sweep, sweep_settings

    dataset, marker = hostile
    target = resolve_target(registered_model.ref, dataset=dataset, settings=registered_model.settings)
    settings = sweep_settings(formats="pytorch", precisions="fp32", batch_sizes="1", iterations=1, warmup=0)
    with pytest.raises(DataError) as e:
        run_sweep(target, settings)
    assert_refused(str(e.value), dataset)
    assert not marker.exists()


def test_the_queue_refuses_it_at_submit(tmp_path: Path, hostile: tuple[Path, Path]) -> None:
    dataset, marker = hostile
    spec = {"train": train_doc(dataset, epochs=None, steps=2), "max_restarts": 0, "team": "vision"}
    cfg = cluster_config(inventory=ONE_GPU, teams=TEAMS)
    with (
        fresh_database("sqlite", tmp_path) as url,
        control_plane(url, cfg, run_scheduler=False) as cp,
        cp.client() as c,
    ):
        r = c.post("/v1/jobs", json={"spec": spec})
        assert r.status_code == 422, r.text
        assert_refused(r.json()["detail"], dataset)
        assert c.get("/v1/jobs").json() == []
    assert not marker.exists()


def test_a_queued_job_whose_dataset_turns_hostile_fails_with_the_refusal(
    tmp_path: Path, digits_dataset: Path
) -> None:
    # Accepted while its dataset was sound; the shards are swapped before the job starts: the
    # trainer's own check is the last line, and the job fails with the refusal in its log.
    dataset, marker = tmp_path / "ds", tmp_path / "marker"
    shutil.copytree(digits_dataset, dataset)
    spec = {"train": train_doc(dataset, epochs=None, steps=2), "max_restarts": 0, "team": "vision"}
    cfg = cluster_config(inventory=ONE_GPU, teams=TEAMS)
    with fresh_database("sqlite", tmp_path) as url:
        with control_plane(url, cfg, run_scheduler=False) as cp, cp.client() as c:
            r = c.post("/v1/jobs", json={"spec": spec})
            assert r.status_code == 201, r.text
            job = r.json()
        count = json.loads((dataset / "dataset.json").read_text())["splits"]["train"]["count"]
        hostile_shards(dataset / "shards" / "train", marker, n=count)
        with control_plane(url, cfg) as cp:
            show = cp.wait_job(job["id"], lambda j: j["state"] in ("succeeded", "failed"))
            with cp.client() as c:
                log = c.get(f"/v1/jobs/{job['id']}/logs").text
    assert show["job"]["state"] == "failed"
    assert [a["outcome"] for a in show["attempts"]] == ["failed"]
    assert_refused(log, dataset)
    assert REFUSAL in show["transitions"][-1]["reason"]
    assert not marker.exists()


@pytest.mark.parametrize("shard_dir", ["/etc", "../other/shards/train", "shards/../../x", ".hidden"])
def test_a_manifest_cannot_point_its_shards_outside_the_dataset(
    tmp_path: Path, digits_dataset: Path, shard_dir: str
) -> None:
    from visionloop.data.shardcheck import check_dataset

    dataset = tmp_path / "ds"
    shutil.copytree(digits_dataset, dataset)
    manifest = json.loads((dataset / "dataset.json").read_text())
    manifest["splits"]["train"]["shard_dir"] = shard_dir
    (dataset / "dataset.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError) as e:
        check_dataset(dataset)
    assert "shard_dir must be a relative path of plain names" in str(e.value)
    assert repr(shard_dir) in str(e.value) and FIX in str(e.value)


def test_a_shard_folder_linked_outside_the_dataset_is_refused(tmp_path: Path, digits_dataset: Path) -> None:
    # Another team's dataset, reached through a link inside a dataset the submitter may read.
    from visionloop.data.shardcheck import check_dataset

    other, dataset = tmp_path / "other-team" / "ds", tmp_path / "mine" / "ds"
    shutil.copytree(digits_dataset, other)
    shutil.copytree(digits_dataset, dataset)
    shutil.rmtree(dataset / "shards" / "train")
    (dataset / "shards" / "train").symlink_to(other / "shards" / "train")
    with pytest.raises(DataError) as e:
        check_dataset(dataset)
    assert "leads outside the dataset folder" in str(e.value) and FIX in str(e.value)
    from visionloop.specs import validate_train_spec
    from visionloop.train.api import train

    doc = spec_doc(dataset, epochs=None, steps=2, data__workers=0)
    with pytest.raises(DataError, match="leads outside the dataset folder"):
        train(validate_train_spec(doc), tmp_path / "run", track=False)
