"""The canary's arithmetic: what it reads from a real server's metrics registry, the verdict on
a window of traffic, a restarted server told apart from a quiet one, and the rollout section
of a loop spec refused where it could not be watched."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from visionloop.core.errors import SpecError
from visionloop.loop.canary import Counts, Reading, difference, judge, parse
from visionloop.loop.spec import RolloutSpec, load_loop_spec, validate_loop_spec
from visionloop.serve.metrics import ServeMetrics


def _rollout(**kw: Any) -> RolloutSpec:
    return RolloutSpec.model_validate({"server": "http://127.0.0.1:8000", **kw})


def test_parse_reads_each_versions_counters_from_a_real_metrics_registry() -> None:
    m = ServeMetrics()
    m.requests.labels("digits", "1", "infer").inc(70)
    m.requests.labels("digits", "1", "classify").inc(30)
    m.requests.labels("digits", "2", "classify").inc(12)
    m.requests.labels("other", "2", "classify").inc(999)  # another model: not ours
    m.rejected.labels("digits", "2", "timeout").inc(2)
    m.rejected.labels("digits", "2", "non_finite_output").inc(1)
    for seconds in (0.004, 0.004, 0.2):
        m.latency.labels("digits", "2").observe(seconds)
    m.shadow.labels("digits", "1", "2", "true").inc(45)
    m.shadow.labels("digits", "1", "2", "false").inc(5)
    r = parse(m.render().decode(), "digits")
    assert (r.get(1).answered, r.get(1).failed) == (100, 0)
    assert (r.get(2).answered, r.get(2).failed) == (12, 3)
    b = r.get(2).buckets
    assert b[0.005] == 2 and b[0.25] == 3 and b[float("inf")] == 3
    assert r.comparisons(1, 2) == (45, 5) and r.comparisons(2, 1) == (0, 0)
    assert Reading.from_json(r.to_json()) == r  # what the loop's state keeps


def _reading(champ: tuple[float, float], cand: tuple[float, float], shadow: tuple[float, float]) -> Reading:
    fast = {0.01: 1.0, 0.1: 1.0, float("inf"): 1.0}  # every request under 10 ms
    return Reading(
        {"1": Counts(champ[0], champ[1], {k: v * champ[0] for k, v in fast.items()}),
         "2": Counts(cand[0], cand[1], {k: v * cand[0] for k, v in fast.items()})},
        {"1>2": shadow},
    )  # fmt: skip


def test_judge_waits_for_enough_answers_then_checks_each_criterion() -> None:
    spec = _rollout(shadow_percent=50, min_requests=100, min_agreement=0.9, max_error_rate_rise=0.01)
    v = judge(_reading((500, 0), (40, 0), (40, 2)), 1, 2, spec)  # 40 + 42 answers < 100
    assert v.passed is None and v.reasons == ("82 of the 100 candidate answers needed so far",)

    v = judge(_reading((500, 1), (60, 0), (95, 5)), 1, 2, spec)
    assert v.passed is True, v.reasons
    assert v.figures["agreement"] == pytest.approx(0.95) and v.figures["latency_ratio"] == pytest.approx(1.0)

    v = judge(_reading((500, 1), (60, 0), (80, 20)), 1, 2, spec)  # agrees 80% of the time
    assert v.passed is False and len(v.reasons) == 1 and v.reasons[0].startswith("agreement 80.0%")

    v = judge(_reading((500, 0), (60, 9), (95, 5)), 1, 2, spec)  # 9 failed of 169
    assert v.passed is False and v.reasons[0].startswith("failures 5.33% (champion 0.00%")

    slow = _reading((500, 0), (60, 0), (95, 5))
    slow = replace(
        slow,
        versions={**slow.versions, "2": Counts(60, 0, {0.01: 0.0, 0.1: 0.0, 1.0: 60.0, float("inf"): 60.0})},
    )
    v = judge(slow, 1, 2, spec)
    assert v.passed is False and "p95 latency" in v.summary() and "(at most 1.5x)" in v.summary()


def test_a_lower_counter_means_a_restart_and_the_window_is_the_difference() -> None:
    before = _reading((500, 1), (60, 0), (95, 5))
    later = _reading((700, 1), (90, 2), (130, 6))
    assert before.before(later) and not later.before(before)
    assert not before.before(_reading((10, 0), (60, 0), (95, 5)))  # the champion's count went back
    w = difference(before, later)
    assert (w.get(1).answered, w.get(2).answered, w.get(2).failed) == (200, 30, 2)
    assert w.comparisons(1, 2) == (35, 1) and w.get(2).buckets[float("inf")] == 30


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"canary_percent": 0}, "give canary_percent or shadow_percent"),
        ({"min_agreement": 0.9}, "min_agreement is measured on mirrored requests"),
        ({"server": "10.0.0.5:8000"}, "must be the server's base URL"),
        ({"server": "http://h:1/v2/models"}, "must be the server's base URL"),
        ({"watch_minutes": 30, "max_watch_minutes": 10}, "max_watch_minutes must be at least"),
        ({"canary_percent": 100}, "rollout.canary_percent"),
        ({"canary": 10}, "rollout.canary"),
    ],
)
def test_a_rollout_that_could_not_be_watched_is_refused(
    rollout: dict[str, Any], message: str, tmp_path: Path
) -> None:
    doc = {
        "name": "l",
        "model": "digits",
        "dataset": str(tmp_path),
        "labels": str(tmp_path / "in"),
        "trigger": {"new_labels": 1},
        "train": {"model": {"arch": "small_cnn"}, "epochs": 1},
        "rollout": {"server": "http://127.0.0.1:8000", **rollout},
    }
    with pytest.raises(SpecError, match=message):
        validate_loop_spec(doc, tmp_path)


def test_a_loop_spec_file_with_aliases_a_fifo_or_bad_bytes_gets_one_line(tmp_path: Path) -> None:
    """LOOP.yaml and the train spec it names are a user's files: read without aliases (a few
    hundred bytes of them stand for billions of values), never blocking on a FIFO, and only
    as UTF-8; the same spec written out in full loads."""
    good = (
        f"name: l\nmodel: digits\ndataset: {tmp_path}\nlabels: {tmp_path / 'in'}\n"
        "trigger: {new_labels: 1}\ntrain: train.yaml\n"
    )
    (tmp_path / "train.yaml").write_text("model: {arch: small_cnn}\nepochs: 1\n")
    (tmp_path / "loop.yaml").write_text(good)
    assert load_loop_spec(tmp_path / "loop.yaml").name == "l"
    bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9)
    )
    (tmp_path / "bomb.yaml").write_text(good + bomb)
    with pytest.raises(SpecError, match=r"uses the alias \*a0, which this file does not allow"):
        load_loop_spec(tmp_path / "bomb.yaml")
    (tmp_path / "train.yaml").write_text("model: &m {arch: small_cnn}\nother: *m\nepochs: 1\n")
    with pytest.raises(SpecError, match=r"cannot read the train spec .*uses the alias"):
        load_loop_spec(tmp_path / "loop.yaml")
    (tmp_path / "train.yaml").unlink()
    os.mkfifo(tmp_path / "train.yaml")
    with pytest.raises(
        SpecError, match=r"loop\.yaml: train spec file .*train\.yaml is a FIFO \(named pipe\)"
    ):
        load_loop_spec(tmp_path / "loop.yaml")
    os.mkfifo(tmp_path / "fifo.yaml")
    with pytest.raises(SpecError, match=r"loop spec file .*fifo\.yaml is a FIFO \(named pipe\)"):
        load_loop_spec(tmp_path / "fifo.yaml")
    (tmp_path / "latin1.yaml").write_bytes(good.encode() + b"# caf\xe9\n")
    with pytest.raises(SpecError, match="is not UTF-8 text"):
        load_loop_spec(tmp_path / "latin1.yaml")
