"""The server's Prometheus exposition at ``GET /metrics`` (issue 36): the lab's jobs, queue and
cost, written by ``prometheus-client`` (:func:`sftctl.health.prometheus.expose`).

=====================================  ==========================================================
``sftctl_jobs{status}``                jobs in the state per status (every status, 0 included)
``sftctl_queue_jobs``                  jobs waiting to start (PENDING: local admission, a dead
                                       controller's job before ``start``)
``sftctl_queue_oldest_wait_seconds``   seconds the oldest PENDING job has waited (0: none)
``sftctl_cost_usd{user}``              what each user's jobs cost so far, all time (USD;
                                       :func:`sftctl.api.costs` by user)
``sftctl_cost_node_hours{user}``       their node-hours, priced or not
``sftctl_cost_unpriced_jobs{user}``    their jobs with no price (no spot price in the catalog)
``sftctl_spend_usd_per_hour``          what the live jobs' nodes cost per hour now (price x nodes)
=====================================  ==========================================================

Who may read it: a request with ``Authorization: Bearer TOKEN`` where TOKEN is the server's
scrape token (:func:`scrape_token`: a secret for ``/metrics`` only, so a Prometheus holds no
user's token) or an admin's. No token or an unknown one: 401; a user who is not an admin: 403.
Every caller needs a token, the server's own machine included: a local job's sandboxed nodes
share the machine's network (loopback), and the exposition names every user and their cost.
:class:`~sftctl.server.guard.Guard` lets ``/metrics`` through (``WEB_PATHS``): this module
authenticates it.
"""

from __future__ import annotations

import hmac
import secrets
import time
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from sftctl.errors import SftctlError
from sftctl.paths import create_private_file, sftctl_home
from sftctl.types import User

#: the exposition's media type (Prometheus text format 0.0.4)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


#: the scrape token's file in the server's ``$SFTCTL_HOME`` when SFTCTL_SERVER_METRICS_TOKEN is unset
TOKEN_FILE = "metrics.token"
#: how Prometheus sends it: its scrape config's ``authorization`` (Bearer is its default type)
SCRAPE_HINT = ("Prometheus sends the server's scrape token with authorization: {credentials_file: FILE} "
               "(sftctl server metrics-token on the server's machine prints it), or use an admin's token")


def token_file() -> Path:
    """``$SFTCTL_HOME/metrics.token``: where :func:`scrape_token` keeps the token it made."""
    return sftctl_home() / TOKEN_FILE


def configured_server_url() -> str | None:
    """The server URL this machine's config names (``server.url``, ``SFTCTL_SERVER_URL``), or
    None. Where one is named this machine is that server's client, and a scrape token made here
    is not the server's (``sftctl server metrics-token`` refuses without ``--local``).

    Raises:
        SettingError: a malformed config file (exit 2).
    """
    from sftctl import settings

    return settings.get("SFTCTL_SERVER_URL") or None


def scrape_token() -> str:
    """The server's scrape token for ``/metrics``: ``SFTCTL_SERVER_METRICS_TOKEN`` (config
    ``server.metrics_token``), else the text of ``$SFTCTL_HOME/metrics.token``, made now when
    missing (256 random bits as URL-safe base64, 43 characters; mode 0600, written whole to a
    temporary file and linked into place, so two processes starting at once agree on one).

    Raises:
        SettingError: a malformed config file (exit 2).
        SftctlError: the file is readable by others, empty, or cannot be read or written (exit 2).
    """
    from sftctl import settings

    text = settings.get("SFTCTL_SERVER_METRICS_TOKEN")
    if text:
        return text
    path = token_file()
    if not path.exists():
        try:
            create_private_file(path, secrets.token_urlsafe(32) + "\n")  # the first process's token wins
        except OSError as e:
            raise SftctlError(f"{path}: cannot create the metrics scrape token: {e.strerror}",
                              hint="SFTCTL_HOME must be writable by the user the server runs as, or set "
                                   "SFTCTL_SERVER_METRICS_TOKEN") from None
    try:
        mode = path.stat().st_mode & 0o777
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise SftctlError(f"{path}: cannot read the metrics scrape token: {getattr(e, 'strerror', None) or e}",
                          hint="it belongs to the user the server runs as (mode 0600)") from None
    if mode & 0o077:
        raise SftctlError(f"{path}: the metrics scrape token is readable by others (mode {mode:o})",
                          hint=f"chmod 600 {path}")
    if not text:
        raise SftctlError(f"{path}: the metrics scrape token is empty",
                          hint=f"remove {path}: the server makes a new one (sftctl server metrics-token prints it)")
    return text


