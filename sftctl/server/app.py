"""The server's REST API: :mod:`sftctl.api` over HTTP, one user's jobs at a time.

Routes (JSON; every one but ``/v1/health`` needs ``Authorization: Bearer <token>``):

==========================  ==============================================================
``GET  /v1/health``         ``{"ok": true, "version", "reconciles"}`` (liveness and readiness
                            probes; reconciliations of state with live controllers so far)
``GET  /v1/whoami``         ``{"name", "admin"}``
``POST /v1/jobs``           submit: ``{"spec_text", "spec_path", "overrides"}`` ->
                            ``{"job": JobRecord.to_dict(), "warnings": [line, ...]}``
``POST /v1/jobs/{job}/start``  the server starts the job's controller -> the job's view
``GET  /v1/jobs``           ``{"jobs": [view, ...]}``, newest first; ``?all_users=true``: an
                            admin's view of every user's jobs. At most :data:`LIST_CACHE_S` old
                            (concurrent polls share one read of the state), never older than a
                            submit, start or down through this server
``GET  /v1/jobs/{job}``     one job's view in detail
``GET  /v1/jobs/{job}/events``  ``{"events": [Event.to_dict(), ...]}``
``GET  /v1/jobs/{job}/logs``    ``?follow&node&rank``: JSON lines ``{"text", "rank", "prefix",
                            "notice"}``, streamed as the nodes write them
``GET  /v1/costs``          ``?by=user|lab&since&until`` -> ``{"costs": [CostTotal.to_dict()]}``: a
                            user's own row; ``lab`` and every user's rows for admins
``POST /v1/down``           ``{"job" | "all", "purge"}`` -> ``{"down": [DownResult.to_dict()]}``
``POST /v1/orphans``        admins: ``down --orphans`` here -> ``{"swept": [line], "checked": [provider]}``
==========================  ==============================================================

A view is :meth:`sftctl.api.JobView.to_wire` (records whole), so a client's ``to_dict()`` is
the document ``status --json`` prints here. ``{job}`` is an id or a unique prefix among the jobs
the user may see: another user's job is "no job" (404), never a hint that it exists. An error is
``{"error", "hint", "exit_code", "kind"}`` with 401 (no or unknown token; exit 4), 403 (not an
admin; exit 2), 404 (no such job of yours; exit 2), 400 (any other
:class:`~sftctl.errors.SftctlError`, its own exit code) or 500 (a bug; exit 1).
"""

from __future__ import annotations

import json
import logging
import threading
import warnings

from fastapi import Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sftctl import __version__, api
from sftctl.errors import ExitCode, NotFoundError, ProviderError, SftctlError, SftctlWarning
from sftctl.server.users import User, job_ids, user_for_token


class Unauthorized(ProviderError):
    """No token, or one no user has (HTTP 401; exit 4 as other credentials errors)."""


class Forbidden(SftctlError):
    """The user may not do this (HTTP 403; exit 2)."""


_STATUS = ((Unauthorized, 401), (Forbidden, 403), (NotFoundError, 404))


#: seconds a jobs list answers every user's poll of it: ten clients polling `status --json` at
#: once cost one read of the state, not ten (benchmarks/server_status.py)
LIST_CACHE_S = 1.0


