"""The client of an ``sftctl server``: HTTP calls that return the server's JSON documents.

When the config names a server (``server: {url, token}`` in the config file, or
``SFTCTL_SERVER_URL`` / ``SFTCTL_SERVER_TOKEN``), :mod:`sftctl.api` sends the job commands
(submit, start, status, events, logs, down) here instead of reading this machine's state; it
turns the documents back into its records (:class:`sftctl.api.JobView` ...), so a caller sees
the same values, ``--json`` documents and exit codes either way. This module knows nothing of
those records (``sftctl.api`` imports it, never the reverse).

Every request carries ``Authorization: Bearer <token>``. The server answers an error as
``{"error", "hint", "exit_code", "kind"}`` (``kind``: the :class:`~sftctl.errors.SftctlError`
subclass's name); :func:`Client.request` raises it again here as that class with that exit
code. A server that cannot be reached is an :class:`Unreachable` (a
:class:`~sftctl.errors.ProviderError`, exit 4) naming the URL; so is a 502, 503 or 504 answer (a
proxy in front of a restarting server, or the server's state database down).

A client following a job (``sftctl wait``, ``logs -f``, an attached ``run``) rides such an outage
out (:meth:`Client.riding_out`, :meth:`Client.follow_lines`): the server supervises the job, so
it retries with bounded exponential backoff (tenacity) for ``server.retry_s``
(``SFTCTL_SERVER_RETRY_S``, 180 s), says ``server unreachable, retrying; the job goes on on the
server`` once on stderr, and goes on following once the server answers; past the window it
raises :class:`ServerLost` (exit 75) naming the job and how to follow it again. A log stream
that stays silent for :data:`FOLLOW_READ_S` (the server sends a blank keep-alive line every
``sftctl.server.app.LOG_KEEPALIVE_S`` while a job writes nothing) is a server lost the same way:
one that accepts the connection and stops answering never hangs a follower.

httpx is imported when a :class:`Client` is made, i.e. only when a server is configured
(``import sftctl.api`` and a server-less ``sftctl status`` never import it); without it (a
``.[torch]`` install) that is one :class:`~sftctl.errors.SftctlError` naming the extra (exit 2).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator, TypeVar

from sftctl import errors
from sftctl.errors import ExitCode, SftctlError

#: seconds a request may take to connect, and to answer (submit plans the job: no read limit)
CONNECT_S = 10.0
READ_S = 120.0
#: seconds a followed log stream may stay silent before the follower counts the server lost and
#: asks again (the server sends a keep-alive line every few seconds of a quiet job)
FOLLOW_READ_S = 30.0

#: the one line a follower prints (stderr) when it starts retrying an unreachable server
RETRYING = "server unreachable, retrying; the job goes on on the server"
#: a follower's backoff between retries: exponential from this many seconds ...
RETRY_FIRST_S = 0.5
#: ... up to this many (a restarting server is back within a few of them)
RETRY_MAX_S = 10.0
#: answers that say "not now" rather than "no": a proxy before a restarting server, a database outage
TRANSIENT_STATUS = (502, 503, 504)

T = TypeVar("T")


class Unreachable(errors.ProviderError):
    """The server cannot be reached, or answered 502/503/504 (exit 4 for a one-shot command; a
    follower retries it: :meth:`Client.riding_out`)."""


class Silent(Unreachable):
    """The server accepted the connection (a stream: answered) and then said nothing for the read
    timeout: a follower's outage has begun even though its next open may succeed."""


class ServerLost(SftctlError):
    """A follower could not reach the server for ``server.retry_s``; the job goes on there
    (exit 75, EX_TEMPFAIL). ``job``: its id; ``cause``: the last :class:`Unreachable`."""

    exit_code = ExitCode.SERVER_LOST

    def __init__(self, message: str, hint: str, job: str, cause: SftctlError | None = None):
        super().__init__(message, hint)
        self.job = job
        self.cause = cause


def configured() -> "Client | None":
    """The :class:`Client` of the configured server, or None when none is configured.

    Raises:
        SettingError: a malformed setting or config file (exit 2).
        SftctlError: a server URL without a token, or httpx is not installed (exit 2).
    """
    from sftctl import settings

    url = settings.get("SFTCTL_SERVER_URL")
    if not url:
        return None
    token = settings.get("SFTCTL_SERVER_TOKEN")
    if not token:
        raise SftctlError(f"server.url is {url}, but no token is set",
                          hint="set server.token in the config file (or SFTCTL_SERVER_TOKEN) to the token "
                               "`sftctl server user add NAME` printed")
    return Client(url, token)


