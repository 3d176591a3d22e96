"""What every reader shares: limits on what it parses, paths kept inside the source, image
headers, and the checks every box goes through.

Trust: an annotation file is untrusted. A reader never raises for one bad item (a box, a line,
an image): it records an `Issue` and goes on. It raises `DataError` only when the whole file is
unusable (not JSON, the wrong top-level type, no classes, over its size limit).

Limits. Each file is read only up to its format's cap (`MAX_*_BYTES`) and refused past it. A
JSON file is parsed whole, in memory: the 512 MiB cap allows COCO's largest public sets (about
450 MiB), and parsing one that large needs several GiB of memory.

Paths. An image path given by an annotation file must resolve inside the source root: an
absolute path, or one whose `..` leads out, is `path_outside_source`; a symbolic link that
resolves outside is `link_outside_source` (as in classification ingest). Backslashes are
read as folder separators (annotations made on Windows).

Images. Only the header is read (Pillow's open, no decode), through the decoders ingest accepts
(`DECODABLE_FORMATS`), for the raw size and the EXIF orientation. A PNG may put its eXIf chunk
after the pixel data; its chunk list is walked (seeks, no decompression) to find it.
"""

from __future__ import annotations

import json
import math
import os
import re
import reprlib
import struct
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from PIL import ExifTags, Image

from visionloop.core.errors import DataError
from visionloop.core.fsutil import NotRegularFileError, TooLargeError
from visionloop.core.fsutil import read_capped as read_file_capped
from visionloop.data.imageio import DECODABLE_FORMATS
from visionloop.data.manifest import SplitName
from visionloop.tasks.detection.annotations import orient
from visionloop.tasks.detection.annotations.model import Box, DetectionSample, Issue, IssueReason

SPLIT_NAMES: tuple[SplitName, ...] = ("train", "val", "test")

MAX_JSON_BYTES = 512 * 1024 * 1024
MAX_YAML_BYTES = 1024 * 1024
MAX_XML_BYTES = 8 * 1024 * 1024
MAX_TXT_BYTES = 16 * 1024 * 1024
MAX_CLASSES = 100_000
MAX_ID_CHARS = 200  # ids and names quoted in messages are cut to this
MAX_CLASS_NAME_CHARS = 256  # a class name (`class_name_problem`)

# Clipping by at most this many pixels is float noise (YOLO's 6 decimals, percent values):
# the box is clipped without an issue. A side shorter than this is zero.
EPS_PX = 0.01
# Duplicate boxes: same class and corners equal when rounded to 1/DUP_GRID pixel.
DUP_GRID = 100

Frame = Literal["raw", "upright"]

_SPLIT_ALIASES: dict[str, SplitName] = {
    "train": "train",
    "training": "train",
    "val": "val",
    "valid": "val",
    "validation": "val",
    "test": "test",
    "testing": "test",
}


def split_from_name(name: str) -> SplitName | None:
    """`train2017` → train, `instances_val` → val, `valid` → val; None when no split is named."""
    for word in re.split(r"[^a-z]+", name.lower()):
        if word in _SPLIT_ALIASES:
            return _SPLIT_ALIASES[word]
    return None


# Containers are shown through reprlib: a few items, a few levels, never the whole of a value
# an annotation file may make as large as its size limit allows.
_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8
_REPR.maxstring = _REPR.maxother = MAX_ID_CHARS


def short(value: object) -> str:
    text = repr(value) if isinstance(value, str | int | float | None) else _REPR.repr(value)
    return text if len(text) <= MAX_ID_CHARS else text[:MAX_ID_CHARS] + "..."


# ---------------------------------------------------------------------------------------------
# Files


class AnnotationFileError(Exception):
    """One annotation file cannot be used; the caller decides: an Issue or a DataError."""


