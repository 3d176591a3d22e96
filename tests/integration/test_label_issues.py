"""`visionloop label issues`: confident learning on out-of-fold predictions from the session
model's export finds the labels flipped on purpose in a copy of its dataset (precision and
recall measured against the flips), writes them out for review, and a review that restores
them becomes relabels of the very same records through `data add`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _modelkit import ModelKit, flip_labels, onnx_model  # noqa: F401  (the session's exported model)
from _trainkit import cli
from visionloop.core.errors import DataError
from visionloop.data.derive import add_images
from visionloop.data.manifest import read_manifest
from visionloop.data.shards import ShardReader
from visionloop.label.issues import find_issues

FLIPS = 30


@pytest.fixture(scope="module")
def noisy(
    onnx_model: ModelKit,  # noqa: F811  (the fixture imported above)
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[ModelKit, Path, dict[int, str]]:
    """A version of the model's dataset with FLIPS train labels changed (seeded), and the true
    label of each flipped record, by record index."""
    kit = onnx_model.copy_home(tmp_path_factory.mktemp("issues") / "home")
    dataset, truth = flip_labels(kit, tmp_path_factory.mktemp("noisy"), FLIPS, seed=7)
    return kit, dataset, truth


def test_the_flipped_labels_are_found(noisy: tuple[ModelKit, Path, dict[int, str]]) -> None:
    kit, dataset, truth = noisy
    report = find_issues(kit.ref, kit.settings, dataset=dataset, folds=5)
    assert report.split == "train" and report.images == read_manifest(dataset).splits["train"].count
    found = {i.index for i in report.issues}
    hits = found & set(truth)
    precision, recall = len(hits) / max(len(found), 1), len(hits) / len(truth)
    print(
        f"{len(found)} flagged, {len(hits)} of {len(truth)} flips: "
        f"precision {precision:.2f}, recall {recall:.2f}"
    )
    assert precision >= 0.8 and recall >= 0.6, (precision, recall, report.oof_accuracy)
    # Ranked by the out-of-fold probability of the given label, lowest first; both labels named.
    probs = [i.given_probability for i in report.issues]
    assert probs == sorted(probs)
    noisy_labels = {
        int(r["index"]): int(r["label"])
        for r in map(ShardReader(dataset / "shards" / "train").__getitem__, range(report.images))
    }
    names = read_manifest(dataset).classes
    for i in report.issues:
        assert i.given == names[noisy_labels[i.index]] and i.suggested != i.given
    assert sum(truth[i.index] == i.suggested for i in report.issues if i.index in truth) >= 0.8 * len(hits)
    # The clean dataset, judged the same way, has far fewer findings.
    clean = find_issues(kit.ref, kit.settings, dataset=kit.dataset, folds=5)
    assert len(clean.issues) < len(report.issues) / 2, (len(clean.issues), len(report.issues))


def test_a_review_from_the_cli_becomes_relabels_of_the_same_records(
    noisy: tuple[ModelKit, Path, dict[int, str]], tmp_path: Path
) -> None:
    kit, dataset, truth = noisy
    r = cli(
        "label",
        "issues",
        kit.ref,
        "--dataset",
        str(dataset),
        "--out",
        str(tmp_path / "review"),
        env=kit.env(),
    )
    assert r.returncode == 0, r.stderr
    assert "likely label errors in" in r.stdout and "label export" in r.stdout
    doc = json.loads((tmp_path / "review" / "issues.json").read_text())
    selection = json.loads((tmp_path / "review" / "selection.json").read_text())
    assert selection["model"] == kit.ref and len(selection["chosen"]) == len(doc["issues"]) > 0
    stored = {
        int(r["index"]): bytes(r["image"])
        for r in map(ShardReader(dataset / "shards" / "train").__getitem__, range(doc["images"]))
    }
    for issue, chosen in zip(doc["issues"], selection["chosen"], strict=True):
        image = Path(issue["image"])
        assert image.name == chosen["id"] and image.parent == Path(selection["source"])
        assert image.read_bytes() == stored[issue["index"]]  # the stored bytes: `data add` matches them

    # The reviewer keeps the suggestion for the true flips (an ImageFolder, as `label import` writes).
    reviewed = tmp_path / "reviewed"
    for issue in doc["issues"]:
        if issue["index"] in truth:
            (reviewed / truth[issue["index"]]).mkdir(parents=True, exist_ok=True)
            Path(issue["image"]).rename(reviewed / truth[issue["index"]] / Path(issue["image"]).name)
    fixed = add_images(dataset, reviewed, tmp_path / "fixed", workers=1)
    assert fixed.relabelled == len(list(reviewed.rglob("*.png"))) > 0 and sum(fixed.added.values()) == 0
    m = read_manifest(tmp_path / "fixed")
    back = {
        int(r["index"]): m.classes[int(r["label"])]
        for r in map(
            ShardReader(tmp_path / "fixed" / "shards" / "train").__getitem__, range(m.splits["train"].count)
        )
    }
    restored = [i for i in truth if back[i] == truth[i]]
    assert len(restored) >= fixed.relabelled
    # The same records (index, image bytes), now with their true labels.
    fixed_bytes = {
        int(r["index"]): bytes(r["image"])
        for r in map(
            ShardReader(tmp_path / "fixed" / "shards" / "train").__getitem__, range(m.splits["train"].count)
        )
    }
    assert all(fixed_bytes[i] == stored[i] for i in restored)


def test_bad_options_are_refused(noisy: tuple[ModelKit, Path, dict[int, str]]) -> None:
    kit, dataset, _ = noisy
    with pytest.raises(DataError, match="--folds must be 2 to 20"):
        find_issues(kit.ref, kit.settings, dataset=dataset, folds=1)
    with pytest.raises(DataError, match="no 'test' images"):
        find_issues(kit.ref, kit.settings, dataset=dataset, split="test")
    r = cli("label", "issues", "nosuch", env=kit.env())
    assert r.returncode != 0 and "nosuch" in r.stderr and "Traceback" not in r.stderr
