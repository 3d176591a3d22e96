"""The control-plane HTTP API (FastAPI), served by `visionloop up` on loopback.

Every route needs `Authorization: Bearer <token>`. A team token sees and acts on its own
team's jobs only (another team's job answers 404, exactly like a missing one, so ids leak
nothing); an admin token sees everything and may manage teams, tokens and spot notices.
Errors are `{"detail": "<what went wrong and what to do>"}` with a 4xx status; a client's
mistake never gets a 500.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import anyio.to_thread
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from visionloop.core.errors import NotFoundError, VisionloopError
from visionloop.sched.cost import cost_report
from visionloop.sched.records import Job
from visionloop.sched.service import ControlPlane, Principal, SubmitError
from visionloop.sched.service_reconcile import EVALS_FILE, read_evals
from visionloop.sched.states import JobState, TransitionError

log = logging.getLogger(__name__)

# A job spec is a few KiB; anything near this is a mistake or an attack.
MAX_BODY_BYTES = 1024 * 1024


class SubmitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: dict[str, Any] = Field(description="a job spec, or a bare train spec (absolute paths)")
    team: str | None = None
    priority: str | None = None
    gpus: int | None = Field(None, ge=0, le=1024)
    spot: Literal["never", "allowed", "preferred"] | None = None
    # Overrides the spec's `max_runtime` (6h, 90m, 2d or seconds); checked with the spec.
    max_runtime: str | float | None = None
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)


class ResumeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    until_epoch: int | None = Field(None, ge=1, le=1_000_000, description="the next rung; null: the end")
    reason: str | None = Field(None, max_length=500)


class PruneBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str | None = Field(None, max_length=500)


class TeamBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nominal_gpus: int = Field(ge=0, le=100_000)
    borrow_limit: int = Field(0, ge=0, le=100_000)
    weight: float = Field(1.0, gt=0, le=1000)


class TokenBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    team: str | None = Field(None, min_length=1, max_length=64)
    admin: bool = False
    label: str = Field("", max_length=200)


class LabellingBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dataset_version: str = Field(pattern=r"^[0-9a-f]{64}$", description="the version the labels produced")
    dataset_path: str = Field(min_length=1, max_length=4096)
    parent_version: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    images: int = Field(ge=0, le=1_000_000_000, description="images labelled")
    cost: float = Field(ge=0, le=1e9, allow_inf_nan=False, description="in the price catalog's currency")
    team: str | None = Field(None, min_length=1, max_length=64, description="who paid (admin tokens only)")


class SpotBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: str = Field(min_length=1, max_length=200, description="a GPU id or a node name")
    reason: str | None = Field(None, max_length=500)


_MISSING_TOKEN = (
    "missing bearer token: send `Authorization: Bearer <token>` "
    "(`visionloop admin token create --team T` makes one)."
)
_UNKNOWN_TOKEN = "unknown or revoked token."


def _authenticate(plane: ControlPlane, authorization: str | None) -> Principal | str:
    """The bearer token's principal, or what is wrong with the header."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return _MISSING_TOKEN
    found = plane.store.authenticate(token.strip())
    if found is None:
        return _UNKNOWN_TOKEN
    return Principal(team=found.team, admin=found.admin)


def _principal(request: Request, authorization: Annotated[str | None, Header()] = None) -> Principal:
    # A request with a body was authenticated by BodyLimit before its body was read.
    who = request.scope.get("state", {}).get(_PRINCIPAL)
    if isinstance(who, Principal):
        return who
    result = _authenticate(request.app.state.plane, authorization)
    if isinstance(result, str):
        raise HTTPException(401, result, headers={"WWW-Authenticate": "Bearer"})
    return result


_PRINCIPAL = "visionloop.principal"


