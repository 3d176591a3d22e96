"""The device catalog: what each GPU type can compute and hold, read from a TOML file the user
can edit (the default ships as `visionloop/assets/devices.toml`, with the datasheet each
figure comes from).

Devices are named as in the price catalog (`visionloop/assets/prices.toml`) so that a device
and its prices join by GPU type. A malformed file fails at load, naming the file, the key and
a valid example, as the price catalog does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeGuard

from visionloop.core.catalogs import read_catalog
from visionloop.core.errors import ConfigError
from visionloop.core.safetoml import TomlError, load_toml
from visionloop.sched.config_values import shown  # a 400-digit number is not echoed whole

DEFAULT_CATALOG = "visionloop/assets/devices.toml (shipped with visionloop)"
# Where `visionloop size` looks for a user's catalog when --catalog is not given.
HOME_CATALOG = "devices.toml"
# A starting assumption (see devices.toml): convnet training sustains about 20% of peak.
DEFAULT_SUSTAINED_FRACTION = 0.2
# No device comes near a billion TFLOPS, GiB or GB/s; past this a figure is a typo, and 1e300
# x 1e12 (TFLOPS to FLOPS) is inf, which then ranks the device first at zero seconds.
MAX_FIGURE = 1e9

ComputePrecision = Literal["fp32", "tf32", "bf16", "fp16", "int8"]
_PEAK_KEYS: dict[ComputePrecision, str] = {
    "fp32": "fp32_tflops",
    "tf32": "tf32_tflops",
    "bf16": "bf16_tflops",
    "fp16": "fp16_tflops",
    "int8": "int8_tops",
}
_REQUIRED = ("source", "fp32_tflops", "fp16_tflops", "memory_gib", "bandwidth_gbs")
_OPTIONAL = ("tf32_tflops", "bf16_tflops", "int8_tops", "sustained_fraction", "nvml_names")
_KEYS = _REQUIRED + _OPTIONAL

_EXAMPLE = (
    '[devices."A100-80GB"]\n'
    'source = "NVIDIA A100 datasheet, SXM"\n'
    "fp32_tflops = 19.5\ntf32_tflops = 156.0\nbf16_tflops = 312.0\nfp16_tflops = 312.0\n"
    "int8_tops = 624.0\nmemory_gib = 80.0\nbandwidth_gbs = 2039.0"
)


@dataclass(frozen=True)
class Device:
    """One device type. Throughputs are dense peaks in TFLOPS (TOPS for int8); a precision the
    device has no units for is None."""

    name: str
    source: str
    fp32_tflops: float
    fp16_tflops: float
    memory_gib: float
    bandwidth_gbs: float
    tf32_tflops: float | None = None
    bf16_tflops: float | None = None
    int8_tops: float | None = None
    sustained_fraction: float = DEFAULT_SUSTAINED_FRACTION
    nvml_names: tuple[str, ...] = field(default_factory=tuple)

    def peak_tflops(self, precision: ComputePrecision) -> float | None:
        value = getattr(self, _PEAK_KEYS[precision])
        return None if value is None else float(value)

    def matches_gpu_name(self, gpu_name: str) -> bool:
        """True when an NVML GPU name (e.g. "NVIDIA A100-SXM4-80GB") is this device."""
        name = gpu_name.lower()
        return any(n.lower() in name for n in self.nvml_names)


@dataclass(frozen=True)
class DeviceCatalog:
    devices: Mapping[str, Device]
    source: str  # the file it came from, for error messages

    def device(self, name: str) -> Device:
        found = self.devices.get(name)
        if found is None:
            known = ", ".join(sorted(self.devices)) or "none"
            raise ConfigError(
                f"no device {name!r} in {self.source} (it has: {known}). Add a table for it, e.g.\n"
                f"{_EXAMPLE.replace('A100-80GB', name)}"
            )
        return found

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.devices)


def load_devices(path: Path | None = None) -> DeviceCatalog:
    """The catalog at `path`, or the default one shipped with visionloop when None."""
    text = read_catalog(
        path,
        asset="devices.toml",
        what="device catalog",
        example=_EXAMPLE,
        default_hint="leave --catalog out",
    )
    return parse_devices(text, DEFAULT_CATALOG if path is None else str(path))


def _number(value: object) -> TypeGuard[int | float]:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # a TOML integer too large for a float: math.isfinite(10**400) raises
        return False


def parse_devices(text: str, source: str) -> DeviceCatalog:
    try:
        doc = load_toml(text)
    except TomlError as e:
        raise ConfigError(
            f"device catalog {source} is not valid TOML ({e}); a valid entry:\n{_EXAMPLE}"
        ) from None
    unknown = sorted(set(doc) - {"devices", "sustained_fraction"})
    if unknown:
        raise ConfigError(
            f"device catalog {source}: unknown top-level key {unknown[0]!r}; devices go in "
            f'[devices."<type>"] tables (and `sustained_fraction` may set the default), e.g.\n{_EXAMPLE}'
        )
    default_fraction = doc.get("sustained_fraction", DEFAULT_SUSTAINED_FRACTION)
    if not _number(default_fraction) or not 0 < default_fraction <= 1:
        raise ConfigError(
            f"device catalog {source}: sustained_fraction = {shown(default_fraction)} must be a number in "
            "(0, 1], the share of peak a training run sustains, e.g. sustained_fraction = 0.2"
        )
    tables = doc.get("devices")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(
            f'device catalog {source} has no [devices."<type>"] tables; add one, e.g.\n{_EXAMPLE}'
        )
    devices: dict[str, Device] = {}
    for name, table in tables.items():
        devices[name] = _parse_device(name, table, source, float(default_fraction))
    return DeviceCatalog(devices, source)


def _parse_device(name: str, table: object, source: str, default_fraction: float) -> Device:
    where = f'device catalog {source}, [devices."{name}"]'
    example = _EXAMPLE.replace("A100-80GB", name)
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table of figures, e.g.\n{example}")
    extra = sorted(set(table) - set(_KEYS))
    if extra:
        raise ConfigError(
            f"{where}: unknown key {extra[0]!r}; the keys are {', '.join(_KEYS)}, e.g.\n{example}"
        )
    for key in _REQUIRED:
        if key not in table:
            raise ConfigError(f"{where}: missing key {key!r}, e.g.\n{example}")
    if not isinstance(table["source"], str) or not table["source"].strip():
        raise ConfigError(
            f"{where}: source must say where the figures come from (a datasheet's name or URL), e.g. "
            'source = "NVIDIA A100 datasheet"'
        )
    figures: dict[str, float] = {}
    for key in (
        "fp32_tflops",
        "fp16_tflops",
        "memory_gib",
        "bandwidth_gbs",
        "tf32_tflops",
        "bf16_tflops",
        "int8_tops",
    ):
        if key not in table:
            continue
        value = table[key]
        if not _number(value) or not 0 < value <= MAX_FIGURE:
            raise ConfigError(
                f"{where}: {key} = {shown(value)} is not a figure; give a number > 0 and at most "
                f"{MAX_FIGURE:g} (leave an optional "
                f"precision out when the device has no units for it), e.g.\n{example}"
            )
        figures[key] = float(value)
    fraction = table.get("sustained_fraction", default_fraction)
    if not _number(fraction) or not 0 < fraction <= 1:
        raise ConfigError(
            f"{where}: sustained_fraction = {shown(fraction)} must be a number in (0, 1], "
            + "e.g. sustained_fraction = 0.2"
        )
    names = table.get("nvml_names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(
            f'{where}: nvml_names must be a list of GPU-name substrings, e.g. nvml_names = ["A100-SXM4-80GB"]'
        )
    return Device(
        name=name,
        source=table["source"].strip(),
        fp32_tflops=figures["fp32_tflops"],
        fp16_tflops=figures["fp16_tflops"],
        memory_gib=figures["memory_gib"],
        bandwidth_gbs=figures["bandwidth_gbs"],
        tf32_tflops=figures.get("tf32_tflops"),
        bf16_tflops=figures.get("bf16_tflops"),
        int8_tops=figures.get("int8_tops"),
        sustained_fraction=float(fraction),
        nvml_names=tuple(names),
    )
