"""Detection annotations: EXIF orientation math on real rotated JPEGs, paths kept inside the
source, box checks. Helpers here are imported by the other test_annotations_* files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from visionloop.tasks.detection.annotations import (
    DetectionSource,
    IssueReason,
    orient,
    read_coco,
    read_label_studio,
    read_voc,
    read_yolo,
)
from visionloop.tasks.detection.annotations.common import read_header

# PIL's transpose that exif_transpose applies for each orientation, and its inverse.
_METHOD = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_INVERSE = {**_METHOD, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


def make_image(path: Path, width: int, height: int, orientation: int = 1, fmt: str = "JPEG") -> Path:
    """A gray image of `width x height` stored pixels, with an EXIF orientation tag."""
    path.parent.mkdir(parents=True, exist_ok=True)
    im = Image.new("RGB", (width, height), (90, 90, 90))
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    im.save(path, fmt, exif=exif.tobytes()) if orientation != 1 else im.save(path, fmt)
    return path


def red_box(arr: np.ndarray) -> tuple[int, int, int, int]:
    mask = (arr[:, :, 0] > 160) & (arr[:, :, 1] < 100)
    ys, xs = np.nonzero(mask)
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


# Upright image 320x192 with a red block at UPRIGHT_BOX (edges on 16-px JPEG blocks).
UPRIGHT = (320, 192)
UPRIGHT_BOX = (32, 48, 160, 112)


def rotated_jpeg(path: Path, orientation: int) -> tuple[int, int, int, int]:
    """Save a real JPEG whose stored pixels, shown with its EXIF orientation, are the upright
    image with the red block at UPRIGHT_BOX. Returns the block's box in the stored pixels."""
    upright = Image.new("RGB", UPRIGHT, (90, 90, 90))
    upright.paste((230, 20, 20), UPRIGHT_BOX)
    raw = upright.transpose(_INVERSE[orientation]) if orientation != 1 else upright
    exif = Image.Exif()
    exif[0x0112] = orientation
    path.parent.mkdir(parents=True, exist_ok=True)
    raw.save(path, "JPEG", quality=95, exif=exif.tobytes())
    with Image.open(path) as im:
        # The test's own premise, checked with Pillow alone: shown upright, the block is where we put it.
        assert red_box(np.asarray(ImageOps.exif_transpose(im))) == UPRIGHT_BOX
        return red_box(np.asarray(im))


def reasons(source: DetectionSource) -> list[str]:
    return [i.reason.value for i in source.issues]


def approx_box(box: tuple[float, ...], expected: tuple[float, ...], tol: float = 1e-6) -> bool:
    return all(abs(a - b) <= tol for a, b in zip(box, expected, strict=True))


# ---------------------------------------------------------------------------------------------
# Orientation math


