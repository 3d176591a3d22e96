"""OpenAPI descriptions of the bodies the raw handlers read (documentation and schemathesis;
the handlers check bodies themselves, see `protocol`)."""

from __future__ import annotations

from typing import Any

_TENSOR: dict[str, Any] = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "datatype": {
            "type": "string",
            "enum": ["BOOL", "UINT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES"],
        },
        "parameters": {"type": "object"},
        "data": {"type": "array", "items": {}},
    },
}

INFER: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["inputs"],
                    "properties": {
                        "id": {"type": "string"},
                        "parameters": {"type": "object"},
                        "inputs": {"type": "array", "items": _TENSOR},
                        "outputs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["name"],
                                "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
                            },
                        },
                    },
                }
            },
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    },
    "parameters": [
        {
            "name": "Inference-Header-Content-Length",
            "in": "header",
            "required": False,
            "schema": {"type": "integer"},
            "description": "length of the JSON header when binary tensor data follows it",
        }
    ],
}

_IMAGE_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "image/png": {"schema": {"type": "string", "format": "binary"}},
            "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {"file": {"type": "string", "format": "binary"}},
                }
            },
        },
    },
}


def image_endpoint(endpoint: str) -> dict[str, Any]:
    """The image endpoint `endpoint` (classify, detect): an image file in, the task's answer
    out. `top_k` caps the items (classes, boxes); `score_threshold` drops those scoring less."""
    return {
        **_IMAGE_BODY,
        "description": (
            f"POST an image (raw JPEG/PNG body, or a multipart form's file field) to /{endpoint}; it is "
            "preprocessed as the model card says. A classifier answers at /classify with "
            '{"predictions": [{"label", "index", "score"}]}; a detector at /detect with '
            '{"detections": [{"label", "index", "score", "box": [x1, y1, x2, y2]}], "counts": {label: n}}, '
            "boxes in pixels of the image as sent. Another endpoint than the model's task's is refused "
            "with the right one named."
        ),
        "parameters": [
            {
                "name": "top_k",
                "in": "query",
                "required": False,
                "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                "description": "at most this many items (default: the task's)",
            },
            {
                "name": "score_threshold",
                "in": "query",
                "required": False,
                "schema": {"type": "number", "minimum": 0, "maximum": 1},
                "description": "only items scoring at least this (default: the task's, 0.25 for boxes)",
            },
        ],
    }


CLASSIFY: dict[str, Any] = image_endpoint("classify")
