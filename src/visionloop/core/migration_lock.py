"""One lock for every Alembic migration this process runs: the job store's and MLflow's.

Alembic is not safe to run twice at once in one process. `alembic.context` and `alembic.op`,
which every env.py and migration script calls, are module-level proxies that each running
migration re-points at itself (`_install_proxy`), so a second migration in another thread
makes the first one's env.py read the wrong config and its `op.*` calls act on the wrong
database. Two migrations can meet in one process: the job store opened in a thread while
MLflow creates a fresh tracking database in another (MLflow migrates on first connect).
Migrations are rare and short (once per database and release), so one lock costs nothing.
"""

from __future__ import annotations

import threading

# Re-entrant: a migration may open the tracking store (or the other way round) in the future
# without deadlocking on itself.
MIGRATION_LOCK = threading.RLock()
