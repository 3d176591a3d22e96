"""Model registry glue: versions, aliases (`champion`, `challenger`), lineage, and the files of
each version (see `layout`)."""
