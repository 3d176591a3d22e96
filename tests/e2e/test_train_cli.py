"""`visionloop train` as a user runs it: summaries, resumption, and errors without tracebacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from _trainkit import cli, spec_doc, write_spec


def test_train_prints_a_summary_and_a_second_run_says_it_is_done(
    tmp_path: Path, digits_dataset: Path
) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset, epochs=None, steps=6))
    run_dir = tmp_path / "run"
    p = cli("train", str(spec), "--run-dir", str(run_dir), "--set", "checkpoint.every_steps=3")
    assert p.returncode == 0, p.stdout + p.stderr
    for expected in ("done: 6 steps", "val accuracy", "final model", str(run_dir / "final.safetensors"),
                     "MLflow run", "mlflow ui --backend-store-uri"):  # fmt: skip
        assert expected in p.stdout, expected
    assert (run_dir / "final.safetensors").is_file() and (run_dir / "model_card.json").is_file()
    assert (run_dir / "train.log").read_text().count("checkpoint at step") >= 2

    again = cli("train", str(spec), "--run-dir", str(run_dir), "--set", "checkpoint.every_steps=3")
    assert again.returncode == 0 and "already finished" in again.stdout


def test_a_changed_spec_on_an_existing_run_dir_is_refused(tmp_path: Path, digits_dataset: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset, epochs=None, steps=2))
    run_dir = tmp_path / "run"
    assert cli("train", str(spec), "--run-dir", str(run_dir), "--no-track").returncode == 0
    p = cli("train", str(spec), "--run-dir", str(run_dir), "--no-track", "--set", "optimizer.lr=0.5")
    assert p.returncode == 1
    assert "different spec" in p.stderr and "optimizer.lr: 0.003 -> 0.5" in p.stderr
    assert "Traceback" not in p.stderr


def test_default_run_dir_is_derived_from_the_spec(
    tmp_path: Path, digits_dataset: Path, vl_home: Path
) -> None:
    spec = write_spec(tmp_path / "tiny.yaml", spec_doc(digits_dataset, epochs=None, steps=1))
    p = cli("train", str(spec), "--no-track")
    assert p.returncode == 0, p.stderr
    runs = list((vl_home / "runs").glob("tiny-*"))
    assert len(runs) == 1 and (runs[0] / "final.safetensors").is_file()


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        ({"data__batch_size": 0}, "data.batch_size: Input should be greater than or equal to 1 (got 0)"),
        ({"model__arch": "resnet1888"}, "resnet18"),
        ({"data__dataset": "/nonexistent/ds"}, "is not a visionloop dataset"),
        ({"data__batch_size": 100000}, "fewer than one batch"),
        ({"device": "cuda:7"}, "CUDA is not available"),
        ({"model": {"arch": "alexnet"}}, "alexnet cannot take 16x16 images"),
        ({"precision": "fp16", "deterministic": True, "device": "cpu"}, "fp16 on CPU"),
    ],
)
def test_bad_specs_get_clear_errors(
    tmp_path: Path, digits_dataset: Path, mutate: dict[str, object], expected: str
) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset, **mutate))
    p = cli("train", str(spec), "--run-dir", str(tmp_path / "run"), "--no-track")
    assert p.returncode in (1, 2), p.stdout + p.stderr
    assert expected in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_missing_spec_and_bad_set_syntax(tmp_path: Path) -> None:
    p = cli("train", str(tmp_path / "missing.yaml"))
    assert p.returncode == 2 and "does not exist" in p.stderr and "minimal train spec" in p.stderr
    spec = tmp_path / "s.yaml"
    spec.write_text("data: {dataset: x}\nmodel: {arch: small_cnn}\nepochs: 1\n")
    p = cli("train", str(spec), "--set", "nonsense")
    assert p.returncode == 2 and "--set expects key=value" in p.stderr


def test_archs_lists_architectures_by_pattern() -> None:
    p = cli("archs", "resnet*")
    assert p.returncode == 0
    for name in ("resnet18", "resnet50", "resnet152"):
        assert name in p.stdout
    assert "mobilenet" not in p.stdout
    assert "small_cnn" in cli("archs").stdout
    miss = cli("archs", "nothing-like-this*")
    assert miss.returncode == 1 and "no architecture matches" in miss.stdout


def test_unusable_run_dirs_and_binary_specs_get_clear_errors(tmp_path: Path, digits_dataset: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset, epochs=1))
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    p = cli("train", str(spec), "--run-dir", str(a_file), "--no-track")
    assert p.returncode == 1 and "it is a file" in p.stderr and "Traceback" not in p.stderr
    assert a_file.read_text() == "not a folder"
    p = cli("train", str(spec), "--run-dir", "/proc/visionloop-cannot-be-here", "--no-track")
    assert p.returncode == 1 and "cannot use /proc/visionloop-cannot-be-here" in p.stderr
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(bytes(range(256)) * 100)
    p = cli("train", str(binary))
    assert p.returncode == 2 and "is not UTF-8 text" in p.stderr and "Traceback" not in p.stderr
