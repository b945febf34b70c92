"""The lab's dashboard (issue 36): HTML pages that ``sftctl server`` serves at ``/``, over the
same :mod:`sftctl.api` calls and the same per-user rules as its JSON API (:mod:`.app`).

Pages (server-rendered with Jinja2 from ``sftctl/web/templates``; htmx and uPlot vendored in
``sftctl/web/static``, no build step, no CDN):

=============================  ===================================================================
``GET  /``                     redirects to ``/ui/jobs``
``GET  /ui/login``             the sign-in form; ``POST`` it with ``token``: the session cookie
``POST /ui/logout``            forgets the cookie
``GET  /ui/jobs``              the user's jobs (an admin's: everyone's): owner, status, offering,
                               steps, cost so far, forecast cost to finish, PRED vs ACTUAL step
                               (a measurement the controller refused: ``1e-09 s refused``);
                               ``?user&status&label`` filter (label: a substring of the name or id)
``GET  /ui/jobs/table``        the table alone (htmx swaps it in)
``GET  /ui/stream``            server-sent events: ``jobs`` whenever the table would change
``GET  /ui/jobs/{job}``        one job: loss, tokens/s and step time per rank (the plan's
                               predicted step and its interval beside the measured one), GPU
                               curves per node, health verdicts, replacements and events, logs
``GET  /ui/jobs/{job}/stream``  server-sent events: ``points`` (new steps and GPU points, JSON)
``GET  /ui/jobs/{job}/logs``   the log tail as HTML (``?q``: lines containing it; ``?n``: how many)
``POST /ui/jobs/{job}/down``   ``sftctl down JOB`` (a CSRF token in ``X-CSRF-Token`` or ``csrf``)
``POST /ui/jobs/{job}/start``  the server starts the job's controller (as ``POST /v1/jobs/{job}/start``)
``GET  /ui/costs``             cost by user (an admin's: every user, and the lab) over ``?days``
``GET  /ui/plan``              a form: paste a job spec (YAML)
``POST /ui/plan``              ``spec`` (and ``csrf``): the offerings ranked as ``sftctl plan`` shows
                               them (its top :data:`PLAN_TOP`, each at its best region), the pick's
                               reason, or the spec's error in one line (an infeasible job: every
                               offering with why it cannot run); an action (CSRF, write rate)
``GET  /ui/static/...``        the vendored files
=============================  ===================================================================

Sign-in: the page asks for the user's token once and keeps it in a cookie (:data:`COOKIE`:
HttpOnly, SameSite=Strict, Secure when the request came over HTTPS, Path ``/ui``, 30 days or
the token's expiry). Every request under ``/ui/`` checks it through the JSON API's own
``authenticate`` (an unknown, removed or expired token: back to the sign-in page), so a user sees
and acts on the same jobs as through the API: another user's job is a 404, admins see all.
Actions (POST) also need the session's CSRF token (an HMAC of the token, in the page) and,
when the browser sends an ``Origin``, this server's own (as sign-in does), are
rate limited per user as the API's writes are (``SFTCTL_SERVER_WRITES_PER_MINUTE``), and an
admin's down of another user's job is audited. :class:`~sftctl.server.guard.Guard` lets ``/``
and ``/ui/`` through (:data:`~sftctl.server.guard.OPEN_PREFIXES`): this module authenticates them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
import urllib.parse
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse

from sftctl import api
from sftctl.errors import SftctlError
from sftctl.plan_wording import format_hours
import sftctl.server.guard as guard
import sftctl.server.users as users
from sftctl.server.users import User

#: the session cookie's name (its value: the user's token; HttpOnly, SameSite=Strict)
COOKIE = "sftctl_session"
#: seconds a session cookie lasts at most (less when the token expires sooner)
SESSION_S = 30 * 86400
#: seconds between two reads of the state for a page's server-sent events
STREAM_POLL_S = 2.0
#: seconds a page's event stream lasts before the browser reconnects (EventSource does)
STREAM_LIFE_S = 300.0
#: the most step points per rank a job page draws (the newest kept; the state keeps at most
#: STEP_SERIES_CAP per rank anyway)
PAGE_STEPS = 20_000
#: the offerings the plan page shows (``sftctl plan``'s ``--top`` default; each at its best region)
PLAN_TOP = 10

WEB = Path(__file__).resolve().parent.parent / "web"


class _Redirect(Exception):
    def __init__(self, to: str):
        self.to = to


def csrf_token(token: str) -> str:
    """The session's CSRF token: an HMAC of its (secret) token, so a page of another origin cannot
    know it, and the server keeps nothing per session."""
    return hmac.new(token.encode(), b"sftctl-web-csrf", hashlib.sha256).hexdigest()[:40]


def _fmt_usd(x) -> str:
    return "–" if x is None else f"${x:,.2f}"


def _fmt_s(x) -> str:
    if x is None:
        return "–"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def forecast_usd(view) -> float | None:
    """The job's cost when it finishes: its cost so far plus its remaining steps at the measured
    step time (the predicted one before any is measured or when it is refused,
    ``measured_refused``; a job without a prediction, which
    status does not measure against one: the mean of its ranks' latest reported step times) at
    its price (USD; None: unknown)."""
    cost, st, rec = view.cost, view.step_time or {}, view.record
    if cost is None or cost.usd is None:
        return None
    if rec.status.terminal:
        return cost.usd
    steps = (rec.spec.get("train") or {}).get("steps")
    # a measurement beyond the bound the run history keeps (a clock glitch's 1e308 s) prices nothing
    step_s = (None if st.get("measured_refused") else st.get("measured_s")) or st.get("predicted_s")
    if not step_s:
        reported = [r.step_time_s for r in view.ranks if r.step_time_s]
        step_s = sum(reported) / len(reported) if reported else None
    if not steps or not step_s or cost.price_per_hour is None:
        return None
    left = max(0, int(steps) - int(view.step or 0))
    nodes = int((rec.spec.get("resources") or {}).get("nodes") or 1)
    return cost.usd + left * float(step_s) / 3600.0 * nodes * cost.price_per_hour


def refused_actual(st: dict | None) -> dict | None:
    """A job's measured step the controller refused (``step_time``'s ``measured_refused``: beyond
    :data:`~sftctl.controller.common.MEASURED_MAX_FACTOR` of the model's step) in status's words:
    ``cell``, ACTUAL as the CLI's table shows it (``1e-09 s refused``), and ``why`` (``refused:
    1.43e-06 x the model's 700.0 us, not learned from``); None: not refused."""
    if not st or not st.get("measured_refused"):
        return None
    from sftctl.ui import refused_words, step_time_cells

    return {"cell": step_time_cells(st)[1], "why": refused_words(st)}


def mount(app: FastAPI, supervisor, authenticate, render, on_write) -> None:
    """Add the pages to ``app``. ``authenticate(authorization_header) -> User`` is the JSON API's
    (it raises a 401's :class:`SftctlError`), ``render(error) -> (status, document)`` its error
    shape (a page answers with the same status); ``on_write()`` is called after a down or start
    (the API forgets its cached lists)."""
    from fastapi.staticfiles import StaticFiles
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    from sftctl import settings
    env = Environment(loader=FileSystemLoader(str(WEB / "templates")), autoescape=select_autoescape(["html"]))
    env.filters.update(usd=_fmt_usd, secs=_fmt_s,
                       when=lambda t: "–" if t is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(t)))
    limiter = guard.RateLimiter(settings.get("SFTCTL_SERVER_WRITES_PER_MINUTE"))
    app.mount("/ui/static", StaticFiles(directory=str(WEB / "static")), name="ui-static")

    def page(name: str, status: int = 200, **context) -> HTMLResponse:
        return HTMLResponse(env.get_template(name).render(**context), status_code=status)

    def session(request: Request) -> tuple[User, str]:
        """The request's user and token, from the session cookie, checked as the API checks a
        bearer token (unknown, removed or expired: back to sign-in; any other error, the state
        unreachable among them, is the page's error and the session stays)."""
        token = request.cookies.get(COOKIE, "")
        if not token:
            raise _Redirect("/ui/login")
        try:
            return authenticate(f"Bearer {token}"), token
        except SftctlError as e:
            if render(e)[0] != 401:
                raise
            raise _Redirect("/ui/login?" + urllib.parse.urlencode({"error": e.message})) from None

    async def checked_write(request: Request, user: User, token: str) -> None:
        """An action's origin, CSRF token (header or form field) and the user's write rate."""
        cross_origin(request)
        sent = request.headers.get("x-csrf-token")
        if sent is None:
            form = urllib.parse.parse_qs((await request.body()).decode("utf-8", "replace"))
            sent = (form.get("csrf") or [""])[0]
        if not hmac.compare_digest(sent, csrf_token(token)):
            raise guard_error(403, "the action's CSRF token is missing or wrong: reload the page")
        wait_s = limiter.take(user.name)
        if wait_s > 0:
            raise guard_error(429, f"too many actions: try again in {int(wait_s + 0.999)} s")

    def cross_origin(request: Request) -> None:
        """A POST whose ``Origin`` (browsers send it) is another site's: 403."""
        origin = request.headers.get("origin")
        if origin and origin != "null" and urllib.parse.urlsplit(origin).netloc != request.headers.get("host"):
            raise guard_error(403, f"a request from {origin[:80]} may not act on this server's pages")

    def guard_error(status: int, message: str) -> "_PageError":
        return _PageError(status, message)

    def owned(user: User, job: str) -> str:
        """The API's rule (:func:`sftctl.server.users.owned_job`): the job's full id, else 404."""
        return users.owned_job(user, job, hint="the jobs page lists yours")

    def guarded(handler):
        """Run a page handler: a missing session redirects to sign-in; an SftctlError is an
        HTML page with the API's status code."""
        import functools
        import inspect

        @functools.wraps(handler)
        async def run(request: Request, **kw):
            try:
                user, token = await _thread(session, request)
                if request.method == "POST":
                    await checked_write(request, user, token)
                return await _thread(functools.partial(handler, request, user, token, **kw))
            except _Redirect as r:
                if request.headers.get("hx-request"):
                    return Response(status_code=204, headers={"HX-Redirect": r.to})
                return RedirectResponse(r.to, status_code=303)
            except _PageError as e:
                return page("error.html", e.status, message=e.message, user=None)
            except SftctlError as e:
                code, _ = render(e)
                return page("error.html", code, message=e.message, hint=e.hint, user=None)

        run.__signature__ = inspect.Signature(
            [inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)]
            + [p for name, p in inspect.signature(handler).parameters.items() if name not in ("request", "user", "token")])
        return run

    # ---------------------------------------------------------------- sign-in

    @app.get("/", include_in_schema=False)
    def root():
        return RedirectResponse("/ui/jobs", status_code=303)

    @app.get("/ui/login", include_in_schema=False)
    def login_form(error: str | None = None):
        return page("login.html", error=error, user=None)

    @app.post("/ui/login", include_in_schema=False)
    async def login(request: Request):
        try:
            cross_origin(request)  # no signing a browser in from another site
        except _PageError as e:
            return page("error.html", e.status, message=e.message, user=None)
        form = urllib.parse.parse_qs((await request.body()).decode("utf-8", "replace"))
        token = (form.get("token") or [""])[0].strip()
        try:
            user = await _thread(authenticate, f"Bearer {token}")
        except SftctlError as e:
            code, _ = render(e)
            if code != 401:  # not the token's fault (the state unreachable): say so, not "sign in"
                return page("error.html", code, message=e.message, hint=e.hint, user=None)
            return page("login.html", 401, error=e.message, user=None)
        max_age = SESSION_S if user.expires_at is None else max(1, min(SESSION_S, int(user.expires_at - time.time())))
        out = RedirectResponse("/ui/jobs", status_code=303)
        out.set_cookie(COOKIE, token, max_age=max_age, path="/ui", httponly=True, samesite="strict",
                       secure=request.url.scheme == "https")
        return out

    @app.post("/ui/logout", include_in_schema=False)
    def logout():
        out = RedirectResponse("/ui/login", status_code=303)
        out.delete_cookie(COOKIE, path="/ui")
        return out

    # ---------------------------------------------------------------- jobs

    def job_rows(user: User, who: str | None, status: str | None, label: str | None) -> list[dict]:
        views = api.status()
        if not user.admin:
            views = [v for v in views if v.record.owner == user.name]
        rows = []
        for v in views:
            rec = v.record
            if who and rec.owner != who or status and rec.status.value != status.upper() \
                    or label and label.lower() not in f"{rec.name} {rec.id}".lower():
                continue
            o, st = rec.offering, v.step_time or {}
            rows.append({"id": rec.id, "name": rec.name, "owner": rec.owner, "status": rec.status.value,
                         "terminal": rec.status.terminal,
                         "offering": f"{o.provider} {o.accelerator}:{o.count}" if o else (rec.provider or "–"),
                         "nodes": (rec.spec.get("resources") or {}).get("nodes"),
                         "step": v.step, "steps": (rec.spec.get("train") or {}).get("steps") if v.ranks else None,
                         "cost": v.cost.usd if v.cost else None, "forecast": forecast_usd(v),
                         "pred": st.get("predicted_s"), "actual": st.get("measured_s"),
                         "difference": st.get("difference"), "refused": refused_actual(st),
                         "created_at": rec.created_at})
        return rows

    def table_context(request: Request, user: User, token: str) -> dict:
        q = request.query_params
        who, status, label = q.get("user") or None, q.get("status") or None, q.get("label") or None
        return {"user": user, "csrf": csrf_token(token), "rows": job_rows(user, who, status, label),
                "filters": {"user": who or "", "status": status or "", "label": label or ""}}

    @app.get("/ui/jobs", include_in_schema=False)
    @guarded
    def jobs_page(request, user, token):
        return page("jobs.html", **table_context(request, user, token))

    @app.get("/ui/jobs/table", include_in_schema=False)
    @guarded
    def jobs_table(request, user, token):
        return page("_jobs_table.html", **table_context(request, user, token))

    @app.get("/ui/stream", include_in_schema=False)
    @guarded
    def jobs_stream(request, user, token):
        def fingerprint() -> str:
            rows = job_rows(user, None, None, None)
            return json.dumps([(r["id"], r["status"], r["step"]) for r in rows])

        async def events():  # on the event loop: an open page holds no worker thread
            import anyio

            last, end = None, time.monotonic() + STREAM_LIFE_S
            yield "retry: 2000\n\n"
            while time.monotonic() < end:
                now = await _thread(fingerprint)
                if now != last:
                    last = now
                    yield f"event: jobs\ndata: {len(now)}\n\n"
                else:
                    yield ": idle\n\n"
                await anyio.sleep(STREAM_POLL_S)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    @app.get("/ui/jobs/{job}", include_in_schema=False)
    @guarded
    def job_page(request, user, token, job: str):
        job_id = owned(user, job)
        view = api.status(job_id)
        data = _series(job_id, None, None)
        events = api.events(job_id)
        return page("job.html", user=user, csrf=csrf_token(token), view=view, job=view.to_dict(),
                    forecast=forecast_usd(view), refused=refused_actual(view.step_time), events=events,
                    data=json.dumps(data),
                    replacements=[e for e in events if e.kind in ("replace", "replaced", "recover", "spot", "elastic")])

    @app.get("/ui/jobs/{job}/stream", include_in_schema=False)
    @guarded
    def job_stream(request, user, token, job: str, after: float = 0.0, gpu_after: float = 0.0, cursors: str = ""):
        job_id = owned(user, job)
        ranks, nodes = _cursors(cursors)

        async def events():  # on the event loop: an open page holds no worker thread
            import anyio

            end = time.monotonic() + STREAM_LIFE_S
            status = None
            yield "retry: 2000\n\n"
            while time.monotonic() < end:
                doc = await _thread(_new_points, job_id, ranks, nodes, after, gpu_after)
                rec = await _thread(api.job, job_id)
                if doc["ranks"] or doc["gpus"] or rec.status.value != status:
                    status = rec.status.value
                    doc["status"] = status
                    yield f"event: points\ndata: {json.dumps(doc)}\n\n"
                else:
                    yield ": idle\n\n"
                if rec.status.terminal:
                    yield "event: ended\ndata: {}\n\n"
                    return
                await anyio.sleep(STREAM_POLL_S)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    @app.get("/ui/jobs/{job}/logs", include_in_schema=False)
    @guarded
    def job_logs(request, user, token, job: str, q: str = "", n: int = 200):
        import collections

        job_id = owned(user, job)
        # only the last n kept while the log streams by: a job's log may be of any size (the whole
        # of a 256 MiB one held here took 390 MB of the server's memory per refresh)
        kept: collections.deque[str] = collections.deque(maxlen=max(1, min(n, 5000)))
        for line in api.logs(job_id):
            text = f"{line.prefix}{line.text}" if line.prefix else line.text
            if not q or q.lower() in text.lower():
                kept.append(text)
        return page("_logs.html", lines=list(kept), q=q)

    @app.post("/ui/jobs/{job}/down", include_in_schema=False)
    @guarded
    def job_down(request, user, token, job: str):
        job_id = owned(user, job)
        users.down_job(user, job_id, via=" (web)")
        on_write()
        if request.headers.get("hx-request"):
            return page("_jobs_table.html", **table_context(request, user, token)) \
                if request.headers.get("hx-target") == "jobs" else Response(status_code=204, headers={"HX-Refresh": "true"})
        return RedirectResponse(f"/ui/jobs/{job_id}", status_code=303)

    @app.post("/ui/jobs/{job}/start", include_in_schema=False)
    @guarded
    def job_start(request, user, token, job: str):
        job_id = owned(user, job)
        if api.job(job_id).status.terminal:
            raise SftctlError(f"job {job_id} already ended: there is nothing to start", hint="sftctl run SPEC starts a new job")
        supervisor.start(job_id)
        on_write()
        if request.headers.get("hx-request"):
            return Response(status_code=204, headers={"HX-Refresh": "true"})
        return RedirectResponse(f"/ui/jobs/{job_id}", status_code=303)

    @app.get("/ui/costs", include_in_schema=False)
    @guarded
    def costs_page(request, user, token, days: str = ""):
        text = days.strip()
        try:
            n = float(text) if text else None
        except ValueError:
            n = math.nan
        if n is not None and not 0 < n < math.inf:
            return page("costs.html", 400, user=user, csrf=csrf_token(token), rows=[], lab=[], days=text,
                        error=f"days: {text!r} is not a number of days above 0: e.g. 7, or empty for all time")
        since = time.time() - n * 86400 if n else None
        rows = api.costs("user", since)
        if not user.admin:
            rows = [r for r in rows if r.group == user.name]
        lab = api.costs("lab", since) if user.admin else []
        return page("costs.html", user=user, csrf=csrf_token(token), rows=rows, lab=lab, days=text)

    @app.get("/ui/plan", include_in_schema=False)
    @guarded
    def plan_form(request, user, token):
        return page("plan.html", user=user, csrf=csrf_token(token), spec="", plan=None)

    @app.post("/ui/plan", include_in_schema=False)
    @guarded
    def plan_post(request, user, token):
        import anyio

        form = urllib.parse.parse_qs(anyio.from_thread.run(request.body).decode("utf-8", "replace"))
        text = (form.get("spec") or [""])[0].replace("\r\n", "\n")
        context = {"user": user, "csrf": csrf_token(token), "spec": text}
        if not text.strip():
            return page("plan.html", 400, **context, plan=None, error="spec: paste a job spec (YAML) to plan",
                        hint="name, resources and run at least: see examples/quickstart.yaml")
        try:
            with guard.collected_warnings() as caught:  # this request's own, while others plan beside it
                # the text is always the spec, never a path on the server (a trailing newline says so);
                # ${VAR} resolves from the user's secrets, as the server's submit does
                spec = api._load(text.rstrip("\n") + "\n", (), None, api._secret_environ(user.name))[0]
                _check_workdir(spec.workdir, user.name)
                chosen = api.plan(spec)
        except SftctlError as e:
            code, _ = render(e)
            candidates = getattr(e, "candidates", None) or []
            return page("plan.html", code, **context, error=e.message, hint=e.hint,
                        plan=plan_view(candidates, None) if candidates else None)
        return page("plan.html", **context, plan=plan_view(chosen.candidates, chosen.reason), warnings=caught)


