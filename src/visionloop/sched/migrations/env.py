"""Alembic environment for the job store.

`visionloop.sched.db.migrate` runs it with a connection already inside a write transaction
(passed as `config.attributes["connection"]`), so the whole upgrade commits or rolls back as
one. Run from the alembic command line instead, it connects to the URL given as
`-x url=...` or in VISIONLOOP_DB_URL.

The revision is kept in `visionloop_alembic_version` (db.VERSION_TABLE), not Alembic's default
`alembic_version`, which belongs to Optuna's history on a database the tuner shares. Run from
the command line on a database of a release before 0002, `alembic` would not find the
revision there: open it with visionloop once first (`Store.open` moves it).
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy.engine import Connection

from visionloop.sched.db import VERSION_TABLE, Base, make_engine, parse_url

config = context.config


# SQLite cannot ALTER most things in place: autogenerate writes batch operations, which
# copy the table on SQLite and are plain ALTERs on PostgreSQL.
RENDER_AS_BATCH = True


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=RENDER_AS_BATCH,
        compare_type=True,
        version_table=VERSION_TABLE,
    )
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or os.environ.get("VISIONLOOP_DB_URL")
    if not url:
        raise SystemExit(
            "give the database: alembic -x url=sqlite:////path/to/state.db ... (or VISIONLOOP_DB_URL)"
        )
    return url


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
elif context.is_offline_mode():
    context.configure(
        url=parse_url(_url()),
        target_metadata=Base.metadata,
        render_as_batch=RENDER_AS_BATCH,
        literal_binds=True,
        version_table=VERSION_TABLE,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = make_engine(parse_url(_url()))
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()
