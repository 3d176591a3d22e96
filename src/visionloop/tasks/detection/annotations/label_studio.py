"""Label Studio's JSON export (a list of tasks), `rectanglelabels` results.

A task's image is `data.image` (or the one string value of `data` when there is no `image`).
Label Studio names it by a URL of its own: `/data/upload/1/3f2a9c1e-dog.jpg`,
`/data/local-files/?d=photos/dog.jpg`, `s3://bucket/dog.jpg`, `https://...`. None of these is
a path on this machine, so the image is looked for under `images_root`: the `?d=` path first
(relative to images_root), then by the file's base name anywhere under images_root, then that
name without the 8-hex-digit prefix Label Studio's upload adds. Two files of that name is
`ambiguous_image`; none is `missing_image`.

A task's annotation: the one marked `ground_truth`, else the last one not cancelled (several
annotators: the others are counted in a warning). A task with no such annotation is
unlabelled and not read (counted); one whose annotation has no rectangle is a background image.

Boxes: `x`, `y`, `width`, `height` in percent of the image. Label Studio shows the image as the
browser does, EXIF applied, and its `original_width`/`original_height` are of that image, so
boxes are in the upright frame, unless the declared size is the raw one (a browser that did
not apply EXIF; see `coco.py`). A box with `rotation` other than 0, or drawn on an image the
user rotated in Label Studio (`image_rotation`), is `box_rotated`: it is no axis-aligned box.
A box with several labels gives one box per label. Other result types (polygons, keypoints,
choices, ...) are ignored and counted in a warning.

Classes: the labels found, sorted, unless `classes` is given (other labels: `unknown_class`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from visionloop.core.errors import DataError
from visionloop.core.fsutil import atomic_write_text
from visionloop.tasks.detection.annotations.common import (
    MAX_ID_CHARS,
    Header,
    ImageBoxes,
    Images,
    Issues,
    SourceRoot,
    Where,
    check_classes,
    choose_frame,
    class_name_problem,
    load_json,
    number,
    short,
    walk_images,
)
from visionloop.tasks.detection.annotations.model import Box, DetectionSample, DetectionSource, IssueReason

EXAMPLE = """\
Expected Label Studio's JSON export (Export → JSON), a list of tasks:
  [{"id": 1, "data": {"image": "/data/upload/1/3f2a9c1e-dog.jpg"},
    "annotations": [{"id": 7, "result": [{"type": "rectanglelabels", "original_width": 640,
      "original_height": 480, "value": {"x": 10, "y": 20, "width": 30, "height": 40,
      "rotation": 0, "rectanglelabels": ["dog"]}}]}]}]"""

_UPLOAD_PREFIX = re.compile(r"^[0-9a-f]{8}-(.+)$")
MAX_KINDS_SHOWN = 10  # result types named in the warning about ignored results


@dataclass(slots=True)
class _Rect:
    label: str
    percent: Box  # x, y, width, height
    declared: tuple[int, int] | None
    where: Where


@dataclass(slots=True)
class _Task:
    image: Path
    rel: str
    header: Header
    where: Where
    rects: list[_Rect] = field(default_factory=list)


def _shown(value: object) -> str:
    """A value of the file (an id, a type) for a message: as written when it is a short
    printable string, else `short`'s repr (quoted, escaped, cut)."""
    if isinstance(value, str) and value.isprintable() and len(value) <= MAX_ID_CHARS:
        return value
    return short(value)


def _image_ref(data: object) -> str | None:
    if not isinstance(data, dict):
        return None
    image = data.get("image")
    if isinstance(image, str):
        return image
    strings = [v for v in data.values() if isinstance(v, str)]
    return strings[0] if len(strings) == 1 else None


def _choose(annotations: list[object]) -> tuple[dict[str, object] | None, int]:
    """The annotation to read and how many others were passed over."""
    usable = [a for a in annotations if isinstance(a, dict) and not a.get("was_cancelled")]
    if not usable:
        return None, 0
    truth = [a for a in usable if a.get("ground_truth") is True]
    return (truth or usable)[-1], len(usable) - 1


