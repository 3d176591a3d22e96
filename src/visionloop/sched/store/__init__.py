"""The job store: the queue's durable state, on SQLite or PostgreSQL. `Store` composes its
parts, one concern each, over the shared connection and transaction of `base` (whose
docstring says why the store is shaped the way it is):

- `teams`: teams and their API tokens;
- `jobs`: submitting jobs, reading them, and their state transitions;
- `attempts`: attempts and their GPU allocations, handles, heartbeats and checkpoints;
- `inventory`: the GPUs, and whether they are up;
- `ledger`: the allocations the cost ledger prices.
"""

from __future__ import annotations

from visionloop.sched.records import (
    Allocation,
    Attempt,
    Checkpoint,
    GpuLike,
    GpuRecord,
    Job,
    LedgerRow,
    Outcome,
    Principal,
    TeamRecord,
    TokenRecord,
    Transition,
)
from visionloop.sched.store.attempts import AttemptsMixin
from visionloop.sched.store.base import ConflictError, TeamQueueFullError, default_url
from visionloop.sched.store.inventory import GONE_REASON, InventoryMixin
from visionloop.sched.store.jobs import JobsMixin
from visionloop.sched.store.ledger import LedgerMixin
from visionloop.sched.store.teams import TOKEN_PREFIX, TeamsMixin


class Store(TeamsMixin, JobsMixin, AttemptsMixin, InventoryMixin, LedgerMixin):
    """The job store. Thread-safe: each call is its own transaction on a pooled connection.
    Open it with `Store.open(url)`; close it with `close()` (or use it as a context manager)."""


__all__ = [
    "GONE_REASON",
    "TOKEN_PREFIX",
    "Allocation",
    "Attempt",
    "Checkpoint",
    "ConflictError",
    "GpuLike",
    "GpuRecord",
    "Job",
    "LedgerRow",
    "Outcome",
    "Principal",
    "Store",
    "TeamQueueFullError",
    "TeamRecord",
    "TokenRecord",
    "Transition",
    "default_url",
]
