"""The control-plane HTTP API (FastAPI), served by `visionloop up` on loopback.

Every route needs `Authorization: Bearer <token>`. A team token sees and acts on its own
team's jobs only (another team's job answers 404, exactly like a missing one, so ids leak
nothing); an admin token sees everything and may manage teams, tokens and spot notices.
Errors are `{"detail": "<what went wrong and what to do>"}` with a 4xx status; a client's
mistake never gets a 500.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DBAPIError

from visionloop.api.bodies import (
    LabellingBody,
    PruneBody,
    ResumeBody,
    SpotBody,
    SubmitBody,
    TeamBody,
    TeamName,
    TokenBody,
)
from visionloop.api.guard import Admin, BodyLimit, Who, short_detail
from visionloop.core.errors import NotFoundError, StoreError, VisionloopError
from visionloop.sched.cost import cost_report
from visionloop.sched.history import Estimate
from visionloop.sched.records import Attempt, Job
from visionloop.sched.service import ControlPlane, SubmitError
from visionloop.sched.service_reconcile import EVALS_FILE, read_evals
from visionloop.sched.states import JobState, TransitionError
from visionloop.sched.store.base import ConflictError, TeamQueueFullError
from visionloop.sched.view import planned_runtime

log = logging.getLogger(__name__)

# A job spec is a few KiB; anything near this is a mistake or an attack.
MAX_BODY_BYTES = 1024 * 1024
# Job ids are a 32-bit column on PostgreSQL; offsets past this are beyond any store. Before,
# `GET /v1/jobs/9223372036854775808` (or `?offset=` that large) was a 500 on SQLite and, on
# PostgreSQL, a 422 blaming the database ("check the database is reachable") with its URL.
MAX_JOB_ID = 2**31 - 1
MAX_OFFSET = 2**53
# How many problems an error answer lists; the rest are counted.
MAX_PROBLEMS = 20
# A submit refused for a full queue: try again after this long (jobs start within cycles).
QUEUE_FULL_RETRY_S = 30

# A job id in a path: any integer parses (an id no job can have answers 404 like a missing one).
JobId = Annotated[int, Path(description="a job id, from `visionloop jobs list`")]


def _job_doc(job: Job, now: float) -> dict[str, Any]:
    """A job as the API serves it: its fields, and the expected end of a running one (from
    the pace it reported; null when it has not reported one in this attempt)."""
    doc: dict[str, Any] = jsonable_encoder(job)
    doc["expected_end"] = job.expected_end(now)
    return doc


def _planned_end(
    job: Job, now: float, estimate: Estimate | None, attempts: Sequence[Attempt]
) -> dict[str, Any] | None:
    """The end reservations plan a running job with before it reports a pace: its attempt's
    start plus its max runtime, else its history (`by`: which). None when it is not running,
    has reported a pace (then `expected_end` says when), or neither is known."""
    if job.state != JobState.RUNNING or job.expected_end(now) is not None or not attempts:
        return None
    planned = planned_runtime(job.max_runtime_s, None if estimate is None else estimate.seconds)
    if planned is None or attempts[-1].ended_at is not None:
        return None
    seconds, by = planned
    return {"at": attempts[-1].started_at + seconds, "by": by}


def _in_range(job_id: int) -> int:
    """An id no job can have (0, negative, past the store's integer) answers as a missing one
    does, before it reaches the store."""
    if not 1 <= job_id <= MAX_JOB_ID:
        raise NotFoundError(f"no job {job_id} visible to you; `visionloop jobs list` shows yours.")
    return job_id


def _server_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug or a broken store: the answer says only an id, the log has the exception (its
    text may name files, SQL or credentials in a database URL). A failing job store is a 503
    (try again), anything else a 500."""
    error_id = secrets.token_hex(6)
    where = f"{request.method} {request.url.path}"
    log.error("internal error (error id %s) answering %s", error_id, where, exc_info=exc)
    if isinstance(exc, StoreError):
        return JSONResponse(
            {
                "detail": f"the job store failed (error id {error_id}); try again, and if it persists "
                "ask an admin to look for that id in the control plane log."
            },
            status_code=503,
        )
    return JSONResponse(
        {"detail": f"internal error, id {error_id}; see the control plane log"}, status_code=500
    )


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
        # The first problems only: a body with 90,000 unknown fields was answered with 3.5 MB,
        # built on the event loop (every other request waited a second).
        errors = exc.errors()
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
            for e in errors[:MAX_PROBLEMS]
        )
        if len(errors) > MAX_PROBLEMS:
            problems += f"; and {len(errors) - MAX_PROBLEMS} more problems"
        return JSONResponse({"detail": short_detail(f"invalid request: {problems}")}, status_code=422)

    @app.exception_handler(VisionloopError)
    async def known_error(request: Request, exc: VisionloopError) -> JSONResponse:
        status = 404 if isinstance(exc, NotFoundError) else 409 if isinstance(exc, TransitionError) else 422
        if isinstance(exc, SubmitError):
            status = exc.status
        if isinstance(exc, ConflictError):
            status = 409  # a reused idempotency key, or a change that raced another
        elif isinstance(exc, TeamQueueFullError):
            # Too many requests: the team's queue is at its limit. Retry-After tells a client
            # (a tuning study, a script) to come back rather than give up.
            return JSONResponse(
                {"detail": short_detail(str(exc))},
                status_code=429,
                headers={"Retry-After": str(QUEUE_FULL_RETRY_S)},
            )
        elif isinstance(exc, StoreError) and isinstance(exc.__cause__, DBAPIError):
            # The database failed, not the caller: its text names the store's URL, which is
            # for the operator's log, not for every team's token.
            return _server_error(request, exc)
        return JSONResponse({"detail": short_detail(str(exc))}, status_code=status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return _server_error(request, exc)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        # On the event loop (no I/O: an attribute): every other route is a sync `def`, run in
        # AnyIO's 40 worker threads, and a job store that stalls (a locked SQLite waits up to
        # its 30 s busy timeout, a slow PostgreSQL as long) holds one thread per request. As
        # a `def` too, the health check queued behind them once 40 were stuck.
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
        team: Annotated[TeamName | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 200,
        offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
        order: Annotated[
            Literal["oldest", "newest"], Query(description="oldest (default) or newest first")
        ] = "oldest",
    ) -> list[dict[str, Any]]:
        if not who.admin:
            if team is not None and team != who.team:
                raise HTTPException(403, f"your token belongs to team {who.team!r}.")
            team = who.team
        jobs = plane.store.list_jobs(
            team=team,
            states=set(state) if state else None,
            limit=limit,
            offset=offset,
            newest_first=order == "newest",
        )
        now = plane.clock()
        return [_job_doc(j, now) for j in jobs]

    @app.get("/v1/jobs/{job_id}")
    def show_job(job_id: JobId, who: Who) -> dict[str, Any]:
        job = plane.visible_job(who, _in_range(job_id))
        now = plane.clock()
        estimate = plane.store.runtime_estimate(job_id)
        attempts = plane.store.attempts(job_id)
        return {
            "job": _job_doc(job, now),
            # What the runs of the same spec or architecture before it took (null: none ran,
            # or it ended): what reservations plan it with when it gave no time limit.
            "runtime_estimate": jsonable_encoder(estimate),
            "planned_end": _planned_end(job, now, estimate, attempts),
            "transitions": jsonable_encoder(plane.store.transitions(job_id)),
            "attempts": jsonable_encoder(attempts),
            "checkpoints": jsonable_encoder(plane.store.checkpoints(job_id)),
            "cost": jsonable_encoder(
                cost_report(plane.store, plane.catalog, job_id=job_id, now=plane.clock())
            ),
        }

    @app.get("/v1/jobs/{job_id}/logs")
    def job_logs(
        job_id: JobId,
        who: Who,
        attempt: int | None = None,
        offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
        limit: Annotated[int, Query(ge=1, le=8 * 1024 * 1024)] = 1024 * 1024,
    ) -> Response:
        plane.visible_job(who, _in_range(job_id))
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
    def cancel(job_id: JobId, who: Who) -> dict[str, Any]:
        return jsonable_encoder(plane.cancel(who, _in_range(job_id)))  # type: ignore[no-any-return]

    @app.get("/v1/jobs/{job_id}/evals")
    def job_evals(job_id: JobId, who: Who) -> dict[str, Any]:
        """The evaluations the job reported (from its log, as the control plane read them),
        in order: what a tuner judges its trial by, from any machine."""
        plane.visible_job(who, _in_range(job_id))
        events = read_evals(plane.job_dir(job_id) / EVALS_FILE)
        return {"evals": [{"step": e.step, "epoch": e.epoch, "metrics": e.metrics} for e in events]}

    @app.post("/v1/jobs/{job_id}/resume")
    def resume(job_id: JobId, body: ResumeBody, who: Who) -> dict[str, Any]:
        """A paused tuning trial goes on (its study promoted it), to `until_epoch` or the end."""
        return jsonable_encoder(plane.resume(who, _in_range(job_id), body.until_epoch, body.reason))  # type: ignore[no-any-return]

    @app.post("/v1/jobs/{job_id}/prune")
    def prune(job_id: JobId, body: PruneBody, who: Who) -> dict[str, Any]:
        """A paused tuning trial ends for good (its study pruned it at its rung)."""
        return jsonable_encoder(plane.prune(who, _in_range(job_id), body.reason))  # type: ignore[no-any-return]

    @app.get("/v1/cluster")
    def cluster(who: Who) -> dict[str, Any]:
        return {
            "gpus": jsonable_encoder(plane.store.list_gpus()),
            "teams": jsonable_encoder(plane.store.list_teams()),
        }

    @app.get("/v1/cost")
    def cost(
        who: Who,
        team: Annotated[TeamName | None, Query()] = None,
        since: Annotated[float | None, Query(allow_inf_nan=False, description="a Unix time")] = None,
    ) -> dict[str, Any]:
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
