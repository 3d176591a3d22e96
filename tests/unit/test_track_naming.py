"""Key sanitisation and param flattening, checked against MLflow's own validators."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlflow.utils import validation

from visionloop.track.naming import (
    MAX_KEY_LENGTH,
    MAX_PARAM_VALUE_LENGTH,
    TRUNCATION_MARKER,
    flatten_params,
    metric_key,
    sanitize_key,
)

# MLflow's own checks are the ground truth for "valid" (they are private, hence untyped).
_validate_metric_name: Callable[[str], None] = validation._validate_metric_name
_validate_param_name: Callable[[str], None] = validation._validate_param_name


@pytest.mark.parametrize(
    "key", ["train/loss", "val/recall/cat", "optimizer.lr", "system/gpu0/power_w", "val/recall/gâteau"]
)
def test_valid_keys_come_back_unchanged(key: str) -> None:
    assert sanitize_key(key) == key


@pytest.mark.parametrize(
    ("raw", "safe"),
    [
        ("val/recall/cat/dog?", "val/recall/cat/dog_"),
        ("val/f1/a:b", "val/f1/a_b"),  # ':' is rejected by MLflow servers on Windows
        ("val//loss", "val/loss"),
        ("/abs/key/", "abs/key"),
        ("val/./x", "val/_/x"),
        ("../up", "__/up"),
        ("..hidden", "_.hidden"),
        ("", "_"),
        ("tab\there", "tab_here"),
    ],
)
def test_unsafe_keys_are_mapped_to_valid_ones(raw: str, safe: str) -> None:
    assert sanitize_key(raw) == safe
    _validate_metric_name(safe)


def test_metric_key_keeps_a_class_name_on_one_level() -> None:
    assert metric_key("val", "recall", "cat/dog?") == "val/recall/cat_dog_"
    assert metric_key("val", "recall", "cat") == "val/recall/cat"


def test_long_keys_are_cut_but_stay_distinct() -> None:
    a, b = "x/" + "a" * 400 + "1", "x/" + "a" * 400 + "2"
    sa, sb = sanitize_key(a), sanitize_key(b)
    assert len(sa) <= MAX_KEY_LENGTH and len(sb) <= MAX_KEY_LENGTH
    assert sa != sb
    assert sanitize_key(a) == sa  # deterministic: a resumed process maps it the same way


@given(st.text(max_size=300))
def test_any_text_becomes_a_key_mlflow_accepts(raw: str) -> None:
    safe = sanitize_key(raw)
    _validate_metric_name(safe)
    _validate_param_name(safe)
    assert len(safe) <= MAX_KEY_LENGTH
    assert sanitize_key(safe) == safe  # idempotent


def test_flatten_params_nests_with_dots_and_stringifies() -> None:
    flat = flatten_params(
        {
            "optimizer": {"name": "sgd", "lr": 0.1, "betas": [0.9, 0.99]},
            "aug": None,
            "epochs": 3,
            "empty": {},
            "a:b": True,
        }
    )
    assert flat == {
        "optimizer.name": "sgd",
        "optimizer.lr": "0.1",
        "optimizer.betas": "[0.9, 0.99]",
        "aug": "None",
        "epochs": "3",
        "empty": "{}",
        "a_b": "True",
    }


def test_long_param_values_are_truncated_with_a_marker() -> None:
    flat = flatten_params({"classes": "c" * 10_000, "short": "c" * MAX_PARAM_VALUE_LENGTH})
    assert len(flat["classes"]) == MAX_PARAM_VALUE_LENGTH
    assert flat["classes"].endswith(TRUNCATION_MARKER)
    assert flat["short"] == "c" * MAX_PARAM_VALUE_LENGTH  # exactly at the limit: untouched
