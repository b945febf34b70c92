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
code. A server that cannot be reached is a :class:`~sftctl.errors.ProviderError` (exit 4)
naming the URL.

httpx is imported when a :class:`Client` is made, i.e. only when a server is configured
(``import sftctl.api`` and a server-less ``sftctl status`` never import it); without it (a
``.[torch]`` install) that is one :class:`~sftctl.errors.SftctlError` naming the extra (exit 2).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from sftctl import errors
from sftctl.errors import ExitCode, SftctlError

#: seconds a request may take to connect, and to answer (submit plans the job: no read limit)
CONNECT_S = 10.0
READ_S = 120.0


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
        self.url = url.rstrip("/")
        self.token = token

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

    @staticmethod
    def job_path(job: str, tail: str = "") -> str:
        """``/v1/jobs/<job><tail>``, the id quoted (a prefix typed by hand may hold anything)."""
        from urllib.parse import quote

        return f"/v1/jobs/{quote(job, safe='')}{tail}"

    def _unreachable(self, e: Exception) -> SftctlError:
        return errors.ProviderError(f"the sftctl server at {self.url} cannot be reached: {e or type(e).__name__}",
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
