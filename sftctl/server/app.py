"""The server's REST API: :mod:`sftctl.api` over HTTP, one user's jobs at a time.

Routes (JSON; every one but ``/v1/health`` needs ``Authorization: Bearer <token>``):

==========================  ==============================================================
``GET  /v1/health``         ``{"ok": true, "version", "reconciles", "database": "up"}`` (liveness
                            and readiness probes; reconciliations of state with live controllers
                            so far); 503 with ``"ok": false, "database": "down"`` while a
                            Postgres state cannot be reached (a readiness probe takes the server
                            out of rotation); ``?live=true``: the process only, for a liveness
                            probe (restarting the server would not bring the database back)
``GET  /v1/whoami``         ``{"name", "admin"}``
``POST /v1/jobs``           submit: ``{"spec_text", "spec_path", "overrides"}`` ->
                            ``{"job": JobRecord.to_dict(), "warnings": [line, ...]}``; 403 for a
                            workdir outside the user's ``server.workdir_roots``
``POST /v1/jobs/{job}/start``  the server starts the job's controller -> the job's view
``GET  /v1/jobs``           ``{"jobs": [view, ...]}``, newest first; ``?all_users=true``: an
                            admin's view of every user's jobs. At most :data:`LIST_CACHE_S` old
                            (concurrent polls share one read of the state), never older than a
                            submit, start or down through this server
``GET  /v1/jobs/{job}``     one job's view in detail
``GET  /v1/jobs/{job}/events``  ``{"events": [Event.to_dict(), ...]}``
``GET  /v1/jobs/{job}/metrics``  ``?rank``: ``{"steps": [StepRecord.to_dict(), ...]}`` (api.metrics)
``GET  /v1/jobs/{job}/logs``    ``?follow&node&rank``: JSON lines ``{"text", "rank", "prefix",
                            "notice"}``, streamed as the nodes write them; a follow of a quiet
                            job sends a blank line every :data:`LOG_KEEPALIVE_S`
``GET  /v1/machines``       ``?provider&include_decayed`` -> ``{"machines": [BadMachine.to_dict()]}``:
                            the machines verdicts marked bad (``sftctl nodes``): a user's own jobs' only
``GET  /v1/costs``          ``?by=user|lab&since&until`` -> ``{"costs": [CostTotal.to_dict()]}``: a
                            user's own row; ``lab`` and every user's rows for admins
``POST /v1/down``           ``{"job" | "all", "purge"}`` -> ``{"down": [DownResult.to_dict()]}``
``POST /v1/orphans``        admins: ``down --orphans`` here -> ``{"swept": [line], "checked": [provider]}``
``GET  /v1/users``          admins: ``{"users": [User.to_dict(), ...]}`` (name, admin, created_at,
                            expires_at; never a token)
``POST /v1/users``          admins: ``{"name", "admin", "expires": days | "never" | null}`` ->
                            ``{"user", "token"}`` (the token shown this once)
``DELETE /v1/users/{name}``  admins: ``{"removed": name}``; its token fails the next request
``POST /v1/users/{name}/token``  admins: ``{"expires"}`` -> ``{"user", "token"}``: a new token,
                            the old one fails the next request
``GET  /v1/audit``          admins: ``?limit`` -> ``{"audit": [AuditEvent.to_dict(), ...]}``, oldest
                            first: users added/removed, tokens rotated, downs of another user's
                            job, orphans sweeps
``PUT  /v1/secrets/{name}``  ``{"value", "lab"}``: the requester's secret (``lab``: the lab's,
                            admins only; :mod:`sftctl.vault`) -> ``{"secret": Secret.to_dict()}``
``GET  /v1/secrets``        ``{"secrets": [Secret.to_dict(), ...]}``: the requester's and the
                            lab's, names and dates only, never a value
``DELETE /v1/secrets/{name}``  ``?lab=true``: the lab's (admins) -> ``{"removed", "scope"}``
``GET  /v1/calibrate``      ``{"runs": [run-history row]}``: what plans here learn from
``POST /v1/calibrate/runs`` ``{"runs": [row]}`` (predicted by the client's ``calibrate import``) ->
                            ``{"imported": n}``, all or none
``POST /v1/calibrate/forget``  admins: ``{"imported": bool, "source": label}`` -> ``{"forgotten": n}``
``GET  /``, ``/ui/...``     the dashboard's HTML pages (:mod:`sftctl.server.web`: a session cookie
                            checked by :func:`authenticate`, the same per-user rules)
==========================  ==============================================================

A view is :meth:`sftctl.api.JobView.to_wire` (records whole), so a client's ``to_dict()`` is
the document ``status --json`` prints here. ``{job}`` is an id or a unique prefix among the jobs
the user may see: another user's job is "no job" (404), never a hint that it exists. An error is
``{"error", "hint", "exit_code", "kind"}`` with 503 (the state database cannot be reached, with
``Retry-After``: one line, :data:`UNAVAILABLE`, never the database's URL, which goes to the
server's log; exit 4, and a follower retries), 401 (no, unknown or expired token; exit 4), 403
(not an admin, a workdir outside the user's roots; exit 2), 404 (no such job of yours; exit 2), 413 (a body over
``SFTCTL_SERVER_MAX_BODY_BYTES``; exit 2), 429 (a user's writes over
``SFTCTL_SERVER_WRITES_PER_MINUTE``, with ``Retry-After``; exit 4), 400 (any other
:class:`~sftctl.errors.SftctlError`, its own exit code) or 500 (a bug; exit 1). The token, the
body's size and the rate are checked by :class:`~sftctl.server.guard.Guard` before a route runs,
the token before any byte of the body is read.
"""

