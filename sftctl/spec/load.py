"""Loading a spec (see :mod:`sftctl.spec`): :func:`load_spec` (YAML 1.2 with lines, the user's
defaults, ``--set`` overrides, one line per problem, the model's entrypoint checked)."""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from sftctl.errors import SpecError
from sftctl.spec.env import _check_env_references, _interpolate
from sftctl.spec.model import JobSpec, MAX_SPEC_BYTES
from sftctl.yaml12 import Path_, _Loader, _Located, _build, _check_depth, _compose, _dotted, shown


# --------------------------------------------------------------------------- overrides


def _apply_override(data: dict, assignment: str, loc: _Located) -> None:
    key, sep, raw = assignment.partition("=")
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"--set {shown(assignment)}: the value is longer than {MAX_SPEC_BYTES:,} characters")
    shown_ = shown(assignment)
    key = key.strip()
    if not sep or not key:
        raise SpecError(
            f"--set {shown_}: expected key.path=value", hint="e.g. --set train.steps=20"
        )
    flow = raw.strip()[:1] in ("[", "{")
    try:
        if flow:
            _check_depth(raw, _Located(f"--set {shown_}"))
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else raw
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        digits = raw.strip().lstrip("+-")
        why = f"a number of {len(digits):,} digits" if digits.isdigit() else shown(str(e).splitlines()[0])
        raise SpecError(f"--set {shown_}: cannot read the value: {why}",
                        hint="give a number of a sensible size, or quote a string") from None
    except yaml.YAMLError as e:
        if flow:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise SpecError(f"--set {shown_}: cannot read {shown(raw)} as a YAML list or mapping: {problem}",
                            hint="e.g. --set 'resources.accelerators=[H100:8, A100-80GB:8]'") from None
        value = raw
    if value is None or not isinstance(value, (str, int, float, bool, list, dict)) or (
        isinstance(value, (list, dict)) and not flow
    ):
        value = raw
    parts: list[Any] = [int(p) if re.fullmatch(r"[0-9]+", p) else p for p in key.split(".")]
    if any(p == "" for p in parts):
        raise SpecError(f"--set {shown_}: empty segment in {key!r}", hint="e.g. train.steps")
    negative = next((p for p in parts if isinstance(p, str) and re.fullmatch(r"-[0-9]+", p)), None)
    if negative is not None:
        head = ".".join(str(p) for p in parts[:parts.index(negative)])
        raise SpecError(f"--set {shown_}: {head}: index {negative}: list indexes count from 0; negative ones are not "
                        "supported", hint=f"give the item's position (0 is the first), or set the whole list: "
                                          f"--set '{head}=[...]'")
    if parts[0] in ("env", "labels") and value is not raw:  # env values are the text written: env.UMASK=0022
        value = _build(yaml.compose(raw, Loader=_Loader), _Located(f"--set {shown_}"), tuple(parts))
    node: Any = data
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = tuple(parts[: i + 1])
        if isinstance(node, dict) and isinstance(part, str):
            if last:
                node[part] = value
            else:
                nxt = node.get(part)
                if nxt is None and isinstance(parts[i + 1], int):  # a list the spec leaves to its default
                    raise SpecError(
                        f"--set {shown_}: {_dotted(here)}: not set in the spec (its default applies), "
                        f"so it has no item {parts[i + 1]}",
                        hint=f"set the whole list: --set '{'.'.join(str(p) for p in here)}=[...]'")
                if nxt is None:
                    nxt = node[part] = {}
                elif here == ("storage",) and isinstance(nxt, str):  # storage: URL is {url: URL}
                    nxt = node[part] = {"url": nxt}
                node = nxt
        elif isinstance(node, list) and isinstance(part, int):
            if part >= len(node):
                raise SpecError(
                    f"--set {shown_}: {_dotted(here)}: index {part} is out of range "
                    f"(the list has {len(node)} items)"
                )
            if last:
                node[part] = value
            else:
                node = node[part]
        else:
            raise SpecError(
                f"--set {shown_}: {_dotted(here[:-1]) or 'top level'} is not a "
                f"{'list' if isinstance(part, int) else 'mapping'}",
                hint="check the key path against the spec",
            )
    loc.overrides[tuple(parts)] = shown_