class _Reader:
    def __init__(self, export_json: Path, images_root: Path, classes: list[str] | None) -> None:
        self.export = export_json
        self.file = export_json.name
        self.root = SourceRoot(images_root)
        self.given_classes = classes
        self.issues = Issues()
        self.images = Images(self.root, self.issues)
        self.warnings: list[str] = []
        self._by_name: dict[str, list[Path]] | None = None

    def _index(self) -> dict[str, list[Path]]:
        if self._by_name is None:
            self._by_name = {}
            for path in walk_images(self.root.root, self.root, self.issues, self.file):
                self._by_name.setdefault(path.name, []).append(path)
        return self._by_name

    def _find(self, ref: str, where: Where, dropped: int) -> tuple[Path, str, Header] | None:
        try:
            parts = urlsplit(ref)
        except ValueError as e:  # `http://[x/a.jpg` (IPv6 brackets), NFKC-unsafe host: one task, not the file
            lost = f"; its {dropped} box(es) are left out" if dropped else ""
            self.issues.add(
                IssueReason.MALFORMED_ANNOTATION,
                where,
                f"image {short(ref)} is not a URL or path that can be read ({e}){lost}; "
                "fix it in Label Studio",
            )
            return None
        query = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p)
        if "d" in query:
            found = self.root.image(unquote(query["d"]))
            if isinstance(found, Path):
                return self.images.open(self.root.rel(found), where, dropped=dropped)
        name = unquote(parts.path.rsplit("/", 1)[-1]) if parts.path else ""
        if "d" in query:
            name = unquote(query["d"]).replace("\\", "/").rsplit("/", 1)[-1]
        if not name or name in (".", ".."):
            self.issues.add(IssueReason.MALFORMED_ANNOTATION, where, f"image {short(ref)} names no file")
            return None
        index = self._index()
        candidates = index.get(name, [])
        m = _UPLOAD_PREFIX.match(name)
        if not candidates and m:
            candidates = index.get(m.group(1), [])
        lost = f"; its {dropped} box(es) are left out" if dropped else ""
        if len(candidates) > 1:
            shown = ", ".join(self.root.rel(c) for c in candidates[:3])
            self.issues.add(
                IssueReason.AMBIGUOUS_IMAGE,
                where,
                f"image {short(ref)} matches {len(candidates)} files under {self.root.root} ({shown}){lost}; "
                "give each image a unique name",
            )
            return None
        if not candidates:
            self.issues.add(
                IssueReason.MISSING_IMAGE,
                where,
                f"image {short(ref)}: no file named {short(name)} under {self.root.root}{lost}; "
                "copy the images there (Label Studio's media/upload folder, or the originals)",
            )
            return None
        return self.images.open(self.root.rel(candidates[0]), where, dropped=dropped)

    def read(self) -> DetectionSource:
        doc = load_json(self.export, "Label Studio JSON export")
        if isinstance(doc, dict) and "annotations" in doc and "images" in doc:
            raise DataError(
                f"{self.export} looks like COCO JSON, not a Label Studio export; use --format coco."
            )
        if not isinstance(doc, list):
            raise DataError(
                f"{self.export} holds a JSON {type(doc).__name__}, not a list of tasks.\n{EXAMPLE}"
            )
        tasks: list[_Task] = []
        seen: dict[str, str] = {}
        skipped = Counter[str]()
        unlabelled = extra = 0
        for n, task in enumerate(doc):
            tid = task.get("id") if isinstance(task, dict) else None
            where = Where(self.file, annotation=f"task {short(tid) if tid is not None else f'[{n}]'}")
            ref = _image_ref(task.get("data")) if isinstance(task, dict) else None
            anns = task.get("annotations") if isinstance(task, dict) else None
            if ref is None or not isinstance(anns, list):
                self.issues.add(
                    IssueReason.MALFORMED_ANNOTATION,
                    where,
                    "task needs `data.image` and an `annotations` list",
                )
                continue
            ann, others = _choose(anns)
            extra += others
            if ann is None:
                unlabelled += 1
                continue
            result = ann.get("result")
            if not isinstance(result, list):
                self.issues.add(IssueReason.MALFORMED_ANNOTATION, where, "annotation has no `result` list")
                continue
            rects = [r for r in result if isinstance(r, dict) and r.get("type") == "rectanglelabels"]
            # Counted by type, not by `r not in rects`: that list search compares whole dicts, a
            # million boxes on one image took hours, and deep values there hit the recursion limit.
            # The type is shortened: it is the file's text and goes into a warning.
            skipped.update(
                _shown(r.get("type"))
                for r in result
                if isinstance(r, dict) and r.get("type") != "rectanglelabels"
            )
            opened = self._find(ref, where, len(rects))
            if opened is None:
                continue
            image, rel, header = opened
            if rel in seen:
                self.issues.add(
                    IssueReason.DUPLICATE_IMAGE,
                    where,
                    f"{rel} is also the image of {seen[rel]}; this task's {len(rects)} box(es) are left out",
                )
                continue
            seen[rel] = where.annotation or ""
            parsed = _Task(image, rel, header, where)
            for i, r in enumerate(rects):
                # The result's id is the file's text: shortened, or one huge id is copied into
                # the message of every issue of that result.
                rid = _shown(r["id"]) if "id" in r else str(i)
                self._rect(parsed, r, Where(self.file, rel, annotation=f"{where.annotation} result {rid}"))
            tasks.append(parsed)
        if extra:
            self.warnings.append(f"{extra} other annotation(s) of tasks with several were passed over")
        if unlabelled:
            self.warnings.append(f"{unlabelled} task(s) without a (non-cancelled) annotation were not read")
        if skipped:
            # At most MAX_KINDS_SHOWN kinds: a file can give every result a type of its own.
            common = sorted(skipped.most_common(MAX_KINDS_SHOWN), key=lambda kc: kc[0])
            kinds = ", ".join(f"{count} {kind}" for kind, count in common)
            if len(skipped) > MAX_KINDS_SHOWN:
                others = sum(skipped.values()) - sum(count for _, count in common)
                kinds += f" and {others} result(s) of {len(skipped) - MAX_KINDS_SHOWN} other type(s)"
            self.warnings.append(f"result(s) other than rectanglelabels ignored: {kinds}")
        return self._build(tasks)

    def _rect(self, task: _Task, r: dict[str, object], where: Where) -> None:
        value = r.get("value")
        if not isinstance(value, dict):
            self.issues.add(IssueReason.MALFORMED_ANNOTATION, where, "rectangle has no `value` object")
            return
        coords = [number(value.get(k)) for k in ("x", "y", "width", "height")]
        labels = value.get("rectanglelabels")
        if any(c is None for c in coords) or not isinstance(labels, list) or not labels:
            self.issues.add(
                IssueReason.MALFORMED_ANNOTATION,
                where,
                f"rectangle {short(value)} needs numeric x, y, width, height and a rectanglelabels list",
            )
            return
        rotation = number(value.get("rotation", 0)) or 0.0
        image_rotation = number(r.get("image_rotation", 0)) or 0.0
        if rotation % 360 != 0 or image_rotation % 360 != 0:
            what = (
                f"rotated by {rotation:g}°"
                if rotation % 360
                else f"drawn on an image rotated {image_rotation:g}°"
            )
            self.issues.add(
                IssueReason.BOX_ROTATED,
                where,
                f"box is {what} in Label Studio; it is no axis-aligned box, left out",
            )
            return
        w, h = number(r.get("original_width")), number(r.get("original_height"))
        declared = (
            (int(w), int(h))
            if w is not None and h is not None and w.is_integer() and h.is_integer()
            else None
        )
        x, y, bw, bh = (float(c) for c in coords if c is not None)
        for label in labels:
            if not isinstance(label, str) or not label.strip():
                self.issues.add(
                    IssueReason.MALFORMED_ANNOTATION, where, f"label {short(label)} is not a name"
                )
                continue
            problem = class_name_problem(label.strip())
            if problem is not None:  # one box's bad label must not refuse the whole export
                self.issues.add(IssueReason.MALFORMED_ANNOTATION, where, f"label {short(label)} {problem}")
                continue
            task.rects.append(_Rect(label.strip(), (x, y, bw, bh), declared, where))

    def _build(self, tasks: list[_Task]) -> DetectionSource:
        names = sorted({r.label for t in tasks for r in t.rects})
        classes = check_classes(
            list(self.given_classes) if self.given_classes is not None else names, self.export
        )
        label_of = {name: i for i, name in enumerate(classes)}
        samples: list[DetectionSample] = []
        for t in tasks:
            declared = next((r.declared for r in t.rects if r.declared is not None), None)
            frame = choose_frame(t.header, declared, "upright")
            if frame is None:
                assert declared is not None
                self.issues.add(
                    IssueReason.IMAGE_SIZE_MISMATCH,
                    Where(self.file, t.rel, annotation=t.where.annotation),
                    f"original size {declared[0]}x{declared[1]} is not the image's "
                    f"({t.header.raw_width}x{t.header.raw_height}); its {len(t.rects)} box(es) are left out",
                )
                continue
            boxes = ImageBoxes(t.header, frame, self.issues)
            for r in t.rects:
                if r.label not in label_of:
                    self.issues.add(
                        IssueReason.UNKNOWN_CLASS, r.where, f"label {short(r.label)} is not in {classes}"
                    )
                    continue
                x, y, bw, bh = r.percent
                fw, fh = boxes.width / 100, boxes.height / 100
                boxes.add((x * fw, y * fh, (x + bw) * fw, (y + bh) * fh), label_of[r.label], r.where)
            samples.append(boxes.sample(t.image, t.rel, None))
        samples.sort(key=lambda s: s.rel)
        return DetectionSource(
            "label_studio", self.root.root, classes, samples, self.issues.items, self.warnings
        )


