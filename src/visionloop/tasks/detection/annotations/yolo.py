"""YOLO (Ultralytics layout), read with our own code: a `data.yaml`, `images/`, `labels/`.

`data.yaml` (read with `yaml.safe_load`, no aliases, at most 1 MiB): `names` as a list or as a dict
`{id: name}` (ids need not be contiguous); `nc` only checked; `path` honoured only when it names
a folder inside the one holding data.yaml (an absolute `path` is the machine the set was made
on: ignored, with a warning); `train`/`val`/`test` each a folder of images, a `.txt` listing
image paths (relative to the txt's folder), or a list of those, all inside the dataset root. A
`../x` entry that leads outside is tried as `x` (as Ultralytics does, for Roboflow exports).
Without any of the three keys, every image under `images/` is read, its split taken from the
folder below `images/` when named like one (`images/train/...`, `valid` meaning val).

Labels mirror images: `.../images/a/b.jpg` → `.../labels/a/b.txt` (the last `images` folder in
the path; with none, the txt next to the image). A missing label file means a background image,
as in Ultralytics. Each line is `class cx cy w h`, normalised to the *upright* image's size
(Ultralytics reads images with EXIF applied). A line of `class x1 y1 x2 y2 x3 y3 ...` (a
segment polygon, 3+ points, or an OBB's 4 corners) becomes the box enclosing its points, as
Ultralytics' segments2boxes does; with `kpt_shape` in data.yaml, pose lines give their box and
drop the keypoints. Any other column count, a non-number or a fractional class id is a
`malformed_annotation` issue naming the file and line. A label file whose image is missing is a
`missing_image` issue; `classes.txt` (LabelImg) is ignored.

Write (`write_yolo`): data.yaml with `names` as a list, images copied (hard-linked when possible)
to `images/<split>/` with flat names, labels with 6 decimals.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import yaml

from visionloop.core.errors import DataError
from visionloop.core.fsutil import atomic_write_text
from visionloop.core.safeyaml import load_untrusted
from visionloop.data.manifest import SPLITS, SplitName
from visionloop.tasks.detection.annotations.common import (
    MAX_TXT_BYTES,
    MAX_YAML_BYTES,
    AnnotationFileError,
    ImageBoxes,
    Images,
    Issues,
    Refusal,
    SourceRoot,
    Where,
    check_classes,
    decode_text,
    read_capped,
    short,
    split_from_name,
    walk_images,
)
from visionloop.tasks.detection.annotations.model import DetectionSample, DetectionSource, IssueReason

EXAMPLE = """\
Expected a YOLO data.yaml such as:
  path: .
  train: images/train
  val: images/val
  names: [cat, dog]        # or {0: cat, 1: dog}
