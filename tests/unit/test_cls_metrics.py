"""Classification metrics agree with scikit-learn exactly, merge exactly, and plot."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from sklearn import metrics as skm
from torch.multiprocessing.spawn import spawn

from visionloop.core.errors import DataError
from visionloop.tasks.classification.metrics import ClassificationReport, ConfusionMatrix
from visionloop.tasks.classification.plots import plot_confusion_matrix


def _random_batch(n: int, c: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, generator=g), torch.randint(0, c, (n,), generator=g)


@pytest.mark.parametrize(("num_classes", "seed"), [(2, 0), (7, 1), (13, 2), (50, 3)])
def test_agrees_with_sklearn_on_random_predictions(num_classes: int, seed: int) -> None:
    logits, targets = _random_batch(997, num_classes, seed)
    preds = logits.argmax(dim=1)
    cm = ConfusionMatrix(num_classes)
    for chunk in range(0, 997, 128):  # several batches, the last one short
        cm.update(logits[chunk : chunk + 128], targets[chunk : chunk + 128])

    y, p = targets.numpy(), preds.numpy()
    labels = list(range(num_classes))
    assert cm.matrix.tolist() == skm.confusion_matrix(y, p, labels=labels).tolist()

    report = cm.compute()
    prec, rec, f1, support = skm.precision_recall_fscore_support(
        y, p, labels=labels, average=None, zero_division=0.0
    )
    assert report.accuracy == skm.accuracy_score(y, p)
    assert report.precision == prec.tolist()
    assert report.recall == rec.tolist()
    assert report.f1 == f1.tolist()
    assert report.support == support.tolist()
    macro = skm.precision_recall_fscore_support(y, p, average="macro", zero_division=0.0)
    assert (report.macro_precision, report.macro_recall, report.macro_f1) == pytest.approx(
        macro[:3], rel=1e-12, abs=0
    )
    if num_classes > 5:
        expected_top5 = skm.top_k_accuracy_score(y, logits.numpy(), k=5, labels=labels)
        assert report.topk_accuracy == {5: pytest.approx(expected_top5, rel=1e-12)}


def test_zero_division_is_zero_without_warnings() -> None:
    # Class 2 never occurs and is never predicted; class 3 is predicted but never occurs;
    # class 1 occurs but is never predicted.
    targets = torch.tensor([0, 0, 1, 1, 0])
    preds = torch.tensor([0, 3, 0, 0, 0])
    cm = ConfusionMatrix(4)
    cm.update(preds, targets)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = cm.compute(["a", "b", "c", "d"])
        empty = ConfusionMatrix(3).compute()
    assert report.precision == [0.5, 0.0, 0.0, 0.0]
    assert report.recall == [2 / 3, 0.0, 0.0, 0.0]
    assert report.f1[1:] == [0.0, 0.0, 0.0]
    # Macro averages run over classes seen in targets or predictions (sklearn's default set).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sklearn itself warns about the ill-defined cases
        sk = skm.precision_recall_fscore_support(targets, preds, average="macro", zero_division=0.0)
    assert (report.macro_precision, report.macro_recall, report.macro_f1) == pytest.approx(sk[:3], rel=1e-12)
    assert empty.accuracy == 0.0 and empty.macro_f1 == 0.0 and empty.total == 0
    assert empty.topk_accuracy == {}


def test_merging_partial_matrices_equals_the_whole() -> None:
    logits, targets = _random_batch(600, 9, seed=7)
    whole, first, second = ConfusionMatrix(9), ConfusionMatrix(9), ConfusionMatrix(9)
    whole.update(logits, targets)
    first.update(logits[:250], targets[:250])
    second.update(logits[250:], targets[250:])

    merged = first.merge(second)
    assert torch.equal(merged.matrix, whole.matrix)
    assert torch.equal(merged.topk_counts, whole.topk_counts)
    assert torch.equal(first.matrix + second.matrix, whole.matrix), "merge must not modify its inputs"
    assert first.matrix.sum() == 250

    first.add_(second)
    assert torch.equal(first.matrix, whole.matrix)
    assert first.compute() == whole.compute()

    with pytest.raises(ValueError, match="cannot merge"):
        whole.add_(ConfusionMatrix(8))


def _all_reduce_worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        logits, targets = _random_batch(400, 6, seed=11)
        shard = slice(rank * 200, (rank + 1) * 200)
        cm = ConfusionMatrix(6, topk=(1, 3))
        cm.update(logits[shard], targets[shard])
        cm.all_reduce()
        torch.save({"matrix": cm.matrix, "topk": cm.topk_counts}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_all_reduce_across_two_ranks_gives_every_rank_the_whole(tmp_path: Path) -> None:
    spawn(_all_reduce_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    logits, targets = _random_batch(400, 6, seed=11)
    whole = ConfusionMatrix(6, topk=(1, 3))
    whole.update(logits, targets)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert torch.equal(got["matrix"], whole.matrix)
        assert torch.equal(got["topk"], whole.topk_counts)


def test_all_reduce_without_a_process_group_is_a_no_op() -> None:
    cm = ConfusionMatrix(3)
    cm.update(torch.tensor([0, 1]), torch.tensor([0, 2]))
    before = cm.matrix.clone()
    cm.all_reduce()
    assert torch.equal(cm.matrix, before)


def test_topk_is_reported_only_when_every_sample_had_scores() -> None:
    logits, targets = _random_batch(100, 10, seed=5)
    cm = ConfusionMatrix(10, topk=(1, 5))
    cm.update(logits, targets)
    report = cm.compute()
    assert report.topk_accuracy[1] == report.accuracy
    assert report.topk_accuracy[5] == pytest.approx(
        skm.top_k_accuracy_score(targets.numpy(), logits.numpy(), k=5, labels=list(range(10)))
    )
    # Predicted indices carry no ranking: a partial top-5 would be wrong, so it disappears.
    cm.update(logits.argmax(dim=1), targets)
    assert cm.compute().topk_accuracy == {}
    # Likewise when the matrix was replaced by a reduced one but top-k counts were not.
    only_scores = ConfusionMatrix(10)
    only_scores.update(logits, targets)
    only_scores.matrix = only_scores.matrix * 2
    assert only_scores.compute().topk_accuracy == {}


def test_topk_larger_than_the_class_count_is_always_a_hit() -> None:
    cm = ConfusionMatrix(3, topk=(5,))
    logits, targets = _random_batch(50, 3, seed=2)
    cm.update(logits, targets)
    assert cm.compute().topk_accuracy == {5: 1.0}


def test_bad_inputs_are_refused() -> None:
    cm = ConfusionMatrix(4)
    with pytest.raises(DataError, match=r"outside \[0, 4\)"):
        cm.update(torch.tensor([0, 1]), torch.tensor([0, 4]))
    with pytest.raises(DataError):
        cm.update(torch.tensor([0, 7]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="expected logits"):
        cm.update(torch.randn(2, 5), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="2 predictions but 3 targets"):
        cm.update(torch.tensor([0, 1]), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="class names"):
        cm.compute(["a", "b"])
    assert cm.matrix.sum() == 0, "a refused batch must not be counted"


def test_report_is_json_safe_and_complete() -> None:
    logits, targets = _random_batch(64, 6, seed=3)
    cm = ConfusionMatrix(6)
    cm.update(logits, targets)
    names = ["ant", "bee", "cat", "dog", "eel", "fox"]
    report = cm.compute(names)
    assert isinstance(report, ClassificationReport)
    d = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert d["total"] == 64
    assert d["accuracy"] == report.accuracy and d["top5_accuracy"] == report.topk_accuracy[5]
    assert [c["name"] for c in d["per_class"]] == names
    assert d["per_class"][2]["support"] == int((targets == 2).sum())
    assert d["confusion_matrix"] == cm.matrix.tolist()
    assert set(report.scalars()) == {
        "accuracy",
        "macro_precision",
        "macro_recall",
        "macro_f1",
        "top5_accuracy",
    }


def test_reset_clears_counts() -> None:
    cm = ConfusionMatrix(3)
    cm.update(torch.randn(5, 3), torch.tensor([0, 1, 2, 0, 1]))
    cm.reset()
    assert cm.matrix.sum() == 0 and cm.topk_counts.sum() == 0


# --------------------------------------------------------------------------- plots


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.parametrize("num_classes", [3, 60])
def test_plot_writes_a_png_of_sensible_size(num_classes: int, tmp_path: Path) -> None:
    logits, targets = _random_batch(40 * num_classes, num_classes, seed=num_classes)
    cm = ConfusionMatrix(num_classes)
    cm.update(logits, targets)
    names = [f"class-{i}-with-a-rather-long-name" for i in range(num_classes)]
    path = plot_confusion_matrix(cm.matrix, names, tmp_path / "plots" / "cm.png")
    assert path == tmp_path / "plots" / "cm.png"
    width, height = _png_size(path)
    low, high = (400, 1200) if num_classes == 3 else (1500, 3500)
    assert low <= width <= high and low <= height <= high, (width, height)
    assert path.stat().st_size > 10_000
    assert [p.name for p in path.parent.iterdir()] == ["cm.png"], "no temporary file left behind"


def test_plot_counts_and_empty_rows(tmp_path: Path) -> None:
    matrix = np.array([[5, 1, 0], [0, 0, 0], [2, 0, 9]])
    path = plot_confusion_matrix(matrix, ["a", "b", "c"], tmp_path / "counts.png", normalize=False)
    assert _png_size(path)[0] > 0
    path = plot_confusion_matrix(matrix.tolist(), ["a", "b", "c"], tmp_path / "norm.png")
    assert _png_size(path)[0] > 0
    with pytest.raises(ValueError, match="does not match 2 class names"):
        plot_confusion_matrix(matrix, ["a", "b"], tmp_path / "bad.png")
