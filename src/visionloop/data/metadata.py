"""Per-image metadata: what a source says about an image beyond its file and its label (a
CSV's extra columns; a task's source may give its own, such as COCO's image fields), kept so
that an evaluation can report its metric per value (`visionloop eval --slices camera`).

**Untrusted, so bounded.** At most `MAX_METADATA_COLUMNS` (32) columns, each named by a simple
name (`METADATA_NAME`: letters, digits, `_ . -`, up to 64 characters); values are scalars only:
a string of at most `MAX_VALUE_CHARS` (256) characters without control or format characters,
an integer within ±2**53 (what every JSON reader keeps exactly), a finite float or a boolean.
`MetadataCleaner` applies the rules item by item and drops (never raises for) what breaks
them, counting it for a warning; an empty string or null is no value (a missing one). A CSV's
header is checked up front instead (`check_column_names`): its author can fix it.

**Storage.** `DIR/metadata/<split>.jsonl`, one line per record of the split's shards, in the
shards' order: line k describes `ShardReader` position k. Each line is the canonical JSON
object of the image's values (`canonical_line`: keys in the manifest's `metadata_columns`
order, only those with a value, compact separators, UTF-8), `{}` for an image with none. The
files are written into the dataset's building folder while the shards are, and reach `DIR`
with it (fsynced, then renamed into place whole: `publish`). The manifest lists the columns
(`metadata_columns`); a dataset without metadata has neither the folder nor the field, so its
manifest, its files and its version are exactly what they were before metadata existed.

**Version.** With metadata, the dataset's version also covers it (`metadata_version`): the
version the images and labels give, the columns, and the sorted (split, image sha256, sha256 of
its line) of every image. Changing one value gives a new version; file names still do not
enter it.

**Reading** (`read_metadata`, `load_metadata`) accepts only what ingest writes: the file of a
listed split inside the dataset folder, as many lines as the split has records, each line the
canonical JSON of an object of listed columns and valid values; anything else is a
`DataError` that says to re-ingest. Nothing else is parsed (no pickle, no YAML).
"""

from __future__ import annotations

import hashlib
import json
import math
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, cast

from visionloop.core.errors import DataError
from visionloop.core.fsutil import open_regular
from visionloop.data.manifest import (
    MAX_METADATA_COLUMNS,
    METADATA_DIR,
    METADATA_NAME,
    METADATA_NAME_RULE,
    SPLITS,
    DatasetManifest,
    read_manifest,
)

Scalar = str | int | float | bool
Metadata = dict[str, Scalar]

MAX_VALUE_CHARS = 256
MAX_INT = 2**53
# The longest canonical line: 32 columns of a 64-character name and a 256-character value,
# 4 bytes a character at most in UTF-8, with quotes and separators; a longer line is not ours.
MAX_LINE_BYTES = 64 * 1024
MISSING_LABEL = "(missing)"  # how reports show the slice of images without a value


def _shown(name: object, limit: int = 40) -> str:
    text = repr(name)
    return text if len(text) <= limit else text[:limit] + "..."


def name_problem(name: object) -> str | None:
    """Why `name` cannot be a metadata column (None: it can)."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a name"
    if not METADATA_NAME.fullmatch(name):
        return f"is not a simple name ({METADATA_NAME_RULE})"
    return None


def value_problem(value: object) -> str | None:
    """Why `value` cannot be a metadata value (None: it can). Check `is_missing` first."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if -MAX_INT < value < MAX_INT else "integers beyond ±2**53"
    if isinstance(value, float):
        return None if math.isfinite(value) else "NaN or infinite numbers"
    if isinstance(value, str):
        if len(value) > MAX_VALUE_CHARS:
            return f"values longer than {MAX_VALUE_CHARS} characters"
        if any(unicodedata.category(c) in ("Cc", "Cf", "Cs") for c in value):
            return "values with control characters"
        return None
    kind = "a list" if isinstance(value, list) else "an object" if isinstance(value, dict) else "a null"
    if value is not None and not isinstance(value, list | dict):
        kind = f"a {type(value).__name__}"
    return f"values that are not a string, number or boolean ({kind})"


