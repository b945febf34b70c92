"""``${VAR}`` in a spec (see :mod:`sftctl.spec`): interpolation at load with line-numbered
errors, ``env:`` values kept as references (:func:`env_references`) and filled for a node
(:func:`resolve_env`), and ``run:``/``setup:``'s shell references nothing sets
(:func:`unset_shell_references`)."""

from __future__ import annotations

import functools
import os
import re
import typing
from typing import Any

from sftctl.errors import SpecError
from sftctl.spec.model import _NO_INTERPOLATION
from sftctl.yaml12 import Path_, _Located, _dotted


# --------------------------------------------------------------------------- YAML with lines


_VAR = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _interpolate(value: Any, path: Path_, loc: _Located, environ: typing.Mapping[str, str]) -> Any:
    if path[:1] and (path[0],) in _NO_INTERPOLATION:
        return value
    if isinstance(value, dict):
        return {k: _interpolate(v, path + (k,), loc, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, path + (i,), loc, environ) for i, v in enumerate(value)]
    if not isinstance(value, str) or "$" not in value:
        return value
    if len(path) == 2 and path[0] == "env":  # kept as a reference: _check_env_references
        return value
    return _expand(value, environ, lambda name: _unset(name, path, loc, environ))


def _unset(name: str, path: Path_, loc: _Located, environ: typing.Mapping[str, str] | None = None) -> SpecError:
    # an environment may word itself (sftctl.vault.SecretEnviron: a user's secrets on a server)
    if hasattr(environ, "hint_for"):
        described: Any = environ
        return SpecError(f"{loc.where(path)}: {_dotted(path)}: ${{{name}}} is not set in {described.where}",
                         hint=described.hint_for(name))
    return SpecError(f"{loc.where(path)}: {_dotted(path)}: ${{{name}}} is not set in the environment",
                     hint=f"export {name}=..., or write ${{{name}:-default}}; $${{ gives a literal ${{")


def _check_env_references(data: dict, loc: _Located, environ: typing.Mapping[str, str]) -> None:
    """Each ``${VAR}`` of an ``env:`` value (file or ``--set``) is set or has a default now; the
    value itself stays the reference, resolved when a node's environment is built (resolve_env)."""
    env = data.get("env")
    if isinstance(env, dict):
        for key, value in env.items():
            if isinstance(key, str) and isinstance(value, str):
                _expand(value, environ, functools.partial(_unset, path=("env", key), loc=loc, environ=environ))


def _expand(value: str, environ: typing.Mapping[str, str], unset: typing.Callable[[str], Exception]) -> str:
    def sub(m: re.Match) -> str:
        if m.group(0) == "$${":
            return "${"
        name, default = m.group(1), m.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        raise unset(name)

    return _VAR.sub(sub, value)


def env_references(value: str) -> list[str]:
    """The environment variables a stored ``env:`` value refers to (``${NAME}``, ``${NAME:-d}``),
    in order; ``$${`` is a literal, not a reference."""
    return [m.group(1) for m in _VAR.finditer(value) if m.group(1)]


#: variables the shell or every machine sets itself: never reported as unset in ``run:``
_SHELL_SET = frozenset("""HOME PATH USER LOGNAME SHELL PWD OLDPWD HOSTNAME HOSTTYPE OSTYPE MACHTYPE UID EUID
PPID RANDOM SRANDOM SECONDS LINENO BASHPID BASH BASH_VERSION BASH_SOURCE BASH_LINENO FUNCNAME IFS PS1 PS2 PS4
SHLVL TERM LANG TMPDIR REPLY OPTARG OPTIND PIPESTATUS EPOCHSECONDS EPOCHREALTIME GROUPS""".split())


_SHELL_REF = re.compile(r"\\\$|\$\$|\$\{#?([A-Za-z_][A-Za-z0-9_]*)(:?[-=?+])?|\$([A-Za-z_][A-Za-z0-9_]*)")


_SINGLE_QUOTED = re.compile(r"'[^']*'")


def unset_shell_references(script: str, known: typing.Iterable[str],
                           environ: typing.Mapping[str, str] | None = None) -> list[str]:
    """The variables a ``run:``/``setup:`` shell script expands (``$NAME``, ``${NAME}``) that
    nothing sets: not in ``known`` (the node's environment: the spec's ``env`` and ``secrets``,
    sftctl's own variables), not in ``environ`` (what the node inherits: this shell's, for local
    nodes; pass ``{}`` for nodes that do not), not the shell's own (``$HOME``, ``$RANDOM``), not
    assigned in the script (``NAME=``, ``for NAME in``, ``read NAME``), not given a default
    (``${NAME:-x}``). The node's shell expands each to nothing. In order, each once; text in
    single quotes and ``$$``/``\\$`` are not expansions."""
    known = set(known) | _SHELL_SET
    environ = os.environ if environ is None else environ
    text = _SINGLE_QUOTED.sub("", script)
    out: list[str] = []
    for m in _SHELL_REF.finditer(text):
        name = m.group(1) or m.group(3)
        if not name or m.group(2) or name in known or name in environ or name in out:
            continue
        if name.startswith(("SFTCTL_", "PET_")):  # sftctl's node variables, some set by the node itself
            continue
        if re.search(rf"(^|[\s;&|(]){name}=|\bfor\s+{name}\b|\bread\b[^\n;]*\b{name}\b", script, re.M):
            continue
        out.append(name)
    return out


def resolve_env(env: typing.Mapping[str, str], environ: typing.Mapping[str, str] | None = None) -> dict[str, str]:
    """The spec's ``env`` as a node gets it: each ``${VAR}`` replaced from ``environ`` (default
    ``os.environ``, the controller's: ``sftctl run`` or the controller it starts, which inherits
    it). A spec keeps the references (state.db, events, logs hold ``${MY_API_TOKEN}``, never its
    value); only the node's environment holds the values.

    Raises:
        SpecError: a variable without a default is not set (it was when the spec was loaded).
    """
    environ = os.environ if environ is None else environ
    described: Any = environ

    def unset(k: str) -> typing.Callable[[str], Exception]:
        if hasattr(environ, "hint_for"):  # sftctl.vault.SecretEnviron: the job's owner's secrets
            return lambda name: SpecError(f"env.{k}: ${{{name}}} is not set in {described.where}",
                                          hint=described.hint_for(name))
        return lambda name: SpecError(f"env.{k}: ${{{name}}} is not set in the environment of the controller",
                                      hint=f"export {name}=... in the shell that runs sftctl")

    return {k: _expand(v, environ, unset(k)) for k, v in env.items()}