# --------------------------------------------------------------------------- validation errors


def _field_model_at(path: Path_) -> type[BaseModel] | None:
    """The pydantic model class that a document path points into, if any."""
    model: Any = JobSpec
    for part in path:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = _unwrap(field.annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(tp: Any) -> Any:
    for arg in typing.get_args(tp) or ():
        inner = _unwrap(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return tp


def _explain(err: typing.Mapping[str, Any], loc: _Located) -> SpecError:
    path = model_path = tuple(p for p in err["loc"] if isinstance(p, (str, int)))
    if path[:2] == ("resources", "spot_policy"):  # written as resources.spot: {...}
        path = ("resources", "spot") + path[2:]
    field = _dotted(path) or "top level"
    where = loc.where(path)
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _field_model_at(model_path[:-1])
        allowed = sorted(f for f in parent.model_fields if f != "spot_policy") if parent else []  # written as spot
        close = difflib.get_close_matches(str(path[-1]), allowed, n=1, cutoff=0.6)
        if parent is JobSpec:  # a nested field written at the top level: steps: is train.steps
            nested = [f"{name}.{path[-1]}" for name, f in JobSpec.model_fields.items()
                      if isinstance(_unwrap(f.annotation), type) and issubclass(_unwrap(f.annotation), BaseModel)
                      and path[-1] in _unwrap(f.annotation).model_fields]
            close = nested[:1] or close
        suggestion = f"; did you mean '{close[0]}'?" if close else ""
        return SpecError(
            f"{where}: {field}: unknown field{suggestion}",
            hint=f"fields allowed here: {', '.join(allowed)}" if allowed else None,
        )
    if kind == "missing":
        return SpecError(
            f"{where}: {field}: required field is missing",
            hint="see examples/quickstart.yaml for a complete spec",
        )
    msg = re.sub(r" or instance of \w+", "", err["msg"].removeprefix("Value error, "))
    named = re.fullmatch(r"([a-z_]+(?:\.[a-z_]+)+): (.*)", msg, re.S) if kind == "value_error" and not path else None
    if named:  # a check across fields (a model validator) names the field it is about
        path = tuple(named.group(1).split("."))
        field, where, msg = named.group(1), loc.where(path), named.group(2)
    msg = msg.replace("a valid dictionary", "a mapping (key: value lines)")
    got = err.get("input")
    if kind == "string_pattern_mismatch" and path == ("name",) and isinstance(got, str):
        return SpecError(f"{where}: name: {NAME_RULE} (got {shown(repr(got))})",
                         hint=f"e.g. name: {name_slug(got)}")
    got_text = "" if isinstance(got, (dict, list)) or kind == "value_error" else f" (got {shown(repr(got))})"
    hint = "docs/spec.md lists every field's type"
    if kind == "less_than_equal":  # the bounds (MAX_STEPS, ...) are far beyond any real job
        hint = "that is far beyond any real job; check the value for a typo"
    if kind == "string_type":  # YAML read an unquoted value as a number, bool or null
        hint = "quote values meant as strings; " + hint
    return SpecError(f"{where}: {field}: {msg}{got_text}", hint=hint)


#: :class:`~sftctl.spec.model.JobSpec`'s ``name`` pattern in words
NAME_RULE = ("a job name is lowercase letters, digits, '.' and '-', starting with a letter, "
             "at most 40 characters")


def name_slug(name: str) -> str:
    """A job name that fits :data:`NAME_RULE`, made from ``name`` as a default name is made from
    the file's stem: accents dropped (``ü`` -> ``u``), lowercased, runs of other characters one
    ``-``, ``job-`` in front when it does not start with a letter, at most 40 characters
    (``训练-ünï`` -> ``uni``; ``训练`` -> ``job``)."""
    import unicodedata

    ascii_ = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode().lower()
    slug = re.sub(r"[^a-z0-9.-]+", "-", ascii_).strip("-.")
    if not slug[:1].isalpha():
        slug = f"job-{slug}".rstrip("-")
    return slug[:40].rstrip("-.")


#: the most lines a spec's problems take (a screen's worth), the last "... and N more problems"
MAX_PROBLEM_LINES = 20


def _all_problems(errors: typing.Sequence[typing.Mapping[str, Any]], loc: _Located) -> SpecError:
    """Every problem of a spec as one :class:`SpecError`: a line each (``file:LINE: field: why``),
    those of --set overrides first (the one the user is looking at), then by line; at most
    :data:`MAX_PROBLEM_LINES` lines. The hint is the first problem's."""
    explained = [_explain(err, loc) for err in errors]

    def order(e: SpecError) -> tuple:
        where = e.message.split(": ", 1)[0]
        line = where.rsplit(":", 1)[-1]
        return (not where.startswith("--set"), int(line) if line.isdigit() else 0)

    explained = list({e.message: e for e in sorted(explained, key=order)}.values())  # one line per problem
    shown_ = explained if len(explained) <= MAX_PROBLEM_LINES else explained[:MAX_PROBLEM_LINES - 1]
    lines = [e.message for e in shown_]
    if len(shown_) < len(explained):
        lines.append(f"... and {len(explained) - len(shown_)} more problems")
    return SpecError("\n".join(lines), hint=shown_[0].hint, exit_code=shown_[0].exit_code)


# --------------------------------------------------------------------------- entry point


def unknown_accelerator(i: int, name: str, where: str | None = None) -> SpecError | None:
    """The error for ``resources.accelerators[i]`` naming an accelerator sftctl does not know
    (:func:`sftctl.catalog.accelerator_names`), at ``where`` (``file:line``) when given; else None."""
    from sftctl.catalog import accelerator_names
    from sftctl.catalog.accelerators import suggest_accelerators

    known = {n.lower(): n for n in accelerator_names()}
    if name.lower() in known:
        return None
    close = suggest_accelerators(name, list(known.values()))
    return SpecError(
        (f"{where}: " if where else "") + f"resources.accelerators[{i}]: unknown accelerator {name!r}"
        + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""),
        hint=f"known accelerators: {', '.join(known.values())} (sftctl catalog lists offerings)",
    )


def default_name(path: Path) -> str:
    """A job name from the spec file's stem that always passes ``name``'s pattern: lowercase,
    runs of other characters as one dash, ``job-`` in front of a stem that does not start with
    a letter (``2024-exp.yaml`` -> ``job-2024-exp``), at most 40 characters."""
    stem = re.sub(r"[^a-z0-9-]+", "-", path.stem.lower()).strip("-")
    if not stem[:1].isalpha():
        stem = f"job-{stem}".rstrip("-")
    return stem[:40].rstrip("-")


def _read_spec_file(path: Path) -> str:
    """The spec's text. Type and size are checked before reading: a FIFO, a device such as
    /dev/zero, or a file over MAX_SPEC_BYTES is refused, never read (nor waited on)."""
    import stat

    try:
        st = path.stat()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file", hint="give the path to a job spec YAML") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read the spec: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise SpecError(f"{path}: is a directory, not a job spec", hint="give the path to a job spec YAML")
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file"
        raise SpecError(f"{path}: is {kind}, not a job spec file", hint="give the path to a job spec YAML file")
    if st.st_size > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: {st.st_size:,} bytes; a job spec is at most {MAX_SPEC_BYTES:,}",
                        hint="is this the right file? keep data in the workdir, not in the spec")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)  # the file may have grown since stat
    except OSError as e:
        raise SpecError(f"{path}: cannot read the spec: {e.strerror or e}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: larger than {MAX_SPEC_BYTES:,} bytes", hint="is this the right file?")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text (byte {e.start}): not a job spec",
                        hint="give the path to a job spec YAML file") from None


