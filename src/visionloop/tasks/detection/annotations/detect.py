"""Which detection format a source is, and reading it whole (several COCO files merged).

Layouts recognised (SOURCE is a folder unless said):
- yolo: `SOURCE/data.yaml` (or `dataset.yaml`, or the one `*.yaml`), or the yaml file itself;
- voc: `SOURCE/Annotations/` (with `JPEGImages/`);
- coco: `SOURCE/annotations/instances*.json` or `SOURCE/instances*.json`, images in
  `SOURCE/<name after instances_>/` (train2017), `SOURCE/images/<that>/`, `SOURCE/images/` or
  SOURCE; or Roboflow's `SOURCE/<split>/_annotations.coco.json` beside its images; or one
  COCO `.json` file, images beside it;
- label_studio: the one `.json` in SOURCE holding a list (images under SOURCE), or such a file.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from visionloop.core.errors import DataError
from visionloop.core.fsutil import open_regular
from visionloop.data.metadata import MetadataCleaner
from visionloop.tasks.detection.annotations.coco import read_coco
from visionloop.tasks.detection.annotations.common import Issues, Where, split_from_name
from visionloop.tasks.detection.annotations.label_studio import read_label_studio
from visionloop.tasks.detection.annotations.model import DetectionSample, DetectionSource, Issue, IssueReason
from visionloop.tasks.detection.annotations.voc import read_voc
from visionloop.tasks.detection.annotations.yolo import read_yolo

FORMATS = ("coco", "yolo", "voc", "label_studio")
_ALIASES = {
    "labelstudio": "label_studio",
    "label-studio": "label_studio",
    "pascal_voc": "voc",
    "ls": "label_studio",
}

LAYOUTS = """\
Detection sources visionloop reads (--format forces one):
  coco          SOURCE/annotations/instances_train.json + SOURCE/train/ (images)
  yolo          SOURCE/data.yaml + SOURCE/images/... + SOURCE/labels/...
  voc           SOURCE/Annotations/*.xml + SOURCE/JPEGImages/
  label_studio  SOURCE/export.json (Label Studio's JSON export) + the images under SOURCE"""


def _first_char(path: Path) -> str:
    try:
        with open_regular(path) as f:
            head = f.read(4096)
    except OSError:
        return ""
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    return chr(text[0]) if text else ""


def _yaml_in(folder: Path) -> Path | None:
    for name in ("data.yaml", "data.yml", "dataset.yaml"):
        if (folder / name).is_file():
            return folder / name
    yamls = [p for p in folder.glob("*.y*ml") if p.suffix in (".yaml", ".yml") and p.is_file()]
    return yamls[0] if len(yamls) == 1 else None


_FILE_NAME = re.compile(rb'"file_name"\s*:\s*"([^"\\]{1,1000})"')


def _coco_images_dir(js: Path, beside: Path) -> Path:
    """The folder a COCO file's `file_name`s are relative to, when the file does not say: the
    folder `beside` it, unless its first `file_name` (peeked from the file's head, no parse) is
    missing there but present under `beside/images/` (the layout `generate_detection_dataset`
    and many exporters write: `instances.json` + `images/`)."""
    images = beside / "images"
    if not images.is_dir():
        return beside
    try:
        with open_regular(js) as f:
            head = f.read(65536)
    except OSError:
        return beside
    match = _FILE_NAME.search(head)
    if match is None:
        return beside
    name = match.group(1).decode("utf-8", "replace")
    if (beside / name).is_file() or not (images / name).is_file():
        return beside
    return images


def _coco_pairs(folder: Path) -> list[tuple[Path, Path]]:
    """(images folder, COCO json) pairs of a COCO-layout folder."""
    pairs: list[tuple[Path, Path]] = []
    jsons = sorted(folder.glob("annotations/instances*.json")) + sorted(folder.glob("instances*.json"))
    for js in jsons:
        name = js.stem.removeprefix("instances").lstrip("_-")
        if not name:
            # `instances.json` names no split folder: images/ or the folder itself.
            pairs.append((_coco_images_dir(js, folder), js))
            continue
        for candidate in (folder / name, folder / "images" / name, folder / "images", folder):
            if candidate.is_dir():
                pairs.append((candidate, js))
                break
    for js in sorted([*folder.glob("*/_annotations.coco.json"), *folder.glob("_annotations.coco.json")]):
        pairs.append((js.parent, js))
    return pairs


def _label_studio_json(folder: Path) -> Path | None:
    jsons = [p for p in sorted(folder.glob("*.json")) if p.is_file() and not p.name.startswith("instances")]
    lists = [p for p in jsons if _first_char(p) == "["]
    return lists[0] if len(lists) == 1 else None


