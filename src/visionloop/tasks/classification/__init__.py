"""tasks/classification: one integer label per image. Importing it registers the task."""

from visionloop.tasks.classification.task import ClassificationTask

__all__ = ["ClassificationTask"]
