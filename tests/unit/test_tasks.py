"""The task registry and the classification task's side of the `Task` contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from visionloop.core.errors import SpecError
from visionloop.tasks import AnswerOptions, Task, get_task, list_tasks, register_task
from visionloop.tasks.registry import _REGISTRY

NAMES = ["cat", "dog", "bird"]


def test_classification_is_registered_and_shared() -> None:
    assert "classification" in list_tasks()
    task = get_task("classification")
    assert isinstance(task, Task) and task.name == "classification"
    assert get_task("classification") is task
    assert (task.primary_metric, task.primary_mode, task.output_names) == ("accuracy", "max", ("logits",))


def test_an_unknown_task_names_the_known_ones() -> None:
    with pytest.raises(SpecError, match=r"unknown task 'detecton'.*known tasks are: .*classification"):
        get_task("detecton")


def test_two_classes_under_one_name_are_refused() -> None:
    cls = type(get_task("classification"))
    with pytest.raises(ValueError, match="already registered"):
        register_task("classification")(type("Other", (cls,), {}))
    assert _REGISTRY["classification"] is cls


def test_the_server_half_needs_no_torch() -> None:
    code = (
        "import sys, numpy as np\n"
        "from visionloop.tasks import AnswerOptions, get_task\n"
        "t = get_task('classification')\n"
        "logits = {'logits': np.zeros((1, 3), np.float32)}\n"
        "t.served_answer(logits, ['a', 'b', 'c'], options=AnswerOptions(top_k=2))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def test_check_output_wants_one_row_of_class_scores() -> None:
    task = get_task("classification")
    assert task.check_output(torch.zeros(1, 3), NAMES) is None
    problem = task.check_output(torch.zeros(1, 4), NAMES)
    assert problem == "returned shape (1, 4) for one image, expected (1, 3)"


def test_served_answer_is_softmax_top_k_in_order() -> None:
    task = get_task("classification")
    logits = np.array([[1.0, 3.0, 2.0]], dtype=np.float32)
    answer = task.served_answer({"logits": logits}, NAMES, options=AnswerOptions(top_k=2))
    probs = np.exp(logits[0] - 3.0) / np.exp(logits[0] - 3.0).sum()
    assert [p["label"] for p in answer["predictions"]] == ["dog", "bird"]
    assert [p["index"] for p in answer["predictions"]] == [1, 2]
    assert answer["predictions"][0]["score"] == pytest.approx(float(probs[1]))


def test_log_fields_and_agreement_per_row() -> None:
    task = get_task("classification")
    a = {"logits": np.array([[5.0, 0.0, 0.0], [0.0, 0.0, 9.0]], dtype=np.float32)}
    b = {"out": np.array([[5.0, 0.0, 0.0], [9.0, 0.0, 0.0]], dtype=np.float32)}
    fields = task.log_fields(a, NAMES[:2])  # class 2 has no name on this card: its index
    assert [f["top_class"] for f in fields] == ["cat", 2]
    assert fields[0]["confidence"] == pytest.approx(np.exp(5) / (np.exp(5) + 2), abs=1e-6)
    assert task.agreement(a, b).tolist() == [True, False]


def test_export_comparison_measures_accuracy_points_and_agreement() -> None:
    task = get_task("classification")
    cmp = task.export_comparison()
    reference = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.0, 2.0]])
    exported = torch.tensor([[2.0, 0.0], [0.0, 2.0], [0.0, 2.5], [0.0, 2.0]])
    cmp.update([reference], [exported], torch.tensor([0, 1, 0, 0]))
    m = cmp.result()
    assert (m.metric, m.samples) == ("accuracy", 4)
    assert (m.reference_score, m.score, m.agreement) == (0.75, 0.5, 0.75)
    assert m.drop_points == pytest.approx(25.0) and m.max_abs_diff == pytest.approx(2.5)


def test_output_scorer_is_top1_accuracy_over_batches() -> None:
    scorer = get_task("classification").output_scorer()
    scorer.update([np.array([[1.0, 0.0], [0.0, 1.0]])], np.array([0, 0]))
    scorer.update([np.array([[0.0, 1.0]])], np.array([1]))
    assert scorer.compute() == pytest.approx(2 / 3)


def test_evaluator_streams_and_resets() -> None:
    ev = get_task("classification").evaluator(NAMES)
    ev.update(torch.tensor([[3.0, 0.0, 0.0], [0.0, 3.0, 0.0]]), torch.tensor([0, 2]), loss_sum=1.0)
    assert ev.compute().metrics["accuracy"] == 0.5
    ev.reset()
    ev.update(torch.tensor([[3.0, 0.0, 0.0]]), torch.tensor([0]), loss_sum=0.5)
    result = ev.compute()
    assert result.metrics["accuracy"] == 1.0 and result.metrics["loss"] == 0.5


def test_a_classifier_refuses_backbone_weights_with_what_to_use_instead(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"model\.pretrained"):
        get_task("classification").build_model(
            "small_cnn", ["a", "b"], kwargs={}, pretrained_backbone=tmp_path / "backbone.safetensors"
        )
