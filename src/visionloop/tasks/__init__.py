"""Everything task-specific, behind one contract (`Task`) and looked up by name.

>>> from visionloop.tasks import get_task
>>> get_task("classification").primary_metric
'accuracy'
"""

from visionloop.tasks.base import LossFn, Task
from visionloop.tasks.evaluation import ConfusedPair, ErrorAnalysis, EvalResult, Evaluator
from visionloop.tasks.export_seams import EmbeddingLayer, ExportComparison, GateMeasurement, OutputScorer
from visionloop.tasks.registry import get_task, list_tasks, register_task
from visionloop.tasks.serving import AnswerOptions, ImageContext

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
