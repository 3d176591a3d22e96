"""A third task needs a folder under `tasks/` and nothing else: a toy "keypoint counting" task,
defined here and nowhere in the source tree, claims its own source layout, ingests it into
shards whose records carry its own `points` field, keeps its own statistics in the manifest,
and reads its dataset back through the registry, with every data-layer check applying to it
as to the built-in tasks."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from pydantic import BaseModel

from visionloop import __version__
from visionloop.core.errors import DataError
from visionloop.data.ingest import IngestOptions, IngestReport, ProgressFn, check_out, ingest
from visionloop.data.ingest_stats import labelled_version
from visionloop.data.manifest import (
    SHARDS_DIR,
    ChannelStats,
    DatasetManifest,
    SizeStats,
    SourceInfo,
    SplitInfo,
    SplitPolicy,
    read_manifest,
    shard_dir_of,
    write_manifest,
)
from visionloop.data.publish import building, publish
from visionloop.data.shardcheck import check_dataset, check_shard_index
from visionloop.data.shards import ShardReader, ShardWriter, make_record, record_field
from visionloop.specs import validate_train_spec
from visionloop.tasks import Task, get_task, list_tasks, register_task
from visionloop.tasks import registry as task_registry
from visionloop.tasks.registry import task_for_source

NAME = "keypoint_count"
MARKER = "points.jsonl"


class PointStats(BaseModel):
    """The toy task's manifest statistics (its `task_stats`)."""

    points: int
    images_without_points: int