from __future__ import annotations

import json
import logging
import threading

from fastapi import Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sftctl import __version__, api
from sftctl.errors import ExitCode, NotFoundError, ProviderError, SftctlError, StateUnavailable
import sftctl.server.guard as guard
from sftctl.server.guard import Forbidden
import sftctl.server.users as users
from sftctl.server.users import User, job_ids, user_for_token


class Unauthorized(ProviderError):
    """No token, or one no user has (HTTP 401; exit 4 as other credentials errors)."""


#: what a user reads while the state database cannot be reached (the details: the server's log)
UNAVAILABLE = "the server's database is unavailable; try again shortly"
#: seconds a 503's ``Retry-After`` asks a client to wait
RETRY_AFTER_S = 5
#: seconds between the server log's lines about one state database outage (every request hits it)
DOWN_LOG_S = 60.0


class DatabaseDown(ProviderError):
    """The state database cannot be reached (HTTP 503 with ``Retry-After``; exit 4): one line
    for the user, :data:`UNAVAILABLE`, no hint."""

    retry_after_s = RETRY_AFTER_S

    def __init__(self) -> None:
        super().__init__(UNAVAILABLE)


_down_logged: dict = {"at": -1e18, "what": ""}


def database_down(e: BaseException) -> DatabaseDown:
    """The user's :class:`DatabaseDown` for ``e`` (a :class:`~sftctl.errors.StateUnavailable`,
    or psycopg's own error); ``e`` itself (the database's redacted URL, the driver's words) goes
    to the server's log, once per :data:`DOWN_LOG_S` seconds while it stays the same."""
    import time

    what = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
    now = time.monotonic()
    if what != _down_logged["what"] or now - float(_down_logged["at"]) > DOWN_LOG_S:
        _down_logged.update(at=now, what=what)
        logging.getLogger("sftctl.server").warning("state database unavailable (answering 503): %s", what)
    return DatabaseDown()


def _db_error(e: BaseException) -> bool:
    """Whether ``e`` is psycopg's error of a database it cannot reach (one the Store did not wrap)."""
    try:
        import psycopg
    except ImportError:
        return False
    return isinstance(e, psycopg.OperationalError)


_STATUS = ((Unauthorized, 401), (Forbidden, 403), (NotFoundError, 404), (guard.TooLarge, 413),
           (guard.RateLimited, 429), (DatabaseDown, 503))


