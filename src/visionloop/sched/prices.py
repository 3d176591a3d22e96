"""The price catalog: what one GPU-hour costs, by GPU type and price class, read from a TOML
file the user can edit (the default ships as `visionloop/assets/prices.toml`, with its
sources and the meaning of the amortised "owned" rate in its comments).

The cost ledger and the scheduler simulator price GPU-time through `PriceCatalog`; a
malformed file fails at load, naming the file, the key and a valid example, rather than
producing a silently wrong bill later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from visionloop.core.catalogs import read_catalog
from visionloop.core.errors import ConfigError
from visionloop.core.safetoml import TomlError, load_toml
from visionloop.sched.config_values import is_finite, shown
from visionloop.sched.view import PriceClass

PRICE_CLASSES: tuple[PriceClass, ...] = ("owned", "on_demand", "spot")
DEFAULT_CATALOG = "visionloop/assets/prices.toml (shipped with visionloop)"

_EXAMPLE = '[gpus."A100-80GB"]\nowned = 0.95\non_demand = 3.43\nspot = 1.65'
# The dearest GPU-hour on any cloud is tens of dollars; past this a value is a typo (3430 for
# 3.43) or hostile, and 1e300 x a job's GPU-seconds overflows the bill to inf.
MAX_PER_GPU_HOUR = 10_000.0


@dataclass(frozen=True)
class PriceCatalog:
    """USD per GPU-hour: `prices[gpu_type][price_class]`."""

    prices: Mapping[str, Mapping[PriceClass, float]]
    source: str  # the file it came from, for error messages

    def per_gpu_hour(self, gpu_type: str, price_class: PriceClass) -> float:
        table = self.prices.get(gpu_type)
        if table is None:
            known = ", ".join(sorted(self.prices)) or "none"
            raise ConfigError(
                f"no price for GPU type {gpu_type!r} in {self.source} (it has: {known}). "
                f"Add a table for it, e.g.\n{_EXAMPLE.replace('A100-80GB', gpu_type)}"
            )
        if price_class not in table:
            raise ConfigError(f"unknown price class {price_class!r}; use one of {', '.join(PRICE_CLASSES)}.")
        return table[price_class]

    def per_gpu_second(self, gpu_type: str, price_class: PriceClass) -> float:
        return self.per_gpu_hour(gpu_type, price_class) / 3600.0

    @property
    def gpu_types(self) -> tuple[str, ...]:
        return tuple(sorted(self.prices))


def load_catalog(path: Path | None = None) -> PriceCatalog:
    """The catalog at `path`, or the default one shipped with visionloop when None."""
    text = read_catalog(
        path,
        asset="prices.toml",
        what="price catalog",
        example=_EXAMPLE,
        default_hint="leave the price catalog unset",
    )
    return parse_catalog(text, DEFAULT_CATALOG if path is None else str(path))


def _price(value: object) -> bool:
    # is_finite, not math.isfinite: that raises OverflowError on a 400-digit TOML integer.
    return is_finite(value) and 0 <= value <= MAX_PER_GPU_HOUR


def parse_catalog(text: str, source: str) -> PriceCatalog:
    try:
        doc = load_toml(text)
    except TomlError as e:
        raise ConfigError(
            f"price catalog {source} is not valid TOML ({e}); a valid entry:\n{_EXAMPLE}"
        ) from None
    gpus = doc.get("gpus")
    unknown = sorted(set(doc) - {"gpus"})
    if unknown:
        raise ConfigError(
            f"price catalog {source}: unknown top-level key {unknown[0]!r}; prices go in "
            f'[gpus."<type>"] tables, e.g.\n{_EXAMPLE}'
        )
    if not isinstance(gpus, dict) or not gpus:
        raise ConfigError(f'price catalog {source} has no [gpus."<type>"] tables; add one, e.g.\n{_EXAMPLE}')
    prices: dict[str, dict[PriceClass, float]] = {}
    for gpu_type, table in gpus.items():
        where = f'price catalog {source}, [gpus."{gpu_type}"]'
        example = _EXAMPLE.replace("A100-80GB", gpu_type)
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table of prices, e.g.\n{example}")
        extra = sorted(set(table) - set(PRICE_CLASSES))
        if extra:
            raise ConfigError(
                f"{where}: unknown key {extra[0]!r}; the keys are {', '.join(PRICE_CLASSES)}, e.g.\n{example}"
            )
        row: dict[PriceClass, float] = {}
        for cls in PRICE_CLASSES:
            if cls not in table:
                raise ConfigError(f"{where}: missing key {cls!r} (USD per GPU-hour), e.g.\n{example}")
            value = table[cls]
            if not _price(value):
                raise ConfigError(
                    f"{where}: {cls} = {shown(value)} is not a price; give USD per GPU-hour as a number "
                    f"from 0 to {MAX_PER_GPU_HOUR:g}, e.g.\n{example}"
                )
            row[cls] = float(value)
        prices[gpu_type] = row
    return PriceCatalog(prices, source)
