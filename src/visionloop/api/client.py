"""A small typed client of the control-plane API, used by the CLI (and usable from Python).

Where it connects: `VISIONLOOP_API_URL`, else the address `visionloop up` wrote to
`<home>/control-plane.json`. Which token it sends: `VISIONLOOP_TOKEN`, else the admin token
`visionloop up` created in `<home>/admin.token` (readable by its owner only).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx

from visionloop.core.errors import (
    ConfigError,
    ControlPlaneUnreachableError,
    NotFoundError,
    QueueFullError,
    VisionloopError,
)
from visionloop.core.settings import Settings

STATE_FILE = "control-plane.json"
ADMIN_TOKEN_FILE = "admin.token"


class ApiError(VisionloopError):
    """The control plane refused a request; the message is its explanation."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.exit_code = 2 if 400 <= status < 500 else 1


class QueueFullApiError(ApiError, QueueFullError):
    """429: the team's queue is at its limit; the same request can succeed later."""


def server_state(settings: Settings) -> dict[str, Any] | None:
    path = settings.home / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def resolve_url(settings: Settings) -> str:
    url = os.environ.get("VISIONLOOP_API_URL")
    if url:
        return url.rstrip("/")
    state = server_state(settings)
    if state and isinstance(state.get("url"), str):
        return str(state["url"]).rstrip("/")
    raise ConfigError(
        f"no control plane known under {settings.home}: start one with `visionloop up --detach`, "
        "or point VISIONLOOP_API_URL at a running one."
    )


def resolve_token(settings: Settings) -> str:
    token = os.environ.get("VISIONLOOP_TOKEN")
    if token:
        return token.strip()
    path = settings.home / ADMIN_TOKEN_FILE
    try:
        return path.read_text().strip()
    except OSError:
        raise ConfigError(
            "no API token: set VISIONLOOP_TOKEN to the token an admin gave you "
            "(`visionloop admin token create --team T`)."
        ) from None


