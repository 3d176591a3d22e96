"""`visionloop export` as a user runs it."""

from __future__ import annotations

from pathlib import Path

from _modelkit import ModelKit, onnx_model  # noqa: F401  (session fixture)
from _trainkit import cli


def test_export_then_show_and_a_refused_export(onnx_model: ModelKit, tmp_path: Path) -> None:  # noqa: F811
    kit = onnx_model.copy_home(tmp_path / "home")
    env = kit.env()
    r = cli(
        "export", "digits", "--format", "onnx", "--precision", "int8", "--calibration-size", "64", env=env
    )
    assert r.returncode == 0, r.stderr
    assert "digits/1 onnx-int8 passed" in r.stdout
    path = kit.home / "models" / "digits" / "v1" / "exports" / "onnx-int8" / "model.onnx"
    assert path.is_file() and str(path) in r.stdout

    # fp16 logits cannot equal fp32 ones exactly: a zero tolerance must refuse the export.
    r = cli("export", "digits@champion", "--precision", "fp16", "--max-abs-diff", "0", env=env)
    assert r.returncode == 1
    assert "digits/1 onnx-fp16 export refused: parity with eager PyTorch is off" in r.stderr
    assert "max |logit diff|" in r.stderr and "accuracy" in r.stderr and "Traceback" not in r.stderr

    exports = kit.info().exports()
    assert {k: v.passed for k, v in exports.items()} == {
        "onnx-fp16": False,
        "onnx-fp32": True,
        "onnx-int8": True,
    }
    text = cli("models", "show", "digits", env=env).stdout
    rows = {line.split()[1]: line for line in text.splitlines() if "onnx-" in line}
    assert " no " in rows["onnx-fp16"] and " yes " in rows["onnx-int8"] and " yes " in rows["onnx-fp32"]

    r = cli("export", "digits", "--precision", "int4", env=env)
    assert (
        r.returncode == 1 and "--precision 'int4' is not supported; use one of fp32, fp16, int8" in r.stderr
    )
