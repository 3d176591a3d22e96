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

CLASSIFY: dict[str, Any] = {
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
    "parameters": [
        {"name": "top_k", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1}}
    ],
}
