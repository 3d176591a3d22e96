"""Object-detection annotation readers and writers: COCO, YOLO, Pascal VOC, Label Studio.

Each reader turns an untrusted annotation source into one typed `DetectionSource`: the class
names, one `DetectionSample` per usable image (boxes in absolute pixels of the upright image),
and an `Issue` with a machine-readable reason for every box, line, image or file it rejected
or repaired. Readers never change the source, and never raise for one bad item; `DataError`
only when the whole source is unusable. Formats are read with our own code (no ultralytics).
"""

from __future__ import annotations

from visionloop.tasks.detection.annotations.coco import read_coco, write_coco
from visionloop.tasks.detection.annotations.detect import FORMATS, detect_format, merge, read_detection_source
from visionloop.tasks.detection.annotations.label_studio import read_label_studio, write_label_studio
from visionloop.tasks.detection.annotations.model import (
    Box,
    DetectionCounts,
    DetectionSample,
    DetectionSource,
    Issue,
    IssueReason,
)
from visionloop.tasks.detection.annotations.voc import read_voc, write_voc
from visionloop.tasks.detection.annotations.yolo import read_yolo, write_yolo

__all__ = [
    "FORMATS",
    "Box",
    "DetectionCounts",
    "DetectionSample",
    "DetectionSource",
    "Issue",
    "IssueReason",
    "detect_format",
    "merge",
    "read_coco",
    "read_detection_source",
    "read_label_studio",
    "read_voc",
    "read_yolo",
    "write_coco",
    "write_label_studio",
    "write_voc",
    "write_yolo",
]
