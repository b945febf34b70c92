"""``sftctl calibrate ...`` (the run history), ``secret ...`` and ``server ...`` (start, users, tokens,
audit, manifest)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from sftctl.cli.common import _console, _escape, _print_json, app
from sftctl.errors import ExitCode, SftctlError

calibrate_app = typer.Typer(help="The run history predictions learn from: import, show, export, forget measured runs.",
                            no_args_is_help=True)
app.add_typer(calibrate_app, name="calibrate")


@calibrate_app.command("import")
def calibrate_import(
    path: Path = typer.Argument(..., metavar="FILE.jsonl", help="One measured run per line (docs/predictions.md: Calibration)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Import measured runs (a lab's past runs, published figures): all lines or none."""
    from sftctl import api

    console = _console(stderr=as_json)
    with console.status("importing") as st:
        doc = api.calibrate_import(path, progress=st.update)
    if as_json:
        _print_json(doc)
    else:
        skipped = f", {doc['skipped']} already present, skipped" if doc.get("skipped") else ""
        console.print(f"imported {doc['imported']} run(s) from {_escape(str(path))} "
                      f"(source {_escape(', '.join(doc['labels']))}){skipped}; sftctl calibrate show lists them",
                      soft_wrap=True)


@calibrate_app.command("show")
def calibrate_show(as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout.")) -> None:
    """The run history: per accelerator, offering and source, the runs and measured / predicted."""
    from sftctl import api

    doc = api.calibrate_show()
    if as_json:
        _print_json(doc)
        return
    from sftctl.ui import calibration_table

    _console().print(calibration_table(doc["summary"], len(doc["runs"])))


@calibrate_app.command("export")
def calibrate_export(
    path: Optional[Path] = typer.Argument(None, metavar="[FILE]", help="Write here (default: stdout)."),
) -> None:
    """Every run of the history as JSON lines (`calibrate import` reads them back)."""
    from sftctl import api

    lines = "".join(json.dumps(r) + "\n" for r in api.calibrate_export())
    if path is None:
        sys.stdout.write(lines)
    else:
        try:
            path.write_text(lines)
        except OSError as e:  # a folder that does not exist, a directory, no permission, a full disk
            raise SftctlError(f"calibrate export {path}: cannot write it: {e.strerror or e}",
                              hint="give a file in a folder that exists and you may write, or no FILE for stdout",
                              exit_code=ExitCode.USAGE) from None
        _console(stderr=True).print(f"wrote {lines.count(chr(10))} run(s) to {_escape(str(path))}", soft_wrap=True)


@calibrate_app.command("forget")
def calibrate_forget(
    imported: bool = typer.Option(False, "--imported", help="Every imported run."),
    source: Optional[str] = typer.Option(None, "--source", metavar="S", help="The runs of this source label."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
) -> None:
    """Delete runs from the history: the imported ones, or one source's."""
    from sftctl import api

    n = api.calibrate_forget(imported=imported, source=source)
    if as_json:
        _print_json({"forgotten": n})
        return
    why = ""
    if n == 0 and source:  # most likely a typo: name the labels there are
        labels = sorted({str(r.get("source_label")) for r in api.calibrate_show()["runs"] if r.get("source_label")})
        why = f": no run has source label {source!r} (labels: {', '.join(labels) or 'none'})"
    _console().print(f"forgot {n} run(s){_escape(why)}", soft_wrap=True)


# ------------------------------------------------------------------------------------ secret

secret_app = typer.Typer(help="Your secrets: the values a job's secrets: [NAME] and ${NAME} in env: get. Stored "
                         "encrypted (on the server when one is configured); never shown again.", no_args_is_help=True)
app.add_typer(secret_app, name="secret")


def _secret_value(name: str) -> str:
    """The value of secret ``name``: stdin when it is not a terminal (one trailing newline
    dropped: ``echo`` adds it), else typed at a prompt that does not echo."""
    if sys.stdin is None or not sys.stdin.isatty():
        data = sys.stdin.read() if sys.stdin is not None else ""
        return data[:-2] if data.endswith("\r\n") else data[:-1] if data.endswith("\n") else data
    import getpass

    try:
        return getpass.getpass(f"value of {name} (not shown): ")
    except EOFError:
        return ""


@secret_app.command("set")
def secret_set(
    name: str = typer.Argument(..., metavar="NAME"),
    extra: Optional[list[str]] = typer.Argument(None, hidden=True, metavar=""),
    lab: bool = typer.Option(False, "--lab", help="The lab's secret: every user's jobs may name it (a user's own "
                             "of the same name wins). Admins only on a server."),
) -> None:
    """Store a secret. Its value comes from stdin when piped (printf %s "$TOKEN" | sftctl secret set NAME),
    else from a prompt that does not echo; never from the command line, which ps shows to everyone."""
    from sftctl import api

    if extra:
        raise SftctlError("secret set: the value is never taken from the command line (ps shows it to every user "
                          "of this machine)", hint=f"printf %s VALUE | sftctl secret set {name}, or type it at the prompt")
    secret = api.secret_set(name, lambda: _secret_value(name), lab=lab)
    scope = "the lab's: every user's jobs may name it" if secret.scope == "lab" else "yours"
    print(f"secret {secret.name} set ({scope}); a job names it in secrets: [{secret.name}] or env: as ${{{secret.name}}}")


@secret_app.command("list")
def secret_list(as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout.")) -> None:
    """Your secrets and the lab's: names, scope and dates, never a value."""
    from sftctl import api

    secrets = api.secret_list()
    if as_json:
        _print_json({"secrets": [x.to_dict() for x in secrets]})
        return
    if not secrets:
        print("no secrets (sftctl secret set NAME stores one)")
        return
    from rich.table import Table

    day = lambda ts: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ts))  # noqa: E731
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("NAME", "SCOPE", "CREATED", "UPDATED"):
        table.add_column(column)
    for x in secrets:
        table.add_row(_escape(x.name), x.scope + (" (yours wins)" if x.shadowed else ""), day(x.created_at), day(x.updated_at))
    _console().print(table)


@secret_app.command("rm")
def secret_rm(
    name: str = typer.Argument(..., metavar="NAME"),
    lab: bool = typer.Option(False, "--lab", help="The lab's secret (admins only on a server)."),
) -> None:
    """Remove a secret; a job that names it gets it empty at its next launch and does not run."""
    from sftctl import api

    api.secret_remove(name, lab=lab)
    print(f"secret {name} removed{' (the lab' + chr(39) + 's)' if lab else ''}")


# ------------------------------------------------------------------------------------ server

server_app = typer.Typer(help="Run the sftctl server: one place for a team's jobs (sftctl server start).",
                         no_args_is_help=True)
app.add_typer(server_app, name="server")
user_app = typer.Typer(help="The server's users and their tokens.", no_args_is_help=True)
server_app.add_typer(user_app, name="user")


@server_app.command("start")
def server_start(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8470, "--port", min=1, max=65535, help="Port to listen on."),
) -> None:
    """Serve the API here until stopped; run the controllers of the jobs submitted to it and,
    first, give every unfinished job without a live controller one."""
    from sftctl.server import serve

    os.umask(0o077)
    serve(host, port)