def _check_workdir(workdir: str, owner: str) -> None:
    """The plan page traces the pasted spec's model from its workdir (in a sandbox, the files
    read-only): with ``server.workdir_roots`` set, a workdir outside ``owner``'s roots is refused
    as the submit route refuses it, so no user has another's code run and its errors shown.

    Raises:
        Forbidden: the workdir lies outside the owner's roots (403).
    """
    from sftctl.providers import workdir_roots

    problem = workdir_roots.refusal(workdir, owner)
    if problem is not None:
        raise guard.Forbidden(problem, hint=workdir_roots.HINT)


def plan_view(candidates: list, reason: str | None) -> dict:
    """The plan page's table: :func:`sftctl.ui.plan_rows`' rows (the CLI's top
    :data:`PLAN_TOP`, each offering at its best region), each a dict of the CLI's columns
    (``step_s``: the step as ``sftctl plan`` shows it, seconds; ``usd_per_hour``, ``total_usd``:
    USD; ``memory_gib``: peak GiB), the line saying what was left out, and the pick's reason."""
    from sftctl.ui import plan_rows

    shown, members, left_out = plan_rows(candidates, PLAN_TOP)
    rows = []
    for i, c in enumerate(shown):
        o = c.offering
        learned = (getattr(c, "learned", None) or {})
        learned = learned.get("runs") or learned.get("other_accelerator_runs")
        verdict = ("chosen" if i == 0 and reason else "ok") if c.rejected is None else c.rejected.message
        rows.append({"rank": i + 1, "provider": o.provider, "instance": o.instance_type,
                     "accelerator": f"{o.accelerator}:{o.count}", "nodes": c.nodes, "region": o.region,
                     "other_regions": len(members[i]) - 1, "usd_per_hour": c.usd_per_hour,
                     "step_s": c.calibrated_step_s if learned else c.step_time_s,
                     "memory_gib": None if c.peak_memory_bytes is None else c.peak_memory_bytes / 2**30,
                     "hours": format_hours(c.hours), "total_usd": c.total_usd,
                     "verdict": verdict, "feasible": c.rejected is None})
    notes = list(dict.fromkeys(c.note for c in shown if getattr(c, "note", None)))
    return {"rows": rows, "left_out": left_out, "reason": reason, "notes": notes}


