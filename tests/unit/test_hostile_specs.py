"""Train and tune specs as an attacker or a careless user writes them, read from real files:
every one is refused with a SpecError that names the field (or the file) and what to do,
never accepted as nonsense and never a traceback further on."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import yaml

from visionloop.core.errors import SpecError
from visionloop.specs import load_train_spec
from visionloop.tune.space import make_sampler
from visionloop.tune.spec import load_tune_spec

BASE = {"data": {"dataset": "ds"}, "model": {"arch": "small_cnn"}, "epochs": 3}


def write(path: Path, doc: object) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def refusal(path: Path, *overrides: str) -> str:
    with pytest.raises(SpecError) as e:
        load_train_spec(path, overrides)
    return str(e.value)


def train_doc(**sections: object) -> dict[str, object]:
    doc: dict[str, object] = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for dotted, value in sections.items():
        node = doc
        *parents, last = dotted.split("__")
        for key in parents:
            node = cast(dict[str, object], node.setdefault(key, {}))
        node[last] = value
    return doc


# --------------------------------------------------------------------------- the file itself


def test_a_file_far_larger_than_any_spec_is_refused(tmp_path: Path) -> None:
    spec = write(tmp_path / "spec.yaml", BASE)
    with spec.open("a") as f:
        f.write("# " + "x" * 2**20 + "\n")  # valid YAML: only its size is wrong
    msg = refusal(spec)
    assert "larger than 1024 KiB" in msg and "right file" in msg, msg


def test_nesting_too_deep_to_parse_is_a_spec_error(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("[" * 20_000 + "]" * 20_000)
    msg = refusal(spec)
    assert "nests too deeply" in msg, msg


def test_an_alias_in_a_set_override_is_refused(tmp_path: Path) -> None:
    spec = write(tmp_path / "spec.yaml", BASE)
    msg = refusal(spec, "model.kwargs.x=[&a [1, 2], *a, *a]")
    assert "--set" in msg and "alias" in msg, msg


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("optimizer__lr", float("inf"), "optimizer.lr: Input should be a finite number"),
        ("optimizer__weight_decay", float("inf"), "optimizer.weight_decay: Input should be a finite"),
        ("schedule__warmup_epochs", float("inf"), "schedule.warmup_epochs: Input should be a finite"),
        ("checkpoint__every_minutes", float("inf"), "checkpoint.every_minutes: Input should be a finite"),
        ("optimizer__betas", [float("nan"), 0.999], "optimizer.betas.0: Input should be a finite number"),
        ("optimizer__betas", [0.9, 2.0], "optimizer.betas: are decay rates: each needs 0 <= beta < 1"),
        ("optimizer__betas", [-0.5, 0.9], "optimizer.betas: are decay rates"),
        ("seed", 10**30, "seed: Input should be less than or equal to 4294967295"),
        ("epochs", 10**27, "epochs: Input should be less than or equal to 100000"),
        ("data__dataset", "a\x00b", "data.dataset: holds a NUL character"),
        ("model__pretrained", "w\x00.safetensors", "model.pretrained: holds a NUL character"),
        # Lax coercion read `epochs: true` as one epoch and 1 or "yes" as a flag's true.
        ("epochs", True, "epochs: should be a number, not true (got True). Example: epochs: 10"),
        ("optimizer__lr", False, "optimizer.lr: should be a number, not false"),
        ("deterministic", 1, "deterministic: should be true or false (got 1)"),
        ("model__channels_last", "yes", "model.channels_last: should be true or false (got 'yes')"),
    ],
)
def test_values_no_run_can_use_are_refused_naming_the_field(
    tmp_path: Path, field: str, value: object, says: str
) -> None:
    spec = write(tmp_path / "spec.yaml", train_doc(**{field: value}))
    msg = refusal(spec)
    assert says in msg, msg


def test_steps_past_any_run_are_refused(tmp_path: Path) -> None:
    doc = train_doc(steps=10**30)
    del doc["epochs"]
    assert "steps: Input should be less than or equal to" in refusal(write(tmp_path / "s.yaml", doc))


def test_a_huge_value_is_named_not_printed_whole(tmp_path: Path) -> None:
    spec = write(tmp_path / "spec.yaml", train_doc(epochs="9" * 4000 + "x"))
    msg = refusal(spec)
    assert "epochs:" in msg and "(4,003 characters)" in msg and len(msg) < 1000, msg


def test_the_example_of_a_pair_names_the_field(tmp_path: Path) -> None:
    msg = refusal(write(tmp_path / "spec.yaml", train_doc(optimizer__betas=[0.9, "x"])))
    assert "Example: betas: [0.9, 0.999]" in msg, msg


def test_every_relative_path_is_taken_from_the_specs_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "specs"
    folder.mkdir()
    spec = write(
        folder / "det.yaml",
        train_doc(model__pretrained="w.safetensors", model__pretrained_backbone="backbone.safetensors"),
    )
    monkeypatch.chdir(tmp_path)  # anywhere but the spec's folder
    loaded, _ = load_train_spec(spec)
    assert loaded.data.dataset == folder / "ds"
    assert loaded.model.pretrained == folder / "w.safetensors"
    assert loaded.model.pretrained_backbone == folder / "backbone.safetensors"


# --------------------------------------------------------------------------- tune specs


def tune_file(tmp_path: Path, **fields: object) -> Path:
    write(tmp_path / "train.yaml", BASE)
    doc: dict[str, object] = {
        "name": "hostile",
        "train": "train.yaml",
        "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-1]}},
        "trials": 4,
        "pruner": {"name": "none"},
        **fields,
    }
    return write(tmp_path / "tune.yaml", doc)


def tune_refusal(path: Path) -> str:
    with pytest.raises(SpecError) as e:
        load_tune_spec(path)
    return str(e.value)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"budget": {"usd": float("inf")}}, "budget.usd: Input should be a finite number"),
        (
            {"space": {"optimizer.lr": {"choice": [float("inf"), 0.1]}}},
            "optimizer.lr: Input should be a finite",
        ),
        ({"space": {"seed": {"int": [0, 10**30]}}}, "seed: Input should be less than or equal to 4294967295"),
        ({"sampler": {"name": "tpe", "seed": 10**30}}, "sampler.seed: Input should be less than or equal"),
        ({"trials": True}, "trials: should be a number, not true"),
    ],
)
def test_tune_values_no_study_can_use_are_refused(
    tmp_path: Path, fields: dict[str, object], says: str
) -> None:
    msg = tune_refusal(tune_file(tmp_path, **fields))
    assert says in msg, msg


def test_the_budgets_example_is_the_fields_own(tmp_path: Path) -> None:
    msg = tune_refusal(tune_file(tmp_path, budget={"gpu_hours": -1}))
    assert "Example: gpu_hours: 10" in msg, msg


def test_the_largest_sampler_seed_survives_a_restarted_study(tmp_path: Path) -> None:
    spec, _ = load_tune_spec(tune_file(tmp_path, sampler={"name": "random", "seed": 2**32 - 1}))
    # A tuner restarted after 40 trials moves the seed on by 40 draws: numpy takes only 0..2**32-1.
    make_sampler(spec, asked=40)