_LOCAL_HELP = "Act on this machine's state even when the config names a server (on the server's own machine)."
_EXPIRES_HELP = "Days until the token stops working, or 'never' (default: SFTCTL_SERVER_TOKEN_DAYS, 90)."


def _when(ts: float | None) -> str:
    import time

    return "never" if ts is None else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ts))


def _token_note(user, where: str, verb: str) -> None:
    _console(stderr=True).print(f"[dim]{verb} {_escape(user.name)}{' (admin)' if user.admin else ''} on "
                                f"{_escape(where)}; the token expires {_when(user.expires_at)}. Put it in their "
                                "config file as server: {url: ..., token: ...} (or SFTCTL_SERVER_TOKEN); "
                                "it is not shown again[/]", soft_wrap=True)


@user_app.command("add")
def server_user_add(
    name: str = typer.Argument(..., metavar="NAME"),
    admin: bool = typer.Option(False, "--admin", help="May see and stop every user's jobs (status --all-users)."),
    expires: Optional[str] = typer.Option(None, "--expires", metavar="DAYS|never", help=_EXPIRES_HELP),
    local: bool = typer.Option(False, "--local", help=_LOCAL_HELP),
) -> None:
    """Create a user and print its token (once: only its hash is kept): on the server the config
    names (with your admin token), else in this machine's state."""
    from sftctl.server.users import Users

    where = Users(local)
    user, token = where.add(name, admin, expires)
    print(token)
    _token_note(user, where.where, "user")


@user_app.command("list")
def server_user_list(
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    local: bool = typer.Option(False, "--local", help=_LOCAL_HELP),
) -> None:
    """The users: name, admin, created, token expiry (never a token)."""
    from sftctl.server.users import Users

    users = Users(local).list()
    if as_json:
        _print_json({"users": [u.to_dict() for u in users]})
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("NAME", "ADMIN", "CREATED", "EXPIRES"):
        table.add_column(column)
    for u in users:
        table.add_row(_escape(u.name), "yes" if u.admin else "", _when(u.created_at),
                      _when(u.expires_at) + (" (expired)" if u.expired() else ""))
    _console().print(table)