class Client:
    def __init__(self, url: str, token: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> Client:
        return cls(resolve_url(settings), resolve_token(settings))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.ConnectError:
            raise ControlPlaneUnreachableError(
                f"cannot reach the control plane at {self.url}: is it running? Start it with "
                "`visionloop up --detach`."
            ) from None
        except httpx.TimeoutException:
            raise ControlPlaneUnreachableError(
                f"the control plane at {self.url} did not answer in time; try again."
            ) from None
        except httpx.TransportError as e:  # the connection broke mid-request (it restarted)
            raise ControlPlaneUnreachableError(
                f"the connection to the control plane at {self.url} broke ({type(e).__name__}); try again."
            ) from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except (json.JSONDecodeError, AttributeError):
                detail = r.text
            if not isinstance(detail, str):
                detail = json.dumps(detail)
            if r.status_code == 404:
                raise NotFoundError(detail)
            if r.status_code == 429:
                raise QueueFullApiError(r.status_code, detail)
            raise ApiError(r.status_code, detail)
        return r

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, path, **kwargs).json()

    # ------------------------------------------------------------------ jobs

    def submit(self, spec: dict[str, Any], **fields: Any) -> dict[str, Any]:
        body = {"spec": spec, **{k: v for k, v in fields.items() if v is not None}}
        return dict(self.json("POST", "/v1/jobs", json=body))

    def jobs(
        self,
        states: list[str] | None = None,
        team: str | None = None,
        limit: int = 200,
        newest_first: bool = False,
    ) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit, "order": "newest" if newest_first else "oldest"}
        if states:
            params["state"] = states
        if team:
            params["team"] = team
        return list(self.json("GET", "/v1/jobs", params=params))

    def job(self, job_id: int) -> dict[str, Any]:
        return dict(self.json("GET", f"/v1/jobs/{job_id}"))

    def cancel(self, job_id: int) -> dict[str, Any]:
        return dict(self.json("POST", f"/v1/jobs/{job_id}/cancel"))

    def evals(self, job_id: int) -> list[dict[str, Any]]:
        """The evaluations the job reported so far ({"step", "epoch", "metrics"}), in order."""
        return list(self.json("GET", f"/v1/jobs/{job_id}/evals")["evals"])

    def resume(self, job_id: int, until_epoch: int | None, reason: str | None = None) -> dict[str, Any]:
        """Promote a paused tuning trial: queued again, to `until_epoch` (None: the end)."""
        body = {"until_epoch": until_epoch, "reason": reason}
        return dict(self.json("POST", f"/v1/jobs/{job_id}/resume", json=body))

    def prune(self, job_id: int, reason: str | None = None) -> dict[str, Any]:
        """End a paused tuning trial for good."""
        return dict(self.json("POST", f"/v1/jobs/{job_id}/prune", json={"reason": reason}))

    def logs(self, job_id: int, offset: int = 0, attempt: int | None = None) -> tuple[bytes, int, int]:
        params: dict[str, Any] = {"offset": offset}
        if attempt is not None:
            params["attempt"] = attempt
        r = self.request("GET", f"/v1/jobs/{job_id}/logs", params=params)
        return r.content, int(r.headers.get("X-Next-Offset", offset)), int(r.headers.get("X-Attempt", 0))

    def follow_logs(self, job_id: int, poll_s: float = 1.0) -> Iterator[bytes]:
        """The job's log from its current attempt on, across later attempts (requeued,
        resumed), until the job ends."""
        import time

        attempt: int | None = None  # None until the job has started once
        offset = 0
        while True:
            data, nxt, current = self.logs(job_id, offset, attempt)
            if attempt is None and current:
                attempt = current
            if data:
                offset = nxt
                yield data
                continue
            show = self.job(job_id)
            if attempt is not None and len(show["attempts"]) > attempt:
                attempt, offset = attempt + 1, 0
                yield f"\n--- attempt {attempt} ---\n".encode()
                continue
            if show["job"]["state"] in ("succeeded", "failed", "cancelled", "pruned", "paused"):
                return
            time.sleep(poll_s)

    # ------------------------------------------------------------------ admin, cost

    def create_token(self, team: str | None, admin: bool = False, label: str = "") -> dict[str, Any]:
        return dict(
            self.json("POST", "/v1/admin/tokens", json={"team": team, "admin": admin, "label": label})
        )

    def set_team(self, name: str, nominal_gpus: int, borrow_limit: int, weight: float) -> dict[str, Any]:
        body = {"nominal_gpus": nominal_gpus, "borrow_limit": borrow_limit, "weight": weight}
        return dict(self.json("PUT", f"/v1/admin/teams/{name}", json=body))

    def spot_interrupt(self, target: str, reason: str | None = None) -> dict[str, Any]:
        return dict(self.json("POST", "/v1/admin/spot-interrupt", json={"target": target, "reason": reason}))

    def spot_restore(self, target: str) -> dict[str, Any]:
        return dict(self.json("POST", "/v1/admin/spot-restore", json={"target": target}))

    def cluster(self) -> dict[str, Any]:
        return dict(self.json("GET", "/v1/cluster"))

    def record_labelling(
        self,
        dataset_version: str,
        dataset_path: str,
        images: int,
        cost: float,
        *,
        parent_version: str | None = None,
        team: str | None = None,
    ) -> dict[str, Any]:
        """Put what labelling a dataset version cost into the ledger (idempotent per version)."""
        body: dict[str, Any] = {
            "dataset_version": dataset_version,
            "dataset_path": dataset_path,
            "images": images,
            "cost": cost,
            "parent_version": parent_version,
        }
        if team is not None:
            body["team"] = team
        return dict(self.json("POST", "/v1/cost/labelling", json=body))

    def cost(self, team: str | None = None, since: float | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if team:
            params["team"] = team
        if since is not None:
            params["since"] = since
        return dict(self.json("GET", "/v1/cost", params=params))
