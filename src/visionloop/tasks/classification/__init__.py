"""tasks/classification."""
