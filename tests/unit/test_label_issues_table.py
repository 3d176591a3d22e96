"""What `visionloop label issues` shows a reviewer: a detector's findings as one line per
suspicious box (kind, both labels, where), a classifier's as the two probabilities."""

from __future__ import annotations

from rich.console import Console

from visionloop.cli.label_issues import _table
from visionloop.label.issues import IssuesReport, LabelIssue
from visionloop.tasks.label_issues import LabelFinding


def _render(report: IssuesReport, show: int = 20) -> str:
    console = Console(width=200, record=True, highlight=False)
    console.print(_table(report, show))
    return console.export_text()


def _report(*issues: LabelIssue) -> IssuesReport:
    return IssuesReport(
        model="m/1", dataset="/d", dataset_version="v1", split="train", images=50, folds=3,
        oof_accuracy=None, issues=issues, method="refit",
    )  # fmt: skip


def test_a_detectors_findings_read_as_one_line_per_box() -> None:
    boxes = LabelIssue(
        split="train",
        position=7,
        index=107,
        given="2 car",
        suggested="1 car, 1 truck",
        given_probability=0.1234,
        suggested_probability=None,
        findings=(
            LabelFinding("swapped", "car", "truck", 0.05, (10.0, 20.0, 50.0, 60.0), (11.0, 19.0, 52.0, 61.0)),
            LabelFinding("overlooked", None, "person", 0.08, None, (70.4, 5.0, 90.0, 40.6)),
            LabelFinding("badly located", "car", "car", 0.2, (0.0, 0.0, 30.0, 30.0), (5.0, 5.0, 40.0, 40.0)),
        ),
    )
    text = _render(_report(boxes))
    assert "quality" in text and "why" in text and "p(suggested)" not in text
    assert "train/7" in text and "107" in text and "0.123" in text
    assert "swapped car -> truck at (10, 20, 50, 60)" in text
    assert "overlooked person at (70, 5, 90, 41)" in text
    assert "badly located car at (0, 0, 30, 30)" in text
    assert (
        boxes.reason()
        == "labelled 2 car, out-of-fold 1 car, 1 truck (swapped car, overlooked person, badly located car)"
    )


def test_a_classifiers_findings_show_both_probabilities_and_the_table_is_cut_at_show() -> None:
    issues = [
        LabelIssue("train", p, 100 + p, "cat", "dog", 0.01 * p, 0.9 - 0.01 * p, findings=())
        for p in range(1, 6)
    ]
    text = _render(_report(*issues), show=3)
    assert "p(labelled)" in text and "p(suggested)" in text and "why" not in text
    assert "(3 of 5)" in text and "train/3" in text and "train/4" not in text
    assert "0.030" in text and "0.870" in text
    assert issues[0].reason() == "labelled cat, out-of-fold dog (0.89)"
