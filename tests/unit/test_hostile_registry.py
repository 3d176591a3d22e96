"""The model registry against hostile input: references, run folders, model cards, alias
history, eval and export files edited by hand. Each case asserts the exact refusal and that
nothing registered was lost. No training: a run folder is written by hand (registration copies
the weights without reading them as tensors)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from _fakerun import fake_card, fake_run, store_settings
from _hangkit import in_thread
from visionloop import registry
from visionloop.core.errors import DataError, VisionloopError
from visionloop.core.settings import Settings
from visionloop.export.data import open_model_dataset
from visionloop.models.card import ModelCard, ModelCardError
from visionloop.registry.evals import list_evals, read_temperature
from visionloop.registry.export_record import read_export_report
from visionloop.registry.layout import ModelRef, ModelRefError, check_alias, check_name, parse_ref
from visionloop.registry.runsource import RunFolderError, load_run


@pytest.fixture
def settings(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Settings:
    return store_settings(tmp_path_factory, tmp_path / "home")


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ("digits\n", "model name 'digits\\n' is not usable"),
        ("digits\x00", "model name 'digits\\x00' is not usable"),
        ("../digits", "model name '../digits' is not usable"),
        ("dígits", "model name 'dígits' is not usable"),
        (
            "a" * 5000,
            "model name 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'... (5000 characters)",
        ),
    ],
)
def test_hostile_model_names_are_refused(bad: str, needle: str) -> None:
    with pytest.raises(ModelRefError) as e:
        check_name(bad)
    assert needle in str(e.value)
    assert len(str(e.value)) < 300


def test_an_alias_with_a_trailing_newline_is_refused() -> None:
    with pytest.raises(ModelRefError, match=r"alias 'champion\\n' is not usable"):
        check_alias("champion\n")


@pytest.mark.parametrize("version", ["²", "١", "0", "+3", "9" * 5000, "9" * 21])
def test_versions_are_ascii_whole_numbers(version: str) -> None:
    with pytest.raises(ModelRefError, match=r"the version after '/' must be a positive whole number"):
        parse_ref(f"digits/{version}")


def test_a_version_too_large_for_the_store_is_refused_by_name(settings: Settings) -> None:
    with pytest.raises(ModelRefError, match=r"a version is a whole number from 1 to 2147483647"):
        parse_ref("digits/99999999999")
    # A ModelRef made in code (the CLI's VERSION argument) never reaches SQLite either.
    with pytest.raises(ModelRefError, match=r"version \(a number that large\) does not exist"):
        registry.get_version(ModelRef("digits", version=10**30), settings)


# --------------------------------------------------------------------------- run folders


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"\xff\xfe{", "cannot be read as UTF-8 JSON ('utf-8' codec can't decode byte 0xff"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply to be read"),
        (b'{"final_metrics": {"a": ' + b"9" * 5000 + b"}}", "Exceeds the limit (4300 digits)"),
    ],
)
def test_a_damaged_run_json_is_refused_by_name(
    settings: Settings, tmp_path: Path, content: bytes, why: str
) -> None:
    run = fake_run(tmp_path)
    (run / "run.json").write_bytes(content)
    with pytest.raises(RunFolderError) as e:
        load_run(run, settings)
    assert str(e.value).startswith(f"{run / 'run.json'} ")
    assert why in str(e.value)
    assert "Restore it, or move it aside" in str(e.value)
    assert "sys.set_int_max_str_digits" not in str(e.value)


@pytest.mark.parametrize(
    "name", ["run.json", "spec.resolved.yaml", "spec.yaml", "model_card.json", "final.safetensors"]
)
def test_a_fifo_in_a_run_folder_is_refused_without_hanging(
    settings: Settings, tmp_path: Path, name: str
) -> None:
    run = fake_run(tmp_path)
    (run / name).unlink()
    os.mkfifo(run / name)
    got = in_thread(lambda: load_run(run, settings))
    assert isinstance(got, RunFolderError), got
    assert f"{run / name} is a FIFO (named pipe), not a regular file" in str(got)


@pytest.mark.parametrize("name", ["spec.yaml", "final.safetensors", "spec.resolved.yaml"])
def test_a_link_out_of_the_run_folder_is_not_copied_into_the_registry(
    settings: Settings, tmp_path: Path, name: str
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("data: {dataset: /x}\n")
    run = fake_run(tmp_path)
    (run / name).unlink()
    (run / name).symlink_to(secret)
    with pytest.raises(RunFolderError, match=rf"{name} is a link to {secret}, outside the run folder"):
        registry.register(run, name="m", settings=settings)
    assert not list((settings.home / "models" / "m").glob("v*"))


def test_a_link_inside_the_run_folder_is_fine(settings: Settings, tmp_path: Path) -> None:
    run = fake_run(tmp_path)
    (run / "weights.bin").write_bytes((run / "final.safetensors").read_bytes())
    (run / "final.safetensors").unlink()
    (run / "final.safetensors").symlink_to(run / "weights.bin")
    assert load_run(run, settings).run_dir == run.resolve()


def test_resolved_spec_aliases_are_refused(settings: Settings, tmp_path: Path) -> None:
    run = fake_run(tmp_path)
    (run / "spec.resolved.yaml").write_text("a: &a [1, 2]\ndata: {dataset: *a}\n")
    with pytest.raises(
        RunFolderError,
        match=r"spec.resolved.yaml cannot be read as the run's resolved spec \(uses the alias \*a",
    ):
        load_run(run, settings)


def test_wrong_types_in_run_files_are_dropped_not_recorded(settings: Settings, tmp_path: Path) -> None:
    run = fake_run(tmp_path)
    (run / "spec.resolved.yaml").write_text("data: {dataset: {not: a path}}\n")
    (run / "run.json").write_text('{"final_metrics": {"a": true, "b": NaN, "c": "x"}, "mlflow_run_id": 5}')
    src = load_run(run, settings)
    assert src.dataset_path is None and src.mlflow_run_id is None
    assert list(src.final_metrics) == ["b"]  # bools and strings are not metrics


# --------------------------------------------------------------------------- model cards


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"[" * 100_000, "cannot be read as JSON (it nests too deeply)"),
        (
            b'{"format_version": ' + b"9" * 5000 + b"}",
            "cannot be read as JSON (Exceeds the limit (4300 digits)",
        ),
        (b" " * (4 * 2**20 + 1), "is over 4 MiB, far more than a model card holds"),
    ],
)
def test_a_damaged_card_says_what_is_wrong(tmp_path: Path, content: bytes, why: str) -> None:
    path = tmp_path / "model_card.json"
    path.write_bytes(content)
    with pytest.raises(ModelCardError) as e:
        ModelCard.load(path)
    assert str(e.value).startswith(f"{path} {why}")


def test_a_card_that_is_a_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    path = tmp_path / "model_card.json"
    os.mkfifo(path)
    got = in_thread(lambda: ModelCard.load(path))
    assert isinstance(got, ModelCardError), got
    assert "is a FIFO (named pipe), not a regular file" in str(got)


@pytest.mark.parametrize("field", ["mean", "std"])
@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_a_card_with_non_finite_normalisation_is_refused(tmp_path: Path, field: str, value: str) -> None:
    path = fake_card().save(tmp_path / "model_card.json")
    doc = json.loads(path.read_text())
    doc[field] = [0.5, 0.5, 0.5]
    text = json.dumps(doc).replace(f'"{field}": [0.5, 0.5, 0.5]', f'"{field}": [0.5, {value}, 0.5]')
    path.write_text(text)
    with pytest.raises(ModelCardError, match=r"mean and std must be finite numbers"):
        ModelCard.load(path)


@pytest.mark.parametrize("size", [[3, 1_000_000, 1_000_000], [100, 32, 32]])
def test_a_card_asking_for_an_absurd_input_is_refused(tmp_path: Path, size: list[int]) -> None:
    # export, bench and serve allocate batches of input_size: a hand edit must not ask for terabytes.
    path = fake_card().save(tmp_path / "model_card.json")
    doc = json.loads(path.read_text())
    doc["input_size"] = size
    path.write_text(json.dumps(doc))
    with pytest.raises(ModelCardError, match=r"input_size must be at most \(16, 4096, 4096\)"):
        ModelCard.load(path)


# --------------------------------------------------------------------------- versions and aliases


def test_a_damaged_alias_history_moves_no_alias(settings: Settings, tmp_path: Path) -> None:
    run = fake_run(tmp_path)
    v1 = registry.register(run, name="m", settings=settings)
    v2 = registry.register(run, name="m", settings=settings)
    registry.set_alias("m", v1.version, "champion", settings=settings)
    registry.set_alias("m", v1.version, "challenger", settings=settings)
    history = settings.home / "models" / "m" / "alias_history.json"
    good = history.read_bytes()
    for damage in (b"\xff\xfe", b"[" * 100_000, b'[{"at": 1}]'):
        history.write_bytes(damage)
        with pytest.raises(VisionloopError, match=r"alias_history.json \(the alias history\) is unreadable"):
            registry.set_alias("m", v2.version, "champion", settings=settings)
        with pytest.raises(VisionloopError, match=r"alias_history.json \(the alias history\) is unreadable"):
            registry.unset_alias("m", "challenger", settings=settings)
        # Nothing moved: the error is not reported for a change that was made after all.
        assert registry.aliases("m", settings) == {"champion": 1, "challenger": 1}
        assert history.read_bytes() == damage  # left for the user to look at
    history.unlink()
    os.mkfifo(history)
    got = in_thread(lambda: registry.set_alias("m", v2.version, "champion", settings=settings))
    assert isinstance(got, VisionloopError) and "is a FIFO (named pipe)" in str(got), got
    history.unlink()
    history.write_bytes(good)
    assert [v.version for v in registry.list_versions("m", settings)] == [1, 2]  # nothing lost


def test_replaced_weights_are_not_exported_under_the_version_name(settings: Settings, tmp_path: Path) -> None:
    info = registry.register(fake_run(tmp_path), name="m", settings=settings)
    original = info.weights.read_bytes()
    assert info.verified_weights_bytes() == original
    info.weights.write_bytes(b"other weights")
    with pytest.raises(registry.RegistryError, match=r"final.safetensors is not the file registered as m/1"):
        info.verified_weights_bytes()
    info.weights.unlink()
    info.weights.mkdir()
    with pytest.raises(
        registry.RegistryError, match=r"m/1's weights cannot be read: .* is a folder, not a regular"
    ):
        info.verified_weights_bytes()
    info.weights.rmdir()
    with pytest.raises(registry.RegistryError, match=r"final.safetensors is missing: m/1 has no weights"):
        info.verified_weights_bytes()
    info.weights.write_bytes(original)
    assert info.verified_weights_bytes() == original


def test_hostile_version_files_read_as_absent_and_never_hang(settings: Settings, tmp_path: Path) -> None:
    info = registry.register(fake_run(tmp_path), name="m", settings=settings)
    lineage = info.dir / "lineage.json"
    lineage.write_bytes(b"\xff")
    assert info.lineage() == {}
    lineage.write_text('{"dataset_path": [1, 2]}')
    with pytest.raises(DataError, match=r"does not record where its dataset is"):
        open_model_dataset(info)
    lineage.unlink()
    os.mkfifo(lineage)
    assert in_thread(info.lineage) == {}

    report_dir = info.dir / "exports" / "onnx-fp32"
    report_dir.mkdir(parents=True)
    os.mkfifo(report_dir / "export.json")
    assert in_thread(lambda: read_export_report(report_dir / "export.json")) is None
    assert in_thread(info.export_path) is None

    evals = info.dir / "evals" / "e1"
    evals.mkdir(parents=True)
    os.mkfifo(evals / "eval.json")
    (info.dir / "evals" / "e2").mkdir()
    (info.dir / "evals" / "e2" / "eval.json").write_bytes(b"[" * 100_000)
    assert in_thread(lambda: list_evals(info.dir)) == []
    os.mkfifo(info.dir / "calibration.json")
    got = in_thread(lambda: read_temperature(info.dir))
    assert isinstance(got, DataError) and "is a FIFO (named pipe)" in str(got), got