with labels/train/001.txt next to images/train/001.jpg, one `class cx cy w h` line per box."""


def _load_yaml(path: Path) -> dict[object, object]:
    try:
        text = decode_text(read_capped(path, MAX_YAML_BYTES, "a YOLO data.yaml"), path)
    except AnnotationFileError as e:
        raise DataError(f"{e}.") from e
    try:
        doc = load_untrusted(text)
    except yaml.YAMLError as e:
        raise DataError(f"{path} is not valid YAML ({e}).\n{EXAMPLE}") from e
    except RecursionError as e:
        raise DataError(f"{path} nests too deeply to be a data.yaml.\n{EXAMPLE}") from e
    if not isinstance(doc, dict):
        raise DataError(f"{path} holds a YAML {type(doc).__name__}, not a mapping.\n{EXAMPLE}")
    return doc


def _names(doc: dict[object, object], path: Path) -> tuple[list[str], dict[int, int]]:
    """Class names and the map from the ids label files use to indices into them."""
    names = doc.get("names")
    nc = doc.get("nc")
    if names is None and isinstance(nc, int) and not isinstance(nc, bool) and 0 < nc <= 100_000:
        names = [f"class_{i}" for i in range(nc)]
    pairs: list[tuple[int, str]]
    if isinstance(names, list):
        pairs = list(enumerate(str(n) if isinstance(n, int | float | str) else "" for n in names))
    elif isinstance(names, dict):
        pairs = []
        for key, value in names.items():
            if isinstance(key, bool) or not isinstance(key, int) or key < 0:
                raise DataError(
                    f"{path}: `names` has the key {short(key)}; ids must be integers from 0.\n{EXAMPLE}"
                )
            pairs.append((key, str(value) if isinstance(value, int | float | str) else ""))
        pairs.sort()
    else:
        raise DataError(
            f"{path}: `names` is {'missing' if names is None else type(names).__name__}; "
            f"give a list.\n{EXAMPLE}"
        )
    for key, name in pairs:
        if not name.strip():
            raise DataError(f"{path}: class {key} has no usable name ({short(names)}).\n{EXAMPLE}")
    classes = check_classes([name.strip() for _, name in pairs], path)
    return classes, {key: i for i, (key, _) in enumerate(pairs)}


def _entries(value: object) -> list[str] | None:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _label_path(image: Path, root: SourceRoot) -> Path:
    parts = list(Path(root.rel(image)).parts)
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "images":
            parts[i] = "labels"
            break
    return (root.root.joinpath(*parts)).with_suffix(".txt")


def _parse_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


class _Reader:
    def __init__(self, data_yaml: Path) -> None:
        self.yaml_path = data_yaml
        self.doc = _load_yaml(data_yaml)
        self.classes, self.label_of = _names(self.doc, data_yaml)
        self.warnings: list[str] = []
        nc = self.doc.get("nc")
        if isinstance(nc, int) and nc != len(self.classes):
            self.warnings.append(
                f"data.yaml says nc: {nc} but names {len(self.classes)} classes; names is used"
            )
        self.root = self._root()
        self.issues = Issues()
        self.images = Images(self.root, self.issues)
        kpt = self.doc.get("kpt_shape")
        self.kpt_columns = None
        if isinstance(kpt, list) and len(kpt) == 2 and all(isinstance(k, int) and k > 0 for k in kpt):
            self.kpt_columns = 5 + kpt[0] * kpt[1]
        self.image_dirs: list[Path] = []

    def _root(self) -> SourceRoot:
        folder = SourceRoot(self.yaml_path.resolve().parent)
        given = self.doc.get("path")
        if given is None or given in ("", "."):
            return folder
        if isinstance(given, str):
            inside = folder.resolve(given)
            if isinstance(inside, Path) and inside.is_dir() and folder.inside(os.path.realpath(inside)):
                return SourceRoot(inside)
        self.warnings.append(
            f"data.yaml's path {short(given)} is not a folder inside {folder.root}; "
            "the folder holding data.yaml is used as the dataset root"
        )
        return folder

    def _listed(self, key: str, entry: str) -> list[Path]:
        """The images one train/val/test entry names."""
        where = Where(self.yaml_path.name, annotation=f"{key}: {short(entry)}")
        target = self.root.resolve(entry)
        if isinstance(target, Refusal) and entry.replace("\\", "/").startswith("../"):
            retried = self.root.resolve(entry.replace("\\", "/")[3:])
            if isinstance(retried, Path) and retried.exists():
                target = retried
        if isinstance(target, Refusal):
            self.issues.add(target.reason, where, target.message)
            return []
        if target.is_dir():
            self.image_dirs.append(target)
            return walk_images(target, self.root, self.issues, self.yaml_path.name)
        if target.suffix.lower() == ".txt" and target.is_file():
            return self._from_list(target)
        self.issues.add(
            IssueReason.MISSING_IMAGE,
            where,
            f"{self.root.rel(target)} is neither a folder of images nor a .txt list of them",
        )
        return []

    def _from_list(self, txt: Path) -> list[Path]:
        file = self.root.rel(txt)
        # `resolve` kept the name inside the root; a link must not lead out of it either.
        outside = self.root.linked_outside(txt, "image list")
        if outside is not None:
            self.issues.add(outside.reason, Where(file), outside.message)
            return []
        try:
            text = decode_text(read_capped(txt, MAX_TXT_BYTES, "an image list"), txt)
        except AnnotationFileError as e:
            self.issues.add(IssueReason.UNREADABLE_ANNOTATION_FILE, Where(file), str(e))
            return []
        paths: list[Path] = []
        for n, line in enumerate(text.splitlines(), start=1):
            name = line.strip()
            if not name:
                continue
            found = self.root.image(name, txt.parent)
            if isinstance(found, Refusal):
                self.issues.add(found.reason, Where(file, line=n), found.message)
                continue
            paths.append(found)
        return paths

    def read(self) -> DetectionSource:
        listed: list[tuple[Path, SplitName | None]] = []
        keys = [k for k in ("train", "val", "test") if self.doc.get(k) is not None]
        if keys:
            for key in keys:
                entries = _entries(self.doc.get(key))
                if entries is None:
                    raise DataError(
                        f"{self.yaml_path}: `{key}` must be a path or a list of paths.\n{EXAMPLE}"
                    )
                given: SplitName = "val" if key == "val" else "train" if key == "train" else "test"
                for entry in entries:
                    listed.extend((p, given) for p in self._listed(key, entry))
        else:
            images = self.root.root / "images"
            if not images.is_dir():
                raise DataError(
                    f"{self.yaml_path} names no train/val/test and {images} is not a folder.\n{EXAMPLE}"
                )
            self.image_dirs.append(images)
            for path in walk_images(images, self.root, self.issues, self.yaml_path.name):
                first = Path(self.root.rel(path)).parts[1]
                listed.append((path, split_from_name(first) if first in (*SPLITS, "valid") else None))

        samples: list[DetectionSample] = []
        split_of: dict[str, SplitName | None] = {}
        for path, split in listed:
            rel = self.root.rel(path)
            if rel in split_of:
                self.issues.add(
                    IssueReason.DUPLICATE_IMAGE,
                    Where(self.yaml_path.name, rel),
                    f"{rel} is listed again (for {split}); it is kept once, in {split_of[rel]}",
                )
                continue
            split_of[rel] = split
            sample = self._sample(path, split)
            if sample is not None:
                samples.append(sample)
        self._orphans(set(split_of))
        samples.sort(key=lambda s: s.rel)
        return DetectionSource(
            "yolo", self.root.root, self.classes, samples, self.issues.items, self.warnings
        )

    def _sample(self, image: Path, split: SplitName | None) -> DetectionSample | None:
        label = _label_path(image, self.root)
        file = self.root.rel(label)
        where = Where(file)
        opened = self.images.open(self.root.rel(image), where)
        if opened is None:
            return None
        path, rel, header = opened
        boxes = ImageBoxes(header, "upright", self.issues)
        if not label.exists():
            return boxes.sample(path, rel, split)
        if not self.root.inside(os.path.realpath(label)):
            self.issues.add(
                IssueReason.LINK_OUTSIDE_SOURCE,
                where,
                "label file is a symbolic link outside the source; the image is left out",
            )
            return None
        try:
            text = decode_text(read_capped(label, MAX_TXT_BYTES, "a YOLO label file"), label)
        except AnnotationFileError as e:
            self.issues.add(IssueReason.UNREADABLE_ANNOTATION_FILE, where, f"{e}; the image is left out")
            return None
        width, height = header.size
        for n, line in enumerate(text.splitlines(), start=1):
            cols = line.split()
            if not cols:
                continue
            at = Where(file, rel, line=n)
            parsed = self._line(cols, at)
            if parsed is None:
                continue
            cls, values = parsed
            if cls not in self.label_of:
                self.issues.add(
                    IssueReason.UNKNOWN_CLASS,
                    at,
                    f"class id {cls} is not in data.yaml's names (0..{len(self.classes) - 1})",
                )
                continue
            if len(values) == 4:
                cx, cy, bw, bh = values
                box = (
                    (cx - bw / 2) * width,
                    (cy - bh / 2) * height,
                    (cx + bw / 2) * width,
                    (cy + bh / 2) * height,
                )
            else:
                xs, ys = values[0::2], values[1::2]
                if not all(v == v and abs(v) != float("inf") for v in values):
                    box = (float("nan"),) * 4
                else:
                    box = (min(xs) * width, min(ys) * height, max(xs) * width, max(ys) * height)
            boxes.add(box, self.label_of[cls], at)
        return boxes.sample(path, rel, split)

    def _line(self, cols: list[str], at: Where) -> tuple[int, list[float]] | None:
        n = len(cols)
        if self.kpt_columns is not None and n == self.kpt_columns:
            cols = cols[:5]
        elif not (n == 5 or (n >= 7 and n % 2 == 1)):
            self.issues.add(
                IssueReason.MALFORMED_ANNOTATION,
                at,
                f"has {n} column(s); expected 5 (`class cx cy w h`) or a polygon "
                "(`class x1 y1 x2 y2 x3 y3 ...`)",
            )
            return None
        cls = _parse_int(cols[0])
        try:
            values = [float(c) for c in cols[1:]]
        except ValueError:
            values = []
        if cls is None or not values:
            self.issues.add(
                IssueReason.MALFORMED_ANNOTATION,
                at,
                f"{short(' '.join(cols)[:80])} is not an integer class and numbers",
            )
            return None
        return cls, values

    def _orphans(self, listed: set[str]) -> None:
        """Label files under the mirrors of the image folders read, whose image is not there."""
        stems = {str(Path(rel).with_suffix("")) for rel in listed}
        for folder in self.image_dirs:
            labels = _label_path(folder / "x.jpg", self.root).parent
            if labels == folder or not labels.is_dir() or not self.root.inside(os.path.realpath(labels)):
                continue
            for dirpath, dirnames, filenames in os.walk(labels):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(filenames):
                    if not name.endswith(".txt") or name == "classes.txt" or name.startswith("."):
                        continue
                    label = Path(dirpath) / name
                    rel = self.root.rel(label)
                    parts = list(Path(rel).with_suffix("").parts)
                    for i in range(len(parts) - 2, -1, -1):
                        if parts[i] == "labels":
                            parts[i] = "images"
                            break
                    if str(Path(*parts)) not in stems:
                        self.issues.add(
                            IssueReason.MISSING_IMAGE,
                            Where(rel),
                            "has no image of the same name under images/; its boxes are left out",
                        )


def read_yolo(data_yaml: Path) -> DetectionSource:
    """Read a YOLO dataset from its data.yaml. Raises DataError only for an unusable data.yaml."""
    data_yaml = Path(data_yaml)
    if not data_yaml.is_file():
        raise DataError(f"YOLO data.yaml {data_yaml} does not exist.\n{EXAMPLE}")
    return _Reader(data_yaml).read()


def flat_name(rel: str) -> str:
    """A sample's path as one file name (folders joined by `__`), unique within a source."""
    return rel.replace("/", "__")


