"""The promotion gate's comparison on hand-made eval reports (the dicts `list_evals` returns),
and the alias history's new fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from visionloop.core.errors import SpecError
from visionloop.eval.gate import GateMargins, compare, decision_lines, refusal_message
from visionloop.registry.history import AliasEvent, append_event, read_history

CELLS = [("fog", 1), ("fog", 3), ("noise", 1), ("noise", 3)]


def report(
    clean: float,
    *,
    at: str = "2026-03-01T10:00:00+00:00",
    path: str = "/m/v2/evals/a/eval.json",
    stress_mean: float | None = None,
    cells: list[tuple[str, int]] | None = None,
    ece: float | None = 0.05,
    ece_after: float | None = None,
    stored: bool = False,
    mode: str = "max",
    **data: Any,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": "m/2",
        "task": "classification",
        "dataset": "/data/pets",
        "dataset_version": "ds-aaaaaaaaaaaaaaaa",
        "split": "val",
        "images": 500,
        "metric": "accuracy",
        "mode": mode,
        "clean": clean,
        "clean_metrics": {"accuracy": clean},
        "seed": 0,
        "created_at": at,
        "calibration": None,
        "stress": [],
        "corruptions": [],
        "stress_mean": None,
        "mean_relative_error": None,
        "path": path,
    }
    doc.update(data)
    if ece is not None:
        doc["calibration"] = {"ece": ece, "stored": stored}
        if ece_after is not None:
            doc["calibration"].update(ece_after=ece_after, temperature=1.5)
    if stress_mean is not None:
        cells = CELLS if cells is None else cells
        doc["stress"] = [
            {"corruption": c, "severity": s, "value": stress_mean, "metrics": {}, "ece": None}
            for c, s in cells
        ]
        doc["stress_mean"] = stress_mean
    return doc


CHAMP = "/m/v1/evals/a/eval.json"


def test_a_clean_drop_beyond_the_margin_refuses_and_within_it_passes() -> None:
    d = compare([report(0.93)], [report(0.95, path=CHAMP)])
    assert d.outcome == "refused"
    (clean, ece) = d.criteria
    assert (clean.name, clean.label, clean.candidate, clean.champion) == ("clean", "accuracy", 0.93, 0.95)
    assert clean.worse_by == pytest.approx(2.0) and clean.margin == 1.0 and not clean.passed
    assert ece.passed and ece.worse_by == 0.0
    assert clean.describe() == (
        "accuracy 0.9300 against the champion's 0.9500: 2.00 points worse (margin 1.00 points)"
    )
    assert d.candidate_report == "/m/v2/evals/a/eval.json" and d.champion_report == CHAMP
    assert d.data == {
        "dataset_version": "ds-aaaaaaaaaaaaaaaa", "split": "val", "images": 500, "seed": 0,
        "metric": "accuracy", "dataset": "/data/pets",
    }  # fmt: skip

    assert compare([report(0.945)], [report(0.95)]).outcome == "passed"  # 0.5 points
    # Exactly the margin passes, whatever the binary rounding of 0.94 and 0.95 says.
    assert compare([report(0.94)], [report(0.95)]).outcome == "passed"
    assert compare([report(0.93)], [report(0.95)], GateMargins(max_drop=2.5)).outcome == "passed"
    better = compare([report(0.97)], [report(0.95)])
    assert better.outcome == "passed" and better.criteria[0].worse_by == pytest.approx(-2.0)
    assert "2.00 points better" in better.criteria[0].describe()


def test_a_metric_to_minimise_is_worse_when_it_rises() -> None:
    d = compare([report(0.30, mode="min")], [report(0.25, mode="min")])
    assert d.outcome == "refused" and d.criteria[0].worse_by == pytest.approx(5.0)
    assert compare([report(0.20, mode="min")], [report(0.25, mode="min")]).outcome == "passed"


def test_stress_is_compared_only_on_the_same_cells() -> None:
    d = compare([report(0.95, stress_mean=0.70)], [report(0.95, stress_mean=0.75)])
    stress = d.criteria[1]
    assert (stress.name, stress.label, stress.candidate, stress.champion) == (
        "stress", "stress mean accuracy", 0.70, 0.75,
    )  # fmt: skip
    assert stress.worse_by == pytest.approx(5.0) and stress.margin == 2.0 and not stress.passed
    assert d.outcome == "refused" and [c.name for c in d.failures] == ["stress"]
    assert compare([report(0.95, stress_mean=0.74)], [report(0.95, stress_mean=0.75)]).outcome == "passed"

    other = compare([report(0.95, stress_mean=0.50, cells=[("fog", 5)])], [report(0.95, stress_mean=0.75)])
    assert other.outcome == "passed" and [c.name for c in other.criteria] == ["clean", "calibration"]
    assert other.skipped == (
        "stress mean: not compared: the reports scored different corruption cells (1 and 4 "
        "corruption x severity cells, not the same set)",
    )
    one = compare([report(0.95)], [report(0.95, stress_mean=0.75)])
    assert one.skipped == (
        "stress mean: not compared: only the champion's report scored corruptions (visionloop eval --stress)",
    )


def test_calibration_compares_ece_after_only_when_both_stored_their_temperature() -> None:
    both = compare(
        [report(0.95, ece=0.20, ece_after=0.05, stored=True)],
        [report(0.95, ece=0.02, ece_after=0.02, stored=True)],
    )
    ece = both.criteria[-1]
    assert (ece.label, ece.candidate, ece.champion) == ("ECE after temperature scaling", 0.05, 0.02)
    assert ece.worse_by == pytest.approx(0.03) and not ece.passed and both.outcome == "refused"
    assert ece.describe() == (
        "ECE after temperature scaling 0.0500 against the champion's 0.0200: 0.0300 higher (margin 0.0200)"
    )
    # One of them serves raw confidences: raw ECE against raw ECE.
    mixed = compare(
        [report(0.95, ece=0.035, ece_after=0.05, stored=False)],
        [report(0.95, ece=0.02, ece_after=0.01, stored=True)],
    )
    assert mixed.criteria[-1].label == "ECE" and mixed.criteria[-1].worse_by == pytest.approx(0.015)
    assert mixed.outcome == "passed"
    assert compare([report(0.95, ece=0.10)], [report(0.95, ece=0.05)]).outcome == "refused"
    assert compare(
        [report(0.95, ece=0.10)], [report(0.95, ece=0.05)], GateMargins(max_ece_rise=0.06)
    ).outcome == ("passed")
    none = compare([report(0.95, ece=None)], [report(0.95)])
    assert [c.name for c in none.criteria] == ["clean"]
    assert none.skipped[-1] == "calibration: not compared: no calibration in the candidate's report"


def test_other_data_is_not_comparable() -> None:
    champ = [report(0.95, path=CHAMP)]
    for change in (
        {"seed": 1},
        {"split": "test"},
        {"images": 200},
        {"dataset_version": "ds-bbbbbbbbbbbbbbbb"},
        {"metric": "mAP"},
    ):
        d = compare([report(0.50, **change)], champ)
        assert d.outcome == "ungated" and d.criteria == () and d.candidate_report is None, change
    d = compare([report(0.50, seed=1), report(0.5, split="test", images=80)], champ)
    assert d.note == (
        "no pair of evaluations on the same data (the same dataset version, split, number of images and "
        "seed): the candidate has 2 evaluations (test, 80 images, seed 0, dataset ds-aaaaaaaaa; "
        "val, 500 images, seed 1, dataset ds-aaaaaaaaa); the champion has 1 evaluation "
        "(val, 500 images, seed 0, dataset ds-aaaaaaaaa)"
    )
    assert compare([], []).note is not None and "the candidate has no evaluations" in str(
        compare([], []).note
    )
    # Damaged reports are left out, not trusted.
    broken = report(0.10)
    broken["clean"] = "0.1"
    assert compare([broken], champ).outcome == "ungated"


def test_the_newest_pair_is_used_and_one_with_stress_preferred() -> None:
    old = report(0.80, at="2026-03-01T10:00:00+00:00", path="/old")
    new = report(0.95, at="2026-03-02T10:00:00+00:00", path="/new")
    champ = [report(0.95, at="2026-03-01T09:00:00+00:00", path=CHAMP)]
    d = compare([old, new], champ)
    assert d.outcome == "passed" and d.candidate_report == "/new"
    d = compare([new, old], champ)  # by time, not by position
    assert d.candidate_report == "/new"
    # A pair that can also compare robustness wins over a newer pair that cannot.
    stressed = report(0.95, at="2026-03-01T11:00:00+00:00", path="/stressed", stress_mean=0.60)
    champs = [*champ, report(0.95, at="2026-03-01T08:00:00+00:00", path="/cs", stress_mean=0.75)]
    d = compare([stressed, new], champs)
    assert (d.candidate_report, d.champion_report) == ("/stressed", "/cs")
    assert d.outcome == "refused" and [c.name for c in d.failures] == ["stress"]


def test_margins_are_checked() -> None:
    assert GateMargins().to_dict() == {"max_drop": 1.0, "max_stress_drop": 2.0, "max_ece_rise": 0.02}
    with pytest.raises(SpecError, match=r"--max-stress-drop must be a number of at least 0, got -1"):
        GateMargins(max_stress_drop=-1)
    with pytest.raises(SpecError, match=r"--max-ece-rise .* got nan"):
        GateMargins(max_ece_rise=float("nan"))


def test_the_refusal_names_every_failing_criterion_both_reports_and_how_to_force() -> None:
    d = compare(
        [report(0.90, stress_mean=0.60, ece=0.10)],
        [report(0.95, stress_mean=0.75, ece=0.02, path=CHAMP)],
    )
    msg = refusal_message("pets", 4, 3, d)
    assert msg.splitlines() == [
        "pets/4 may not become pets@champion: it is worse than the champion pets/3 beyond the promotion "
        "gate's margins, on the val split of dataset ds-aaaaaaaaa, 500 images, seed 0:",
        "  - accuracy 0.9000 against the champion's 0.9500: 5.00 points worse (margin 1.00 points)",
        "  - stress mean accuracy 0.6000 against the champion's 0.7500: 15.00 points worse "
        "(margin 2.00 points)",
        "  - ECE 0.1000 against the champion's 0.0200: 0.0800 higher (margin 0.0200)",
        f"Compared /m/v2/evals/a/eval.json (v4) with {CHAMP} (v3).",
        'To promote it anyway, say why: `visionloop models alias pets 4 champion --force --reason "..."` '
        "(the reason is recorded in the alias history); or set the margins with --max-drop, "
        "--max-stress-drop, --max-ece-rise.",
    ]
    assert [line[:4] for line in decision_lines(d)] == ["FAIL", "FAIL", "FAIL"]
    recorded = d.to_dict()
    assert recorded["decision"] == "refused" and len(recorded["criteria"]) == 3
    assert recorded["criteria"][0] == {
        "name": "clean", "label": "accuracy", "candidate": 0.90, "champion": 0.95,
        "worse_by": pytest.approx(5.0), "margin": 1.0, "unit": "points", "passed": False,
    }  # fmt: skip


def test_alias_history_keeps_reasons_and_gate_decisions_and_reads_old_files(tmp_path: Path) -> None:
    path = tmp_path / "alias_history.json"
    # A history written before reasons and gates existed.
    path.write_text(
        '[{"at": "2026-01-01T00:00:00+00:00", "actor": "a", "action": "set", "alias": "champion", '
        '"version": 1, "previous": null}]'
    )
    (old,) = read_history(path)
    assert old.reason is None and old.gate is None
    gate = {"outcome": "forced", "champion": 1, "criteria": [{"name": "clean", "worse_by": 3.0}]}
    append_event(
        path,
        AliasEvent(
            at="2026-01-02T00:00:00+00:00", actor="b", action="set", alias="champion", version=2,
            previous=1, reason="hotfix", gate=gate,
        ),
    )  # fmt: skip
    first, second = read_history(path)
    assert first == old and (second.reason, second.gate) == ("hotfix", gate)
    text = path.read_text()
    assert text.count('"reason"') == 1 and text.count('"gate"') == 1  # unset fields stay out
