"""Pascal VOC: `Annotations/*.xml`, `JPEGImages/`, optional `ImageSets/Main/{train,val,test}.txt`.

XML is parsed with defusedxml only (`forbid_dtd=True`: a VOC file never needs a DTD, and a DTD
is where entity bombs and external entities live), each file at most 8 MiB. A file that
declares a DTD or entities is `unsafe_xml`; one that does not parse is
`unreadable_annotation_file`; either way that one image is left out and reading goes on.

Each XML is one image: `<filename>` relative to `JPEGImages/` (`<folder>` and `<path>`, which
name the annotator's machine, are ignored; with no filename, an image in JPEGImages/ with the
XML's stem), `<size>` and its `<object>`s (`name`, `bndbox`, `difficult`). An XML with no
object is a background image. Images in JPEGImages/ with no XML are not read (VOC lists its
images by their XML; a warning counts them).

Coordinates: VOC's are 1-based pixel indices, both ends included, so a box is read as
`(xmin - 1, ymin - 1, xmax, ymax)` in continuous pixels (as detectron2 does) and written back
with `xmin = x1 + 1`, two decimals (as CVAT writes them).

Difficult boxes (`<difficult>1</difficult>`) are kept, with `difficult=True`, and ingest
stores the flag: VOC's evaluation ignores them, and so does ours (mapped onto COCO's iscrowd);
training leaves them out of its targets, as torchvision's detection references do with COCO's
crowd boxes, since a box too hard to label reliably is a poor regression target. The writer
writes the flag back.

Orientation: as COCO, `<size>` is of the stored pixel array in the tools that write VOC
(LabelImg, CVAT), so boxes are in the raw frame unless the declared size says upright (see
`coco.py`); a missing or zero size means the raw frame.

Classes: the object names found, sorted, unless `classes` is given, in which case other names
are `unknown_class`. Splits: an XML's stem listed in `ImageSets/Main/train.txt` (val, test) has
that split (the first listing wins; listed twice is an issue); unlisted ones have none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import defusedxml
import defusedxml.ElementTree as SafeET

from visionloop.core.errors import DataError
from visionloop.core.fsutil import atomic_write_text
from visionloop.data.imageio import is_image_name
from visionloop.data.manifest import SplitName
from visionloop.tasks.detection.annotations import orient
from visionloop.tasks.detection.annotations.common import (
    MAX_TXT_BYTES,
    MAX_XML_BYTES,
    SPLIT_NAMES,
    AnnotationFileError,
    Header,
    ImageBoxes,
    Images,
    Issues,
    SourceRoot,
    Where,
    check_classes,
    choose_frame,
    class_name_problem,
    decode_text,
    number,
    read_capped,
    read_header,
    short,
    vote_frame,
)
from visionloop.tasks.detection.annotations.model import DetectionSample, DetectionSource, IssueReason
from visionloop.tasks.detection.annotations.yolo import flat_name, place_image

if TYPE_CHECKING:  # the standard parser is never used on an annotation file; only its type is
    from xml.etree.ElementTree import Element

LAYOUT = """\
Expected a Pascal VOC folder:
  ROOT/Annotations/001.xml      <annotation><filename>001.jpg</filename><size>...</size><object>...
  ROOT/JPEGImages/001.jpg
  ROOT/ImageSets/Main/train.txt (optional: one id per line; val.txt, test.txt likewise)"""


@dataclass(slots=True)
class _Object:
    name: str
    box: tuple[float, float, float, float]
    difficult: bool
    where: Where


@dataclass(slots=True)
class _Parsed:
    xml: Path
    stem: str
    image: Path
    rel: str
    header: Header
    declared: tuple[int, int] | None
    objects: list[_Object] = field(default_factory=list)


def parse_xml(data: bytes) -> Element:
    """Parse untrusted XML: defusedxml, no DTD, no entities, no external references."""
    return SafeET.fromstring(data, forbid_dtd=True, forbid_entities=True, forbid_external=True)


def _text(node: Element | None, tag: str) -> str | None:
    child = node.find(tag) if node is not None else None
    return child.text.strip() if child is not None and child.text is not None else None


def _size(root: Element) -> tuple[int, int] | None:
    size = root.find("size")
    w, h = number(_text(size, "width")), number(_text(size, "height"))
    if w is None or h is None or not w.is_integer() or not h.is_integer() or w <= 0 or h <= 0:
        return None
    return int(w), int(h)


class _Reader:
    def __init__(self, root: Path, classes: list[str] | None) -> None:
        self.root = SourceRoot(root)
        self.given_classes = classes
        self.issues = Issues()
        self.images = Images(self.root, self.issues)
        self.jpeg = self.root.root / "JPEGImages"
        self.warnings: list[str] = []

    def _splits(self) -> dict[str, SplitName]:
        split_of: dict[str, SplitName] = {}
        main = self.root.root / "ImageSets" / "Main"
        for split in SPLIT_NAMES:
            txt = main / f"{split}.txt"
            if not txt.is_file():
                continue
            file = self.root.rel(txt)
            outside = self.root.linked_outside(txt, "split list")  # read only inside the source
            if outside is not None:
                self.issues.add(outside.reason, Where(file), outside.message)
                continue
            try:
                text = decode_text(read_capped(txt, MAX_TXT_BYTES, "an ImageSets list"), txt)
            except AnnotationFileError as e:
                self.issues.add(IssueReason.UNREADABLE_ANNOTATION_FILE, Where(file), str(e))
                continue
            for n, line in enumerate(text.splitlines(), start=1):
                words = line.split()
                if not words:
                    continue
                if words[0] in split_of:
                    self.issues.add(
                        IssueReason.DUPLICATE_IMAGE,
                        Where(file, line=n),
                        f"id {short(words[0])} is already in {split_of[words[0]]}; it stays there",
                    )
                    continue
                split_of[words[0]] = split
        return split_of

    def _parse(self, xml: Path) -> _Parsed | None:
        file = self.root.rel(xml)
        where = Where(file)
        # An XML (or Annotations/ itself) linked to a file outside the source is not read.
        outside = self.root.linked_outside(xml, "VOC annotation")
        if outside is not None:
            self.issues.add(outside.reason, where, f"{outside.message}; its image is left out")
            return None
        try:
            data = read_capped(xml, MAX_XML_BYTES, "a VOC annotation")
            root = parse_xml(data)
        except AnnotationFileError as e:
            self.issues.add(IssueReason.UNREADABLE_ANNOTATION_FILE, where, f"{e}; its image is left out")
            return None
        except defusedxml.DefusedXmlException as e:
            self.issues.add(
                IssueReason.UNSAFE_XML,
                where,
                f"declares a DTD or entities ({type(e).__name__}), which VOC never needs and which can "
                "expand without bound or read other files; refused, its image is left out",
            )
            return None
        except (SafeET.ParseError, ValueError, RecursionError) as e:
            self.issues.add(
                IssueReason.UNREADABLE_ANNOTATION_FILE,
                where,
                f"is not well-formed XML ({e}); its image is left out",
            )
            return None
        if root.tag != "annotation":
            self.issues.add(
                IssueReason.UNREADABLE_ANNOTATION_FILE,
                where,
                f"has the root <{short(root.tag)}>, not <annotation>",
            )
            return None
        n_objects = len(root.findall("object"))
        name = _text(root, "filename") or self._by_stem(xml.stem)
        if name is None:
            self.issues.add(
                IssueReason.MISSING_IMAGE,
                where,
                f"has no <filename> and JPEGImages/ has no image named {short(xml.stem)}.*; "
                f"its {n_objects} object(s) are left out",
            )
            return None
        opened = self.images.open(name, where, base=self.jpeg, dropped=n_objects)
        if opened is None:
            return None
        image, rel, header = opened
        parsed = _Parsed(xml, xml.stem, image, rel, header, _size(root))
        for i, obj in enumerate(root.findall("object"), start=1):
            at = Where(file, rel, annotation=f"object {i}")
            label = _text(obj, "name")
            bnd = obj.find("bndbox")
            coords = [number(_text(bnd, k)) for k in ("xmin", "ymin", "xmax", "ymax")]
            if not label or bnd is None or any(c is None for c in coords):
                self.issues.add(
                    IssueReason.MALFORMED_ANNOTATION,
                    at,
                    "needs a <name> and a <bndbox> with numeric xmin, ymin, xmax, ymax",
                )
                continue
            problem = class_name_problem(label)
            if problem is not None:  # one object's bad name must not refuse the whole folder
                self.issues.add(IssueReason.MALFORMED_ANNOTATION, at, f"<name> {short(label)} {problem}")
                continue
            x1, y1, x2, y2 = (float(c) for c in coords if c is not None)
            parsed.objects.append(
                _Object(label, (x1 - 1, y1 - 1, x2, y2), _text(obj, "difficult") == "1", at)
            )
        return parsed

    def _by_stem(self, stem: str) -> str | None:
        if not self.jpeg.is_dir():
            return None
        for entry in sorted(self.jpeg.iterdir()):
            if entry.stem == stem and is_image_name(entry.name):
                return entry.name
        return None

    def read(self) -> DetectionSource:
        annotations = self.root.root / "Annotations"
        if not annotations.is_dir():
            raise DataError(f"{self.root.root} has no Annotations/ folder.\n{LAYOUT}")
        if not self.jpeg.is_dir():
            raise DataError(f"{self.root.root} has no JPEGImages/ folder.\n{LAYOUT}")
        split_of = self._splits()
        xmls = sorted(
            Path(e.path)
            for e in os.scandir(annotations)
            if e.name.lower().endswith(".xml") and not e.name.startswith(".")
        )
        parsed: list[_Parsed] = []
        seen: dict[str, str] = {}
        for xml in xmls:
            p = self._parse(xml)
            if p is None:
                continue
            if p.rel in seen:
                self.issues.add(
                    IssueReason.DUPLICATE_IMAGE,
                    Where(self.root.rel(xml), p.rel),
                    f"{p.rel} is also annotated by {seen[p.rel]}; only that one is read",
                )
                continue
            seen[p.rel] = self.root.rel(xml)
            parsed.append(p)

        names = sorted({o.name for p in parsed for o in p.objects})
        classes = check_classes(
            list(self.given_classes) if self.given_classes is not None else names,
            self.root.root / "Annotations",
        )
        label_of = {name: i for i, name in enumerate(classes)}
        default, disagree = vote_frame([(p.header, p.declared) for p in parsed], "raw")
        if disagree:
            self.warnings.append(disagree)
        samples: list[DetectionSample] = []
        for p in parsed:
            frame = choose_frame(p.header, p.declared, default)
            if frame is None:
                assert p.declared is not None
                self.issues.add(
                    IssueReason.IMAGE_SIZE_MISMATCH,
                    Where(self.root.rel(p.xml), p.rel),
                    f"declares {p.declared[0]}x{p.declared[1]} but the image is "
                    f"{p.header.raw_width}x{p.header.raw_height}; its {len(p.objects)} object(s) were drawn "
                    "on another copy and are left out with it",
                )
                continue
            boxes = ImageBoxes(p.header, frame, self.issues)
            for o in p.objects:
                if o.name not in label_of:
                    self.issues.add(
                        IssueReason.UNKNOWN_CLASS, o.where, f"class {short(o.name)} is not in {classes}"
                    )
                    continue
                boxes.add(o.box, label_of[o.name], o.where, difficult=o.difficult)
            samples.append(boxes.sample(p.image, p.rel, split_of.get(p.stem)))
        unannotated = sum(1 for _ in self._images_without_xml({p.image for p in parsed}, xmls))
        if unannotated:
            self.warnings.append(
                f"{unannotated} image(s) in JPEGImages/ have no XML in Annotations/ and are not read"
            )
        samples.sort(key=lambda s: s.rel)
        return DetectionSource("voc", self.root.root, classes, samples, self.issues.items, self.warnings)

    def _images_without_xml(self, used: set[Path], xmls: list[Path]) -> list[str]:
        stems = {x.stem for x in xmls}
        return [
            e.name
            for e in os.scandir(self.jpeg)
            if is_image_name(e.name) and Path(e.path) not in used and Path(e.name).stem not in stems
        ]


def read_voc(root: Path, *, classes: list[str] | None = None) -> DetectionSource:
    """Read a Pascal VOC folder (see the module doc). DataError only for an unusable layout."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"VOC folder {root} does not exist.\n{LAYOUT}")
    return _Reader(root, classes).read()