class _Recent:
    """A value per key, built at most once per ``ttl_s`` seconds: callers that ask while it is
    being built wait for that build instead of starting their own."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._keys: dict = {}  # key -> [lock, built at (monotonic s), value]

    def get(self, key, build):
        import time

        with self._lock:
            entry = self._keys.setdefault(key, [threading.Lock(), -1e18, None])
        with entry[0]:
            if time.monotonic() - entry[1] > self.ttl_s:
                entry[2], entry[1] = build(), time.monotonic()
            return entry[2]

    def clear(self) -> None:
        """Forget every value (a write through this server: a submit, start or down)."""
        with self._lock:
            self._keys.clear()


def _json(doc) -> Response:
    """``doc`` as JSON, encoded by :func:`json.dumps` alone: FastAPI's own encoder walks every
    value first (0.54 s for 1,000 jobs' views, against 0.04 s; benchmarks/server_status.py)."""
    return Response(json.dumps(doc, default=str), media_type="application/json")


def create_app(supervisor):
    """The FastAPI application; ``supervisor`` (:class:`sftctl.server.Supervisor`) starts the
    controllers of the jobs submitted to it."""
    app = FastAPI(title="sftctl server", version=__version__)
    submitting = threading.Lock()  # one plan at a time (CPU-bound; keeps each request's warnings its own)
    lists = _Recent(LIST_CACHE_S)

    def error_doc(e: SftctlError) -> dict:
        return {"error": e.message, "hint": e.hint, "exit_code": int(e.exit_code), "kind": type(e).__name__}

    @app.exception_handler(SftctlError)
    async def sftctl_error(request, e: SftctlError):
        code = next((c for cls, c in _STATUS if isinstance(e, cls)), 400)
        return JSONResponse(error_doc(e), status_code=code)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, e: RequestValidationError):
        where = "; ".join(f"{'.'.join(map(str, err.get('loc', ())))}: {err.get('msg')}" for err in e.errors())
        return JSONResponse({"error": f"bad request to {request.url.path}: {where}", "hint": "the client and the "
                             "server are different sftctl versions?", "exit_code": int(ExitCode.USAGE),
                             "kind": "SftctlError"}, status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        logging.getLogger("sftctl.server").error("%s %s", request.method, request.url.path, exc_info=e)
        return JSONResponse({"error": f"internal error on the server: {type(e).__name__}: {e}",
                             "hint": "the server's log has the traceback; please report it",
                             "exit_code": int(ExitCode.JOB_FAILED), "kind": "SftctlError"}, status_code=500)

    def current_user(request: Request) -> User:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("no token: every request needs Authorization: Bearer <token>",
                               hint="set server.token in the config file (or SFTCTL_SERVER_TOKEN)")
        user = user_for_token(token.strip())
        if user is None:
            raise Unauthorized("the server knows no user with this token",
                               hint="ask the server's admin for a token (sftctl server user add NAME)")
        return user

    def mine(user: User) -> set[str] | None:
        """The ids of the jobs ``user`` may see (None: every job, an admin's)."""
        return None if user.admin else job_ids(user)

    def owned(user: User, job: str) -> str:
        """The full id of ``job`` (an id or a unique prefix) among the user's jobs."""
        if user.admin:
            return api.job(job).id
        ids = mine(user)
        if job in ids:
            return job
        matches = sorted(i for i in ids if job.strip() and i.startswith(job))
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise NotFoundError(f"{job!r} matches {len(matches)} of your jobs", hint=f"give more of the id: {', '.join(matches[:5])}")
        raise NotFoundError(f"no job {job!r} of yours ({user.name}) on this server", hint="sftctl status lists your jobs")

    @app.get("/v1/health")
    def health():
        return {"ok": True, "version": __version__, "reconciles": supervisor.rounds}

    @app.get("/v1/whoami")
    def whoami(user: User = Depends(current_user)):
        return {"name": user.name, "admin": user.admin}

    @app.post("/v1/jobs")
    def submit(body: dict = Body(...), user: User = Depends(current_user)):
        text, label, overrides = body.get("spec_text"), body.get("spec_path"), body.get("overrides") or []
        if not isinstance(text, str) or not isinstance(label, str) or not all(isinstance(o, str) for o in overrides):
            raise SftctlError("submit needs spec_text, spec_path (strings) and overrides (a list of strings)",
                              hint="sftctl run SPEC with server.url set sends them")
        with submitting, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SftctlWarning)
            submitted = api.submit(text, overrides, origin=label, owner=user.name)
            lists.clear()
        return _json({"job": api.job(submitted.job_id).to_dict(),
                      "warnings": [str(w.message) for w in caught if issubclass(w.category, SftctlWarning)]})

    @app.post("/v1/jobs/{job}/start")
    def start(job: str, user: User = Depends(current_user)):
        job_id = owned(user, job)
        ended = api.job(job_id).status
        if ended.terminal:
            raise SftctlError(f"job {job_id} already ended ({ended.value}): there is nothing to start",
                              hint="sftctl run SPEC starts a new job")
        supervisor.start(job_id)
        lists.clear()
        return _json(api.status(job_id).to_wire())

    @app.get("/v1/jobs")
    def status_all(all_users: bool = False, user: User = Depends(current_user)):
        if all_users and not user.admin:
            raise Forbidden(f"--all-users: {user.name} is not an admin of this server", hint="sftctl status shows your jobs")
        def build() -> bytes:
            views = api.status()
            if not all_users:
                views = [v for v in views if v.record.owner == user.name]
            return json.dumps({"jobs": [v.to_wire() for v in views]}, default=str).encode()

        body = lists.get((None if all_users else user.name), build)
        return Response(body, media_type="application/json")

    @app.get("/v1/jobs/{job}")
    def status_one(job: str, user: User = Depends(current_user)):
        return _json(api.status(owned(user, job)).to_wire())

    @app.get("/v1/jobs/{job}/events")
    def events(job: str, user: User = Depends(current_user)):
        return _json({"events": [e.to_dict() for e in api.events(owned(user, job))]})

    @app.get("/v1/jobs/{job}/logs")
    def logs(job: str, follow: bool = False, node: int | None = None, rank: int | None = None,
             user: User = Depends(current_user)):
        lines = api.logs(owned(user, job), follow=follow, node=node, rank=rank)  # a bad --node raises here

        def stream():
            for line in lines:
                yield json.dumps({"text": line.text, "rank": line.rank, "prefix": line.prefix,
                                  "notice": line.notice}) + "\n"

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    @app.get("/v1/costs")
    def costs(by: str = "user", since: float | None = None, until: float | None = None,
              user: User = Depends(current_user)):
        if by == "lab" and not user.admin:
            raise Forbidden(f"costs by lab: {user.name} is not an admin of this server", hint="by user: your own jobs' cost")
        rows = api.costs(by, since, until)
        if not user.admin:
            rows = [r for r in rows if r.group == user.name]
        return _json({"costs": [r.to_dict() for r in rows]})

    @app.post("/v1/down")
    def down(body: dict = Body(...), user: User = Depends(current_user)):
        from sftctl.types import NodeState

        purge = bool(body.get("purge"))
        if body.get("all"):
            ids = mine(user)
            views = [v for v in api.status() if ids is None or v.id in ids]
            todo = [v.id for v in views if not v.status.terminal
                    or any(n.status != NodeState.TERMINATED for n in api.status(v.id).nodes)]
        else:
            todo = [owned(user, str(body.get("job") or ""))]
        results = [r.to_dict() for j in todo for r in api.down(j, purge=purge)]
        lists.clear()
        return _json({"down": results})

    @app.post("/v1/orphans")
    def orphans(user: User = Depends(current_user)):
        """``down --orphans`` on the server's machine: its state, its providers' credentials
        (an admin's request: it may stop what belongs to anyone)."""
        if not user.admin:
            raise Forbidden(f"down --orphans: {user.name} is not an admin of this server",
                            hint="sftctl down JOB takes down one of your jobs")
        checked: list[str] = []
        swept = api.down_orphans(checked)
        lists.clear()
        return _json({"swept": swept, "checked": checked})

    return app