@user_app.command("remove")
def server_user_remove(
    name: str = typer.Argument(..., metavar="NAME"),
    local: bool = typer.Option(False, "--local", help=_LOCAL_HELP),
) -> None:
    """Remove a user: their token fails the next request (their jobs stay)."""
    from sftctl.server.users import Users

    where = Users(local)
    where.remove(name)
    _console(stderr=True).print(f"user {_escape(name)} removed from {_escape(where.where)}", soft_wrap=True)


token_app = typer.Typer(help="A user's token.", no_args_is_help=True)
user_app.add_typer(token_app, name="token")


@token_app.command("rotate")
def server_user_token_rotate(
    name: str = typer.Argument(..., metavar="NAME"),
    expires: Optional[str] = typer.Option(None, "--expires", metavar="DAYS|never", help=_EXPIRES_HELP),
    local: bool = typer.Option(False, "--local", help=_LOCAL_HELP),
) -> None:
    """Give a user a new token and print it (once); the old one fails the next request."""
    from sftctl.server.users import Users

    where = Users(local)
    user, token = where.rotate(name, expires)
    print(token)
    _token_note(user, where.where, "new token of")


@server_app.command("audit")
def server_audit(
    as_json: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, metavar="N", help="Only the newest N actions."),
    local: bool = typer.Option(False, "--local", help=_LOCAL_HELP),
) -> None:
    """The admin actions recorded (users added and removed, tokens rotated, another user's job
    taken down, orphans swept), oldest first."""
    from sftctl.server.users import Users

    events = Users(local).audit(limit)
    if as_json:
        _print_json({"audit": [e.to_dict() for e in events]})
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("WHEN", "ACTOR", "ACTION", "TARGET", "DETAIL"):
        table.add_column(column)
    for e in events:
        table.add_row(_when(e.ts), _escape(e.actor), e.action, _escape(e.target or ""), _escape(e.detail or ""))
    _console().print(table)


@server_app.command("metrics-token")
def server_metrics_token(local: bool = typer.Option(False, "--local", help=_LOCAL_HELP)) -> None:
    """Print the token Prometheus scrapes this machine's server's /metrics with (made on first use):
    SFTCTL_SERVER_METRICS_TOKEN, else $SFTCTL_HOME/metrics.token. Run it on the server's machine,
    as the server's user.

    Raises:
        SftctlError: the config names a server and ``--local`` is not given (exit 2): the token
            would be this machine's own, one that server refuses (401).
    """
    from sftctl.server.metrics import configured_server_url, scrape_token, token_source

    url = configured_server_url()
    if url and not local:
        raise SftctlError(f"server metrics-token: your config names the server {url}, whose scrape token "
                          "is kept on its machine, not here",
                          hint="run sftctl server metrics-token on the server's machine, as the server's user "
                               "(--local there if its config names a server too); an admin's token scrapes too")
    print(scrape_token())
    _console(stderr=True).print(f"[dim]the /metrics scrape token ({_escape(token_source())}). Prometheus: put it in a "
                                "file only Prometheus reads and name it in the scrape config: authorization: "
                                "{credentials_file: FILE} (docs/server.md)[/]", soft_wrap=True)


@server_app.command("manifest")
def server_manifest(
    kubernetes: bool = typer.Option(False, "--kubernetes", help="A Deployment, a Service and a Secret (YAML)."),
    systemd: bool = typer.Option(False, "--systemd", help="A systemd unit for a lab's login node."),
    port: int = typer.Option(8470, "--port", min=1, max=65535, help="The port the server listens on."),
    image: str = typer.Option("sftctl:latest", "--image", help="Kubernetes: the image with sftctl[server] installed."),
    namespace: Optional[str] = typer.Option(None, "--namespace", help="Kubernetes: the namespace (default: the context's)."),
) -> None:
    """Print what runs the server elsewhere: Kubernetes objects or a systemd unit."""
    from sftctl.server.manifest import kubernetes as k8s_text
    from sftctl.server.manifest import systemd as unit_text

    if kubernetes == systemd:
        raise SftctlError("give one of --kubernetes and --systemd", hint="sftctl server manifest --kubernetes")
    sys.stdout.write(k8s_text(port=port, image=image, namespace=namespace) if kubernetes else unit_text(port=port))
