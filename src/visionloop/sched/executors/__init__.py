"""Executors run a job's attempt somewhere (local processes, a Ray cluster) and report back."""
