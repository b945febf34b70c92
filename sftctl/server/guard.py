"""The server's door: what every request meets before its route runs (issue 40).

:class:`Guard` is a pure ASGI middleware around the whole application. For every route but the
open ones (``/v1/health``, and the dashboard's ``/`` and ``/ui/...``, which
:mod:`sftctl.server.web` authenticates by their session cookie) it

1. authenticates the request from its headers alone, before one byte of its body is read: no
   token, an unknown one or an expired one is answered 401 at once (and the connection closed,
   so a client streaming a large body stops there);
2. refuses a body larger than ``max_body_bytes``: 413 at once from ``Content-Length``, or as soon
   as a chunked body streams past the limit (the route never sees more than the limit);
3. rate limits each user's writes (``POST /v1/jobs``, ``/v1/jobs/{job}/start``, ``/v1/down``)
   with a token bucket per user (:class:`RateLimiter`): 429 with ``Retry-After``.

Its errors have the server's JSON shape, ``{"error", "hint", "exit_code", "kind"}`` (built by the
``render`` the application passes), so the client prints one line. The authenticated user is left
in the ASGI scope (:data:`USER_KEY`) for the routes.

:func:`collected_warnings` gathers the :class:`~sftctl.errors.SftctlWarning`\\ s one thread
issues, so concurrent submits each return their own warnings without a process-wide lock.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import warnings
from typing import Any, Callable, Iterator

from sftctl.errors import ProviderError, SftctlError, SftctlWarning

#: the scope key under which :class:`Guard` leaves the request's user (:class:`sftctl.types.User`)
USER_KEY = "sftctl.user"
#: routes anyone may call: no token, no body
OPEN_PATHS = frozenset({"/v1/health"})
#: the dashboard's pages (``/`` and under ``/ui/``): :mod:`sftctl.server.web` authenticates them
#: by their session cookie, through the same ``authenticate``, and limits their actions itself
OPEN_PREFIXES = ("/ui/",)
#: ``/metrics`` (:mod:`sftctl.server.metrics`) authenticates itself too: the scrape token or an admin's
WEB_PATHS = frozenset({"/", "/metrics"})
#: the writes a user's rate limit counts: (method, path pattern)
WRITES = ((b"POST", re.compile(r"/v1/jobs/?")), (b"POST", re.compile(r"/v1/jobs/[^/]+/start/?")),
          (b"POST", re.compile(r"/v1/down/?")))


class Forbidden(SftctlError):
    """The user may not do this (HTTP 403; exit 2)."""


class TooLarge(SftctlError):
    """A request body over the server's limit (HTTP 413; exit 2)."""


class RateLimited(ProviderError):
    """A user's writes over the server's rate limit (HTTP 429; exit 4: try again later)."""

    def __init__(self, message: str, hint: str, retry_after_s: int):
        super().__init__(message, hint=hint)
        self.retry_after_s = retry_after_s