def authenticate(authorization: str) -> User:
    """The user an ``Authorization: Bearer <token>`` header names.

    Raises:
        Unauthorized: no token, one no user has, or an expired one (exit 4).
    """
    import time

    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("no token: every request needs Authorization: Bearer <token>",
                           hint="set server.token in the config file (or SFTCTL_SERVER_TOKEN)")
    try:
        user = user_for_token(token.strip())
    except StateUnavailable as e:  # not the user's business: one line for them, the details logged
        raise database_down(e) from None
    if user is None:
        raise Unauthorized("the server knows no user with this token",
                           hint="ask the server's admin for a token (sftctl server user add NAME)")
    if user.expired():
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(user.expires_at))
        raise Unauthorized(f"the token of {user.name} expired on {when}",
                           hint=f"ask the server's admin for a new one (sftctl server user token rotate {user.name})")
    return user


#: seconds between a log follower's reads of the nodes' logs while they write nothing new
LOG_POLL_S = 0.5
#: seconds of a quiet job between the blank keep-alive lines of a log follow: the client takes a
#: stream silent for ``sftctl.remote.FOLLOW_READ_S`` (30 s) for a lost server
LOG_KEEPALIVE_S = 5.0

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


#: seconds a health probe waits for Postgres to accept a connection (psycopg's minimum is 2)
HEALTH_CONNECT_S = 3


def database_up() -> bool:
    """Whether the state database answers ``SELECT 1`` (a new connection, at most
    :data:`HEALTH_CONNECT_S` seconds to connect). A SQLite state is a file of this machine: True."""
    from sftctl import settings
    from sftctl.state.dialect import is_url

    url = settings.get("SFTCTL_STATE_URL")
    if not is_url(url):
        return True
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=HEALTH_CONNECT_S) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as e:
        database_down(e)  # logged (the details); the probe's answer says down
        return False
    return True


