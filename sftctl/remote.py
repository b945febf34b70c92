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
raises :class:`ServerLost` (exit 75) naming the job and how to follow it again.

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


class ServerLost(SftctlError):
    """A follower could not reach the server for ``server.retry_s``; the job goes on there
    (exit 75, EX_TEMPFAIL). ``job``: its id."""

    exit_code = ExitCode.SERVER_LOST

    def __init__(self, message: str, hint: str, job: str):
        super().__init__(message, hint)
        self.job = job


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
            raise self._unreachable(e) from None
        return self._decode(r)

    def stream_lines(self, path: str, params: dict) -> Iterator[dict]:
        """A streamed answer of JSON lines (``logs --follow``), one dict per line, until the
        server ends it. The request is made now (its error raises now, as :meth:`request`'s);
        the lines come as the returned iterator is read."""
        import httpx

        http = self._http(None)
        try:
            r = http.send(http.build_request("GET", path, params=params), stream=True)
        except httpx.HTTPError as e:
            http.close()
            raise self._unreachable(e) from None
        if r.status_code >= 400:
            try:
                r.read()
            finally:
                r.close()
                http.close()
            self._decode(r)

        def lines() -> Iterator[dict]:
            try:
                for line in r.iter_lines():
                    if line:
                        yield json.loads(line)
            except httpx.HTTPError as e:
                raise self._unreachable(e) from None
            finally:
                r.close()
                http.close()

        return lines()

    def riding_out(self, job: str, call: Callable[[], T], told: list[bool] | None = None) -> T:
        """``call()`` (one or more requests about ``job``), retried while it raises
        :class:`Unreachable`: exponential backoff from :data:`RETRY_FIRST_S` to :data:`RETRY_MAX_S`
        seconds, for at most :attr:`retry_s` seconds from this call. :data:`RETRYING` is logged
        (``sftctl.remote``, WARNING: stderr unless logging is set up) once per outage (``told``: a caller's flag shared by its calls, reset once the
        server answers).

        Raises:
            ServerLost: still unreachable after :attr:`retry_s` seconds (exit 75).
            SftctlError: any other error of ``call``, at once.
        """
        import tenacity

        told = [False] if told is None else told

        def tell(state) -> None:
            import logging

            if not told[0]:
                told[0] = True
                # a library's notice: with no logging set up (the CLI's case) Python's last-resort
                # handler writes the bare line to stderr; a program that sets up logging routes it
                logging.getLogger("sftctl.remote").warning(RETRYING)

        try:
            for attempt in tenacity.Retrying(stop=tenacity.stop_after_delay(self.retry_s),
                                             wait=tenacity.wait_exponential(multiplier=RETRY_FIRST_S, max=RETRY_MAX_S),
                                             retry=tenacity.retry_if_exception_type(Unreachable),
                                             before_sleep=tell, reraise=True):
                with attempt:
                    result = call()
        except Unreachable as e:
            raise self.lost(job, e) from None
        told[0] = False
        return result

    def lost(self, job: str, e: SftctlError) -> ServerLost:
        """The :class:`ServerLost` of ``job`` after ``e`` (an :class:`Unreachable`)."""
        return ServerLost(f"{e.message}; gave up after {self.retry_s:g} s (server.retry_s): job {job} goes on, "
                          "supervised by the server",
                          hint=f"sftctl wait {job} or sftctl logs -f {job} follows it again once the server is back",
                          job=job)

    def follow_lines(self, job: str, path: str, params: dict) -> Iterator[dict]:
        """:meth:`stream_lines` of a follow (``logs --follow``) that rides out a lost server: the
        stream is asked for again (:meth:`riding_out`) and, since the server sends a job's log
        from its start each time, each rank's lines already passed on are skipped (a rank's
        lines come in order; notices are never skipped). The open of the first stream raises
        at once, as :meth:`stream_lines`'s; the rest raise as the iterator is read.

        Raises:
            ServerLost: the server stayed unreachable for :attr:`retry_s` seconds (exit 75).
        """
        told = [False]
        first = self.riding_out(job, lambda: self.stream_lines(path, params), told)

        def lines() -> Iterator[dict]:
            passed: dict = {}  # rank -> lines passed on
            stream = first
            while True:
                skip = dict(passed)
                try:
                    for d in stream:
                        rank = None if d.get("notice") else d.get("rank")
                        if not d.get("notice") and skip.get(rank, 0) > 0:
                            skip[rank] -= 1
                            continue
                        if not d.get("notice"):
                            passed[rank] = passed.get(rank, 0) + 1
                        yield d
                    return
                except Unreachable:
                    stream = self.riding_out(job, lambda: self.stream_lines(path, params), told)

        return lines()

    @staticmethod
    def job_path(job: str, tail: str = "") -> str:
        """``/v1/jobs/<job><tail>``, the id quoted (a prefix typed by hand may hold anything)."""
        from urllib.parse import quote

        return f"/v1/jobs/{quote(job, safe='')}{tail}"

    def _unreachable(self, e: Exception) -> SftctlError:
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
