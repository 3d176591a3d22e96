"""The job store's schema revisions, oldest first (0001_initial.py, ...)."""
