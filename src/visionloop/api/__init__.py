"""The control-plane HTTP API."""