def read_capped(path: Path, cap: int, what: str) -> bytes:
    """The bytes of `path`, refused (AnnotationFileError) past `cap` bytes or when unreadable."""
    try:
        # A regular file only: a FIFO named like an annotation file must not hang us.
        return read_file_capped(path, cap, what=what)
    except NotRegularFileError as e:
        raise AnnotationFileError(f"{path} {e.strerror}") from e
    except FileNotFoundError as e:
        raise AnnotationFileError(f"{path} does not exist") from e
    except IsADirectoryError as e:
        raise AnnotationFileError(f"{path} is a folder, not {what}") from e
    except OSError as e:
        raise AnnotationFileError(f"{path} cannot be read ({e.strerror or e}); check its permissions") from e
    except TooLargeError as e:
        raise AnnotationFileError(
            f"{path} is larger than the {cap // (1024 * 1024)} MiB limit for {what}; "
            "split it into smaller files"
        ) from e


def decode_text(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise AnnotationFileError(f"{path} is not UTF-8 text ({e}); save it as UTF-8") from e


def load_json(path: Path, what: str) -> object:
    """Parse a whole JSON annotation file; DataError when it cannot be used at all."""
    try:
        text = decode_text(read_capped(path, MAX_JSON_BYTES, what), path)
    except AnnotationFileError as e:
        raise DataError(f"{e}.") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
            f"re-export it as {what} or fix it (a truncated copy ends like this)."
        ) from e
    except (RecursionError, ValueError) as e:  # absurd nesting, 5000-digit numbers
        raise DataError(f"{path} cannot be parsed as JSON ({type(e).__name__}: {e}); re-export it.") from e


def number(value: object) -> float | None:
    """A JSON/XML/text number as float (NaN and inf kept, for the box checks); None if not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:
            return math.inf
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


# ---------------------------------------------------------------------------------------------
# Paths inside the source


def _encodable(name: str) -> bool:
    """Whether `name` can be a file name here. JSON's `\\ud800` is a lone surrogate no file
    system encoding takes: realpath and stat raise UnicodeEncodeError on it, which would end
    the whole read for one image's bad path."""
    try:
        os.fsencode(name)
    except UnicodeError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: IssueReason
    message: str


