"""List a labelled-image source: which files, which class, and (when the source says) which split.

Two layouts are understood:

- an **ImageFolder**: one folder per class, optionally under top-level `train/`, `val/`,
  `test/` folders, in which case the split comes from the source;
- a **CSV** file with the header `path,label[,split]`, paths relative to the CSV's folder
  or absolute. Any other column is per-image **metadata** (camera, site, time_of_day, ...),
  bounded as `data.metadata` says: at most 32 columns with simple names (checked here, a
  `DataError` before any work), scalar values of at most 256 characters (a value that breaks
  a rule is left out with a warning; an empty cell is no value). Values stay strings, as
  written. A column named like `split` or `label` but misspelt (`splt`, `lable`) is refused,
  not taken for metadata.

**Symbolic links** that resolve outside the source folder (an ImageFolder's root, a CSV's
folder) are not followed, files and folders alike: they are listed in `SourceListing.links`
and ingest writes them to rejected.jsonl (reason `link_outside_source`), unless
`follow_links` is given. A source is often untrusted (an upload, a shared drive): a link must
not make ingest copy files from elsewhere on the machine into a dataset. Links that stay
inside are followed (a folder reached twice through links is walked once). In a CSV, this
applies to relative paths (`..` included); absolute paths are the CSV author's explicit choice.

Listing reads directory entries and the CSV only, never image bytes. Every problem with the
layout itself is a `DataError` that names the problem, the fix and an example layout; problems
with single files (unreadable, not an image) are left to ingest, which rejects them one by one.
"""

from __future__ import annotations

import csv
import difflib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

from visionloop.core.errors import DataError
from visionloop.core.fsutil import NotRegularFileError, open_regular
from visionloop.data.imageio import is_image_name
from visionloop.data.manifest import SPLITS, SplitName
from visionloop.data.metadata import Metadata, MetadataCleaner, column_problems

SourceKind = Literal["imagefolder", "csv"]

LAYOUT_EXAMPLE = """\
Expected one of:
  an ImageFolder, one folder per class:
    SOURCE/cat/001.jpg
    SOURCE/dog/002.png
  the same under split folders (the split then comes from the source):
    SOURCE/train/cat/001.jpg
    SOURCE/val/cat/101.jpg
  or a CSV file with the header `path,label[,split]` (other columns are per-image metadata):
    path,label,split,camera
    images/001.jpg,cat,train,north
    images/101.jpg,cat,val,south"""

CSV_EXAMPLE = """\
Example (paths relative to the CSV's folder, or absolute; the split column is optional; any
other column, such as camera, is per-image metadata):
  path,label,split,camera
  images/001.jpg,cat,train,north
  images/002.jpg,dog,val,south"""

_CSV_COLUMNS = ("path", "label", "split")
LINK_OUTSIDE = "link_outside_source"  # the reason in rejected.jsonl


@dataclass(frozen=True, slots=True)
class SkippedLink:
    """A symbolic link that leads outside the source, not followed."""

    rel: str  # as the source names it (posix, relative to its root or the CSV's folder)
    label: str  # the class it would have belonged to ("" when not known: a split folder)
    folder: bool  # a link to a folder (everything under it was left out)

    @property
    def message(self) -> str:
        what = "a folder" if self.folder else "a file"
        return (
            f"{self.rel} is a symbolic link to {what} outside the source folder; not followed "
            "(pass --follow-links to follow links that lead outside)"
        )


class _Links:
    """Which symbolic links a listing follows, and the ones it did not."""

    def __init__(self, root: Path, follow: bool) -> None:
        self.root = os.path.realpath(root)
        self.follow = follow
        self.skipped: list[SkippedLink] = []
        self.walked: set[str] = set()  # real paths of folders reached through links

    def inside(self, path: str) -> bool:
        real = os.path.realpath(path)
        return real == self.root or real.startswith(self.root.rstrip(os.sep) + os.sep)

    def allows(self, entry: os.DirEntry[str], rel: str, label: str) -> bool:
        """False (and recorded) for a link leading outside that is not to be followed."""
        if self.follow or not entry.is_symlink() or self.inside(entry.path):
            return True
        self.skipped.append(SkippedLink(rel, label, _is_dir(entry)))
        return False

    def first_visit(self, entry: os.DirEntry[str]) -> bool:
        """For a linked folder: whether it is reached for the first time (links can loop)."""
        if not entry.is_symlink():
            return True
        real = os.path.realpath(entry.path)
        if real in self.walked:
            return False
        self.walked.add(real)
        return True


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class Candidate:
    """One image file the source lists."""

    rel: str  # as the source names it: relative to its root (posix), or the CSV's absolute path
    path: str  # where to read it (a str: a million Path objects cost half a gigabyte)
    label: int  # index into SourceListing.classes
    split: SplitName | None  # given by the source, or None to let ingest split
    metadata: Metadata | None = None  # its values of SourceListing.metadata_columns (a CSV's)