def is_missing(value: object) -> bool:
    """No value: null or an empty string (a CSV's empty cell)."""
    return value is None or value == ""


def canonical_line(metadata: Mapping[str, Scalar]) -> str:
    """One image's line of `metadata/<split>.jsonl` (without the newline); the caller orders
    the keys as the manifest's columns."""
    return json.dumps(dict(metadata), ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def column_problems(names: Sequence[str]) -> list[str]:
    """What keeps `names` from all being columns: not simple names, repeated, over 32."""
    problems = []
    if len(names) > MAX_METADATA_COLUMNS:
        problems.append(
            f"{len(names)} metadata columns, over the {MAX_METADATA_COLUMNS} a dataset keeps; "
            "drop the ones you will not slice by"
        )
    for name in names:
        why = name_problem(name)
        if why is not None:
            problems.append(f"metadata column {_shown(name)} {why}")
    repeated = sorted(n for n, k in Counter(names).items() if k > 1)
    if repeated:
        problems.append(f"metadata column {_shown(repeated[0])} is named twice")
    return problems


def check_column_names(names: Sequence[str], where: str) -> None:
    """DataError unless `names` can all be columns."""
    problems = column_problems(names)
    if problems:
        raise DataError(f"{where}: " + "; ".join(problems[:5]) + ".")


class MetadataCleaner:
    """Bounds untrusted per-image fields, item by item. `columns` fixed: only those are read
    (a CSV's checked header); None: columns are admitted as first seen, up to 32. Whatever
    breaks a rule is left out and counted; `warnings()` says what and how many."""

    def __init__(self, columns: Sequence[str] | None = None) -> None:
        self.columns: list[str] = list(columns or [])
        self._admitted = set(self.columns)
        self._open = columns is None
        self._bad_names: dict[str, str] = {}  # name -> why (first few kept for the message)
        self._bad_name_count = 0
        self._over_cap: list[str] = []
        self._over_cap_count = 0
        self._refused: set[str] = set()
        self._dropped: Counter[tuple[str, str]] = Counter()  # (column, why) -> values

    def clean(self, fields: Mapping[str, object]) -> Metadata:
        """The item's valid values, keys in column order. An open cleaner admits a column with
        its first valid value: a field that never has one is no column."""
        kept: dict[str, Scalar] = {}
        for name, value in fields.items():
            if name in self._refused or (not self._open and name not in self._admitted):
                continue
            if self._open and name not in self._admitted and self._refuse_name(name):
                continue
            if is_missing(value):
                continue
            why = value_problem(value)
            if why is not None:
                self._dropped[(name, why)] += 1
                continue
            if name not in self._admitted and not self._admit(name):
                continue
            kept[name] = cast(Scalar, value)  # value_problem checked the type
        if len(kept) < 2:
            return kept
        return {c: kept[c] for c in self.columns if c in kept}

    def declare(self, names: Iterable[str]) -> None:
        """Admit `names` as columns in this order (as far as the rules allow), before any item:
        several sources merged keep the first one's columns first."""
        for name in names:
            if name not in self._admitted and name not in self._refused and not self._refuse_name(name):
                self._admit(name)

    def _refuse_name(self, name: object) -> bool:
        """True (and remembered) when `name` cannot be a column."""
        why = name_problem(name)
        if why is None:
            return False
        key = name if isinstance(name, str) else repr(name)
        self._refused.add(key)
        self._bad_name_count += 1
        if len(self._bad_names) < 5:
            self._bad_names[key] = why
        return True

    def _admit(self, name: str) -> bool:
        """Whether a good name seen with a value for the first time becomes a column (each
        name decided once): not when there are 32 already."""
        if not self._open:
            return False
        if len(self.columns) >= MAX_METADATA_COLUMNS:
            self._refused.add(name)
            self._over_cap_count += 1
            if len(self._over_cap) < 5:
                self._over_cap.append(name)
            return False
        self._admitted.add(name)
        self.columns.append(name)
        return True

    def warnings(self, what: str) -> list[str]:
        """What was left out, one line per kind; `what` names the source's fields."""
        out = []
        if self._bad_name_count:
            n = self._bad_name_count
            shown = ", ".join(f"{_shown(name)} ({why})" for name, why in self._bad_names.items())
            more = f" and {n - len(self._bad_names)} more" if n > len(self._bad_names) else ""
            out.append(f"{what}: {n} field name(s) left out of the metadata: {shown}{more}")
        if self._over_cap_count:
            n = self._over_cap_count
            shown = ", ".join(_shown(name) for name in self._over_cap)
            more = f" and {n - len(self._over_cap)} more" if n > len(self._over_cap) else ""
            out.append(
                f"{what}: metadata keeps at most {MAX_METADATA_COLUMNS} columns; {self._over_cap_count} "
                f"more field name(s) left out: {shown}{more}"
            )
        for (column, why), n in sorted(self._dropped.items()):
            out.append(
                f"{what}: {n} value(s) of metadata column {_shown(column)} left out ({why}); those "
                "images have no value for it"
            )
        return out


# ---------------------------------------------------------------------------------------------
# Writing


class MetadataWriter:
    """Writes `metadata/<split>.jsonl` under a dataset being built, one line per record, in the
    order the records are added to the split's shard writer. Use as a context manager."""

    def __init__(self, dataset_dir: Path, columns: Sequence[str]) -> None:
        check_column_names(list(columns), "metadata")
        if not columns:
            raise ValueError("a MetadataWriter needs at least one column")
        self.columns = list(columns)
        self.folder = Path(dataset_dir) / METADATA_DIR
        self._files: dict[str, IO[str]] = {}
        self._entries: list[tuple[str, str, str]] = []
        self.counts: Counter[str] = Counter()

    def __enter__(self) -> MetadataWriter:
        self.folder.mkdir(parents=True, exist_ok=True)
        for split in SPLITS:
            self._files[split] = open(self.folder / f"{split}.jsonl", "w", encoding="utf-8", newline="\n")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for f in self._files.values():
            f.close()

    def add(self, split: str, image_sha256: str, metadata: Mapping[str, Scalar]) -> None:
        """The next record of `split`: its values (already cleaned) and its image's hash."""
        unknown = [k for k in metadata if k not in self.columns]
        if unknown:
            raise ValueError(f"metadata column {unknown[0]!r} is not one of {self.columns}")
        line = canonical_line({c: metadata[c] for c in self.columns if c in metadata})
        self._files[split].write(line + "\n")
        self.counts[split] += 1
        self._entries.append((split, image_sha256, hashlib.sha256(line.encode("utf-8")).hexdigest()))

    def version(self, base: str) -> str:
        return metadata_version(base, self.columns, self._entries)


def metadata_version(base: str, columns: Sequence[str], entries: Iterable[tuple[str, str, str]]) -> str:
    """The version of a dataset with metadata: sha256 (hex) over the version its images and
    labels give (`base`), its columns and the sorted (split, image sha256, line sha256)."""
    h = hashlib.sha256()
    head = {"version": base, "metadata_columns": list(columns)}
    h.update(json.dumps(head, sort_keys=True, separators=(",", ":")).encode())
    for entry in sorted(entries):
        h.update(b"\n" + json.dumps(list(entry), separators=(",", ":")).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Reading


def metadata_path(dataset_dir: Path, split: str) -> Path:
    """`DIR/metadata/<split>.jsonl`, refused when it leads outside the dataset folder."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}.")
    path = Path(dataset_dir) / METADATA_DIR / f"{split}.jsonl"
    if not path.resolve().is_relative_to(Path(dataset_dir).resolve()):
        raise DataError(
            f"{path} leads outside the dataset folder {dataset_dir} (a symbolic link?); re-run "
            "`visionloop data ingest` to rebuild the dataset."
        )
    return path


def read_metadata(dataset_dir: Path, split: str) -> list[Metadata] | None:
    """Every record's metadata in `split`, in `ShardReader` position order; None when the
    dataset has no metadata. DataError for files that are not exactly what ingest writes."""
    return load_metadata(Path(dataset_dir), read_manifest(Path(dataset_dir)), split)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a key is given twice")
    return dict(pairs)


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a value ingest writes")


def _parse_line(raw: bytes, columns: Sequence[str]) -> Metadata:
    text = raw.decode("utf-8")
    obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant)
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    unknown = [k for k in obj if k not in columns]
    if unknown:
        raise ValueError(f"column {_shown(unknown[0])} is not in the manifest's metadata_columns")
    for key, value in obj.items():
        why = "no value is written as missing" if is_missing(value) else value_problem(value)
        if why is not None:
            raise ValueError(f"column {_shown(key)}: {why}")
    ordered = {c: obj[c] for c in columns if c in obj}
    if canonical_line(ordered) != text:
        raise ValueError("not written the way ingest writes it (canonical JSON, columns in order)")
    return ordered


def load_metadata(dataset_dir: Path, manifest: DatasetManifest, split: str) -> list[Metadata] | None:
    """As `read_metadata`, with the dataset's manifest already read."""
    columns = manifest.metadata_columns
    if columns is None:
        return None
    path = metadata_path(dataset_dir, split)
    info = manifest.splits.get(split)  # type: ignore[call-overload]
    count = 0 if info is None else int(info.count)
    fix = "re-run `visionloop data ingest` to rebuild the dataset"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(
            f"{path} is missing, but {dataset_dir}'s manifest lists metadata columns; {fix}."
        ) from None
    if size > count * MAX_LINE_BYTES:
        raise DataError(f"{path} is larger than {count} lines of metadata can be; {fix}.")
    rows: list[Metadata] = []
    try:
        f = open_regular(path)  # a dataset folder is handed in: a FIFO there must not hang training
    except OSError as e:
        raise DataError(f"{path} cannot be read ({e.strerror or e}); {fix}.") from None
    with f:
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            n = len(rows) + 1
            if len(rows) >= count:
                raise DataError(f"{path} has more lines than the {count} records of {split}; {fix}.")
            if not raw.endswith(b"\n"):
                raise DataError(f"{path}: line {n} is cut short or over {MAX_LINE_BYTES} bytes; {fix}.")
            try:
                rows.append(_parse_line(raw[:-1], columns))
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                raise DataError(f"{path}: line {n} is not metadata ingest wrote ({e}); {fix}.") from None
    if len(rows) != count:
        raise DataError(f"{path} has {len(rows)} lines for the {count} records of {split}; {fix}.")
    return rows


@dataclass(frozen=True)
class ColumnSummary:
    """One metadata column over a dataset: how many distinct values, how many images lack
    one, and the most common values (value, images)."""

    name: str
    distinct: int
    missing: int
    common: tuple[tuple[Scalar, int], ...]


def value_key(value: Scalar | None) -> str:
    """A key that tells values apart by type too (1, 1.0, true and "1" are four values)."""
    return "" if value is None else json.dumps(value, ensure_ascii=False)


def summarize_metadata(dataset_dir: Path, manifest: DatasetManifest, top: int = 3) -> list[ColumnSummary]:
    """Per column, over every split: distinct values, images without one, the `top` most common."""
    columns = manifest.metadata_columns or []
    counts: dict[str, Counter[str]] = {c: Counter() for c in columns}
    values: dict[str, Scalar] = {}
    missing: Counter[str] = Counter()
    for split in SPLITS:
        for row in load_metadata(dataset_dir, manifest, split) or []:
            for c in columns:
                if c in row:
                    key = value_key(row[c])
                    counts[c][key] += 1
                    values.setdefault(key, row[c])
                else:
                    missing[c] += 1
    return [
        ColumnSummary(
            c,
            len(counts[c]),
            missing[c],
            tuple((values[k], n) for k, n in sorted(counts[c].items(), key=lambda kv: (-kv[1], kv[0]))[:top]),
        )
        for c in columns
    ]