@pytest.mark.parametrize("o", range(1, 9))
def test_to_upright_matches_pillow_exif_transpose_pixel_for_pixel(o: int) -> None:
    w, h = 7, 4
    for x in range(w):
        for y in range(h):
            a = np.zeros((h, w), np.uint8)
            a[y, x] = 255
            im = Image.fromarray(a)
            im.getexif()[0x0112] = o
            up = np.asarray(ImageOps.exif_transpose(im))
            ys, xs = np.nonzero(up)
            expected = (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
            assert orient.to_upright((x, y, x + 1, y + 1), o, w, h) == expected
            assert up.shape[::-1] == orient.upright_size(w, h, o)


@pytest.mark.parametrize("o", range(1, 9))
def test_to_raw_inverts_to_upright(o: int) -> None:
    box = (1.25, 0.5, 5.75, 3.0)
    up = orient.to_upright(box, o, 7, 4)
    uw, uh = orient.upright_size(7, 4, o)
    assert approx_box(orient.to_raw(up, o, uw, uh), box)


@pytest.mark.parametrize("o", range(1, 9))
def test_real_rotated_jpeg_header_and_boxes_in_every_format(tmp_path: Path, o: int) -> None:
    raw_box = rotated_jpeg(tmp_path / "img" / "a.jpg", o)
    header = read_header(tmp_path / "img" / "a.jpg")
    assert not isinstance(header, str)
    assert header.orientation == o and header.size == UPRIGHT
    raw_w, raw_h = header.raw_width, header.raw_height

    # COCO: boxes drawn on the stored pixel array, its size declared.
    x1, y1, x2, y2 = raw_box
    coco = {
        "images": [{"id": 1, "file_name": "a.jpg", "width": raw_w, "height": raw_h}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [x1, y1, x2 - x1, y2 - y1]}],
        "categories": [{"id": 1, "name": "red"}],
    }
    (tmp_path / "coco.json").write_text(json.dumps(coco))
    src = read_coco(tmp_path / "img", tmp_path / "coco.json")
    (s,) = src.samples
    assert (s.width, s.height) == UPRIGHT
    assert s.boxes == [tuple(float(v) for v in UPRIGHT_BOX)], f"orientation {o}"

    # YOLO: normalised to the upright image.
    yolo = tmp_path / "yolo"
    rotated_jpeg(yolo / "images" / "a.jpg", o)
    (yolo / "labels").mkdir()
    ux1, uy1, ux2, uy2 = UPRIGHT_BOX
    W, H = UPRIGHT  # noqa: N806
    (yolo / "labels" / "a.txt").write_text(
        f"0 {(ux1 + ux2) / 2 / W} {(uy1 + uy2) / 2 / H} {(ux2 - ux1) / W} {(uy2 - uy1) / H}\n"
    )
    (yolo / "data.yaml").write_text("names: [red]\n")
    (s,) = read_yolo(yolo / "data.yaml").samples
    assert approx_box(s.boxes[0], UPRIGHT_BOX)

    # Label Studio: percent of the displayed (upright) image, whose size is declared.
    ls = [
        {
            "id": 1,
            "data": {"image": "/data/upload/1/0a1b2c3d-a.jpg"},
            "annotations": [
                {
                    "id": 1,
                    "result": [
                        {
                            "type": "rectanglelabels",
                            "original_width": W,
                            "original_height": H,
                            "value": {
                                "x": ux1 * 100 / W,
                                "y": uy1 * 100 / H,
                                "width": (ux2 - ux1) * 100 / W,
                                "height": (uy2 - uy1) * 100 / H,
                                "rotation": 0,
                                "rectanglelabels": ["red"],
                            },
                        }
                    ],
                }
            ],
        }
    ]
    (tmp_path / "ls.json").write_text(json.dumps(ls))
    (s,) = read_label_studio(tmp_path / "ls.json", tmp_path / "img").samples
    assert approx_box(s.boxes[0], UPRIGHT_BOX)

    # VOC: 1-based pixel indices on the stored pixel array, its size declared.
    voc = tmp_path / "voc"
    rotated_jpeg(voc / "JPEGImages" / "a.jpg", o)
    (voc / "Annotations").mkdir()
    (voc / "Annotations" / "a.xml").write_text(
        f"<annotation><filename>a.jpg</filename><size><width>{raw_w}</width><height>{raw_h}</height></size>"
        f"<object><name>red</name><bndbox><xmin>{x1 + 1}</xmin><ymin>{y1 + 1}</ymin><xmax>{x2}</xmax>"
        f"<ymax>{y2}</ymax></bndbox></object></annotation>"
    )
    (s,) = read_voc(voc).samples
    assert s.boxes == [tuple(float(v) for v in UPRIGHT_BOX)]