# (rel path, class name, split given by the source, metadata values) of one listed image
_Entry = tuple[str, str, SplitName | None, Metadata | None]


@dataclass(frozen=True)
class SourceListing:
    kind: SourceKind
    root: Path  # the ImageFolder, or the CSV file
    classes: list[str]
    candidates: list[Candidate]  # sorted by `rel`: the order that defines each image's index
    skipped: int  # files without an image extension
    split_from_source: bool
    warnings: list[str] = field(default_factory=list)
    links: list[SkippedLink] = field(default_factory=list)  # not followed: they lead outside
    metadata_columns: list[str] = field(default_factory=list)  # a CSV's extra columns, in order

    @property
    def files_seen(self) -> int:
        return len(self.candidates) + self.skipped


def _hidden(name: str) -> bool:
    return name.startswith(".")


def list_source(source: Path, *, follow_links: bool = False) -> SourceListing:
    """List an ImageFolder or CSV source. Raises `DataError` for an unusable layout.
    Symbolic links leading outside the source are not followed unless `follow_links`."""
    source = Path(source).expanduser()
    if not source.exists():
        raise DataError(
            f"source {source} does not exist. Give an ImageFolder or a CSV file.\n{LAYOUT_EXAMPLE}"
        )
    source = source.resolve()
    if source.is_dir():
        return _list_imagefolder(source, _Links(source, follow_links))
    if source.suffix.lower() == ".csv":
        return _list_csv(source, _Links(source.parent, follow_links))
    raise DataError(
        f"source {source} is a file but not a .csv; give a folder of class folders or a CSV manifest.\n"
        f"{LAYOUT_EXAMPLE}"
    )


def _walk_images(folder: Path, root: Path, links: _Links, label: str) -> tuple[list[str], int]:
    """Relative paths (posix, from `root`) of the image files under `folder`, and how many
    other visible files were seen. Hidden files and folders are not descended into; links
    are followed as `links` allows."""
    images: list[str] = []
    skipped = 0
    links.walked.add(os.path.realpath(folder))  # a link back to it is a loop
    stack = [str(folder)]
    while stack:
        current = stack.pop()
        base = Path(current).relative_to(root).as_posix()
        try:
            entries = list(os.scandir(current))
        except OSError:  # as os.walk: an unreadable folder is passed over
            continue
        for entry in entries:
            if _hidden(entry.name):
                continue
            rel = f"{base}/{entry.name}"
            if not links.allows(entry, rel, label):
                continue
            if _is_dir(entry):
                if links.first_visit(entry):
                    stack.append(entry.path)
            elif is_image_name(entry.name):
                images.append(rel)
            else:
                skipped += 1
    return images, skipped


def _top_level(folder: Path, root: Path, links: _Links) -> tuple[list[str], list[str], int]:
    """(sub-folder names, image file names, count of other files) directly in `folder`."""
    dirs: list[str] = []
    images: list[str] = []
    others = 0
    base = "" if folder == root else f"{folder.relative_to(root).as_posix()}/"
    with os.scandir(folder) as entries:
        for entry in entries:
            if _hidden(entry.name):
                continue
            label = "" if not base and entry.name in SPLITS else entry.name
            if not links.allows(entry, f"{base}{entry.name}", label):
                continue
            if _is_dir(entry):
                links.first_visit(entry)
                dirs.append(entry.name)
            elif is_image_name(entry.name):
                images.append(entry.name)
            else:
                others += 1
    return sorted(dirs), sorted(images), others


def _no_loose_images(folder: Path, images: list[str], what: str) -> None:
    if images:
        shown = ", ".join(images[:3]) + (", ..." if len(images) > 3 else "")
        raise DataError(
            f"{folder} has {len(images)} image(s) directly inside it ({shown}), but {what} must hold only "
            f"class folders: move each image into a folder named after its class, e.g. "
            f"{folder}/cat/{images[0]}.\n{LAYOUT_EXAMPLE}"
        )