def _storage_url(value: typing.Any) -> str | None:
    """The URL of a spec's ``storage:`` as written (a string, or ``{url: ...}``), else None."""
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) else None


def _is_relative_directory(url: str) -> bool:
    """Whether a storage URL is a local directory given relative (``relstore``, ``./out``):
    no ``scheme://``, not absolute once ``~`` is expanded."""
    return "://" not in url and not os.path.isabs(os.path.expanduser(url))


def absolute_storage_overrides(sets: typing.Sequence[str], cwd: Path | None = None) -> list[str]:
    """``--set`` strings with a relative storage directory (``storage=relstore``,
    ``storage.url=./out``) made absolute against ``cwd`` (default: the current directory), as
    :func:`load_spec` would take it here. A client sends these to a server, whose current
    directory is not the user's (the job's checkpoints went below the server's)."""
    out = []
    for s in sets:
        key, sep, value = s.partition("=")
        if sep and key.strip() in ("storage", "storage.url") and value.strip() \
                and value.strip()[:1] not in "[{'\"" and _is_relative_directory(value.strip()):
            value = str(((cwd or Path.cwd()) / os.path.expanduser(value.strip())).resolve())
        out.append(f"{key}{sep}{value}")
    return out


def _config_dir() -> Path:
    """The directory a relative ``defaults.storage`` is taken from: the config file's, when the
    setting comes from it (not from ``$SFTCTL_STORAGE``), else the current directory."""
    from sftctl import settings

    if settings.raw("SFTCTL_STORAGE") is None:
        config = settings.config_document()[0]
        if config is not None:
            return Path(config).parent
    return Path.cwd()


