"""Datasets: ingest, validation, shards, manifests and the resumable loader."""