class KeypointCountTask(Task):
    """Per image, a list of (x, y) points; the label is how many."""

    primary_metric = "count_error"
    primary_mode = "min"
    output_names = ("count",)
    image_endpoint = "count"
    metric_label = "count error"
    record_fields = ("points",)
    source_formats = ("points_jsonl",)

    def claims_source(self, path: Path) -> bool:
        return (Path(path) / MARKER).is_file()

    def ingest(
        self, source: Path, out: Path, options: IngestOptions, progress: ProgressFn | None = None
    ) -> IngestReport:
        lines = [json.loads(line) for line in (source / MARKER).read_text().splitlines()]
        out = out.resolve()
        check_out(out, source, [str(source / row["image"]) for row in lines], options.overwrite)
        policy = options.image_policy()
        with building(out) as tmp:
            writer = ShardWriter(tmp / SHARDS_DIR / "train", fields=self.record_fields)
            versioned = []
            for i, row in enumerate(lines):
                image = (source / row["image"]).read_bytes()
                points = np.asarray(row["points"], dtype="<f4").reshape(-1, 2).tobytes()
                writer.add(make_record(image, len(row["points"]), i, points=points))
                versioned.append(("train", str(i), points))
            writer.close()
            stats = PointStats(
                points=sum(len(r["points"]) for r in lines),
                images_without_points=sum(1 for r in lines if not r["points"]),
            )
            manifest = DatasetManifest(
                version=labelled_version(self.name, policy, ["point"], versioned),
                task=self.name,
                classes=["point"],
                splits={
                    "train": SplitInfo(
                        count=len(lines), per_class={"point": len(lines)}, shard_dir="shards/train", bytes=1
                    )
                },
                image_policy=policy,
                source=SourceInfo(kind="points_jsonl", path=str(source), files_seen=len(lines)),
                split_policy=SplitPolicy(seed=0, val_fraction=0.0, test_fraction=0.0, from_source=True),
                channel_stats=ChannelStats(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25)),
                size_stats=SizeStats(min=(8, 8), median=(8, 8), max=(8, 8)),
                created_at=datetime.now(UTC).isoformat(timespec="seconds"),
                visionloop_version=__version__,
                task_stats=stats.model_dump(mode="json"),
            )
            write_manifest(tmp, manifest)
            publish(tmp, out, replace=options.overwrite)
        return IngestReport(out, manifest, 0, {}, 0, 0, False, {}, [], 0.0)

    def dataset_stats(self, manifest: DatasetManifest) -> PointStats | None:
        return None if manifest.task_stats is None else PointStats.model_validate(manifest.task_stats)

    def train_dataset(self, reader: ShardReader, spec: Any) -> Any:
        self.check_records(reader)
        return [
            (r["index"], np.frombuffer(record_field(r, "points"), dtype="<f4").reshape(-1, 2).tolist())
            for r in (reader[i] for i in range(len(reader)))
        ]

    eval_dataset = train_dataset

    def _no(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a data-only toy task")

    record_targets = build_model = check_output = loss_fn = evaluator = model_card = _no
    export_comparison = output_scorer = postprocess = log_fields = agreement = _no


@pytest.fixture
def toy_task() -> Iterator[Task]:
    register_task(NAME)(KeypointCountTask)
    try:
        yield get_task(NAME)
    finally:
        task_registry._REGISTRY.pop(NAME, None)
        task_registry._INSTANCES.pop(NAME, None)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _source(root: Path, marker: str = MARKER) -> Path:
    root.mkdir(parents=True)
    rows: list[dict[str, Any]] = [
        {"image": "a.png", "points": [[1.0, 2.0], [3.5, 4.0]]},
        {"image": "b.png", "points": []},
        {"image": "c.png", "points": [[7.0, 0.25]]},
    ]
    for row in rows:
        (root / row["image"]).write_bytes(_png())
    (root / marker).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_a_task_defined_outside_the_tree_ingests_checks_and_reads_its_own_records(
    toy_task: Task, tmp_path: Path
) -> None:
    src = _source(tmp_path / "src")
    assert task_for_source(src) is toy_task  # claimed by its layout, ahead of the fallback
    report = ingest(src, tmp_path / "ds", IngestOptions(workers=1))
    manifest = read_manifest(tmp_path / "ds")
    assert manifest == report.manifest and manifest.task == NAME
    assert toy_task.dataset_stats(manifest) == PointStats(points=3, images_without_points=1)

    # the data layer's checks, unchanged, accept its layout and report its field
    assert check_dataset(tmp_path / "ds") == manifest
    shards = shard_dir_of(tmp_path / "ds", manifest.splits["train"])
    assert check_shard_index(shards).fields == ("image", "label", "index", "points")

    # read back through the registry, as the trainer does
    task = get_task(manifest.task)
    spec = validate_train_spec(
        {
            "task": NAME,
            "data": {"dataset": str(tmp_path / "ds"), "image_size": 8},
            "model": {"arch": "none"},
            "epochs": 1,
        }
    )
    samples: object = task.train_dataset(ShardReader(shards), spec)  # the toy task's: a list
    assert samples == [(0, [[1.0, 2.0], [3.5, 4.0]]), (1, []), (2, [[7.0, 0.25]])]
    assert [ShardReader(shards)[i]["label"] for i in range(3)] == [2, 0, 1]

    # another task refuses these records, naming both layouts
    with pytest.raises(DataError, match=r"\[points\], but task 'classification' reads records with \[none\]"):
        get_task("classification").train_dataset(ShardReader(shards), spec)


def test_its_format_name_routes_a_source_it_does_not_claim(toy_task: Task, tmp_path: Path) -> None:
    src = _source(tmp_path / "src")
    assert task_for_source(src, "POINTS_JSONL") is toy_task
    # a folder without the marker is nobody's but the fallback's
    other = tmp_path / "plain"
    (other / "cat").mkdir(parents=True)
    assert task_for_source(other).ingest_fallback
    with pytest.raises(DataError, match=r"points_jsonl \(keypoint_count\)"):
        task_for_source(src, "points_csv")


def test_unregistered_it_leaves_no_trace(tmp_path: Path) -> None:
    assert NAME not in list_tasks()
    src = _source(tmp_path / "src")
    assert task_for_source(src).name != NAME
