"""`visionloop demo`: the whole spine on scikit-learn's digits."""

from __future__ import annotations


def demo() -> None:
    """Run the demo (placeholder)."""
    raise NotImplementedError
