"""Object detection: boxes with class labels.

`metrics` holds the streaming COCO-style evaluator (mAP through faster-coco-eval) and the
detection confusion matrix; `plots` draws precision-recall curves, the confusion matrix and a
grid of validation images with their boxes. `task.DetectionTask` (dataset, collate, model,
loss, evaluation, export comparison, served answer) is registered as "detection"; importing
this package registers it.

Conventions shared by every module here: boxes are `xyxy` in absolute pixels of the image
they were annotated on, labels index the dataset's class names (no background entry), and a
prediction's score is a probability-like confidence in [0, 1].
"""

from visionloop.tasks.detection.task import DetectionTask

__all__ = ["DetectionTask"]