class _PageError(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


async def _thread(fn, *args):
    """``fn(*args)`` in a worker thread (it reads the state)."""
    import anyio

    return await anyio.to_thread.run_sync(fn, *args)


def _cursors(text: str) -> tuple[dict[int, float], dict[int, float]]:
    """A job page's ``cursors`` (JSON ``{"ranks": {RANK: TS}, "nodes": {NODE: TS}}``: each rank's
    newest step and each node's newest GPU sample the page has drawn, Unix seconds) as two dicts.

    Raises:
        _PageError: 400, the text is not that shape or a time is not a finite number.
    """
    if not text:
        return {}, {}
    try:
        doc = json.loads(text)
        out = tuple({int(k): float(v) for k, v in (doc.get(key) or {}).items()} for key in ("ranks", "nodes"))
    except (ValueError, TypeError, AttributeError):
        out = None
    if out is None or not all(math.isfinite(v) for d in out for v in d.values()):
        raise _PageError(400, 'cursors: expected {"ranks": {RANK: TS}, "nodes": {NODE: TS}}, finite Unix seconds: '
                              "reload the job's page")
    return out[0], out[1]


def _new_points(job_id: str, ranks: dict[int, float], nodes: dict[int, float], after: float,
                gpu_after: float) -> dict:
    """The points of a job's curves that its page has not drawn, in :func:`_series`' shape: each
    rank's steps reported after that rank's cursor (``ranks``: rank -> the ``ts`` of its newest
    drawn step), each node's GPU samples after that node's (``nodes``); a rank or node with no
    cursor yet: those after ``after`` / ``gpu_after`` (0: all). Moves the cursors past what it
    returns. Each node stamps its points with its own clock, so one cursor over all of them missed
    every new point of a node whose clock is behind the others' (issue: the curve stops growing).
    Reads the ranks that reported (one row each) and the job's node count, then only new rows."""
    from sftctl.state import Store

    store = Store()
    try:
        reporting = {m.rank for m in store.metrics(job_id)}
        steps = [s for s in store.step_series(job_id, after=min(ranks.values())) if s.ts > ranks.get(s.rank, math.inf)] \
            if ranks else []
        for rank in sorted(reporting - ranks.keys()):
            steps += store.step_series(job_id, rank=rank, after=after or None)
        gpus = [p for p in store.gpu_series(job_id, since=min(nodes.values())) if p.ts > nodes.get(p.node_rank, math.inf)] \
            if nodes else []
        rec = store.get_job(job_id)
        count = int(((rec.spec if rec else {}).get("resources") or {}).get("nodes") or 1)
        for node in range(count):
            if node not in nodes:
                gpus += [p for p in store.gpu_series(job_id, node_rank=node, since=gpu_after or None)
                         if p.ts > gpu_after]
    finally:
        store.close()
    for s in steps:
        ranks[s.rank] = max(ranks.get(s.rank, s.ts), s.ts)
    for p in gpus:
        nodes[p.node_rank] = max(nodes.get(p.node_rank, p.ts), p.ts)
    return _curves(steps, gpus)


def _series(job_id: str, after_ts: float | None, gpu_after: float | None) -> dict:
    """A job's curves as the page draws them: ``{"ranks": {rank: {"step", "ts", "loss",
    "tokens_per_s", "step_time_s"}}, "gpus": {node: {gpu: {"ts", "util", "temp", "power",
    "memory", "clock", "xids"}}}}``, each a list (GPU measures: the bucket's max); only points
    after ``after_ts`` / ``gpu_after`` (Unix seconds) when given."""
    from sftctl.state import Store

    store = Store()
    try:
        steps = store.step_series(job_id, after=after_ts or None)
        gpus = store.gpu_series(job_id, since=gpu_after + 1e-6 if gpu_after else None)
    finally:
        store.close()
    return _curves(steps, gpus)


def _curves(steps: list, gpus: list) -> dict:
    """:func:`_series`' document from step records and GPU points."""
    ranks: dict = {}
    for s in steps:
        r = ranks.setdefault(s.rank, {"step": [], "ts": [], "loss": [], "tokens_per_s": [], "step_time_s": []})
        r["step"].append(s.step)
        r["ts"].append(s.ts)
        r["loss"].append(s.loss)
        r["tokens_per_s"].append(s.tokens_per_s)
        r["step_time_s"].append(s.step_time_s)
    for r in ranks.values():
        for k in r:
            r[k] = r[k][-PAGE_STEPS:]
    nodes: dict = {}
    for p in gpus:
        g = nodes.setdefault(p.node_rank, {}).setdefault(p.gpu, {"ts": [], "util": [], "temp": [], "power": [],
                                                                  "memory": [], "clock": [], "xids": []})
        g["ts"].append(p.ts)
        g["util"].append(p.util_pct_max)
        g["temp"].append(p.temp_c_max)
        g["power"].append(p.power_w_max)
        g["memory"].append(p.memory_mib_max)
        g["clock"].append(p.sm_clock_mhz_min)
        g["xids"].append(p.xids)
    return {"ranks": ranks, "gpus": nodes}