@pytest.mark.parametrize("o", [5, 6, 7, 8])
def test_coco_declaring_the_upright_size_is_read_upright(tmp_path: Path, o: int) -> None:
    rotated_jpeg(tmp_path / "img" / "a.jpg", o)
    rotated_jpeg(tmp_path / "img" / "b.jpg", 3)  # cannot tell by its size: follows the vote
    x1, y1, x2, y2 = UPRIGHT_BOX
    bbox = [x1, y1, x2 - x1, y2 - y1]
    coco = {
        "images": [
            {"id": 1, "file_name": "a.jpg", "width": UPRIGHT[0], "height": UPRIGHT[1]},
            {"id": 2, "file_name": "b.jpg", "width": UPRIGHT[0], "height": UPRIGHT[1]},
        ],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": bbox},
            {"id": 2, "image_id": 2, "category_id": 1, "bbox": bbox},
        ],
        "categories": [{"id": 1, "name": "red"}],
    }
    (tmp_path / "c.json").write_text(json.dumps(coco))
    src = read_coco(tmp_path / "img", tmp_path / "c.json")
    assert [s.boxes for s in src.samples] == [[tuple(map(float, UPRIGHT_BOX))]] * 2
    assert not src.issues


def test_coco_declared_size_of_another_copy_is_a_size_mismatch(tmp_path: Path) -> None:
    make_image(tmp_path / "img" / "a.jpg", 64, 48)
    coco = {
        "images": [{"id": 1, "file_name": "a.jpg", "width": 640, "height": 480}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 10, 10]}],
        "categories": [{"id": 1, "name": "x"}],
    }
    (tmp_path / "c.json").write_text(json.dumps(coco))
    src = read_coco(tmp_path / "img", tmp_path / "c.json")
    assert src.samples == [] and reasons(src) == ["image_size_mismatch"]
    assert "640x480" in src.issues[0].message and "64x48" in src.issues[0].message