class BodyLimit:
    """Pure ASGI middleware for requests with a body (a Content-Length above 0, or chunked):
    the bearer token is checked before any body byte is read (no token or a bad one: 401, the
    body unread, the connection closed), and the body is limited by the bytes actually
    received, chunked bodies too: past `limit`, 413. Before, an unauthenticated chunked POST of
    400 MiB was read whole (2.5 GB of process memory) to be answered 422."""

    def __init__(self, app: Any, plane: ControlPlane, limit: int) -> None:
        self.app = app
        self.plane = plane
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"]}
        length = headers.get(b"content-length")
        if length is None and b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)  # no body: routes authenticate as they did
            return
        if length is not None and length.strip() == b"0":
            await self.app(scope, receive, send)
            return
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        who = await anyio.to_thread.run_sync(_authenticate, self.plane, authorization)
        if isinstance(who, str):
            await _refuse(send, 401, who, {"WWW-Authenticate": "Bearer"})
            return
        scope.setdefault("state", {})[_PRINCIPAL] = who
        if length is not None and (not length.strip().isdigit() or int(length) > self.limit):
            await _refuse(send, 413, self._too_big())
            return
        received = 0
        refused = False
        started = False

        async def limited_receive() -> Any:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    if not started and not refused:
                        refused = True
                        await _refuse(send, 413, self._too_big())
                    raise _BodyTooLargeError
            return message

        async def guarded_send(message: Any) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out; the app's own answer to the cut body is dropped
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLargeError:
            if not refused:
                raise

    def _too_big(self) -> str:
        return f"request body over {self.limit} bytes; a job spec is a few KiB."


class _BodyTooLargeError(Exception):
    """Raised out of `receive` once the body is over the limit (the 413 is already sent)."""