def detect_format(path: Path) -> str:
    """One of FORMATS; DataError when the source matches none or several."""
    path = Path(path)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".yaml", ".yml"):
            return "yolo"
        if suffix == ".json":
            first = _first_char(path)
            if first == "[":
                return "label_studio"
            if first == "{":
                return "coco"
        raise DataError(f"{path} is not a detection annotation file visionloop recognises.\n{LAYOUTS}")
    if not path.is_dir():
        raise DataError(f"source {path} does not exist.\n{LAYOUTS}")
    found = []
    if _yaml_in(path) is not None:
        found.append("yolo")
    if (path / "Annotations").is_dir():
        found.append("voc")
    if _coco_pairs(path):
        found.append("coco")
    if _label_studio_json(path) is not None:
        found.append("label_studio")
    if len(found) == 1:
        return found[0]
    if not found:
        raise DataError(f"{path} holds no detection source visionloop recognises.\n{LAYOUTS}")
    raise DataError(
        f"{path} looks like several formats ({', '.join(found)}); pass --format to choose.\n{LAYOUTS}"
    )


def _rebase(issue: Issue, old_root: Path, root: Path) -> Issue:
    if issue.image is None:
        return issue
    try:
        rel = Path(os.path.normpath(Path(os.path.realpath(old_root)) / issue.image)).relative_to(root)
    except ValueError:
        return issue
    return dataclasses.replace(issue, image=rel.as_posix())


def merge(fmt: str, root: Path, sources: list[DetectionSource]) -> DetectionSource:
    """One source from several read from files under `root`: classes joined by name (in the
    order first seen), image paths made relative to `root`, an image read twice kept once."""
    root = Path(os.path.realpath(root))
    classes: list[str] = []
    index: dict[str, int] = {}
    samples: list[DetectionSample] = []
    issues = Issues()
    warnings: list[str] = []
    seen: set[str] = set()
    # Each file's metadata columns, joined (in the order first seen) and bounded again.
    cleaner = MetadataCleaner()
    for source in sources:
        cleaner.declare(source.metadata_columns)
    for source in sources:
        for name in source.classes:
            if name not in index:
                index[name] = len(classes)
                classes.append(name)
        remap = [index[name] for name in source.classes]
        # Issues name their image relative to the file's own root: make it relative to `root`,
        # as the samples' `rel` are, so rejected.jsonl and the dataset use one path per image.
        issues.items.extend(_rebase(issue, source.root, root) for issue in source.issues)
        warnings.extend(source.warnings)
        for s in source.samples:
            rel = Path(os.path.realpath(s.image)).relative_to(root).as_posix()
            if rel in seen:
                issues.add(
                    IssueReason.DUPLICATE_IMAGE,
                    Where(source.root.name, rel),
                    f"{rel} is read twice; kept once",
                )
                continue
            seen.add(rel)
            labels = [remap[label] for label in s.labels]
            sample = DetectionSample(s.image, rel, s.width, s.height, s.boxes, labels, s.difficult, s.split)
            sample.metadata = cleaner.clean(s.metadata)
            samples.append(sample)
    samples.sort(key=lambda s: s.rel)
    warnings.extend(cleaner.warnings(root.name))
    return DetectionSource(fmt, root, classes, samples, issues.items, warnings, cleaner.columns)


def read_detection_source(path: Path, format: str | None = None) -> DetectionSource:
    """Read a detection source in `format` (detected when None)."""
    path = Path(path)
    fmt = detect_format(path) if format is None else _ALIASES.get(format.lower(), format.lower())
    if fmt not in FORMATS:
        raise DataError(f"unknown detection format {format!r}; use one of {', '.join(FORMATS)}.")
    if not path.exists():
        raise DataError(f"source {path} does not exist.\n{LAYOUTS}")
    if fmt == "yolo":
        yaml_path = path if path.is_file() else _yaml_in(path)
        if yaml_path is None:
            raise DataError(f"{path} has no data.yaml.\n{LAYOUTS}")
        return read_yolo(yaml_path)
    if fmt == "voc":
        return read_voc(path if path.is_dir() else path.parent)
    if fmt == "label_studio":
        js = path if path.is_file() else _label_studio_json(path)
        if js is None:
            raise DataError(
                f"{path} holds no single Label Studio JSON export (a .json file holding a list).\n{LAYOUTS}"
            )
        return read_label_studio(js, js.parent)
    if path.is_file():
        return read_coco(_coco_images_dir(path, path.parent), path)
    pairs = _coco_pairs(path)
    if not pairs:
        raise DataError(f"{path} has no COCO instances*.json.\n{LAYOUTS}")
    sources = []
    for images, js in pairs:
        split = split_from_name(js.stem) or split_from_name(images.name)
        sources.append(read_coco(images, js, split=split))
    return merge("coco", path, sources)
