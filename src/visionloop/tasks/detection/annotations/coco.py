"""COCO detection JSON: an images folder and an `instances*.json`.

Read: `categories` (id, name) in id order become the classes (two ids with one name share a
class); `images` (id, file_name relative to the images folder, width, height); `annotations`
(id, image_id, category_id, bbox `[x, y, w, h]` in absolute pixels, iscrowd). An image with no
annotation is a background image. `iscrowd: 1` boxes are kept with `difficult=True`: ingest
stores the flag, evaluation ignores them (as COCO's does) and training leaves them out of its
targets (as torchvision's references do). Segmentations are not read.

An image entry's other fields (`camera`, `site`, `time_of_day`, ...: anything but COCO's own
`STANDARD_IMAGE_FIELDS`) are the image's metadata, bounded by `data.metadata.MetadataCleaner`:
scalar values only, at most 32 columns, simple names, values of at most 256 characters; what
breaks a rule is left out with a warning. COCO's own per-image fields (license, URLs,
`date_captured`) are not metadata: every COCO export has them, and a dataset's version must
not change because of them.

Orientation: COCO's `width`/`height` are, in most tools, of the stored pixel array, and its
boxes are drawn on it (pycocotools and torchvision's CocoDetection never apply EXIF). So boxes
are taken in the raw frame and moved onto the upright image, unless the file says otherwise:
an image whose declared size is its *upright* size (an orientation that swaps the axes, a
non-square image) is read in the upright frame, and when such images outvote the ones whose
declared size is the raw size, so are the images whose size cannot tell (orientations 2-4,
square images). A declared size that is neither is `image_size_mismatch`: the boxes were
drawn on another image (a resized copy) and are left out with the image.

Write (`write_coco`): the boxes back in the raw frame with the raw size declared, so that
reading the file gives the same boxes; category ids from 1 in class order.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from visionloop.core.errors import DataError
from visionloop.core.fsutil import atomic_write_text
from visionloop.data.manifest import SplitName
from visionloop.data.metadata import Metadata, MetadataCleaner
from visionloop.tasks.detection.annotations import orient
from visionloop.tasks.detection.annotations.common import (
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
    read_header,
    short,
    split_from_name,
    vote_frame,
)
from visionloop.tasks.detection.annotations.model import DetectionSample, DetectionSource, IssueReason

EXAMPLE = """\
Expected COCO detection JSON:
  {"images": [{"id": 1, "file_name": "001.jpg", "width": 640, "height": 480}],
   "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 20, 100, 50]}],
   "categories": [{"id": 1, "name": "cat"}]}"""


Id = int | str | None
# An image entry's fields that COCO itself defines: not metadata.
STANDARD_IMAGE_FIELDS = frozenset(
    {"id", "file_name", "width", "height", "license", "coco_url", "flickr_url", "date_captured"}
)


def _id(value: object) -> Id:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | str):
        return value
    return None


def _list(doc: dict[str, object], key: str, path: Path, required: bool) -> list[object]:
    value = doc.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list):
        raise DataError(
            f"{path}: `{key}` is {'missing' if value is None else type(value).__name__}, "
            f"not a list.\n{EXAMPLE}"
        )
    return value


def _categories(
    doc: dict[str, object], path: Path, issues: Issues, file: str
) -> tuple[list[str], dict[Id, int]]:
    named: dict[Id, str] = {}
    for n, cat in enumerate(_list(doc, "categories", path, True)):
        where = Where(file, annotation=f"categories[{n}]")
        cid = _id(cat.get("id")) if isinstance(cat, dict) else None
        name = cat.get("name") if isinstance(cat, dict) else None
        if cid is None or not isinstance(name, str) or not name.strip():
            issues.add(
                IssueReason.MALFORMED_ANNOTATION, where, f"category {short(cat)} needs an id and a name"
            )
            continue
        problem = class_name_problem(name.strip())
        if problem is not None:  # its annotations are then unknown_class, each named
            issues.add(
                IssueReason.MALFORMED_ANNOTATION,
                where,
                f"category {short(cid)}'s name {short(name)} {problem}; rename it",
            )
            continue
        if cid in named:
            issues.add(
                IssueReason.MALFORMED_ANNOTATION,
                where,
                f"category id {short(cid)} is given twice; the first is used",
            )
            continue
        named[cid] = name.strip()
    order = sorted(named, key=lambda c: (isinstance(c, str), c if isinstance(c, int) else 0, str(c)))
    classes: list[str] = []
    index: dict[str, int] = {}
    label_of: dict[Id, int] = {}
    for cid in order:
        name = named[cid]
        if name not in index:
            index[name] = len(classes)
            classes.append(name)
        label_of[cid] = index[name]
    return check_classes(classes, path), label_of


def read_coco(images_dir: Path, instances_json: Path, *, split: SplitName | None = None) -> DetectionSource:
    """Read one COCO file whose `file_name`s are relative to `images_dir` (the source root:
    no image outside it is read). `split` defaults to the one the file's name says
    (`instances_val2017.json` → val), else None."""
    images_dir, instances_json = Path(images_dir), Path(instances_json)
    if not images_dir.is_dir():
        raise DataError(f"COCO images folder {images_dir} does not exist or is not a folder.")
    doc = load_json(instances_json, "COCO detection JSON")
    if not isinstance(doc, dict):
        raise DataError(f"{instances_json} holds a JSON {type(doc).__name__}, not an object.\n{EXAMPLE}")
    if split is None:
        split = split_from_name(instances_json.stem)
    file = instances_json.name
    issues = Issues()
    classes, label_of = _categories(doc, instances_json, issues, file)
    root = SourceRoot(images_dir)
    finder = Images(root, issues)
    raw_images = _list(doc, "images", instances_json, True)
    raw_anns = _list(doc, "annotations", instances_json, False)
    warnings: list[str] = []
    if "annotations" not in doc:
        warnings.append(f"{file} has no `annotations` list: every image is a background image")

    by_image: dict[Id, list[tuple[int, dict[str, object]]]] = defaultdict(list)
    for n, ann in enumerate(raw_anns):
        if not isinstance(ann, dict):
            issues.add(
                IssueReason.MALFORMED_ANNOTATION,
                Where(file, annotation=f"annotations[{n}]"),
                f"annotation is a {type(ann).__name__}, not an object",
            )
            continue
        by_image[_id(ann.get("image_id"))].append((n, ann))

    # Images: resolve, read headers, note which frame each declared size points to.
    found: dict[Id, tuple[Path, str, Header, tuple[int, int] | None]] = {}
    by_file: dict[str, Id] = {}
    cleaner = MetadataCleaner()
    metadata: dict[Id, Metadata] = {}
    for n, img in enumerate(raw_images):
        where = Where(file, annotation=f"images[{n}]")
        iid = _id(img.get("id")) if isinstance(img, dict) else None
        name = img.get("file_name") if isinstance(img, dict) else None
        if iid is None or not isinstance(img, dict) or not isinstance(name, str):
            issues.add(
                IssueReason.MALFORMED_ANNOTATION,
                where,
                f"image entry {short(img)} needs an id and a file_name",
            )
            continue
        where.annotation = f"image id {short(iid)}"
        dropped = len(by_image.get(iid, []))
        if iid in found:
            issues.add(IssueReason.DUPLICATE_IMAGE, where, "image id is given twice; the first entry is used")
            continue
        opened = finder.open(name, where, dropped=dropped)
        if opened is None:
            by_image.pop(iid, None)
            continue
        path, rel, header = opened
        if rel in by_file:
            issues.add(
                IssueReason.DUPLICATE_IMAGE,
                where,
                f"{rel} is also image id {short(by_file[rel])}; this entry and its {dropped} annotation(s) "
                "are left out",
            )
            by_image.pop(iid, None)
            continue
        by_file[rel] = iid
        w, h = number(img.get("width")), number(img.get("height"))
        declared = (
            (int(w), int(h))
            if w is not None and h is not None and w.is_integer() and h.is_integer()
            else None
        )
        found[iid] = (path, rel, header, declared)
        metadata[iid] = cleaner.clean({k: v for k, v in img.items() if k not in STANDARD_IMAGE_FIELDS})

    default, disagree = vote_frame([(header, declared) for _, _, header, declared in found.values()], "raw")
    if disagree:
        warnings.append(f"{file}: {disagree}")

    samples: list[DetectionSample] = []
    for iid, (path, rel, header, declared) in found.items():
        anns = by_image.pop(iid, [])
        frame = choose_frame(header, declared, default)
        if frame is None:
            assert declared is not None
            issues.add(
                IssueReason.IMAGE_SIZE_MISMATCH,
                Where(file, rel, annotation=f"image id {short(iid)}"),
                f"declares {declared[0]}x{declared[1]} but the file is "
                f"{header.raw_width}x{header.raw_height}; "
                f"its {len(anns)} annotation(s) were drawn on another copy and are left out with it",
            )
            continue
        boxes = ImageBoxes(header, frame, issues)
        for n, ann in anns:
            aid = _id(ann.get("id"))
            where = Where(
                file, rel, annotation=f"id {short(aid)}" if aid is not None else f"annotations[{n}]"
            )
            cid = _id(ann.get("category_id"))
            if cid not in label_of:
                issues.add(
                    IssueReason.UNKNOWN_CLASS,
                    where,
                    f"category_id {short(ann.get('category_id'))} is not in `categories`",
                )
                continue
            bbox = ann.get("bbox")
            values = [number(v) for v in bbox] if isinstance(bbox, list) and len(bbox) == 4 else None
            if values is None or any(v is None for v in values):
                issues.add(
                    IssueReason.MALFORMED_ANNOTATION,
                    where,
                    f"bbox {short(bbox)} is not [x, y, width, height]",
                )
                continue
            x, y, bw, bh = (float(v) for v in values if v is not None)
            boxes.add((x, y, x + bw, y + bh), label_of[cid], where, difficult=ann.get("iscrowd") in (1, True))
        sample = boxes.sample(path, rel, split)
        sample.metadata = metadata[iid]
        samples.append(sample)

    for anns in by_image.values():
        for n, ann in anns:
            aid = _id(ann.get("id"))
            issues.add(
                IssueReason.MISSING_IMAGE,
                Where(file, annotation=f"id {short(aid)}" if aid is not None else f"annotations[{n}]"),
                f"image_id {short(ann.get('image_id'))} is not in `images`; the annotation is left out",
            )
    samples.sort(key=lambda s: s.rel)
    warnings.extend(cleaner.warnings(file))
    return DetectionSource("coco", root.root, classes, samples, issues.items, warnings, cleaner.columns)


def write_coco(source: DetectionSource, out_json: Path, images_root: Path) -> None:
    """Write `source` as COCO JSON whose `file_name`s are relative to `images_root` (every
    image must be under it). Written atomically; the images are not copied."""
    root = Path(images_root).resolve()
    images: list[dict[str, object]] = []
    annotations: list[dict[str, object]] = []
    for n, sample in enumerate(sorted(source.samples, key=lambda s: s.rel), start=1):
        try:
            name = Path(sample.image).resolve().relative_to(root).as_posix()
        except ValueError as e:
            raise DataError(
                f"image {sample.image} is not under {root}; write the COCO file next to the images."
            ) from e
        header = read_header(sample.image)
        if isinstance(header, str):
            header = Header(sample.width, sample.height, 1)
        images.append({"id": n, "file_name": name, "width": header.raw_width, "height": header.raw_height})
        for box, label, difficult in zip(sample.boxes, sample.labels, sample.difficult, strict=True):
            x1, y1, x2, y2 = orient.to_raw(box, header.orientation, sample.width, sample.height)
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": n,
                    "category_id": label + 1,
                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                    "area": (x2 - x1) * (y2 - y1),
                    "iscrowd": int(difficult),
                    "segmentation": [],
                }
            )
    doc = {
        "info": {"description": "written by visionloop"},
        "images": images,
        "annotations": annotations,
        "categories": [{"id": i + 1, "name": name} for i, name in enumerate(source.classes)],
    }
    atomic_write_text(Path(out_json), json.dumps(doc, allow_nan=False) + "\n")