class SourceRoot:
    """Resolves the image paths an annotation file gives, keeping them inside `root`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.realpath(root))
        self._prefix = str(self.root).rstrip(os.sep) + os.sep

    def inside(self, path: str) -> bool:
        return path == str(self.root) or path.startswith(self._prefix)

    def rel(self, path: Path) -> str:
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError:
            return path.as_posix()

    def resolve(self, given: str, base: Path | None = None) -> Path | Refusal:
        """The file `given` names, relative to `base` (a folder inside the root; default the
        root), or why it is refused. Does not check that it exists (see `existing`)."""
        name = given.replace("\\", "/").strip()
        if not name or "\x00" in name or not _encodable(name):
            return Refusal(IssueReason.MALFORMED_ANNOTATION, f"image path {short(given)} is empty or invalid")
        if name.startswith("/") or re.match(r"^[A-Za-z]:/", name) or "://" in name:
            return Refusal(
                IssueReason.PATH_OUTSIDE_SOURCE,
                f"image path {short(given)} is absolute; give paths relative to {self.root}",
            )
        joined = os.path.normpath(Path(base or self.root) / name)
        if not self.inside(joined):
            return Refusal(
                IssueReason.PATH_OUTSIDE_SOURCE,
                f"image path {short(given)} leads outside the source folder {self.root}; not read",
            )
        return Path(joined)

    def existing(self, path: Path, given: str) -> Path | Refusal:
        """`path` (lexically inside the root) if it is a file whose real path is inside too."""
        real = os.path.realpath(path)
        if not self.inside(real):
            return Refusal(
                IssueReason.LINK_OUTSIDE_SOURCE,
                f"image {short(given)} is a symbolic link (or under one) to a file outside the source "
                f"folder {self.root}; not followed",
            )
        if not Path(real).is_file():
            if os.path.lexists(real):  # a FIFO, folder or device: say so, not "does not exist"
                return Refusal(
                    IssueReason.UNREADABLE_IMAGE,
                    f"image {short(given)} is not a regular file (a folder, FIFO or device); "
                    "replace it with the image file",
                )
            return Refusal(
                IssueReason.MISSING_IMAGE,
                f"image {short(given)} does not exist under {self.root}; add it or remove its annotations",
            )
        return path

    def linked_outside(self, path: Path, what: str) -> Refusal | None:
        """A refusal when the annotation file `path` (found in, or named by, the source) is a
        symbolic link, or under one, to a file outside the root. Such a file is not read: its
        lines would be quoted into rejected.jsonl (a list linked to /etc/passwd) or its
        names taken as classes, from a file the source does not hold."""
        if self.inside(os.path.realpath(path)):
            return None
        return Refusal(
            IssueReason.LINK_OUTSIDE_SOURCE,
            f"{what} {self.rel(path)} is a symbolic link (or under one) to a file outside the source "
            f"folder {self.root}; not read, copy the file into the source instead",
        )

    def image(self, given: str, base: Path | None = None) -> Path | Refusal:
        path = self.resolve(given, base)
        return path if isinstance(path, Refusal) else self.existing(path, given)


# ---------------------------------------------------------------------------------------------
# Image headers


@dataclass(frozen=True, slots=True)
class Header:
    raw_width: int
    raw_height: int
    orientation: int  # 1..8

    @property
    def size(self) -> tuple[int, int]:
        """Of the upright image."""
        return orient.upright_size(self.raw_width, self.raw_height, self.orientation)


def _png_exif_orientation(path: Path) -> int:
    """The orientation in a PNG's eXIf chunk placed anywhere (after IDAT too), reading only
    chunk headers and that chunk."""
    try:
        with open(path, "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                return 1
            for _ in range(100_000):
                head = f.read(8)
                if len(head) < 8:
                    return 1
                length, kind = struct.unpack(">I4s", head)
                if kind == b"eXIf":
                    exif = Image.Exif()
                    exif.load(f.read(min(length, 1 << 20)))
                    return orient.normal(exif.get(ExifTags.Base.Orientation, 1))
                if kind == b"IEND":
                    return 1
                f.seek(length + 4, os.SEEK_CUR)
    except Exception:  # a malformed chunk list or EXIF block says nothing reliable
        return 1
    return 1


def read_header(path: Path) -> Header | str:
    """Raw size and orientation from the file's header, or a message saying why not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(path, formats=DECODABLE_FORMATS) as im:
                width, height = im.size
                if im.format == "PNG" and "exif" not in im.info:
                    orientation = _png_exif_orientation(path)
                else:
                    try:
                        orientation = orient.normal(im.getexif().get(ExifTags.Base.Orientation, 1))
                    except Exception:
                        orientation = 1
    except Exception as e:  # not an image, truncated header, decompression bomb, unreadable
        return f"{type(e).__name__}: {e}"
    if width < 1 or height < 1:
        return f"declares a size of {width}x{height}"
    return Header(width, height, orientation)


def choose_frame(header: Header, declared: tuple[int, int] | None, default: Frame) -> Frame | None:
    """Which frame an annotation's boxes are in, from the image size the annotation declares:
    the raw pixel array's or the upright image's. A declared size telling them apart (an
    orientation that swaps the axes, a non-square image) decides; otherwise `default`. None
    when the declared size is neither (the boxes were drawn on some other image)."""
    if declared is None:
        return default
    raw = (header.raw_width, header.raw_height)
    up = header.size
    if declared == raw and declared == up:
        return default
    if declared == raw:
        return "raw"
    if declared == up:
        return "upright"
    return None


# ---------------------------------------------------------------------------------------------
# Boxes


@dataclass(slots=True)
class Where:
    """Where an annotation comes from, for messages and issues."""

    file: str
    image: str | None = None
    line: int | None = None
    annotation: str | None = None

    def __str__(self) -> str:
        text = self.file
        if self.line is not None:
            text += f":{self.line}"
        if self.annotation is not None:
            text += f" annotation {self.annotation}"
        if self.image is not None:
            text += f" (image {self.image})"
        return text


