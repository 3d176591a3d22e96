"""Everything task-specific, behind one contract (`Task`) and looked up by name.

>>> from visionloop.tasks import get_task
>>> get_task("classification").primary_metric
'accuracy'
"""

from visionloop.tasks.base import (
    AnswerOptions,
    ConfusedPair,
    EmbeddingLayer,
    ErrorAnalysis,
    EvalResult,
    Evaluator,
    ExportComparison,
    GateMeasurement,
    ImageContext,
    LossFn,
    OutputScorer,
    Task,
)
from visionloop.tasks.registry import get_task, list_tasks, register_task

__all__ = [
    "AnswerOptions",
    "ConfusedPair",
    "EmbeddingLayer",
    "ErrorAnalysis",
    "EvalResult",
    "Evaluator",
    "ExportComparison",
    "GateMeasurement",
    "ImageContext",
    "LossFn",
    "OutputScorer",
    "Task",
    "get_task",
    "list_tasks",
    "register_task",
]