def _list_imagefolder(root: Path, links: _Links) -> SourceListing:
    dirs, images, skipped = _top_level(root, root, links)
    split_dirs = [d for d in dirs if d in SPLITS]
    if split_dirs and len(split_dirs) != len(dirs):
        classes = [d for d in dirs if d not in SPLITS]
        raise DataError(
            f"{root} mixes split folders ({', '.join(split_dirs)}) with class folders "
            f"({', '.join(classes[:5])}). Either put every class folder under train/ (and val/, test/), "
            f"or rename the class folders named like a split.\n{LAYOUT_EXAMPLE}"
        )
    _no_loose_images(root, images, "an ImageFolder's top level")

    # (split or None, folder holding that split's class folders)
    layers: list[tuple[SplitName | None, Path]] = (
        [(cast(SplitName, s), root / s) for s in split_dirs] if split_dirs else [(None, root)]
    )
    entries: list[_Entry] = []  # (rel path, class name, split, no metadata)
    class_dirs: set[str] = set()
    per_split: dict[SplitName | None, set[str]] = {}
    for split, folder in layers:
        names = dirs
        if split is not None:
            names, loose, others = _top_level(folder, root, links)
            _no_loose_images(folder, loose, f"the split folder {split}/")
            skipped += others
        class_dirs.update(names)
        for cls in names:
            rels, more = _walk_images(folder / cls, root, links, cls)
            skipped += more
            entries.extend((rel, cls, split, None) for rel in rels)
            if rels:
                per_split.setdefault(split, set()).add(cls)

    if not entries:
        raise DataError(
            f"found no image files in {root} ({skipped} other file(s) skipped{_links_note(links)}; "
            f"image extensions are .jpg .png .webp .bmp .gif .tif ...).\n{LAYOUT_EXAMPLE}"
        )
    classes = sorted({e[1] for e in entries})
    warnings: list[str] = []
    empty = sorted(class_dirs - set(classes))
    if empty:
        warnings.append(f"folder(s) with no images, not used as classes: {', '.join(empty[:10])}")
    for split, _ in layers:
        missing = sorted(set(classes) - per_split.get(split, set()))
        if split is not None and missing:
            warnings.append(f"{split}/ has no images of class(es): {', '.join(missing[:10])}")
    return _listing("imagefolder", root, classes, entries, skipped, bool(split_dirs), warnings, root, links)


def _csv_error(path: Path, problem: str) -> DataError:
    return DataError(f"{path}: {problem}\n{CSV_EXAMPLE}")


def _read_header(path: Path, header: list[str] | None) -> tuple[dict[str, int], dict[str, int]]:
    """(the known columns → their index, the metadata columns → their index)."""
    if header is None:
        raise _csv_error(
            path, "the file is empty; it needs the header line `path,label` or `path,label,split`."
        )
    given = [h.strip() for h in header]
    names = [h.lower() for h in given]
    extra = [h for h, name in zip(given, names, strict=True) if name not in _CSV_COLUMNS]
    missing = [c for c in ("path", "label") if c not in names]
    known = [name for name in names if name in _CSV_COLUMNS]
    # With path or label missing, the other columns are most likely them misnamed; a column
    # named nearly like a known one (splt, lable) is a typo, not metadata.
    unknown = extra if missing else [h for h in extra if _looks_like_known(h)]
    if missing or unknown or len(set(known)) != len(known):
        found = ",".join(given)
        details = []
        if missing:
            details.append(f"missing column(s) {', '.join(missing)}")
        if unknown:
            hints = "".join(
                f" (did you mean {_looks_like_known(u)}?)" for u in unknown[:1] if _looks_like_known(u)
            )
            details.append(f"unknown column(s) {', '.join(repr(u) for u in unknown)}{hints}")
        if len(set(known)) != len(known):
            details.append("a column is named twice")
        raise _csv_error(
            path,
            f"bad header `{found}`: {'; '.join(details)}. "
            "The header must be `path,label` or `path,label,split`, then any metadata columns.",
        )
    problems = column_problems(extra)
    if problems:
        raise _csv_error(path, f"bad header `{','.join(given)}`: {'; '.join(problems[:5])}.")
    columns = {name: i for i, name in enumerate(names) if name in _CSV_COLUMNS}
    return columns, {h: i for i, h in enumerate(given) if h.lower() not in _CSV_COLUMNS}


def _looks_like_known(name: str) -> str | None:
    """The known column `name` is a misspelling of, if any."""
    close = difflib.get_close_matches(name.lower(), _CSV_COLUMNS, n=1, cutoff=0.8)
    return close[0] if close else None