class Issues:
    """The list a reader fills, with helpers that build the message."""

    def __init__(self) -> None:
        self.items: list[Issue] = []

    def add(self, reason: IssueReason, where: Where, problem: str, *, kept: bool = False) -> None:
        self.items.append(
            Issue(reason, f"{where}: {problem}", where.file, where.line, where.annotation, where.image, kept)
        )


class ImageBoxes:
    """Collects the boxes of one image: checks each against the image, moves it onto the
    upright image, drops duplicates, and records an issue for every box repaired or left out."""

    def __init__(self, header: Header, frame: Frame, issues: Issues) -> None:
        self.header = header
        self.frame = frame
        self.issues = issues
        self.width, self.height = header.size if frame == "upright" else (header.raw_width, header.raw_height)
        self.boxes: list[Box] = []
        self.labels: list[int] = []
        self.difficult: list[bool] = []
        self._seen: set[tuple[int, int, int, int, int]] = set()

    def add(self, box: Box, label: int, where: Where, *, difficult: bool = False) -> None:
        """`box` in absolute pixels of this image's frame, corners (x1, y1, x2, y2)."""
        x1, y1, x2, y2 = box
        w, h = self.width, self.height
        shown = f"box ({x1:g}, {y1:g}, {x2:g}, {y2:g}) on a {w}x{h} image"
        if not all(math.isfinite(v) for v in box):
            self.issues.add(IssueReason.BOX_NOT_FINITE, where, f"{shown} has a NaN or infinite coordinate")
            return
        if x2 < x1 or y2 < y1:
            self.issues.add(
                IssueReason.BOX_INVERTED, where, f"{shown} has its right/bottom edge before its left/top edge"
            )
            return
        if x2 - x1 < EPS_PX or y2 - y1 < EPS_PX:
            self.issues.add(IssueReason.BOX_ZERO_AREA, where, f"{shown} has no area")
            return
        if x2 <= 0 or y2 <= 0 or x1 >= w or y1 >= h:
            self.issues.add(IssueReason.BOX_OUTSIDE_IMAGE, where, f"{shown} lies entirely outside the image")
            return
        clipped = (max(0.0, x1), max(0.0, y1), min(float(w), x2), min(float(h), y2))
        overshoot = max(-x1, -y1, x2 - w, y2 - h)
        if clipped[2] - clipped[0] < EPS_PX or clipped[3] - clipped[1] < EPS_PX:
            self.issues.add(IssueReason.BOX_ZERO_AREA, where, f"{shown} has no area left inside the image")
            return
        if overshoot > EPS_PX:
            self.issues.add(
                IssueReason.BOX_CLIPPED,
                where,
                f"{shown} reaches {overshoot:.3g} px outside the image; clipped to its edges",
                kept=True,
            )
        if self.frame == "raw":
            clipped = orient.to_upright(clipped, self.header.orientation, w, h)
        key = (label, *(round(v * DUP_GRID) for v in clipped))
        if key in self._seen:
            self.issues.add(IssueReason.DUPLICATE_BOX, where, f"{shown} repeats a box of the same class")
            return
        self._seen.add(key)  # type: ignore[arg-type]
        self.boxes.append(clipped)
        self.labels.append(label)
        self.difficult.append(difficult)

    def sample(self, image: Path, rel: str, split: SplitName | None) -> DetectionSample:
        width, height = self.header.size
        return DetectionSample(image, rel, width, height, self.boxes, self.labels, self.difficult, split)


def class_name_problem(name: str) -> str | None:
    """Why `name` cannot be a class name (None: it can). A class name goes into the manifest,
    the model card, every served answer and the CLI's tables: a lone surrogate (JSON's
    `\\ud800`) cannot be written as UTF-8 and failed ingest only at its very end, control
    characters (ESC, newline) rewrite the terminal that prints it, and the file's size limit
    is no limit on one name."""
    if len(name) > MAX_CLASS_NAME_CHARS:
        return f"is longer than {MAX_CLASS_NAME_CHARS} characters"
    if any(unicodedata.category(c) in ("Cc", "Cs") for c in name):
        return "has control characters or unpaired surrogates"
    return None