def place_image(src: Path, dst: Path) -> None:
    """Put a copy of `src` at `dst`: a hard link where the file system allows, else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def write_yolo(source: DetectionSource, out_dir: Path) -> Path:
    """Write `source` as a YOLO dataset under `out_dir` (images linked or copied); returns the
    data.yaml path. Difficult boxes are written as ordinary boxes (YOLO has no such flag)."""
    out_dir = Path(out_dir)
    splits = {s.split for s in source.samples}
    if None in splits and len(splits) > 1:
        raise DataError(
            "a YOLO data.yaml cannot mix images with a split and images without one; split them all."
        )
    for sample in source.samples:
        folder = sample.split or ""
        name = flat_name(sample.rel)
        place_image(sample.image, out_dir / "images" / folder / name)
        lines = []
        for (x1, y1, x2, y2), label in zip(sample.boxes, sample.labels, strict=True):
            w, h = sample.width, sample.height
            cx, cy, bw, bh = (x1 + x2) / 2 / w, (y1 + y2) / 2 / h, (x2 - x1) / w, (y2 - y1) / h
            lines.append(f"{label} {cx:.6f} {cy:.6f} {bw:.6f} {bh:.6f}\n")
        atomic_write_text((out_dir / "labels" / folder / name).with_suffix(".txt"), "".join(lines))
    doc: dict[str, object] = {"path": "."}
    for split in SPLITS:
        if split in splits:
            doc[split] = f"images/{split}"
    doc["names"] = list(source.classes)
    data_yaml = out_dir / "data.yaml"
    atomic_write_text(data_yaml, yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return data_yaml
