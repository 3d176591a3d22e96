"""`visionloop size train` as a user runs it: help, the table and its recommendation, JSON,
limits nothing meets (exit 3 with what to change), and a bad catalog."""

from __future__ import annotations

import json
from pathlib import Path

from _trainkit import cli, spec_doc, write_spec


def test_help_explains_the_command_on_its_own() -> None:
    done = cli("size", "train", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for words in (
        "--deadline",
        "--budget",
        "--catalog",
        "--json",
        "cheapest option",
        "on spot",
        "Exit codes",
    ):
        assert words in text
    top = cli("--help")
    assert "size" in top.stdout


def test_size_a_small_job(tmp_path: Path, digits_dataset: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset))
    done = cli("size", "train", str(spec), "--deadline", "12h")
    assert done.returncode == 0, done.stderr
    assert "small_cnn (classification), 164,962 parameters" in done.stdout
    assert "recommended: 1 x T4 on spot" in done.stdout
    assert "not shown: 3, 5, 6, 7 GPUs (data.batch_size 64 does not divide over them)" in done.stdout

    as_json = cli("size", "train", str(spec), "--json", "--budget", "100")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert (doc["recommended"]["device"], doc["recommended"]["gpus"]) == ("T4", 1)
    assert doc["price_class"] == "spot" and doc["budget_usd"] == 100.0
    assert len(doc["options"]) == 6 * 8 and doc["images_to_train"] == 2 * (1438 // 64) * 64


def test_limits_nothing_meets_exit_3_with_the_closest_option(tmp_path: Path, digits_dataset: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset))
    done = cli("size", "train", str(spec), "--deadline", "0.001s")
    assert done.returncode == 3
    assert "no option finishes within" in done.stderr and "Raise --deadline to at least" in done.stderr
    assert "too slow" in done.stdout  # the table still says why each option loses
    broke = cli("size", "train", str(spec), "--budget", "0.0000001")
    assert broke.returncode == 3 and "Raise --budget to at least $" in broke.stderr


def test_bad_inputs_say_what_to_fix(tmp_path: Path, digits_dataset: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset))
    catalog = tmp_path / "devices.toml"
    catalog.write_text('[devices.X]\nsource = "x"\nfp32_tflops = 1\n')
    done = cli("size", "train", str(spec), "--catalog", str(catalog))
    assert done.returncode == 1 and str(catalog) in done.stderr and "missing key 'fp16_tflops'" in done.stderr
    late = cli("size", "train", str(spec), "--deadline", "tomorrow")
    assert late.returncode == 2 and "give e.g. 12h, 90m, 2d or 3600s" in late.stderr