def _user_defaults(data: dict) -> dict[str, str]:
    """Fill ``resources.clouds``, ``resources.regions`` and ``storage`` that the spec leaves out
    from the user's settings (``SFTCTL_CLOUDS``/``defaults.clouds`` of the config file, ...:
    :mod:`sftctl.settings`); return where each filled field came from (``{"resources.clouds":
    "<file>:<line>: defaults.clouds"}``, see :func:`sftctl.settings.origin`). Raises
    SettingError (exit 2) for a malformed setting."""
    from sftctl import settings

    filled: dict[str, str] = {}
    for key, name in (("clouds", "SFTCTL_CLOUDS"), ("regions", "SFTCTL_REGIONS")):
        value = settings.get(name)
        resources = data.get("resources", {})
        if value is not None and isinstance(resources, dict) and key not in resources:
            data["resources"] = {**resources, key: value}
            filled[f"resources.{key}"] = settings.origin(name) or name
    storage = settings.get("SFTCTL_STORAGE")
    if storage is not None and "storage" not in data:
        data["storage"] = storage
        filled["storage"] = settings.origin("SFTCTL_STORAGE") or "SFTCTL_STORAGE"
    return filled


def load_spec(
    path: str | os.PathLike,
    overrides: typing.Sequence[str] = (),
    environ: typing.Mapping[str, str] | None = None,
    *,
    text: str | None = None,
) -> JobSpec:
    """Read, interpolate, override and validate a job spec.

    Args:
        path: the YAML file; with ``text``, only the name errors give it, and the directory
            relative paths are taken from (``sftctl.api`` passes ``<spec>`` for YAML text).
        text: the YAML itself instead of the file's content.
        overrides: ``key.path=value`` strings from ``--set``, applied in order after the file.
        environ: the environment for ``${VAR}``; defaults to ``os.environ``.

    Returns:
        The validated :class:`JobSpec`, with ``workdir`` made absolute (relative paths are taken
        from the spec file's directory) and ``name`` defaulted to the file's stem. A ``storage``
        directory given relative is made absolute too: against the spec file's directory when
        the file names it, the config file's when its ``defaults.storage`` does, the current
        directory when ``SFTCTL_STORAGE`` or ``--set`` does.

    Raises:
        SpecError: for every problem with the file or an override (exit code 2), naming the
            field and its line.
    """
    path = Path(path)
    loc = _Located(str(path))
    if text is None:
        text = _read_spec_file(path)
    elif len(text.encode()) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: {len(text.encode()):,} bytes; a job spec is at most {MAX_SPEC_BYTES:,}")
    data = _compose(text, loc)
    if not isinstance(data, dict):
        raise SpecError(
            f"{path}:1: the spec must be a mapping of fields (name, run, resources, ...)",
            hint="see examples/quickstart.yaml",
        )
    data = _interpolate(data, (), loc, os.environ if environ is None else environ)
    written = _storage_url(data.get("storage"))  # as the file has it, before --set
    for assignment in overrides:
        _apply_override(data, assignment, loc)
    _check_env_references(data, loc, os.environ if environ is None else environ)
    filled = _user_defaults(data)
    data.setdefault("name", default_name(path))
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        raise _all_problems(e.errors(include_url=False), loc) from None
    spec._defaults_from.update(filled)
    if spec.storage is not None and _is_relative_directory(spec.storage.url):
        # the file's own storage: relative to its directory (as workdir); the config file's
        # defaults.storage: to the config file's; SFTCTL_STORAGE's or --set's: to the current
        # directory. Nodes get it absolute (they run elsewhere).
        in_file = "storage" not in filled and spec.storage.url == written
        base = path.parent if in_file else _config_dir() if "storage" in filled else Path.cwd()
        url = str((base / os.path.expanduser(spec.storage.url)).resolve())
        spec = spec.model_copy(update={"storage": spec.storage.model_copy(update={"url": url})})
    workdir = (path.parent / spec.workdir).resolve()
    if not workdir.is_dir():
        raise SpecError(
            f"{loc.where(('workdir',))}: workdir: {workdir} is not a directory",
            hint="workdir is relative to the spec file's directory",
        )
    if spec.model is not None and not (workdir / spec.model.entrypoint_file).is_file():
        raise SpecError(
            f"{loc.where(('model', 'entrypoint'))}: model.entrypoint: "
            f"{spec.model.entrypoint_file} not found in workdir {workdir}",
            hint="the entrypoint's file is relative to workdir",
        )
    if spec.model is not None:
        _check_entrypoint_function(workdir, spec.model.entrypoint_file, spec.model.entrypoint,
                                   loc.where(("model", "entrypoint")))
    for i, acc in enumerate(spec.resources.accelerators):
        error = unknown_accelerator(i, acc.name, loc.where(("resources", "accelerators", i)))
        if error is not None:
            raise error
    return spec.model_copy(update={"workdir": str(workdir)})


