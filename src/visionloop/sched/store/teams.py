"""The job store's teams and API tokens: who may use the queue, and with what quota."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from visionloop.core.errors import ConfigError, NotFoundError
from visionloop.sched.db import TeamRow, TokenRow
from visionloop.sched.records import Principal, TeamRecord, TokenRecord
from visionloop.sched.store.base import StoreBase

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
TOKEN_PREFIX = "vl_"  # lets secret scanners and people recognise a visionloop token


def _team(r: TeamRow) -> TeamRecord:
    return TeamRecord(r.name, r.nominal_gpus, r.borrow_limit, r.weight, r.created_at, r.updated_at)


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class TeamsMixin(StoreBase):
    """Teams (their quotas) and the tokens that authenticate them."""

    def upsert_team(
        self,
        name: str,
        nominal_gpus: int,
        borrow_limit: int = 0,
        weight: float = 1.0,
        *,
        now: float | None = None,
    ) -> TeamRecord:
        """Create a team or change its quota; its jobs and tokens stay."""
        if not _NAME.fullmatch(name):
            raise ConfigError(
                f"team name {name!r}: use 1-64 letters, digits, '-', '_' or '.', e.g. 'vision'."
            )
        if nominal_gpus < 0 or borrow_limit < 0 or not weight > 0:
            raise ConfigError(
                f"team {name}: nominal_gpus ({nominal_gpus}) and borrow_limit ({borrow_limit}) must be "
                f">= 0 and weight ({weight}) > 0, e.g. nominal_gpus=4, borrow_limit=2, weight=1."
            )
        now = time.time() if now is None else now
        values = {
            "name": name,
            "nominal_gpus": nominal_gpus,
            "borrow_limit": borrow_limit,
            "weight": float(weight),
            "created_at": now,
            "updated_at": now,
        }
        changed = {k: values[k] for k in ("nominal_gpus", "borrow_limit", "weight", "updated_at")}
        with self._session(write=True) as s:
            # An upsert, so two admins creating one team at once cannot collide.
            if self.backend == "postgresql":
                s.execute(
                    pg_insert(TeamRow)
                    .values(values)
                    .on_conflict_do_update(index_elements=["name"], set_=changed)
                )
            else:
                stmt = sqlite_insert(TeamRow).values(values)
                s.execute(stmt.on_conflict_do_update(index_elements=["name"], set_=changed))
            return _team(s.get_one(TeamRow, name, populate_existing=True))

    def get_team(self, name: str) -> TeamRecord | None:
        with self._session(write=False) as s:
            row = s.get(TeamRow, name)
            return None if row is None else _team(row)

    def list_teams(self) -> list[TeamRecord]:
        with self._session(write=False) as s:
            return [_team(r) for r in s.scalars(select(TeamRow).order_by(TeamRow.name))]

    def create_token(self, team: str | None, admin: bool, label: str, *, now: float | None = None) -> str:
        """A new API token. The plaintext is returned once and never stored (only its SHA-256):
        whoever loses it makes a new one."""
        if team is None and not admin:
            raise ConfigError("a token belongs to a team, or is an admin token: give a team or admin=True.")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self._session(write=True) as s:
            if team is not None and s.get(TeamRow, team) is None:
                raise NotFoundError(
                    f"no team {team!r}; create it first (Store.upsert_team / `visionloop admin team set`)."
                )
            s.add(
                TokenRow(
                    token_hash=_token_hash(token),
                    team=team,
                    admin=admin,
                    label=label,
                    created_at=time.time() if now is None else now,
                )
            )
        return token

    def authenticate(self, token: str) -> Principal | None:
        """The token's owner, or None for an unknown or revoked token.

        The lookup is by SHA-256, so timing reveals at most how much of a *hash* matched,
        which does not help forge a token; the final comparison is constant-time anyway."""
        digest = _token_hash(token)
        with self._session(write=False) as s:
            row = s.scalars(select(TokenRow).where(TokenRow.token_hash == digest)).one_or_none()
            if row is None or not hmac.compare_digest(row.token_hash, digest) or row.revoked_at is not None:
                return None
            return Principal(token_id=row.id, team=row.team, admin=row.admin, label=row.label)

    def list_tokens(self, team: str | None = None) -> list[TokenRecord]:
        with self._session(write=False) as s:
            q = select(TokenRow).order_by(TokenRow.id)
            if team is not None:
                q = q.where(TokenRow.team == team)
            return [
                TokenRecord(r.id, r.team, r.admin, r.label, r.created_at, r.revoked_at) for r in s.scalars(q)
            ]

    def revoke_token(self, token_id: int, *, now: float | None = None) -> None:
        """Revoke a token by its id (`list_tokens`); revoking twice keeps the first time."""
        with self._session(write=True) as s:
            row = s.get(TokenRow, token_id)
            if row is None:
                raise NotFoundError(f"no token {token_id}; `visionloop admin token list` shows them.")
            if row.revoked_at is None:
                row.revoked_at = time.time() if now is None else now
