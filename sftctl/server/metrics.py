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

Who may read it: an admin's token (``Authorization: Bearer``), or any request from the server's
own machine (a loopback peer address: a Prometheus beside the server needs no token). A request
that came through a proxy (``X-Forwarded-For`` or ``Forwarded``) is never taken as loopback,
whatever its peer address. Anyone else: 401 (no or a bad token) or 403 (not an admin).
:class:`~sftctl.server.guard.Guard` lets ``/metrics`` through (``WEB_PATHS``): this module
authenticates it.
"""

from __future__ import annotations

import ipaddress
import time
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from sftctl.errors import SftctlError
from sftctl.types import User

#: the exposition's media type (Prometheus text format 0.0.4)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def loopback(request: Request) -> bool:
    """Whether the request came from this machine, not through a proxy."""
    if request.headers.get("x-forwarded-for") or request.headers.get("forwarded"):
        return False
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    API's (a 401's :class:`SftctlError` for a bad token); ``forbidden``: the API's 403 error."""

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request):
        if not loopback(request):
            user = authenticate(request.headers.get("authorization", ""))
            if not user.admin:
                raise forbidden(f"/metrics: {user.name} is not an admin of this server",
                                hint="an admin's token, or scrape from the server's own machine")
        return Response(render(), media_type=CONTENT_TYPE)