def _check_entrypoint_function(workdir: Path, name: str, entrypoint: str, where: str) -> None:
    """A ``model.entrypoint`` function the file does not define is said at load, with a
    did-you-mean, in milliseconds: the file is parsed (:mod:`ast`), never imported (importing
    it imports torch: 20 s). What the module's top level binds counts (``def``, ``class``,
    assignments, imports, also inside ``if``/``try``/``with``); a file Python cannot parse, one
    that binds names dynamically (``from x import *``, a module ``__getattr__``, ``globals()``)
    or raises at its top level is left to the tracer."""
    import ast

    func = entrypoint.rpartition(":")[2]
    file = workdir / name
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except (SyntaxError, ValueError, OSError):
        return
    names: set[str] = set()
    functions: list[str] = []
    dynamic = False

    def visit(body: list) -> None:
        nonlocal dynamic
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                functions.append(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.name == "*":
                        dynamic = True
                    names.add((alias.asname or alias.name).split(".")[0])
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            for child in ("body", "orelse", "finalbody", "handlers"):  # if/try/with/for blocks
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = getattr(node, child, None)
                    if isinstance(inner, list):
                        visit(inner)
            if isinstance(node, ast.Raise) or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and any(
                    isinstance(n, ast.Name) and n.id in ("globals", "setattr", "exec") for n in ast.walk(node)):
                dynamic = True  # what its import does is the tracer's to say

    visit(tree.body)
    if func in names or dynamic or "__getattr__" in names:
        return
    close = difflib.get_close_matches(func, functions, n=1, cutoff=0.6)
    raise SpecError(
        f"{where}: model.entrypoint: {name} has no function {func!r}"
        + (f"; did you mean '{close[0]}'?" if close else ""),
        hint=f"defined in {name}: {', '.join(functions[:10]) or 'none'}" + (" ..." if len(functions) > 10 else ""),
    )