def _xml_text(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_voc(source: DetectionSource, out_dir: Path) -> Path:
    """Write `source` as a VOC folder under `out_dir` (images linked or copied into JPEGImages/
    with flat names); returns `out_dir`. Boxes are written on the stored pixel array."""
    out_dir = Path(out_dir)
    ids: dict[SplitName, list[str]] = {s: [] for s in SPLIT_NAMES}
    stems: set[str] = set()
    for sample in source.samples:
        name = flat_name(sample.rel)
        # An id is one word in ImageSets lists: no white space in it.
        stem = "_".join(Path(name).stem.split())
        stem = stem if stem not in stems else "_".join(name.split()).replace(".", "_")
        stems.add(stem)
        place_image(sample.image, out_dir / "JPEGImages" / name)
        header = read_header(sample.image)
        if isinstance(header, str):
            header = Header(sample.width, sample.height, 1)
        objects = []
        for box, label, difficult in zip(sample.boxes, sample.labels, sample.difficult, strict=True):
            x1, y1, x2, y2 = orient.to_raw(box, header.orientation, sample.width, sample.height)
            objects.append(
                "  <object>\n"
                f"    <name>{_xml_text(source.classes[label])}</name>\n"
                f"    <difficult>{int(difficult)}</difficult>\n"
                f"    <bndbox><xmin>{x1 + 1:.2f}</xmin><ymin>{y1 + 1:.2f}</ymin>"
                f"<xmax>{x2:.2f}</xmax><ymax>{y2:.2f}</ymax></bndbox>\n"
                "  </object>\n"
            )
        xml = (
            "<annotation>\n"
            "  <folder>JPEGImages</folder>\n"
            f"  <filename>{_xml_text(name)}</filename>\n"
            f"  <size><width>{header.raw_width}</width><height>{header.raw_height}</height>"
            "<depth>3</depth></size>\n" + "".join(objects) + "</annotation>\n"
        )
        atomic_write_text(out_dir / "Annotations" / f"{stem}.xml", xml)
        if sample.split is not None:
            ids[sample.split].append(stem)
    for split, listed in ids.items():
        if listed:
            atomic_write_text(
                out_dir / "ImageSets" / "Main" / f"{split}.txt", "".join(f"{s}\n" for s in listed)
            )
    return out_dir