def token_source() -> str:
    """Where :func:`scrape_token` takes the token from, for a note: ``$SFTCTL_SERVER_METRICS_TOKEN``
    or the config file's line, else the token file's path."""
    from sftctl import settings

    if settings.get("SFTCTL_SERVER_METRICS_TOKEN"):
        return f"from {settings.origin('SFTCTL_SERVER_METRICS_TOKEN')}; the server must have the same"
    return f"kept in {token_file()}, the server's when its SFTCTL_HOME is this one"


def is_scrape_token(authorization: str) -> bool:
    """Whether an ``Authorization`` header carries the server's scrape token (``Bearer TOKEN``),
    compared in constant time (:func:`hmac.compare_digest`)."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    return hmac.compare_digest(token.strip().encode(), scrape_token().encode())


def render(now: float | None = None) -> str:
    """The exposition's text (see the module's table); ``now``: Unix seconds (default the clock)."""
    from prometheus_client.core import GaugeMetricFamily

    from sftctl import api
    from sftctl.health.prometheus import expose
    from sftctl.types import JobStatus

    now = time.time() if now is None else now
    views = api.status()  # in the server: its state, every user's jobs
    counts = {s.value: 0 for s in JobStatus}
    pending, spend = [], 0.0
    for v in views:
        counts[v.record.status.value] = counts.get(v.record.status.value, 0) + 1
        if v.record.status == JobStatus.PENDING:
            pending.append(v.record.created_at)
        elif not v.record.status.terminal and v.cost is not None and v.cost.price_per_hour is not None:
            nodes = int((v.record.spec.get("resources") or {}).get("nodes") or 1)
            spend += v.cost.price_per_hour * nodes
    jobs = GaugeMetricFamily("sftctl_jobs", "Jobs in the state per status.", labels=["status"])
    for status, n in counts.items():
        jobs.add_metric([status], n)
    families = [
        jobs,
        GaugeMetricFamily("sftctl_queue_jobs", "Jobs waiting to start (PENDING).", value=len(pending)),
        GaugeMetricFamily("sftctl_queue_oldest_wait_seconds", "Seconds the oldest PENDING job has waited (0: none).",
                          value=max(0.0, now - min(pending)) if pending else 0.0),
    ]
    usd = GaugeMetricFamily("sftctl_cost_usd", "What each user's jobs cost so far, all time (USD).", labels=["user"])
    hours = GaugeMetricFamily("sftctl_cost_node_hours", "Each user's jobs' node-hours, all time.", labels=["user"])
    unpriced = GaugeMetricFamily("sftctl_cost_unpriced_jobs", "Each user's jobs with no price.", labels=["user"])
    for row in api.costs("user"):
        usd.add_metric([row.group], row.usd)
        hours.add_metric([row.group], row.node_hours)
        unpriced.add_metric([row.group], row.unpriced_jobs)
    families += [usd, hours, unpriced,
                 GaugeMetricFamily("sftctl_spend_usd_per_hour", "What the live jobs' nodes cost per hour now (USD).",
                                   value=spend)]
    return expose(families)


def mount(app: FastAPI, authenticate: Callable[[str], User], forbidden: type[SftctlError]) -> None:
    """Add ``GET /metrics`` to ``app``. ``authenticate(authorization_header) -> User`` is the JSON
    API's (a 401's :class:`SftctlError` for a bad token); ``forbidden``: the API's 403 error.
    The scrape token is made (or checked) now, so a problem with it stops the server's start.

    Raises:
        SftctlError: the scrape token's file cannot be made or read, or is readable by others.
    """
    scrape_token()

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request):
        header = request.headers.get("authorization", "")
        if not is_scrape_token(header):
            try:
                user = authenticate(header)
            except SftctlError as e:  # the JSON API's hint names server.token: say what a scraper sends
                raise type(e)(f"/metrics: {e.message}", hint=SCRAPE_HINT) from None
            if not user.admin:
                raise forbidden(f"/metrics: {user.name} is not an admin of this server", hint=SCRAPE_HINT)
        return Response(render(), media_type=CONTENT_TYPE)