class Client:
    """One server: ``url`` (``http://host:port``) and this user's ``token``.

    Raises:
        SftctlError: httpx is not installed (exit 2), as a Postgres state without psycopg.
    """

    def __init__(self, url: str, token: str):
        try:
            import httpx  # noqa: F401 - every request needs it: say so before the first
        except ImportError:
            raise SftctlError(f"server.url is {url}, but httpx is not installed",
                              hint="pip install 'sftctl[server]' (httpx), or unset server.url (SFTCTL_SERVER_URL) "
                                   "to use this machine's state") from None
        from sftctl import settings

        self.url = url.rstrip("/")
        self.token = token
        #: seconds a follower retries an unreachable server (``SFTCTL_SERVER_RETRY_S``)
        self.retry_s: float = settings.get("SFTCTL_SERVER_RETRY_S")

    def _http(self, read_s: float | None):
        import httpx

        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"},
                            timeout=httpx.Timeout(read_s, connect=CONNECT_S))

    def request(self, method: str, path: str, *, read_s: float | None = READ_S, **kw) -> Any:
        """``method path`` (``json=``, ``params=``); the decoded JSON answer.

        Raises:
            SftctlError (its subclass as the server named it): the server's error, with its
                exit code; ProviderError (exit 4): the server cannot be reached or answered
                something that is not sftctl's.
        """
        import httpx

        try:
            with self._http(read_s) as http:
                r = http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise self._unreachable(e, read_s) from None
        return self._decode(r)

    def stream_lines(self, path: str, params: dict, *, read_s: float = READ_S) -> Iterator[dict]:
        """A streamed answer of JSON lines (``logs``), one dict per line, until the server ends
        it. The request is made now (its error raises now, as :meth:`request`'s); the lines come
        as the returned iterator is read. ``read_s``: seconds the answer may stay silent (its
        headers, then between two lines)."""
        return (d for d in self._stream(path, params, read_s) if d is not None)

    def _stream(self, path: str, params: dict, read_s: float) -> Iterator[dict | None]:
        """:meth:`stream_lines`, with None for each blank (keep-alive) line.

        Raises:
            Unreachable: no connection, no answer within ``read_s`` seconds, or 502/503/504
                (exit 4), now or as the lines are read.
            SftctlError: the server's error (its exit code), now.
        """
        import httpx

        http = self._http(read_s)
        try:
            r = http.send(http.build_request("GET", path, params=params), stream=True)
        except httpx.HTTPError as e:
            http.close()
            raise self._unreachable(e, read_s) from None
        if r.status_code >= 400:
            try:
                r.read()
            finally:
                r.close()
                http.close()
            self._decode(r)

        def lines() -> Iterator[dict | None]:
            try:
                for line in r.iter_lines():
                    yield json.loads(line) if line.strip() else None
            except httpx.HTTPError as e:
                raise self._unreachable(e, read_s) from None
            finally:
                r.close()
                http.close()

        return lines()

    def riding_out(self, job: str, call: Callable[[], T], told: list[bool] | None = None,
                   since: float | None = None, reset: bool = True, until: float | None = None) -> T:
        """``call()`` (one or more requests about ``job``), retried while it raises
        :class:`Unreachable`: exponential backoff from :data:`RETRY_FIRST_S` to :data:`RETRY_MAX_S`
        seconds, for at most :attr:`retry_s` seconds from this call (or from ``since``, a
        ``time.monotonic()`` when the outage began; ``call`` is tried once at least). :data:`RETRYING` is logged
        (``sftctl.remote``, WARNING: stderr unless logging is set up) once per outage (``told``: a caller's flag shared by its calls, reset once the
        server answers; ``reset`` False leaves that to the caller, as a follow whose stream may
        open and then stay silent resets it at its next line). ``until``: a ``time.monotonic()``
        deadline of the caller's own (``wait --timeout``) that ends the retries sooner.

        Raises:
            ServerLost: still unreachable after :attr:`retry_s` seconds, or at ``until`` (exit 75).
            SftctlError: any other error of ``call``, at once.
        """
        import time

        import tenacity

        told = [False] if told is None else told
        window_s = self.retry_s if since is None else max(0.0, self.retry_s - (time.monotonic() - since))
        cut = until is not None and until - time.monotonic() < window_s  # the caller's deadline comes first
        if cut:
            window_s = max(0.0, until - time.monotonic())

        def tell(state) -> None:
            _tell(told)

        try:
            for attempt in tenacity.Retrying(stop=tenacity.stop_after_delay(window_s),
                                             wait=tenacity.wait_exponential(multiplier=RETRY_FIRST_S, max=RETRY_MAX_S),
                                             retry=tenacity.retry_if_exception_type(Unreachable),
                                             before_sleep=tell, reraise=True):
                with attempt:
                    result = call()
        except Unreachable as e:
            if cut:
                raise ServerLost(f"{e.message}; still unreachable at the timeout: job {job} goes on, supervised by "
                                 "the server", hint=f"sftctl wait {job} again once the server is back",
                                 job=job, cause=e) from None
            raise self.lost(job, e) from None
        if reset:
            told[0] = False
        return result

    def lost(self, job: str, e: SftctlError) -> ServerLost:
        """The :class:`ServerLost` of ``job`` after ``e`` (an :class:`Unreachable`)."""
        return ServerLost(f"{e.message}; gave up after {self.retry_s:g} s (server.retry_s): job {job} goes on, "
                          "supervised by the server",
                          hint=f"sftctl wait {job} or sftctl logs -f {job} follows it again once the server is back",
                          job=job, cause=e)

    def follow_lines(self, job: str, path: str, params: dict) -> Iterator[dict]:
        """:meth:`stream_lines` of a follow (``logs --follow``) that rides out a lost server: the
        stream is asked for again (:meth:`riding_out`) and, since the server sends a job's log
        from its start each time, each rank's lines already passed on are skipped (a rank's
        lines come in order; notices are never skipped). A stream silent for :data:`FOLLOW_READ_S`
        seconds (not even a keep-alive line) counts as a lost server; the outage runs from the
        last line received (a keep-alive one too), so a server whose every reopen answers and
        then says nothing (:class:`Silent`) is given up after :attr:`retry_s` as one that refuses
        it, with one :data:`RETRYING` notice at its first silence however often it reopens. The open of the first stream raises
        at once, as :meth:`stream_lines`'s; the rest raise as the iterator is read.

        Raises:
            ServerLost: the server stayed unreachable for :attr:`retry_s` seconds (exit 75).
        """
        import time

        told = [False]

        def open_stream() -> Iterator[dict | None]:
            return self._stream(path, params, FOLLOW_READ_S)

        first = self.riding_out(job, open_stream, told, reset=False)  # an outage ends at a line, not an open

        def lines() -> Iterator[dict]:
            passed: dict = {}  # rank -> lines passed on
            stream = first
            outage: float | None = None  # monotonic start of an outage no line has ended yet
            while True:
                skip = dict(passed)
                try:
                    for d in stream:
                        outage, told[0] = None, False
                        if d is None:  # the server's keep-alive
                            continue
                        rank = None if d.get("notice") else d.get("rank")
                        if not d.get("notice") and skip.get(rank, 0) > 0:
                            skip[rank] -= 1
                            continue
                        if not d.get("notice"):
                            passed[rank] = passed.get(rank, 0) + 1
                        yield d
                    return
                except Unreachable as e:
                    outage = time.monotonic() if outage is None else outage
                    if isinstance(e, Silent):  # said now: its reopen may answer, and then be silent again
                        _tell(told)
                    if time.monotonic() - outage >= self.retry_s:  # reopens that answer, then nothing: lost too
                        raise self.lost(job, e) from None
                    stream = self.riding_out(job, open_stream, told, since=outage, reset=False)

        return lines()

    @staticmethod
    def job_path(job: str, tail: str = "") -> str:
        """``/v1/jobs/<job><tail>``, the id quoted (a prefix typed by hand may hold anything)."""
        from urllib.parse import quote

        return f"/v1/jobs/{quote(job, safe='')}{tail}"

    def _unreachable(self, e: Exception, read_s: float | None = None) -> SftctlError:
        import httpx

        if isinstance(e, httpx.ReadTimeout) and read_s is not None:
            return Silent(f"the sftctl server at {self.url} accepted the connection but did not answer "
                          f"for {read_s:g} s", hint="is it overloaded or stuck? check its log (sftctl server "
                                                    "start's output); server.url in the config file or SFTCTL_SERVER_URL")
        return Unreachable(f"the sftctl server at {self.url} cannot be reached: {e or type(e).__name__}",
                                    hint="is it running (sftctl server start)? check server.url in the config "
                                         "file or SFTCTL_SERVER_URL")

    def _decode(self, r) -> Any:
        try:
            doc = r.json()
        except ValueError:
            doc = None
        if r.status_code < 400:
            if doc is None:
                raise errors.ProviderError(f"the sftctl server at {self.url} answered {r.status_code} with no JSON",
                                           hint="is server.url an sftctl server?")
            return doc
        if r.status_code in TRANSIENT_STATUS:  # not now: a proxy before a restarting server, its database down
            if isinstance(doc, dict) and "error" in doc:  # the server's own line (its database is down)
                raise Unreachable(str(doc["error"]), hint=doc.get("hint"))
            raise Unreachable(f"the sftctl server at {self.url} is unavailable: it answered {r.status_code}",
                              hint="a proxy in front of a restarting server? try again shortly")
        if isinstance(doc, dict) and "error" in doc:
            cls = getattr(errors, str(doc.get("kind")), None)
            if not (isinstance(cls, type) and issubclass(cls, SftctlError)):
                cls = SftctlError
            if cls is errors.CapacityError:  # its attributes (scope, zone ...) stay on the server
                cls = errors.ProviderError
            err = SftctlError.__new__(cls)
            SftctlError.__init__(err, doc["error"], doc.get("hint"), ExitCode(int(doc.get("exit_code") or 2)))
            if cls is errors.InfeasibleError:
                err.candidates = []
            raise err
        raise errors.ProviderError(f"the sftctl server at {self.url} answered {r.status_code}: {r.text[:200]}",
                                   hint="is server.url an sftctl server?")


def _tell(told: list[bool]) -> None:
    """Log :data:`RETRYING` (``sftctl.remote``, WARNING) unless ``told[0]``, and set it: once per
    outage. A library's notice: with no logging set up (the CLI's case) Python's last-resort
    handler writes the bare line to stderr; a program that sets up logging routes it."""
    import logging

    if not told[0]:
        told[0] = True
        logging.getLogger("sftctl.remote").warning(RETRYING)
