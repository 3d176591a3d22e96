"""The device catalog: the shipped default (dense datasheet figures, joined to prices by GPU
type) and hostile files that fail at load naming the file, the key and a valid example."""

from __future__ import annotations

from pathlib import Path

import pytest

from visionloop.core.errors import ConfigError
from visionloop.sched.prices import load_catalog
from visionloop.size.catalog import DEFAULT_SUSTAINED_FRACTION, load_devices, parse_devices

GOOD = """
sustained_fraction = 0.3

[devices."A100-80GB"]
source = "NVIDIA A100 datasheet"
fp32_tflops = 19.5
tf32_tflops = 156.0
bf16_tflops = 312.0
fp16_tflops = 312.0
int8_tops = 624.0
memory_gib = 80.0
bandwidth_gbs = 2039.0
nvml_names = ["A100-SXM4-80GB"]

[devices.old]
source = "a Turing card"
fp32_tflops = 8.1
fp16_tflops = 65
memory_gib = 15
bandwidth_gbs = 300
sustained_fraction = 0.5
"""


def test_the_shipped_catalog_has_the_six_gpus_with_dense_figures() -> None:
    cat = load_devices(None)
    assert set(cat.names) == {"T4", "A10G", "L4", "A100-40GB", "A100-80GB", "H100-80GB"}
    a100, h100, t4 = cat.device("A100-80GB"), cat.device("H100-80GB"), cat.device("T4")
    # Dense, not the datasheets' "with sparsity" figures (which are twice these).
    assert (a100.peak_tflops("tf32"), a100.peak_tflops("bf16"), a100.peak_tflops("int8")) == (
        156.0,
        312.0,
        624.0,
    )
    assert (h100.peak_tflops("bf16"), h100.peak_tflops("fp32"), h100.memory_gib) == (989.5, 67.0, 79.6)
    assert t4.peak_tflops("bf16") is None and t4.peak_tflops("tf32") is None and t4.fp16_tflops == 65.0
    assert all(d.source and d.sustained_fraction == DEFAULT_SUSTAINED_FRACTION for d in cat.devices.values())
    assert a100.matches_gpu_name("NVIDIA A100-SXM4-80GB") and not a100.matches_gpu_name(
        "NVIDIA A100-SXM4-40GB"
    )
    # The GPU types that have a price join the price catalog by name.
    prices = load_catalog(None)
    assert {"T4", "L4", "A100-80GB", "H100-80GB"} <= set(cat.names) & set(prices.gpu_types)


def test_a_user_catalog(tmp_path: Path) -> None:
    path = tmp_path / "devices.toml"
    path.write_text(GOOD)
    cat = load_devices(path)
    assert cat.source == str(path) and cat.names == ("A100-80GB", "old")
    assert cat.device("A100-80GB").sustained_fraction == 0.3  # the file's default
    old = cat.device("old")
    assert (old.sustained_fraction, old.fp16_tflops, old.bf16_tflops, old.nvml_names) == (0.5, 65.0, None, ())
    with pytest.raises(ConfigError, match=r"no device 'B200' .*\(it has: A100-80GB, old\)"):
        cat.device("B200")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[devices.x\n", "is not valid TOML"),
        ("gpus = 1\n" + GOOD, "unknown top-level key 'gpus'"),
        ("sustained_fraction = 0.3\n", 'has no [devices."<type>"] tables'),
        ("devices = 3\n", 'has no [devices."<type>"] tables'),
        (GOOD.replace("int8_tops = 624.0", "int8_tops = 624.0\nfp8_tflops = 1"), "unknown key 'fp8_tflops'"),
        (GOOD.replace("memory_gib = 80.0\n", ""), "missing key 'memory_gib'"),
        (GOOD.replace("fp32_tflops = 19.5", "fp32_tflops = -19.5"), "fp32_tflops = -19.5 is not a figure"),
        (GOOD.replace("fp32_tflops = 19.5", "fp32_tflops = true"), "fp32_tflops = True is not a figure"),
        (GOOD.replace("fp32_tflops = 19.5", "fp32_tflops = inf"), "fp32_tflops = inf is not a figure"),
        (GOOD.replace("fp32_tflops = 19.5", 'fp32_tflops = "19.5"'), "fp32_tflops = '19.5' is not a figure"),
        (GOOD.replace('source = "NVIDIA A100 datasheet"', 'source = ""'), "source must say where"),
        (GOOD.replace("sustained_fraction = 0.5", "sustained_fraction = 1.5"), "sustained_fraction = 1.5"),
        (GOOD.replace("sustained_fraction = 0.3", "sustained_fraction = 0"), "sustained_fraction = 0 must"),
        (GOOD.replace('nvml_names = ["A100-SXM4-80GB"]', 'nvml_names = "A100"'), "nvml_names must be a list"),
    ],
)
def test_a_malformed_catalog_fails_at_load_naming_file_and_key(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "devices.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_devices(path)
    msg = str(e.value)
    assert says in msg and str(path) in msg
    assert "e.g." in msg or "a valid entry" in msg  # every message shows a valid value


def test_a_missing_catalog_file_says_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist; give the path of a TOML file such as\n\[devices"):
        load_devices(tmp_path / "nope.toml")


def test_a_table_that_is_not_a_table(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r'\[devices."x"\] must be a table'):
        parse_devices("[devices]\nx = 3\n", "inline")
