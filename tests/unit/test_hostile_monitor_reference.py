"""A version's stored monitoring reference, damaged or hostile (the registry can sit on storage a
whole team writes): `load_reference` refuses it in words that say to rebuild it, never waits on
a FIFO, and never expands an .npz past its limit."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
from numpy.lib import format as npy_format

from _hangkit import in_thread
from _refkit import three_class_reference
from visionloop.core.errors import DataError
from visionloop.monitor import reference as reference_module
from visionloop.monitor.reference import (
    ARRAYS_FILE,
    META_FILE,
    load_reference,
    reference_dir,
    save_reference,
)


def _saved(version_dir: Path) -> Path:
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(3), size=50).astype(np.float32)
    ref = three_class_reference(probs, atc_threshold=0.6)
    save_reference(version_dir, ref)
    loaded = load_reference(version_dir).outputs
    assert loaded is not None and np.array_equal(loaded, probs)  # round-trips as it is
    return reference_dir(version_dir)


def _refused(version_dir: Path) -> str:
    got = in_thread(lambda: load_reference(version_dir))
    assert isinstance(got, DataError), got
    assert str(got).startswith(f"the monitoring reference in {reference_dir(version_dir)} is damaged (")
    assert "--rebuild-reference" in str(got)
    return str(got)


@pytest.mark.parametrize("name", [META_FILE, ARRAYS_FILE])
def test_a_fifo_in_place_of_a_reference_file_is_refused_without_waiting(tmp_path: Path, name: str) -> None:
    out = _saved(tmp_path)
    (out / name).unlink()
    os.mkfifo(out / name)
    assert "FIFO" in _refused(tmp_path)


def test_arrays_that_would_expand_past_the_limit_are_refused_before_expanding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _saved(tmp_path)
    buf = io.BytesIO()
    np.savez_compressed(buf, outputs=np.zeros((1024, 1024), np.float32))  # 4 MiB in, a few KiB stored
    (out / ARRAYS_FILE).write_bytes(buf.getvalue())
    assert (out / ARRAYS_FILE).stat().st_size < 64 * 1024
    monkeypatch.setattr(reference_module, "MAX_ARRAYS_BYTES", 1 << 20)
    assert f"{ARRAYS_FILE} would expand to 4194432 bytes, more than 1 MiB" in _refused(
        tmp_path
    )  # + npy header


def test_an_array_header_claiming_terabytes_is_refused_not_allocated(tmp_path: Path) -> None:
    out = _saved(tmp_path)
    header = io.BytesIO()
    npy_format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**12,)})
    with zipfile.ZipFile(out / ARRAYS_FILE, "w") as zf:
        zf.writestr("outputs.npy", header.getvalue() + b"\0" * 64)
    _refused(tmp_path)


def test_a_reference_file_past_its_size_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(tmp_path)
    monkeypatch.setattr(reference_module, "MAX_META_BYTES", 16)
    assert "the limit for a reference's metadata" in _refused(tmp_path)


def test_bytes_that_are_not_a_zip_are_refused(tmp_path: Path) -> None:
    out = _saved(tmp_path)
    (out / ARRAYS_FILE).write_bytes(b"not a zip at all")
    _refused(tmp_path)
