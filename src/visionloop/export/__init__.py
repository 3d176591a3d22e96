"""ONNX export (fp32, fp16, int8 with calibration), parity with eager PyTorch and the accuracy
gate; exports are stored with their model version (see `registry.layout`)."""

from visionloop.export.api import CARD_METADATA_KEY, DEFAULT_CALIBRATION_SIZE, export_model
from visionloop.export.data import ModelDataset, open_model_dataset
from visionloop.export.report import (
    DEFAULT_PARITY,
    PRECISIONS,
    ExportError,
    ExportGateError,
    ExportReport,
    ParityThresholds,
)

__all__ = [
    "CARD_METADATA_KEY",
    "DEFAULT_CALIBRATION_SIZE",
    "DEFAULT_PARITY",
    "PRECISIONS",
    "ExportError",
    "ExportGateError",
    "ExportReport",
    "ModelDataset",
    "ParityThresholds",
    "export_model",
    "open_model_dataset",
]