def check_classes(classes: list[str], path: Path) -> list[str]:
    if not classes:
        raise DataError(f"{path} names no classes; a detection source needs at least one class.")
    if len(classes) > MAX_CLASSES:
        raise DataError(f"{path} names {len(classes):,} classes, over the limit of {MAX_CLASSES:,}.")
    for name in classes:  # the readers leave such names out item by item; this is the backstop
        problem = class_name_problem(name)
        if problem is not None:
            raise DataError(f"{path}: the class name {short(name)} {problem}; rename the class.")
    seen: set[str] = set()
    for name in classes:
        if name in seen:
            raise DataError(f"{path} names the class {short(name)} twice; give each class one name.")
        seen.add(name)
    return classes


class Images:
    """Finds the images an annotation file names, inside the root, and reads their headers;
    records an issue for each one it cannot use."""

    def __init__(self, root: SourceRoot, issues: Issues) -> None:
        self.root = root
        self.issues = issues

    def open(
        self, given: str, where: Where, base: Path | None = None, dropped: int = 0
    ) -> tuple[Path, str, Header] | None:
        """(path, path relative to the root, header), or None with an issue recorded. `dropped`
        is how many annotations go with the image, for the message."""
        found = self.root.image(given, base)
        lost = f"; its {dropped} annotation(s) are left out" if dropped else ""
        if isinstance(found, Refusal):
            self.issues.add(found.reason, where, found.message + lost)
            return None
        rel = self.root.rel(found)
        where.image = rel
        header = read_header(found)
        if isinstance(header, str):
            self.issues.add(
                IssueReason.UNREADABLE_IMAGE,
                where,
                f"image {rel} cannot be opened as an image ({header}){lost}; replace it or remove it",
            )
            return None
        return found, rel, header


def vote_frame(
    sized: list[tuple[Header, tuple[int, int] | None]], default: Frame
) -> tuple[Frame, str | None]:
    """The frame for images whose declared size cannot tell: what the images whose size can
    tell (axes swapped by their orientation, not square) say by majority, else `default`.
    Also a warning when they disagree."""
    votes: dict[Frame, int] = {"raw": 0, "upright": 0}
    for header, declared in sized:
        if (
            declared is not None
            and header.orientation in orient.SWAPS_AXES
            and header.raw_width != header.raw_height
        ):
            vote = choose_frame(header, declared, default)
            if vote is not None:
                votes[vote] += 1
    frame: Frame = default
    if votes["upright"] > votes["raw"]:
        frame = "upright"
    elif votes["raw"] > votes["upright"]:
        frame = "raw"
    warning = None
    if votes["upright"] and votes["raw"]:
        warning = (
            f"{votes['raw']} rotated image(s) declare their stored size and {votes['upright']} their upright "
            f"size; each is read in the frame its size says, the others as {frame}"
        )
    return frame, warning


def walk_images(folder: Path, root: SourceRoot, issues: Issues, file: str) -> list[Path]:
    """Image files under `folder` (sorted; hidden entries skipped), not entering a folder
    whose real path is outside the root (an issue) and entering each real folder once."""
    from visionloop.data.imageio import is_image_name

    found: list[Path] = []
    seen: set[str] = set()
    stack = [folder]
    while stack:
        current = stack.pop()
        real = os.path.realpath(current)
        if not root.inside(real):
            rel = root.rel(current)
            issues.add(
                IssueReason.LINK_OUTSIDE_SOURCE,
                Where(file, rel),
                f"folder {rel} is a symbolic link to a folder outside the source {root.root}; not followed",
            )
            continue
        if real in seen:
            continue
        seen.add(real)
        try:
            entries = sorted(os.scandir(current), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                is_dir = entry.is_dir()
            except OSError:
                continue
            if is_dir:
                stack.append(Path(entry.path))
            elif is_image_name(entry.name):
                found.append(Path(entry.path))
    return sorted(found)
