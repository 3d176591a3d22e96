"""The price catalog: the shipped default, a user's file, and errors that name the file,
the key and a valid example."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from visionloop.core.errors import ConfigError
from visionloop.sched.prices import PriceCatalog, load_catalog

GOOD = """
[gpus."A100-80GB"]
owned = 0.95
on_demand = 3.43
spot = 1.65

[gpus.fake]
owned = 0
on_demand = 2
spot = 1
"""


def test_default_catalog_ships_with_the_package() -> None:
    assert resources.files("visionloop").joinpath("assets/prices.toml").is_file()
    cat = load_catalog(None)
    assert {"H100-80GB", "A100-80GB", "L4", "T4", "V100", "fake"} <= set(cat.gpu_types)
    assert cat.per_gpu_hour("fake", "owned") == 0.5
    assert cat.per_gpu_hour("fake", "on_demand") == 2.0
    assert cat.per_gpu_hour("fake", "spot") == 1.0
    for gpu in ("H100-80GB", "A100-80GB", "L4", "T4", "V100"):
        # spot and owned (amortised) hours are cheaper than on-demand ones for every real type
        on_demand = cat.per_gpu_hour(gpu, "on_demand")
        assert (
            0 < cat.per_gpu_hour(gpu, "spot") < on_demand and 0 < cat.per_gpu_hour(gpu, "owned") < on_demand
        )
    assert cat.per_gpu_second("A100-80GB", "on_demand") == pytest.approx(3.43 / 3600)


def test_user_catalog(tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(GOOD)
    cat = load_catalog(path)
    assert isinstance(cat, PriceCatalog) and cat.source == str(path)
    assert cat.per_gpu_hour("A100-80GB", "spot") == 1.65
    assert cat.per_gpu_hour("fake", "owned") == 0.0


def test_unknown_gpu_type_names_the_file_and_shows_an_example(tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(GOOD)
    with pytest.raises(ConfigError) as e:
        load_catalog(path).per_gpu_hour("B200", "spot")
    msg = str(e.value)
    assert "no price for GPU type 'B200'" in msg and str(path) in msg and "A100-80GB, fake" in msg
    assert '[gpus."B200"]\nowned = ' in msg


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[gpus.fake\nowned = 1", "is not valid TOML"),
        ("title = 'x'\n[gpus.fake]\nowned = 1\non_demand = 1\nspot = 1", "unknown top-level key 'title'"),
        ("", 'has no [gpus."<type>"] tables'),
        ("[gpus]\nfake = 3", 'price catalog {path}, [gpus."fake"] must be a table of prices'),
        ("[gpus.fake]\nowned = 1\nspot = 1", "[gpus.\"fake\"]: missing key 'on_demand' (USD per GPU-hour)"),
        ("[gpus.fake]\nowned = 1\non_demand = 2\nspot = 1\nreserved = 1", "unknown key 'reserved'"),
        ("[gpus.fake]\nowned = -1\non_demand = 2\nspot = 1", "owned = -1 is not a price"),
        ("[gpus.fake]\nowned = '1'\non_demand = 2\nspot = 1", "owned = '1' is not a price"),
        ("[gpus.fake]\nowned = true\non_demand = 2\nspot = 1", "owned = True is not a price"),
        ("[gpus.fake]\nowned = nan\non_demand = 2\nspot = 1", "owned = nan is not a price"),
    ],
)
def test_malformed_catalog_errors(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_catalog(path)
    msg = str(e.value)
    assert expected.format(path=path) in msg
    assert str(path) in msg
    assert "on_demand = " in msg  # a valid example to copy


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_catalog(tmp_path / "nope.toml")
