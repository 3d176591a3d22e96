"""Train spec validation: every bad field gets its name, the value and a valid example."""

from __future__ import annotations

from pathlib import Path

import pytest

from visionloop.core.errors import SpecError
from visionloop.spec_files import apply_overrides
from visionloop.specs import load_train_spec, validate_train_spec

BASE = {"data": {"dataset": "ds"}, "model": {"arch": "small_cnn"}, "epochs": 3}


def doc(**sections: object) -> dict[str, object]:
    d: dict[str, object] = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    d.update(sections)
    return d


def error_of(d: dict[str, object]) -> str:
    with pytest.raises(SpecError) as e:
        validate_train_spec(d, "spec.yaml")
    return str(e.value)


def test_minimal_spec_gets_sensible_defaults() -> None:
    s = validate_train_spec(doc())
    assert s.data.batch_size == 64 and s.precision == "auto" and s.device == "auto"
    assert s.optimizer.name == "adamw" and s.checkpoint.keep_last == 3 and s.steps is None


def test_out_of_range_value_names_field_value_and_example() -> None:
    msg = error_of(doc(data={"dataset": "ds", "batch_size": -3}))
    assert "data.batch_size" in msg and "got -3" in msg and "Example: batch_size: 64" in msg


def test_wrong_type_and_bad_choice() -> None:
    msg = error_of(doc(optimizer={"lr": "fast"}, precision="fp8"))
    assert "optimizer.lr" in msg and "'fast'" in msg and "Example: lr: 0.1" in msg
    assert "precision" in msg and "'fp8'" in msg and "bf16" in msg


def test_unknown_field_suggests_the_closest_name() -> None:
    msg = error_of(doc(data={"dataset": "ds", "batchsize": 32}))
    assert "data.batchsize: unknown field" in msg and "Did you mean `batch_size`?" in msg


def test_epochs_and_steps_are_exclusive_and_one_is_required() -> None:
    assert "exactly one of `epochs` or `steps`" in error_of(doc(steps=100))
    d = doc()
    del d["epochs"]
    assert "exactly one of `epochs` or `steps`" in error_of(d)


def test_augment_ranges_and_device_names() -> None:
    msg = error_of(doc(data={"dataset": "ds", "augment": {"scale": [0.9, 0.1]}}, device="tpu"))
    assert "data.augment.scale" in msg and "low <= high" in msg
    assert "device" in msg and "cuda:N" in msg


def test_missing_section_says_missing() -> None:
    assert "data: Field required (missing)" in error_of({"model": {"arch": "x"}, "epochs": 1})


def test_overrides_parse_yaml_scalars_and_create_sections() -> None:
    d = apply_overrides(
        doc(), ["optimizer.lr=0.01", "epochs=7", "model.pretrained=null", "data.augment.hflip=0"]
    )
    s = validate_train_spec(d)
    assert s.optimizer.lr == 0.01 and s.epochs == 7 and s.model.pretrained is None
    assert s.data.augment.hflip == 0.0


@pytest.mark.parametrize("bad", ["noequals", "=3", "epochs.x=1"])
def test_bad_overrides_are_explained(bad: str) -> None:
    with pytest.raises(SpecError, match="--set"):
        apply_overrides(doc(), [bad])


def test_an_override_through_a_value_names_the_value_and_the_field() -> None:
    with pytest.raises(
        SpecError, match=r"--set epochs\.x: `epochs` is a value, not a section, so it has no field `x`"
    ):
        apply_overrides(doc(), ["epochs.x=1"])


def test_relative_paths_resolve_against_the_spec_folder(tmp_path: Path) -> None:
    (tmp_path / "cfg").mkdir()
    spec = tmp_path / "cfg" / "train.yaml"
    spec.write_text(
        "data: {dataset: ../ds}\nmodel: {arch: small_cnn, pretrained: w.safetensors}\nepochs: 1\n"
    )
    s, _ = load_train_spec(spec)
    assert s.data.dataset == (tmp_path / "ds").resolve()
    assert s.model.pretrained == (tmp_path / "cfg" / "w.safetensors").resolve()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", "is empty"), ("- a\n- b\n", "must be a mapping"), ("data: [unclosed\n", "not valid YAML")],
)
def test_unusable_files_are_explained(tmp_path: Path, text: str, expected: str) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(text)
    with pytest.raises(SpecError, match=expected):
        load_train_spec(spec)


def test_missing_file_shows_a_minimal_spec(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"does not exist\. A minimal train spec"):
        load_train_spec(tmp_path / "nope.yaml")


def test_a_held_out_fold_must_be_one_of_its_folds() -> None:
    s = validate_train_spec(doc(data={"dataset": "ds", "holdout": {"folds": 5, "fold": 4}}))
    assert s.data.holdout is not None and (
        s.data.holdout.folds,
        s.data.holdout.fold,
        s.data.holdout.seed,
    ) == (5, 4, 0)
    assert validate_train_spec(doc()).data.holdout is None
    msg = error_of(doc(data={"dataset": "ds", "holdout": {"folds": 5, "fold": 5}}))
    assert "data.holdout" in msg and "fold 5 is not one of 0..4" in msg
    msg = error_of(doc(data={"dataset": "ds", "holdout": {"folds": 1, "fold": 0}}))
    assert "data.holdout.folds" in msg and "got 1" in msg