def create_app(supervisor):
    """The FastAPI application; ``supervisor`` (:class:`sftctl.server.Supervisor`) starts the
    controllers of the jobs submitted to it."""
    from sftctl import settings

    app = FastAPI(title="sftctl server", version=__version__)
    lists = _Recent(LIST_CACHE_S)
    max_overrides = settings.get("SFTCTL_SERVER_MAX_OVERRIDES")
    max_override_chars = settings.get("SFTCTL_SERVER_MAX_OVERRIDE_CHARS")

    def error_doc(e: SftctlError) -> dict:
        return {"error": e.message, "hint": e.hint, "exit_code": int(e.exit_code), "kind": type(e).__name__}

    def render(e: SftctlError) -> tuple[int, dict]:
        return next((c for cls, c in _STATUS if isinstance(e, cls)), 400), error_doc(e)

    def answer(e: SftctlError) -> JSONResponse:
        if isinstance(e, StateUnavailable):
            e = database_down(e)
        code, doc = render(e)
        after = getattr(e, "retry_after_s", None)
        return JSONResponse(doc, status_code=code, headers={"Retry-After": str(after)} if after else None)

    # the token before any byte of the body, a bounded body, each user's writes rate limited
    app.add_middleware(guard.Guard, authenticate=authenticate, render=render,
                       max_body_bytes=settings.get("SFTCTL_SERVER_MAX_BODY_BYTES"),
                       writes_per_minute=settings.get("SFTCTL_SERVER_WRITES_PER_MINUTE"))

    @app.exception_handler(SftctlError)
    async def sftctl_error(request, e: SftctlError):
        return answer(e)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, e: RequestValidationError):
        where = "; ".join(f"{'.'.join(map(str, err.get('loc', ())))}: {err.get('msg')}" for err in e.errors())
        return JSONResponse({"error": f"bad request to {request.url.path}: {where}", "hint": "the client and the "
                             "server are different sftctl versions?", "exit_code": int(ExitCode.USAGE),
                             "kind": "SftctlError"}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def no_such_route(request, e: StarletteHTTPException):
        """The API's routing errors (an unknown path, a method it does not take) in the API's
        error document, as every other error of ``/v1``; the dashboard's pages keep FastAPI's."""
        if not request.url.path.startswith("/v1/") or e.status_code not in (404, 405):
            from fastapi.exception_handlers import http_exception_handler

            return await http_exception_handler(request, e)
        what = "no such route" if e.status_code == 404 else "method not allowed on"
        return JSONResponse({"error": f"{what}: {request.method} {request.url.path}",
                             "hint": "sftctl and the server may be different versions (sftctl --version; "
                                     "GET /v1/health gives the server's)",
                             "exit_code": int(ExitCode.USAGE), "kind": "SftctlError"},
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        if _db_error(e):  # psycopg's own, not wrapped by the Store: still the database, not a bug
            return answer(database_down(e))
        logging.getLogger("sftctl.server").error("%s %s", request.method, request.url.path, exc_info=e)
        return JSONResponse({"error": f"internal error on the server: {type(e).__name__}: {e}",
                             "hint": "the server's log has the traceback; please report it",
                             "exit_code": int(ExitCode.JOB_FAILED), "kind": "SftctlError"}, status_code=500)

    def current_user(request: Request) -> User:
        """The request's user, as :class:`~sftctl.server.guard.Guard` authenticated it."""
        return request.scope.get(guard.USER_KEY) or authenticate(request.headers.get("authorization", ""))

    def mine(user: User) -> set[str] | None:
        """The ids of the jobs ``user`` may see (None: every job, an admin's)."""
        return None if user.admin else job_ids(user)

    owned = users.owned_job  # (user, job) -> the full id of one the user may act on, else 404

    def check_workdir(text: str, overrides: list[str], label: str, user: User) -> tuple | None:
        """With ``server.workdir_roots`` set: the spec's workdir (resolved, as submit records it)
        must lie in one of ``user``'s roots (:mod:`sftctl.providers.workdir_roots`), else
        :class:`Forbidden` (403, exit 2) before anything is recorded. Returns the spec loaded
        for the check (``_load``'s ``(spec, label, path)``), which submit then uses, not loading
        it again; None when the setting is unset. The local provider checks again where it
        binds the workdir into a node's sandbox."""
        from sftctl.providers import workdir_roots

        if workdir_roots.roots(user.name) is None:
            return None
        from sftctl.api._run import _secret_environ
        from sftctl.api._specs import _load

        loaded = _load(text, overrides, label, _secret_environ(user.name))  # as api.submit loads it
        problem = workdir_roots.refusal(loaded[0].workdir, user.name)
        if problem is not None:
            raise Forbidden(problem, hint=workdir_roots.HINT)
        return loaded

    @app.get("/v1/health")
    def health(live: bool = False):
        up = live or database_up()  # ?live=true: a liveness probe's (a restart would not bring Postgres back)
        doc = {"ok": up, "version": __version__, "reconciles": supervisor.rounds, "database": "up" if up else "down"}
        return JSONResponse(doc, status_code=200 if up else 503)

    @app.get("/v1/whoami")
    def whoami(user: User = Depends(current_user)):
        return {"name": user.name, "admin": user.admin}

    @app.post("/v1/jobs")
    def submit(body: dict = Body(...), user: User = Depends(current_user)):
        text, label, overrides = body.get("spec_text"), body.get("spec_path"), body.get("overrides") or []
        if not isinstance(text, str) or not isinstance(label, str) or not isinstance(overrides, list) \
                or not all(isinstance(o, str) for o in overrides):
            raise SftctlError("submit needs spec_text, spec_path (strings) and overrides (a list of strings)",
                              hint="sftctl run SPEC with server.url set sends them")
        if len(overrides) > max_overrides:
            raise SftctlError(f"--set: {len(overrides):,} overrides; this server takes at most {max_overrides:,}",
                              hint="put the values in the spec file (the server's admin sets SFTCTL_SERVER_MAX_OVERRIDES)")
        long = next((o for o in overrides if len(o) > max_override_chars), None)
        if long is not None:
            key = " ".join(long.partition("=")[0][:60].split())
            raise SftctlError(f"--set {key}=...: {len(long):,} characters; this server takes at most "
                              f"{max_override_chars:,} per override",
                              hint="put the value in the spec file (the server's admin sets "
                                   "SFTCTL_SERVER_MAX_OVERRIDE_CHARS)")
        with guard.collected_warnings() as caught:  # this request's own, while others plan beside it
            loaded = check_workdir(text, overrides, label, user)
            submitted = api.submit(text, overrides, origin=label, owner=user.name, loaded=loaded)
        lists.clear()
        return _json({"job": api.job(submitted.job_id).to_dict(), "warnings": caught})

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

    @app.get("/v1/jobs/{job}/metrics")
    def metrics(job: str, rank: int | None = None, user: User = Depends(current_user)):
        return _json({"steps": [s.to_dict() for s in api.metrics(owned(user, job), rank=rank)]})

    @app.get("/v1/jobs/{job}/logs")
    def logs(job: str, follow: bool = False, node: int | None = None, rank: int | None = None,
             user: User = Depends(current_user)):
        import time

        import anyio

        from sftctl.api._views import log_chunks

        # a bad --node raises here; poll_s 0: each read returns at once (an empty chunk when idle) and
        # the wait for more is on the event loop, so a follower holds none of the server's worker
        # threads between reads (45 followers of a quiet job held all 40: no request was answered)
        chunks = log_chunks(owned(user, job), follow=follow, node=node, rank=rank, poll_s=0)

        async def stream():  # one HTTP chunk per read of the nodes' logs, not per line
            sent = time.monotonic()
            while True:
                chunk = await anyio.to_thread.run_sync(next, chunks, None)
                if chunk is None:
                    return
                if not chunk:
                    if time.monotonic() - sent >= LOG_KEEPALIVE_S:  # a quiet job: say the server is there
                        sent = time.monotonic()
                        yield "\n"
                    await anyio.sleep(LOG_POLL_S)
                    continue
                sent = time.monotonic()
                yield "".join(json.dumps({"text": line.text, "rank": line.rank, "prefix": line.prefix,
                                          "notice": line.notice}) + "\n" for line in chunk)

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    @app.get("/v1/machines")
    def machines(provider: str | None = None, include_decayed: bool = False, user: User = Depends(current_user)):
        rows, ids = api.machines(provider, include_decayed), mine(user)  # issue 41: a user sees their jobs' only
        return _json({"machines": [m.to_dict() for m in rows if ids is None or m.job_id in ids]})

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
        results = []
        for j in todo:
            results += [r.to_dict() for r in users.down_job(user, j, purge=purge)]
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
        users.record(user.name, "orphans", None, f"{len(swept)} swept; checked {', '.join(checked) or 'nothing'}")
        lists.clear()
        return _json({"swept": swept, "checked": checked})

    # ------------------------------------------------------------ calibration: the lab's run history

    @app.get("/v1/calibrate")
    def calibrate_runs(user: User = Depends(current_user)):
        """The run history every plan here learns from; another user's job id is left out."""
        ids = mine(user)
        runs = [r.to_dict() | ({} if ids is None or r.job_id in ids else {"job_id": None}) for r in api.calibration_runs()]
        return _json({"runs": runs})

    @app.post("/v1/calibrate/runs")
    def calibrate_add(body: dict = Body(...), user: User = Depends(current_user)):
        """Imported runs, predicted by the client (its specs are its files), stored all at once."""
        n = api.calibrate_store(body.get("runs"))
        return _json({"imported": n})

    @app.post("/v1/calibrate/forget")
    def calibrate_forget(body: dict = Body(...), user: User = Depends(current_user)):
        """Admins: delete imported runs, or one source's (the history is the lab's)."""
        if not user.admin:
            raise Forbidden(f"calibrate forget: {user.name} is not an admin of this server",
                            hint="ask the server's admin; sftctl calibrate show lists the sources")
        n = api.calibrate_forget(imported=bool(body.get("imported")), source=body.get("source") or None)
        return _json({"forgotten": n})

    # ------------------------------------------------------------ secrets (per user; sftctl.vault)

    @app.put("/v1/secrets/{name}")
    def secret_put(name: str, body: dict = Body(...), user: User = Depends(current_user)):
        """Store the requester's secret (``lab``: the lab's, admins only); the value is never
        logged, echoed or put in an error."""
        lab, value = bool(body.get("lab")), body.get("value")
        if lab and not user.admin:
            raise Forbidden(f"secret set --lab: {user.name} is not an admin of this server",
                            hint=f"sftctl secret set {name} stores it as yours")
        if not isinstance(value, str):
            raise SftctlError(f"secret {name}: the request carries no value (a string)",
                              hint="sftctl secret set NAME sends it")
        secret = api.secret_set(name, value, lab=lab, owner=user.name)
        if lab:
            users.record(user.name, "secret.set", name, "lab secret")
        return _json({"secret": secret.to_dict()})

    @app.get("/v1/secrets")
    def secret_get(user: User = Depends(current_user)):
        return _json({"secrets": [s.to_dict() for s in api.secret_list(owner=user.name)]})

    @app.delete("/v1/secrets/{name}")
    def secret_delete(name: str, lab: bool = False, user: User = Depends(current_user)):
        if lab and not user.admin:
            raise Forbidden(f"secret rm --lab: {user.name} is not an admin of this server",
                            hint=f"sftctl secret rm {name} removes yours")
        api.secret_remove(name, lab=lab, owner=user.name)
        if lab:
            users.record(user.name, "secret.remove", name, "lab secret")
        return _json({"removed": name, "scope": "lab" if lab else "user"})

    # ------------------------------------------------------------ users and audit (admins)

    def admin_only(user: User, what: str) -> None:
        if not user.admin:
            raise Forbidden(f"{what}: {user.name} is not an admin of this server",
                            hint="ask the server's admin")

    def user_doc(name: str) -> dict:
        found = users.get_user(name)
        if found is None:
            raise NotFoundError(f"no user {name!r} on this server", hint="sftctl server user list shows them")
        return found.to_dict()

    @app.get("/v1/users")
    def users_list(user: User = Depends(current_user)):
        admin_only(user, "server user list")
        return _json({"users": [u.to_dict() for u in users.list_users()]})

    @app.post("/v1/users")
    def users_add(body: dict = Body(...), user: User = Depends(current_user)):
        admin_only(user, "server user add")
        name, expires = body.get("name"), body.get("expires")
        if not isinstance(name, str) or not isinstance(expires, (str, int, type(None))):
            raise SftctlError("user add needs name (a string) and expires (days, 'never' or null)",
                              hint="sftctl server user add NAME sends them")
        token = users.add_user(name, bool(body.get("admin")), expires, actor=user.name)
        return _json({"user": user_doc(name), "token": token})

    @app.delete("/v1/users/{name}")
    def users_remove(name: str, user: User = Depends(current_user)):
        admin_only(user, "server user remove")
        if name == user.name:
            raise SftctlError(f"{name} cannot remove themselves", hint="another admin can (or sftctl server user "
                              "remove --local on the server's machine)")
        user_doc(name)  # no such user: 404
        users.remove_user(name, actor=user.name)
        return _json({"removed": name})

    @app.post("/v1/users/{name}/token")
    def users_rotate(name: str, body: dict | None = Body(None), user: User = Depends(current_user)):
        admin_only(user, "server user token rotate")
        expires = (body or {}).get("expires")
        if not isinstance(expires, (str, int, type(None))):
            raise SftctlError("token rotate takes expires: days, 'never' or null", hint="sftctl server user token "
                              "rotate NAME --expires 30")
        user_doc(name)  # no such user: 404
        token = users.rotate_token(name, expires, actor=user.name)
        return _json({"user": user_doc(name), "token": token})

    @app.get("/v1/audit")
    def audit(limit: int | None = None, user: User = Depends(current_user)):
        admin_only(user, "server audit")
        return _json({"audit": [e.to_dict() for e in users.audit_events(limit)]})

    import sftctl.server.web as web  # the dashboard's pages: /, /ui/ (sftctl.server.web)
    web.mount(app, supervisor, authenticate, render, lists.clear)
    import sftctl.server.metrics as prometheus  # GET /metrics: jobs, queue, cost (Prometheus)
    prometheus.mount(app, authenticate, Forbidden)
    return app