class RateLimiter:
    """A token bucket per key: ``per_minute`` writes a minute, in bursts of up to as many
    (``per_minute`` 0: no limit). Thread-safe."""

    def __init__(self, per_minute: int):
        self.per_minute = per_minute
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at monotonic s)

    def take(self, key: str, now: float | None = None) -> float:
        """Take one write for ``key``: 0.0 when it is allowed, else the seconds until one is."""
        if self.per_minute <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        rate = self.per_minute / 60.0  # writes per second
        with self._lock:
            tokens, at = self._buckets.get(key, (float(self.per_minute), now))
            tokens = min(float(self.per_minute), tokens + (now - at) * rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / rate


class _BodyOverLimit(Exception):
    """Raised into the route by the guarded ``receive`` when the body passes the limit."""


class Guard:
    """The ASGI middleware (see the module's docstring).

    ``authenticate(authorization_header) -> User`` raises an :class:`SftctlError` (401's) for a
    request it refuses; it runs in a worker thread (it reads the state). ``render(error) ->
    (status, document)`` is the application's error shape.
    """

    def __init__(self, app, *, authenticate: Callable[[str], Any], render: Callable[[SftctlError], tuple[int, dict]],
                 max_body_bytes: int, writes_per_minute: int, open_paths: frozenset[str] = OPEN_PATHS):
        self.app, self.authenticate, self.render = app, authenticate, render
        self.max_body_bytes, self.open_paths = max_body_bytes, open_paths
        self.limiter = RateLimiter(writes_per_minute)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["path"] in WEB_PATHS \
                or scope["path"].startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        import anyio

        headers = dict(scope.get("headers") or [])  # names are lower-case bytes
        try:
            user = await anyio.to_thread.run_sync(self.authenticate,
                                                  headers.get(b"authorization", b"").decode("latin-1"))
            self._check_length(headers.get(b"content-length"))
            if any(scope["method"].encode() == m and p.fullmatch(scope["path"]) for m, p in WRITES):
                self._check_rate(user)
        except SftctlError as e:
            await self._refuse(send, e)
            return
        scope[USER_KEY] = user
        await self._bounded(scope, receive, send)

    def _check_length(self, value: bytes | None) -> None:
        if value is None:
            return
        if not value.strip().isdigit():
            raise SftctlError(f"bad request: Content-Length {value[:40].decode('latin-1')!r} is not a number",
                              hint="the client and the server are different sftctl versions?")
        if int(value) > self.max_body_bytes:
            raise self._too_large(f"{int(value):,} bytes")

    def _too_large(self, size: str) -> TooLarge:
        return TooLarge(f"the request's body ({size}) is larger than this server accepts "
                        f"({self.max_body_bytes:,} bytes)",
                        hint="a spec is at most 1 MiB and a few --set overrides; the server's admin sets "
                             "SFTCTL_SERVER_MAX_BODY_BYTES")

    def _check_rate(self, user) -> None:
        wait_s = self.limiter.take(user.name)
        if wait_s > 0:
            after = max(1, int(wait_s + 0.999))
            n = self.limiter.per_minute
            raise RateLimited(f"too many writes: {user.name} may submit, start or take down "
                              f"{n} time{'s' if n != 1 else ''} a minute on this server",
                              hint=f"try again in {after} s (the server's admin sets SFTCTL_SERVER_WRITES_PER_MINUTE)",
                              retry_after_s=after)

    async def _refuse(self, send, e: SftctlError) -> None:
        """Answer ``e`` now and close the connection (a body still coming is never read)."""
        import json

        status, doc = self.render(e)
        body = json.dumps(doc).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        after = getattr(e, "retry_after_s", None)  # RateLimited (429); the state database down (503)
        if after:
            headers.append((b"retry-after", str(after).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _bounded(self, scope, receive, send) -> None:
        """The application, with a ``receive`` that counts the body's bytes: past the limit the
        route is stopped and the answer is 413, whatever the route made of the interruption."""
        state = {"read": 0, "over": False, "started": False}

        async def guarded_receive():
            message = await receive()
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                if state["read"] > self.max_body_bytes:
                    state["over"] = True
                    raise _BodyOverLimit()
            return message

        async def guarded_send(message):
            if state["over"]:
                return  # the route's own answer to the interruption: the 413 replaces it
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if not state["over"]:
                raise
        if state["over"] and not state["started"]:
            await self._refuse(send, self._too_large(f"over {self.max_body_bytes:,} bytes, chunked"))


# ------------------------------------------------------------------ warnings per thread

_collecting = threading.local()
_install_lock = threading.Lock()
_installed: list[bool] = []


def _install() -> None:
    """Route :class:`SftctlWarning`\\ s to the issuing thread's collector (when it has one): a
    ``warnings.showwarning`` hook, installed once; every SftctlWarning is issued ("always")."""
    with _install_lock:
        if _installed:
            return
        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            sink = getattr(_collecting, "lines", None)
            if sink is not None and issubclass(category, SftctlWarning):
                sink.append(str(message))
                return
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        warnings.filterwarnings("always", category=SftctlWarning)
        _installed.append(True)


@contextlib.contextmanager
def collected_warnings() -> Iterator[list[str]]:
    """The :class:`SftctlWarning` lines this thread issues inside the block (other threads'
    go to their own collectors). Unlike :class:`warnings.catch_warnings`, which swaps the
    process's warning state, concurrent blocks in several threads each get their own."""
    _install()
    outer = getattr(_collecting, "lines", None)
    _collecting.lines = lines = []
    try:
        yield lines
    finally:
        _collecting.lines = outer
