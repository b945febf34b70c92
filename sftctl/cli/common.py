"""The typer app every command module registers on, its root callback (``--version``, ``--debug``,
the config file checked first), shell completion, and the output helpers the commands share
(:func:`_console`, :func:`_print_json`, :func:`_escape`, :func:`_planning`, :func:`_labels`, this
invocation's flags)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

import typer

from sftctl.errors import ExitCode, SftctlError

app = typer.Typer(
    name="sftctl",
    help="Train models on the cheapest accelerator that can run them.",
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _console(stderr: bool = False):
    from sftctl.ui import SafeConsole

    stream = sys.stderr if stderr else sys.stdout
    # piped output is read by scripts and people alike: do not squeeze tables to 80 columns,
    # unless COLUMNS says how wide (rich reads it when width is None)
    width = None if stream.isatty() or os.environ.get("COLUMNS", "").isdigit() else 240
    # a closed pipe or terminal silences the output, never ends the command (or its job)
    return SafeConsole(stderr=stderr, highlight=False, width=width)


def _finite(x):
    """``x`` (a JSON-able tree: dicts, lists, tuples, scalars) with every float that is NaN or
    infinite replaced by None: JSON (RFC 8259) has no NaN or Infinity, and ``jq`` refuses them."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _print_json(doc) -> None:
    """Print ``doc`` as one JSON document on stdout (a figure that is not finite: null)."""
    _JSON_PRINTED[0] = True
    sys.stdout.write(json.dumps(_finite(doc), indent=2, default=str, allow_nan=False) + "\n")
    sys.stdout.flush()


def _plain_metavars() -> None:
    """Help shows each value as its metavar (SPEC, JOB, --node RANK), never as a Python type
    (typer prints ``<list[str]>``, ``<int>`` after every argument and option without one)."""
    from typer.core import TyperArgument, TyperOption

    TyperArgument.display_type_rich = lambda self, ctx: None  # type: ignore[method-assign]  # typer's own hook

    def option_metavar(self, ctx):
        if self.metavar is not None:
            return self.metavar
        return (self.name or "value").upper().replace("_", "-")

    TyperOption.display_type_rich = option_metavar  # type: ignore[method-assign]


_plain_metavars()


# ------------------------------------------------------------------------ shell completion
# Each runs inside the user's shell at <TAB>: quick, and silent on any error (no traceback).


def _complete_jobs(incomplete: str) -> list[str]:
    """Job ids of this $SFTCTL_HOME, newest first, that start with what was typed."""
    try:
        from sftctl import api

        return [v.id for v in api.status() if v.id.startswith(incomplete)]
    except Exception:  # noqa: BLE001 (a damaged or locked state: no completions, never a traceback)
        return []


def _complete_accelerators(incomplete: str) -> list[str]:
    """Accelerator names (``--target``, ``--accelerator``), in the case typed."""
    try:
        from sftctl import api

        names = api.accelerator_names()
    except Exception:  # noqa: BLE001
        return []
    low = incomplete.lower()
    return [n.lower() if incomplete.islower() else n for n in names if n.lower().startswith(low)]


def _complete_specs(incomplete: str) -> list[str]:
    """Spec paths: directories (to descend into) and ``*.yaml`` / ``*.yml`` files."""
    import glob

    out = []
    for p in sorted(glob.glob(glob.escape(incomplete) + "*")):
        if os.path.isdir(p):
            out.append(p.rstrip("/") + "/")
        elif p.endswith((".yaml", ".yml")):
            out.append(p)
    return out


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True),
    debug: bool = typer.Option(False, "--debug", help="On an error, also print the traceback (for bug reports); "
                               "accepted anywhere on the command line; exit codes stay the same."),
) -> None:
    """Train models on the cheapest accelerator that can run them."""
    if version:
        from sftctl import __version__

        print(f"sftctl {__version__}")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is not None and not _HELP[0]:
        # every command reads the config file (state's lock timeout, clouds, slurm:): check it
        # as a whole first, so a mistake in it is the same exit 2 whatever the command
        from sftctl import api

        api.validate_config()


@contextlib.contextmanager
def _planning(stderr: bool, label: str = "planning"):
    """A ``progress`` callback for :mod:`sftctl.api` that drives a spinner on a terminal; the
    api's :class:`~sftctl.errors.SftctlWarning`\\ s are printed as ``warning:`` lines after. A
    Ctrl-C inside raises :class:`~sftctl.cli._interrupt.Interrupted` ("interrupted while planning:
    nothing was started"): the api records a job only once its plan is made."""
    import warnings

    from sftctl.cli._interrupt import Interrupted, caused_by_interrupt
    from sftctl.errors import SftctlWarning

    # the status line is on stderr whatever ``stderr`` says: stdout may be a --json document or a table
    console = _console(stderr=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SftctlWarning)
        try:
            if not console.is_terminal:
                yield lambda msg: None
            else:
                from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

                # what it is doing (tracing, compiling for H100 (accelerator 2 of 5): GEMM schedules
                # 12/40), with the time since it started: a cold plan takes minutes
                with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                              transient=True) as bar:
                    task = bar.add_task(label, total=None)
                    yield lambda msg: bar.update(task, description=_escape(msg))
        except BaseException as e:  # Ctrl-C, or pydantic-core's SchemaError wrapping one (cli._interrupt)
            if isinstance(e, Interrupted) or not caused_by_interrupt(e):
                raise
            nothing = ": nothing was started" if label == "planning" else ""
            raise Interrupted(f"interrupted while {label}{nothing}") from e
    for w in caught:
        if issubclass(w.category, SftctlWarning):
            _console(stderr=True).print(f"[yellow]warning:[/] {_escape(str(w.message))}", soft_wrap=True)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _labels(pairs: list[str]) -> dict[str, str]:
    """``--label k=v`` options as a mapping. Raises SftctlError (exit 2) for one without ``=``."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SftctlError(f"--label {pair}: expected k=v", hint="e.g. --label lr=0.001", exit_code=ExitCode.USAGE)
        out[key.strip()] = value
    return out


_JSON_PRINTED = [False]  # whether this invocation printed its JSON document already
_DEBUG = [False]  # sftctl --debug: tracebacks, and an attached run shows torch's noise in the node logs
_HELP = [False]  # whether this invocation only asks for help (the config file is not checked)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
