"""`visionloop train SPEC.yaml`: train, or resume, a model from a spec."""

from __future__ import annotations


def train() -> None:
    """Train a model from a YAML spec (placeholder)."""
    raise NotImplementedError