def read_label_studio(
    export_json: Path, images_root: Path, *, classes: list[str] | None = None
) -> DetectionSource:
    """Read a Label Studio JSON export whose images are under `images_root` (see the module doc)."""
    export_json, images_root = Path(export_json), Path(images_root)
    if not images_root.is_dir():
        raise DataError(f"images folder {images_root} does not exist or is not a folder.")
    return _Reader(export_json, images_root, classes).read()


def write_label_studio(source: DetectionSource, out_json: Path, images_root: Path) -> None:
    """Write `source` as a Label Studio JSON export, images named `/data/local-files/?d=<path
    relative to images_root>` (Label Studio's local-files storage). Splits are not kept (Label
    Studio has none)."""
    root = Path(images_root).resolve()
    tasks: list[dict[str, object]] = []
    for n, sample in enumerate(sorted(source.samples, key=lambda s: s.rel), start=1):
        try:
            rel = Path(sample.image).resolve().relative_to(root).as_posix()
        except ValueError as e:
            raise DataError(f"image {sample.image} is not under {root}.") from e
        result = []
        for i, ((x1, y1, x2, y2), label) in enumerate(zip(sample.boxes, sample.labels, strict=True)):
            w, h = sample.width, sample.height
            result.append(
                {
                    "id": f"r{n}_{i}",
                    "type": "rectanglelabels",
                    "from_name": "label",
                    "to_name": "image",
                    "original_width": w,
                    "original_height": h,
                    "image_rotation": 0,
                    "value": {
                        "x": x1 * 100 / w,
                        "y": y1 * 100 / h,
                        "width": (x2 - x1) * 100 / w,
                        "height": (y2 - y1) * 100 / h,
                        "rotation": 0,
                        "rectanglelabels": [source.classes[label]],
                    },
                }
            )
        tasks.append(
            {
                "id": n,
                "data": {"image": f"/data/local-files/?d={quote(rel)}"},
                "annotations": [{"id": n, "result": result, "was_cancelled": False}],
            }
        )
    atomic_write_text(Path(out_json), json.dumps(tasks, allow_nan=False, ensure_ascii=False) + "\n")
