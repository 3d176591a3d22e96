"""Alembic migrations of the job store, shipped inside the package and run by
`visionloop.sched.db.migrate` whenever a store is opened (no alembic.ini needed).

Revisions are numbered 0001, 0002, ...; each one must work on SQLite (batch mode for ALTERs)
and PostgreSQL. Write one with `visionloop.sched.db.new_revision("what changed")`, review it,
and let `tests/integration/test_sched_store.py` check that the migrations still produce the
models' schema on both backends.
"""