async def _refuse(send: Any, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    """An answer before (or instead of) reading the body; `Connection: close`, so the server
    stops reading what the client still sends (uvicorn drains a kept-alive request's body)."""
    body = json.dumps({"detail": detail}).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _admin(who: Annotated[Principal, Depends(_principal)]) -> Principal:
    if not who.admin:
        raise HTTPException(403, "this needs an admin token.")
    return who


Who = Annotated[Principal, Depends(_principal)]
Admin = Annotated[Principal, Depends(_admin)]


def _job_doc(job: Job, now: float) -> dict[str, Any]:
    """A job as the API serves it: its fields, and the expected end of a running one (from
    the pace it reported; null when it has not reported one in this attempt)."""
    doc: dict[str, Any] = jsonable_encoder(job)
    doc["expected_end"] = job.expected_end(now)
    return doc


def create_app(plane: ControlPlane, *, run_scheduler: bool = True) -> FastAPI:
    stop = threading.Event()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        thread = None
        if run_scheduler:
            thread = threading.Thread(target=plane.run_forever, args=(stop,), name="scheduler", daemon=True)
            thread.start()
        yield
        stop.set()
        plane.wake.set()
        if thread is not None:
            thread.join(timeout=30)

    app = FastAPI(title="visionloop control plane", version="1", lifespan=lifespan)
    app.state.plane = plane

    app.add_middleware(BodyLimit, plane=plane, limit=MAX_BODY_BYTES)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in exc.errors()
        )
        return JSONResponse({"detail": f"invalid request: {problems}"}, status_code=422)

    @app.exception_handler(VisionloopError)
    async def known_error(_request: Request, exc: VisionloopError) -> JSONResponse:
        status = 404 if isinstance(exc, NotFoundError) else 409 if isinstance(exc, TransitionError) else 422
        if isinstance(exc, SubmitError):
            status = exc.status
        return JSONResponse({"detail": str(exc)}, status_code=status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug or a broken store: the answer says only an id, the log has the exception
        # (its text may name files, SQL or credentials in a database URL).
        error_id = secrets.token_hex(6)
        where = f"{request.method} {request.url.path}"
        log.error("internal error (error id %s) answering %s", error_id, where, exc_info=exc)
        return JSONResponse(
            {"detail": f"internal error, id {error_id}; see the control plane log"}, status_code=500
        )

    @app.get("/v1/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "executor": plane.executor.name}

    @app.post("/v1/jobs", status_code=201)
    def submit(body: SubmitBody, who: Who) -> dict[str, Any]:
        job = plane.submit(
            who,
            body.spec,
            team=body.team,
            priority=body.priority,
            gpus=body.gpus,
            spot=body.spot,
            max_runtime=body.max_runtime,
            idempotency_key=body.idempotency_key,
        )
        plane.wake.set()
        return jsonable_encoder(job)  # type: ignore[no-any-return]

    @app.get("/v1/jobs")
    def list_jobs(
        who: Who,
        state: Annotated[list[JobState] | None, Query()] = None,
        team: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 200,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> list[dict[str, Any]]:
        if not who.admin:
            if team is not None and team != who.team:
                raise HTTPException(403, f"your token belongs to team {who.team!r}.")
            team = who.team
        jobs = plane.store.list_jobs(
            team=team, states=set(state) if state else None, limit=limit, offset=offset
        )
        now = plane.clock()
        return [_job_doc(j, now) for j in jobs]

    @app.get("/v1/jobs/{job_id}")
    def show_job(job_id: int, who: Who) -> dict[str, Any]:
        job = plane.visible_job(who, job_id)
        return {
            "job": _job_doc(job, plane.clock()),
            # What the runs of the same spec or architecture before it took (null: none ran,
            # or it ended): what reservations plan it with when it gave no time limit.
            "runtime_estimate": jsonable_encoder(plane.store.runtime_estimate(job_id)),
            "transitions": jsonable_encoder(plane.store.transitions(job_id)),
            "attempts": jsonable_encoder(plane.store.attempts(job_id)),
            "checkpoints": jsonable_encoder(plane.store.checkpoints(job_id)),
            "cost": jsonable_encoder(
                cost_report(plane.store, plane.catalog, job_id=job_id, now=plane.clock())
            ),
        }

    @app.get("/v1/jobs/{job_id}/logs")
    def job_logs(
        job_id: int,
        who: Who,
        attempt: int | None = None,
        offset: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=8 * 1024 * 1024)] = 1024 * 1024,
    ) -> Response:
        plane.visible_job(who, job_id)
        attempts = plane.store.attempts(job_id)
        if not attempts:
            return Response(
                b"", media_type="text/plain", headers={"X-Next-Offset": str(offset), "X-Attempt": "0"}
            )
        chosen = attempts[-1] if attempt is None else next((a for a in attempts if a.number == attempt), None)
        if chosen is None:
            raise HTTPException(404, f"job {job_id} has no attempt {attempt}; it has {len(attempts)}.")
        data = b""
        for piece in plane.executor.read_log(chosen.handle or {}, offset):
            data += piece
            if len(data) >= limit:
                data = data[:limit]
                break
        return Response(
            data,
            media_type="text/plain; charset=utf-8",
            headers={"X-Next-Offset": str(offset + len(data)), "X-Attempt": str(chosen.number)},
        )

    @app.post("/v1/jobs/{job_id}/cancel")
    def cancel(job_id: int, who: Who) -> dict[str, Any]:
        return jsonable_encoder(plane.cancel(who, job_id))  # type: ignore[no-any-return]

    @app.get("/v1/jobs/{job_id}/evals")
    def job_evals(job_id: int, who: Who) -> dict[str, Any]:
        """The evaluations the job reported (from its log, as the control plane read them),
        in order: what a tuner judges its trial by, from any machine."""
        plane.visible_job(who, job_id)
        events = read_evals(plane.job_dir(job_id) / EVALS_FILE)
        return {"evals": [{"step": e.step, "epoch": e.epoch, "metrics": e.metrics} for e in events]}

    @app.post("/v1/jobs/{job_id}/resume")
    def resume(job_id: int, body: ResumeBody, who: Who) -> dict[str, Any]:
        """A paused tuning trial goes on (its study promoted it), to `until_epoch` or the end."""
        return jsonable_encoder(plane.resume(who, job_id, body.until_epoch, body.reason))  # type: ignore[no-any-return]

    @app.post("/v1/jobs/{job_id}/prune")
    def prune(job_id: int, body: PruneBody, who: Who) -> dict[str, Any]:
        """A paused tuning trial ends for good (its study pruned it at its rung)."""
        return jsonable_encoder(plane.prune(who, job_id, body.reason))  # type: ignore[no-any-return]

    @app.get("/v1/cluster")
    def cluster(who: Who) -> dict[str, Any]:
        return {
            "gpus": jsonable_encoder(plane.store.list_gpus()),
            "teams": jsonable_encoder(plane.store.list_teams()),
        }

    @app.get("/v1/cost")
    def cost(who: Who, team: str | None = None, since: float | None = None) -> dict[str, Any]:
        if not who.admin:
            if team is not None and team != who.team:
                raise HTTPException(403, f"your token belongs to team {who.team!r}.")
            team = who.team
        report = cost_report(plane.store, plane.catalog, team=team, since=since, now=plane.clock())
        return jsonable_encoder(report)  # type: ignore[no-any-return]

    @app.post("/v1/cost/labelling")
    def record_labelling(body: LabellingBody, who: Who, response: Response) -> dict[str, Any]:
        """What labelling one dataset version's images cost, into the ledger against a team
        (a team token's own; an admin names one). Idempotent per version: the same figures
        again answer 200 with the stored entry; other figures are a 409."""
        from visionloop.sched.records import LabellingCost
        from visionloop.sched.store.ledger import AlreadyBilledError

        if who.admin:
            if body.team is None:
                raise HTTPException(422, "an admin token records labelling for a team: give `team`.")
            team = body.team
        else:
            if body.team is not None and body.team != who.team:
                raise HTTPException(403, f"your token belongs to team {who.team!r}.")
            team = str(who.team)
        if plane.store.get_team(team) is None:
            raise HTTPException(404, f"no team {team!r}; `visionloop admin teams` lists them.")
        entry = LabellingCost(
            team=team,
            dataset_version=body.dataset_version,
            dataset_path=body.dataset_path,
            parent_version=body.parent_version,
            images=body.images,
            cost=body.cost,
            recorded_at=plane.clock(),
            recorded_by="admin" if who.admin else f"team {team}",
        )
        try:
            stored, created = plane.store.record_labelling(entry)
        except AlreadyBilledError as e:
            raise HTTPException(409, str(e)) from e
        response.status_code = 201 if created else 200
        return jsonable_encoder(stored)  # type: ignore[no-any-return]

    @app.put("/v1/admin/teams/{name}")
    def set_team(name: str, body: TeamBody, _: Admin) -> dict[str, Any]:
        from visionloop.sched.config import _name

        _name(name, "team name", None)
        plane.store.upsert_team(name, body.nominal_gpus, body.borrow_limit, body.weight)
        plane.wake.set()
        return jsonable_encoder(plane.store.get_team(name))  # type: ignore[no-any-return]

    @app.post("/v1/admin/tokens", status_code=201)
    def create_token(body: TokenBody, _: Admin) -> dict[str, Any]:
        if body.admin == (body.team is not None):
            raise HTTPException(422, "give a team (a team token) or admin: true (an admin token), not both.")
        if body.team is not None and plane.store.get_team(body.team) is None:
            raise HTTPException(
                404,
                f"unknown team {body.team!r}; add it first: "
                f"`visionloop admin team set {body.team} --nominal N`.",
            )
        token = plane.store.create_token(team=body.team, admin=body.admin, label=body.label)
        return {"token": token, "team": body.team, "admin": body.admin}

    @app.post("/v1/admin/spot-interrupt")
    def spot_interrupt(body: SpotBody, _: Admin) -> dict[str, Any]:
        return {"preempting": plane.spot_interrupt(body.target, body.reason)}

    @app.post("/v1/admin/spot-restore")
    def spot_restore(body: SpotBody, _: Admin) -> dict[str, Any]:
        return {"up": plane.spot_restore(body.target)}

    return app
