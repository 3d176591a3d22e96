"""Architectures (a timm-style registry over native and torchvision models), weights on disk,
and the model card saved with every trained model.

Importing this package is cheap: torch is imported by the first call that needs it. The
weights functions are re-exported lazily for that reason (they import torch and safetensors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from visionloop.models.card import MODEL_CARD_NAME, EvalPreprocess, ModelCard, ModelCardError, eval_preprocess
from visionloop.models.registry import (
    ModelDefaults,
    create_model,
    is_model,
    list_models,
    model_defaults,
    model_source,
    register_model,
)

if TYPE_CHECKING:
    from visionloop.models.weights import (
        LoadReport,
        WeightsError,
        find_classifier,
        load_pretrained,
        load_weights,
        save_weights,
    )

_LAZY = {"LoadReport", "WeightsError", "find_classifier", "load_pretrained", "load_weights", "save_weights"}

__all__ = [
    "MODEL_CARD_NAME",
    "EvalPreprocess",
    "LoadReport",
    "ModelCard",
    "ModelCardError",
    "ModelDefaults",
    "WeightsError",
    "create_model",
    "eval_preprocess",
    "find_classifier",
    "is_model",
    "list_models",
    "load_pretrained",
    "load_weights",
    "model_defaults",
    "model_source",
    "register_model",
    "save_weights",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from visionloop.models import weights

        return getattr(weights, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
