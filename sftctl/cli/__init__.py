"""The ``sftctl`` command line: parsing and rendering over :mod:`sftctl.api`.

Each command parses its options, calls :mod:`sftctl.api` and renders what it returns: rich
tables (:mod:`sftctl.ui`) for people, or with ``--json`` the api's documents
(``JobView.to_dict()``, ``plan_doc``, ``events_doc`` ...; built in :mod:`sftctl.api`, never
here). No orchestration lives here. Heavy modules (pydantic specs, the controller, torch) are
imported inside the api's functions, and a plain ``sftctl status`` skips typer's parsing (see
:func:`_plain_status`), so it starts fast. Exit codes: see
:class:`sftctl.errors.ExitCode`. A :class:`~sftctl.errors.SftctlError` prints one ``error:`` line
and a ``hint:`` line on stderr, never a traceback (``--debug`` shows it).

The package, split by job (ARCHITECTURE.md, "Layout"): :mod:`~sftctl.cli.common` (the typer app,
its root callback, completion, the helpers commands share), :mod:`~sftctl.cli.launch` (run,
plan, catalog, compile), :mod:`~sftctl.cli.jobs` (check, status, metrics, costs, logs, wait,
down, events, schema), :mod:`~sftctl.cli.admin` (calibrate, secret, server) and
:mod:`~sftctl.cli.entry` (:func:`main`, the console script ``sftctl``; ``python -m sftctl.cli``
is ``__main__.py``). Importing the package registers every command on :data:`app`, in the order
``--help`` lists them (the order of the imports below); every name is importable from here.
"""

import sys as _sys

from sftctl.cli._interrupt import (caused_by_interrupt as _caused_by_interrupt, exit_interrupted as _exit_interrupted,
    say_interrupted as _say_interrupted)

try:  # a Ctrl-C while typer, rich, pydantic load: one line and exit 130, not a traceback
    # the order registers the commands as --help lists them: keep it
    from sftctl.cli.common import (app, _console, _print_json, _complete_jobs, _complete_accelerators, _complete_specs,
        _planning, _labels, _JSON_PRINTED, _DEBUG, _HELP, _escape)
    from sftctl.cli.launch import run, plan, catalog_app, catalog, catalog_refresh, compile_
    from sftctl.cli.jobs import TABLE_ROWS, check, status, metrics, costs, logs, wait, down, events, nodes, schema
    from sftctl.cli.admin import (calibrate_app, calibrate_import, calibrate_show, calibrate_export, calibrate_forget,
        secret_app, secret_set, secret_list, secret_rm, server_app, user_app, server_start, server_user_add,
        server_user_list, server_user_remove, token_app, server_user_token_rotate, server_audit, server_manifest)
    from sftctl.cli.entry import main, _plain_status
except BaseException as _e:
    if not _caused_by_interrupt(_e):
        raise
    _code = _say_interrupted()
    if _sys.argv[:1] == ["-m"] or _sys.argv[0].endswith("sftctl"):  # the CLI process, not an importer
        _exit_interrupted()
    _sys.exit(_code)

__all__ = [
    "app", "_console", "_print_json", "_complete_jobs", "_complete_accelerators", "_complete_specs",
    "_planning", "_labels", "_JSON_PRINTED", "_DEBUG", "_HELP", "_escape", "run", "plan", "catalog_app",
    "catalog", "catalog_refresh", "compile_", "TABLE_ROWS", "check", "status", "metrics", "costs", "logs",
    "wait", "down", "events", "nodes", "schema", "calibrate_app", "calibrate_import", "calibrate_show",
    "calibrate_export", "calibrate_forget", "secret_app", "secret_set", "secret_list", "secret_rm",
    "server_app", "user_app", "server_start", "server_user_add", "server_user_list", "server_user_remove",
    "token_app", "server_user_token_rotate", "server_audit", "server_manifest", "main", "_plain_status",
]