def _links_note(links: _Links) -> str:
    n = len(links.skipped)
    return f", {n} symbolic link(s) leading outside the source not followed (--follow-links)" if n else ""


def _list_csv(path: Path, links: _Links) -> SourceListing:
    base = path.parent
    folders: dict[str, bool] = {}  # a relative row's folder → whether it resolves inside
    entries: list[_Entry] = []
    skipped = 0
    cleaner: MetadataCleaner | None = None
    try:
        # utf-8-sig: spreadsheets put a byte-order mark in front of the header. A FIFO named
        # like a CSV is refused, not waited on.
        with io.TextIOWrapper(open_regular(path), encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f)
            columns, meta = _read_header(path, next(reader, None))
            width = len(columns) + len(meta)
            has_split = "split" in columns
            if meta:
                cleaner = MetadataCleaner(list(meta))
            for row in reader:
                line = reader.line_num
                if not any(cell.strip() for cell in row):
                    continue
                if len(row) != width:
                    raise _csv_error(
                        path, f"line {line} has {len(row)} field(s), but the header has {width}."
                    )
                rel = row[columns["path"]].strip()
                label = row[columns["label"]].strip()
                if not rel:
                    raise _csv_error(path, f"line {line} has an empty path; give the image's path.")
                if not label:
                    raise _csv_error(
                        path,
                        f"line {line} ({rel}) has an empty label; give every image a class or drop the row.",
                    )
                split: SplitName | None = None
                if has_split:
                    value = row[columns["split"]].strip().lower()
                    if value not in SPLITS:
                        raise _csv_error(
                            path,
                            f"line {line} ({rel}) has split {row[columns['split']]!r}; use one of "
                            f"{', '.join(SPLITS)}, or remove the split column to let visionloop split.",
                        )
                    split = cast(SplitName, value)
                if not is_image_name(rel):
                    skipped += 1
                    continue
                if (
                    not links.follow
                    and not Path(rel).is_absolute()
                    and not _csv_row_inside(base / rel, links, folders)
                ):
                    links.skipped.append(SkippedLink(Path(rel).as_posix(), label, False))
                    continue
                values = None
                if cleaner is not None:
                    values = cleaner.clean({name: row[i].strip() for name, i in meta.items()})
                entries.append((Path(rel).as_posix(), label, split, values))
    except UnicodeDecodeError as e:
        raise _csv_error(path, f"is not UTF-8 text ({e}); save it as UTF-8 CSV.") from e
    except NotRegularFileError as e:
        raise _csv_error(path, f"{e.strerror}.") from e
    except csv.Error as e:
        raise _csv_error(path, f"is not valid CSV ({e}).") from e
    if not entries:
        raise _csv_error(
            path,
            f"lists no image files ({skipped} row(s) without an image extension skipped"
            f"{_links_note(links)}).",
        )
    classes = sorted({e[1] for e in entries})
    warnings = cleaner.warnings(path.name) if cleaner is not None else []
    kept = cleaner.columns if cleaner is not None else []
    return _listing("csv", path, classes, entries, skipped, has_split, warnings, base, links, kept)


def _csv_row_inside(file: Path, links: _Links, folders: dict[str, bool]) -> bool:
    """Whether a relative CSV row resolves inside the CSV's folder: its folder (resolved once
    per folder, `..` and links included), then the file itself if it is a link."""
    folder = str(file.parent)
    inside = folders.get(folder)
    if inside is None:
        inside = folders[folder] = links.inside(folder)
    return inside and (not file.is_symlink() or links.inside(str(file)))


def _listing(
    kind: SourceKind,
    root: Path,
    classes: list[str],
    entries: list[_Entry],
    skipped: int,
    split_from_source: bool,
    warnings: list[str],
    base: Path,
    links: _Links,
    metadata_columns: list[str] | None = None,
) -> SourceListing:
    label_of = {name: i for i, name in enumerate(classes)}
    # Stable sort: a CSV naming one file twice keeps its rows in file order.
    entries.sort(key=lambda e: e[0])
    candidates = [
        Candidate(rel, str(base / rel), label_of[cls], split, meta) for rel, cls, split, meta in entries
    ]
    if links.skipped:
        warnings = [
            *warnings,
            f"{len(links.skipped)} symbolic link(s) leading outside the source were not followed "
            "(listed in rejected.jsonl; --follow-links follows them)",
        ]
    return SourceListing(
        kind,
        root,
        classes,
        candidates,
        skipped,
        split_from_source,
        warnings,
        sorted(links.skipped, key=lambda link: link.rel),
        list(metadata_columns or []),
    )
