"""The job store's GPU inventory: which GPUs exist, on which node, and whether they are up."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Literal, cast

from sqlalchemy import or_, select

from visionloop.core.errors import ConfigError
from visionloop.sched import db
from visionloop.sched.db import GpuRow
from visionloop.sched.records import GpuLike, GpuRecord
from visionloop.sched.store.base import StoreBase, _natural
from visionloop.sched.view import PriceClass

# Why a GPU is down when the executor stopped listing it (its node left the cluster).
GONE_REASON = "no longer reported by the executor (its node left?)"


def _gpu(r: GpuRow) -> GpuRecord:
    return GpuRecord(
        id=r.id,
        node=r.node,
        type=r.type,
        price_class=cast(PriceClass, r.price_class),
        up=r.up,
        down_reason=r.down_reason,
        updated_at=r.updated_at,
    )


class InventoryMixin(StoreBase):
    """The GPUs the scheduler may place jobs on."""

    def sync_gpus(
        self,
        gpus: Iterable[GpuLike],
        *,
        now: float | None = None,
        missing: Literal["remove", "down"] = "remove",
    ) -> list[GpuRecord]:
        """Make the inventory match discovery (or the configured list): new GPUs are added
        (up, unless they say otherwise), changed ones updated, and a known GPU keeps its
        up/down state, so a spot interruption survives a control-plane restart.

        GPUs no longer listed: "remove" deletes them (their allocations stay in the ledger),
        as the start-up sync does; "down" marks them down with GONE_REASON — what a periodic
        re-sync does, since a Ray node that left may hold attempts still being settled — and a
        GPU down for that reason alone comes back up when it is listed again (one down for a
        spot interruption stays down)."""
        now = time.time() if now is None else now
        wanted = {g.id: g for g in gpus}
        for g in wanted.values():
            if g.price_class not in db.PRICE_CLASSES:
                raise ConfigError(
                    f"GPU {g.id}: price class {g.price_class!r} is not one of {db.PRICE_CLASSES}."
                )
        with self._session(write=True) as s:
            existing = {r.id: r for r in s.scalars(select(GpuRow).with_for_update())}
            for gid, g in wanted.items():
                row = existing.get(gid)
                if row is None:
                    up = bool(getattr(g, "up", True))
                    s.add(
                        GpuRow(
                            id=gid,
                            node=g.node,
                            type=g.type,
                            price_class=g.price_class,
                            up=up,
                            down_reason=None if up else "down when discovered",
                            updated_at=now,
                        )
                    )
                    continue
                if (row.node, row.type, row.price_class) != (g.node, g.type, g.price_class):
                    row.node, row.type, row.price_class, row.updated_at = g.node, g.type, g.price_class, now
                if not row.up and row.down_reason == GONE_REASON:
                    row.up, row.down_reason, row.updated_at = True, None, now
            for gid in existing.keys() - wanted.keys():
                row = existing[gid]
                if missing == "remove":
                    s.delete(row)
                elif missing == "down" and row.up:
                    row.up, row.down_reason, row.updated_at = False, GONE_REASON, now
            s.flush()
            rows = s.scalars(select(GpuRow)).all()
            return sorted((_gpu(r) for r in rows), key=lambda g: (_natural(g.node), _natural(g.id)))

    def list_gpus(self) -> list[GpuRecord]:
        """The inventory, by node and GPU id in natural order (node2/9 before node2/10)."""
        with self._session(write=False) as s:
            rows = s.scalars(select(GpuRow)).all()
            return sorted((_gpu(r) for r in rows), key=lambda g: (_natural(g.node), _natural(g.id)))

    def set_gpus_up(
        self, target: str | Sequence[str], *, up: bool, reason: str | None = None, now: float
    ) -> list[str]:
        """Mark GPUs up or down (a spot interruption takes a GPU or a whole node away).

        `target`: a GPU id or a node name, or a list of GPU ids. Returns the ids matched
        (whether or not they changed), empty if none: the caller decides if that is an error."""
        with self._session(write=True) as s:
            q = select(GpuRow).with_for_update()
            if isinstance(target, str):
                q = q.where(or_(GpuRow.id == target, GpuRow.node == target))
            else:
                q = q.where(GpuRow.id.in_(list(target)))
            rows = s.scalars(q).all()
            for row in rows:
                if row.up != up:
                    row.up = up
                    row.down_reason = None if up else (reason or "marked down")
                    row.updated_at = now
            return sorted((r.id for r in rows), key=_natural)
