"""The runtime history's keys and estimates (`visionloop.sched.history`): which changes to a
job make it other work (its spec key), another architecture or data (its shape key), and what
the earlier runs of either say of its run time."""

from __future__ import annotations

from typing import Any

import pytest

from visionloop.sched.history import RuntimeHistory, RuntimeKey, Sample, runtime_key
from visionloop.sched.workload import TrainWorkload, TrialWorkload
from visionloop.specs import TrainSpec

BASE: dict[str, Any] = {
    "epochs": 10,
    "model": {"arch": "resnet18"},
    "data": {"dataset": "/data/digits", "batch_size": 64},
}


def key(gpus: int = 1, nodes: int = 1, trial_until: int | None = None, **changes: Any) -> RuntimeKey:
    doc = {**BASE, **changes}
    train = TrainSpec.model_validate(doc)
    if trial_until is not None:
        w: TrainWorkload | TrialWorkload = TrialWorkload(
            train=train, study="s", number=0, until_epoch=trial_until
        )
    else:
        w = TrainWorkload(train=train)
    return runtime_key(w.runtime_profile(), gpus, nodes)


def test_seed_and_tracking_leave_both_keys_alone() -> None:
    k = key()
    assert key(seed=7) == k
    assert key(tracking={"experiment": "other", "run_name": "x", "tags": {"a": "b"}}) == k
    assert (k.length, len(k.spec), len(k.shape)) == (10, 32, 32)


@pytest.mark.parametrize(
    "changes",
    [{"optimizer": {"lr": 0.1}}, {"epochs": 90}, {"loss": {"label_smoothing": 0.1}}],
    ids=["learning-rate", "length", "loss"],
)
def test_the_optimiser_and_the_length_make_other_work_of_the_same_shape(changes: dict[str, Any]) -> None:
    k, other = key(), key(**changes)
    assert other.spec != k.spec and other.shape == k.shape


@pytest.mark.parametrize(
    "changes",
    [
        {"model": {"arch": "resnet50"}},
        {"data": {"dataset": "/data/digits", "batch_size": 128}},
        {"data": {"dataset": "/data/other", "batch_size": 64}},
        {"precision": "bf16"},
        {"eval": {"every_epochs": 5}},
        {"steps": 100, "epochs": None},  # steps are not epochs: no time per unit in common
    ],
    ids=["arch", "batch", "dataset", "precision", "eval", "unit"],
)
def test_architecture_data_and_how_it_runs_make_another_shape(changes: dict[str, Any]) -> None:
    assert key(**changes).shape != key().shape


def test_more_gpus_or_nodes_are_another_shape() -> None:
    assert len({key().shape, key(gpus=2).shape, key(gpus=2, nodes=2).shape}) == 3


def test_a_trial_is_as_long_as_the_rung_it_is_heading_for() -> None:
    rung3, rung9 = key(trial_until=3), key(trial_until=9)
    assert (rung3.length, rung9.length) == (3, 9)
    assert rung3.shape == rung9.shape == key().shape  # the same architecture as the full run
    assert rung3.spec != rung9.spec
    assert key(trial_until=10) == key()  # to its last epoch: the same work as training


def test_same_spec_gives_the_median_of_its_runs() -> None:
    k = key()
    h = RuntimeHistory([Sample(k.spec, k.shape, 10, s) for s in (100.0, 400.0, 130.0)])
    found = h.estimate(k.spec, k.shape, k.length)
    assert found is not None
    assert (found.seconds, found.runs, found.basis) == (130.0, 3, "the median of 3 earlier runs of this spec")
    assert (found.shortest, found.longest) == (100.0, 400.0)


def test_same_shape_scales_the_median_time_per_epoch_to_the_length() -> None:
    k, longer = key(), key(epochs=90)
    # 10-epoch runs at 12, 10 and 50 s per epoch: the median, 12 s, times 90 epochs.
    h = RuntimeHistory([Sample(k.spec, k.shape, 10, s) for s in (120.0, 100.0, 500.0)])
    found = h.estimate(longer.spec, longer.shape, longer.length)
    assert found is not None and found.seconds == pytest.approx(1080.0) and found.runs == 3
    assert (found.shortest, found.longest) == pytest.approx((900.0, 4500.0))
    assert found.basis.startswith("3 earlier runs of this architecture on the same data and GPUs")


def test_the_same_spec_comes_before_the_same_shape() -> None:
    k, longer = key(), key(epochs=90)
    h = RuntimeHistory([Sample(k.spec, k.shape, 10, 100.0), Sample(longer.spec, longer.shape, 90, 2000.0)])
    assert h.estimate(k.spec, k.shape, 10).seconds == 100.0  # type: ignore[union-attr]
    assert h.estimate(longer.spec, longer.shape, 90).seconds == 2000.0  # type: ignore[union-attr]
    mid = key(epochs=45)  # no run of its own: the median per epoch of both, (10 + 22.2) / 2
    est = h.estimate(mid.spec, mid.shape, 45)
    assert est is not None and est.seconds == pytest.approx(45 * (10.0 + 2000.0 / 90) / 2)


def test_nothing_like_it_ran_or_no_keys_gives_none_and_bad_samples_are_ignored() -> None:
    k, other = key(), key(model={"arch": "resnet50"})
    h = RuntimeHistory([Sample(k.spec, k.shape, 10, 0.0), Sample(k.spec, k.shape, 0, 50.0)])
    assert len(h) == 0
    assert h.estimate(k.spec, k.shape, 10) is None
    h = RuntimeHistory([Sample(k.spec, k.shape, 10, 100.0)])
    assert h.estimate(other.spec, other.shape, 10) is None
    assert h.estimate(None, None, None) is None  # a job from before the history
