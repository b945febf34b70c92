"""The console entry point :func:`main` (``sftctl = sftctl.cli:main``): errors to exit codes, and a
plain ``sftctl status`` parsed without typer (:func:`_plain_status`)."""

from __future__ import annotations

import contextlib
import sqlite3
import sys

import typer

from sftctl.cli._interrupt import Interrupted, caused_by_interrupt, exit_interrupted, guard_commands
from sftctl.cli.common import _DEBUG, _HELP, _JSON_PRINTED, _console, _print_json, app
from sftctl.cli.jobs import status
from sftctl.errors import ExitCode, SftctlError


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Maps errors to exit codes; ``--debug`` anywhere shows tracebacks.

    Every error prints ``error:`` and ``hint:`` lines on stderr; with ``--json`` it also prints
    one JSON object on stdout, ``{"error", "hint", "exit_code"}``, unless the command already
    printed its document (``plan --json`` of an infeasible job prints the plan with those keys).

    Ctrl-C (a KeyboardInterrupt, or an error caused by one: pydantic-core wraps it in a
    SchemaError when it lands while a model is built) prints one line, ``interrupted`` or what
    was interrupted (``interrupted while planning: nothing was started``), and exits 130.
    """
    from typer._click.exceptions import ClickException

    args = list(sys.argv[1:] if argv is None else argv)
    debug = _DEBUG[0] = "--debug" in args
    args = [a for a in args if a != "--debug"]
    as_json = "--json" in args
    _JSON_PRINTED[0] = False
    _HELP[0] = "--help" in args

    def fail(message: str, hint: str | None, code: int) -> int:
        if debug:
            import traceback

            traceback.print_exc()
        from rich.text import Text

        err = _console(stderr=True)
        # Text, not markup: a message quoting user input prints "[bold]" and ":smile:" as typed
        err.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)
        if hint:
            err.print(Text(f"hint: {hint}", style="dim"), soft_wrap=True)
        if as_json and not _JSON_PRINTED[0]:
            with contextlib.suppress(OSError):
                _print_json({"error": message, "hint": hint, "exit_code": int(code)})
        return int(code)

    def interrupted(message: str = "interrupted") -> int:
        if debug:
            import traceback

            traceback.print_exc()
        _console(stderr=True).print(message, markup=False, highlight=False, soft_wrap=True)
        if as_json and not _JSON_PRINTED[0]:
            with contextlib.suppress(OSError):
                _print_json({"error": message, "hint": None, "exit_code": int(ExitCode.INTERRUPTED)})
        if argv is None:  # the process's own command line: exit 130 here, never by SIGINT
            exit_interrupted()
        return int(ExitCode.INTERRUPTED)

    guard_commands(app)  # typer answers a bare KeyboardInterrupt with a silent exit 130
    try:
        plain = _plain_status(args)
        if plain is not None:  # the command scripts poll: no typer parsing (its adapters import pydantic)
            from sftctl import api

            api.validate_config()
            status(**plain)
            return 0
        rv = app(args=args, prog_name="sftctl", standalone_mode=False)
        return int(rv or 0)
    except typer.Exit as e:
        return e.exit_code
    except Interrupted as e:
        return interrupted(e.message)
    except (typer.Abort, KeyboardInterrupt):
        return interrupted()
    except ClickException as e:  # usage: unknown option, missing argument, bad value
        code = getattr(e, "exit_code", ExitCode.USAGE) or ExitCode.USAGE
        ctx = getattr(e, "ctx", None)
        hint = f"{ctx.command_path} --help shows the options" if ctx is not None else "sftctl --help"
        return fail(e.format_message(), hint, code)
    except SftctlError as e:
        return fail(e.message, e.hint, e.exit_code)
    except sqlite3.DatabaseError as e:  # a state.db damaged (or held) after it was opened
        from sftctl.paths import sftctl_home

        path = sftctl_home() / "state.db"
        if isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "busy" in str(e)):
            return fail(f"{path}: the state database stayed locked by another process: {e}",
                        "retry; if it persists, look for a process holding it (fuser state.db)", ExitCode.USAGE)
        return fail(f"{path}: the state database is damaged: {e}",
                    f"move it aside (mv {path} {path}.bad) and sftctl starts a new one; "
                    "sftctl down --orphans removes cloud resources of jobs it no longer knows", ExitCode.USAGE)
    except Exception as e:  # noqa: BLE001 - a bug or damaged data: one line, the traceback with --debug
        if caused_by_interrupt(e):
            return interrupted()
        return fail(f"internal error: {type(e).__name__}: {e}",
                    "sftctl --debug ... shows the traceback; please report it. If the state database may be "
                    "damaged: sqlite3 state.db 'PRAGMA integrity_check' in $SFTCTL_HOME", ExitCode.JOB_FAILED)


def _plain_status(args: list[str]) -> dict | None:
    """``status [JOB] [--json] [--all|-a] [--all-users]`` as :func:`status`'s arguments, or None for anything
    else (``--watch``, ``--help``, a typo: typer parses those). ``sftctl status`` is what scripts
    and prompts poll: typer's parameter adapters cost about 0.1-0.4 s (they import pydantic)."""
    if not args or args[0] != "status":
        return None
    flags = {"--json": "as_json", "--all": "all_", "-a": "all_", "--all-users": "all_users"}
    out: dict = {"job_ids": [], "label": [], "as_json": False, "watch": False, "all_": False, "all_users": False}
    for a in args[1:]:
        if a in flags:
            out[flags[a]] = True
        elif a.startswith("-"):
            return None
        else:
            out["job_ids"].append(a)
    return out