def test_png_exif_after_the_pixel_data_is_found_without_decoding(tmp_path: Path) -> None:
    im = Image.new("RGB", (40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "a.png"
    im.save(path, "PNG", exif=exif.tobytes())
    data = path.read_bytes()
    # Move the eXIf chunk after IDAT, as some writers place it.
    i = data.index(b"eXIf") - 4
    n = int.from_bytes(data[i : i + 4], "big") + 12
    chunk, rest = data[i : i + n], data[:i] + data[i + n :]
    end = rest.index(b"IEND") - 4
    path.write_bytes(rest[:end] + chunk + rest[end:])
    assert data.index(b"eXIf") < data.index(b"IDAT") and path.read_bytes().index(
        b"eXIf"
    ) > path.read_bytes().index(b"IDAT")
    header = read_header(path)
    assert not isinstance(header, str)
    assert (header.orientation, header.size) == (6, (20, 40))


def test_header_refuses_formats_ingest_does_not_decode(tmp_path: Path) -> None:
    eps = tmp_path / "a.jpg"
    eps.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n")
    assert isinstance(read_header(eps), str)


# ---------------------------------------------------------------------------------------------
# Paths and links


def _coco_with(tmp_path: Path, names: list[str]) -> DetectionSource:
    coco = {
        "images": [{"id": i, "file_name": n} for i, n in enumerate(names)],
        "annotations": [],
        "categories": [{"id": 1, "name": "x"}],
    }
    (tmp_path / "c.json").write_text(json.dumps(coco))
    return read_coco(tmp_path / "img", tmp_path / "c.json")


def test_image_paths_must_stay_inside_the_source(tmp_path: Path) -> None:
    make_image(tmp_path / "img" / "ok.jpg", 8, 8)
    make_image(tmp_path / "secret.jpg", 8, 8)
    (tmp_path / "img" / "link.jpg").symlink_to(tmp_path / "secret.jpg")
    (tmp_path / "img" / "inner.jpg").symlink_to(tmp_path / "img" / "ok.jpg")
    src = _coco_with(
        tmp_path,
        [
            "ok.jpg",
            "../secret.jpg",
            str(tmp_path / "secret.jpg"),
            "link.jpg",
            "sub\\..\\..\\secret.jpg",
            "C:/x.jpg",
        ],
    )
    assert [s.rel for s in src.samples] == ["ok.jpg"]
    assert reasons(src) == [
        "path_outside_source",
        "path_outside_source",
        "link_outside_source",
        "path_outside_source",
        "path_outside_source",
    ]
    src = _coco_with(tmp_path, ["inner.jpg", "nope.jpg"])
    assert [s.rel for s in src.samples] == ["inner.jpg"] and reasons(src) == ["missing_image"]


def test_source_files_are_never_changed(tmp_path: Path) -> None:
    make_image(tmp_path / "img" / "ok.jpg", 8, 8)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    _coco_with(tmp_path, ["ok.jpg"])
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after.keys() - before.keys() == {tmp_path / "c.json"}
    assert all(after[p] == before[p] for p in before)


# ---------------------------------------------------------------------------------------------
# Box checks


def test_box_checks_clip_reject_and_dedupe(tmp_path: Path) -> None:
    make_image(tmp_path / "img" / "a.jpg", 100, 50)
    bboxes = {
        1: [10, 10, 20, 20],  # fine
        2: [-5, 40, 20, 20],  # partly outside: clipped to (0, 40, 15, 50)
        3: [10, 10, 20, 20],  # duplicate of 1
        4: [10, 10, 0, 5],  # zero area
        5: [10, 10, -3, 5],  # inverted (negative width)
        6: [200, 10, 5, 5],  # outside
        7: [float("nan"), 1, 2, 2],  # NaN (json.dumps writes NaN; Python's json reads it)
        8: [1, 1, float("inf"), 2],
        9: [1, 2, 3],  # wrong length
        10: ["1", 2, 3, 4],  # strings are read as numbers
        11: [True, 2, 3, 4],  # booleans are not numbers
        12: [99.999, 1, 0.005, 3],  # zero area once clipped... and thin
        13: [0, 0, 100.004, 50],  # overshoot within float noise: clipped without an issue
    }
    coco = {
        "images": [{"id": 1, "file_name": "a.jpg", "width": 100, "height": 50}],
        "annotations": [{"id": k, "image_id": 1, "category_id": 1, "bbox": v} for k, v in bboxes.items()],
        "categories": [{"id": 1, "name": "x"}],
    }
    (tmp_path / "c.json").write_text(json.dumps(coco))
    src = read_coco(tmp_path / "img", tmp_path / "c.json")
    (s,) = src.samples
    assert s.boxes == [(10, 10, 30, 30), (0, 40, 15, 50), (1, 2, 4, 6), (0, 0, 100, 50)]
    by_id = {i.annotation: i.reason for i in src.issues}
    assert by_id == {
        "id 2": IssueReason.BOX_CLIPPED,
        "id 3": IssueReason.DUPLICATE_BOX,
        "id 4": IssueReason.BOX_ZERO_AREA,
        "id 5": IssueReason.BOX_INVERTED,
        "id 6": IssueReason.BOX_OUTSIDE_IMAGE,
        "id 7": IssueReason.BOX_NOT_FINITE,
        "id 8": IssueReason.BOX_NOT_FINITE,
        "id 9": IssueReason.MALFORMED_ANNOTATION,
        "id 11": IssueReason.MALFORMED_ANNOTATION,
        "id 12": IssueReason.BOX_ZERO_AREA,
    }
    clipped = next(i for i in src.issues if i.reason == IssueReason.BOX_CLIPPED)
    assert clipped.kept and "c.json" in clipped.message and "a.jpg" in clipped.message
    assert all(not i.kept for i in src.issues if i is not clipped)
    counts = src.counts()
    assert counts.clipped_boxes == 1 and counts.instances == {"x": 4} and counts.images == 1
    row = clipped.to_row()
    assert row["reason"] == "box_clipped" and row["path"] == "a.jpg" and row["annotation"] == "id 2"
