"""The config file sftctl reads user settings from (:mod:`sftctl.settings`): where it is
(:func:`locate`), reading it with the job spec's YAML 1.2 loader (:mod:`sftctl.yaml12`: line
numbers kept, no pydantic), checking it as a whole (:func:`document`) and a setting's typed value
in it (:func:`value_in`).

It declares no setting: :mod:`sftctl.settings` passes its declarations (``DECLARED``) and the
values of ``SFTCTL_CONFIG`` and ``SFTCTL_HOME``, and is the module callers use
(``settings.config_path()``, ``settings.config_document()``, ``settings.get``). Every problem is a
:class:`SettingError` (``sftctl.settings.SettingError``, the same class) naming the file, line
and key (exit 2).
"""

from __future__ import annotations

import os
import typing

from sftctl.errors import ExitCode, SftctlError, SpecError
from sftctl.slurm_config import FIELD_KINDS, value_problem

class SettingError(SftctlError, ValueError):
    """A setting's value (from the environment or the config file) is malformed, or the config
    file is. The message names the variable (or the file, line and key). Exit code 2.

    A ``ValueError`` too: :mod:`sftctl.train` documents ``ValueError`` for bad variables.
    Declared here, below :mod:`sftctl.settings`, which raises it too and exports it."""

    exit_code = ExitCode.USAGE


#: what :func:`value_in` gives for a key the file does not set (or sets to null)
MISSING = object()
_cache: dict = {}  # (path, mtime_ns, size) -> (document, lines)
#: top-level sections of the config file that belong to others (validated where they are used)
OTHER_SECTIONS = ("slurm",)


class Declared(typing.Protocol):
    """What the reader needs of a declared setting (:class:`sftctl.settings.Setting`)."""

    name: str
    type: str
    meaning: str
    file: str | None

    def expected(self) -> str: ...

    def parse(self, raw: str, where: str | None = None) -> typing.Any: ...


def _not_a_file(path: str) -> str:
    """What ``path``, which is not a regular file, is instead: "does not exist", "is a directory,
    not a file", "is a FIFO (named pipe), not a file", ..."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    return f"is {kind}, not a file" if kind != "not a regular file" else "is not a regular file"


def locate(explicit: str | None, home: typing.Callable[[], str | None]) -> str | None:
    """The config file to read: ``explicit`` (``$SFTCTL_CONFIG``); else ``config.yaml`` in the
    user config directory when it exists; else ``config.yaml`` in ``home()`` (``$SFTCTL_HOME``,
    asked only then; None: the default data directory) when it exists (the old location); else
    None.

    Raises:
        SettingError: ``explicit`` names a file that does not exist, or a directory, FIFO,
            device or socket (exit 2).
    """
    if explicit:  # named by the user: it must be there (the default location may be absent)
        path = os.path.expanduser(explicit)
        if not os.path.isfile(path):
            what = _not_a_file(path)
            raise SettingError(f"SFTCTL_CONFIG: {path} {what}",
                               hint="point SFTCTL_CONFIG at your config file, or unset it "
                                    "(then ~/.config/sftctl/config.yaml is read when it exists)")
        return path
    import platformdirs

    xdg = os.path.join(platformdirs.user_config_dir("sftctl", appauthor=False), "config.yaml")
    if os.path.isfile(xdg):
        return xdg
    old = os.path.join(home() or platformdirs.user_data_dir("sftctl", appauthor=False), "config.yaml")  # as sftctl.paths
    return old if os.path.isfile(old) else None


def document(path: str | None, declared: typing.Sequence[Declared]) -> tuple[str | None, dict, dict]:
    """``(path, document, lines)`` of the config file ``path`` (:func:`locate`'s): its mapping
    (``{}`` when there is none) and the line of each dotted key. Cached per file version.

    The whole file is validated when it is read (whichever setting asked): every key is one of
    ``declared``'s ``file`` keys (did-you-mean hint) or in :data:`OTHER_SECTIONS`, every value
    has its setting's type, and the ``slurm:`` section has
    :class:`sftctl.slurm_config.SlurmConfig`'s fields and types.

    Raises:
        SettingError: the file cannot be read, is not YAML, is not a mapping, has a key no
            setting declares, or a value of the wrong type (the message names the file, line and
            key; exit 2).
    """
    if path is None or not os.path.isfile(path):
        return path, {}, {}
    try:
        st = os.stat(path)
    except OSError as e:
        raise SettingError(f"{path}: cannot read the config file: {e.strerror or e}") from None
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _cache:
        _cache.clear()
        _cache[key] = _load(path, declared)
    doc, lines = _cache[key]
    return path, doc, lines


def _load(path: str, declared: typing.Sequence[Declared]) -> tuple[dict, dict]:
    from sftctl.yaml12 import _compose, _Located  # the job spec's YAML 1.2 loader (line numbers)

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except (OSError, UnicodeDecodeError) as e:
        raise SettingError(f"{path}: cannot read the config file: {getattr(e, 'strerror', None) or e}") from None
    if not text.strip():
        return {}, {}
    loc = _Located(path)
    try:
        doc = _compose(text, loc)
    except SpecError as e:
        raise SettingError(e.message.replace("the spec is empty", "empty"),
                           hint="fix the YAML on that line (see `python -m sftctl.settings --markdown`)") from None
    if not isinstance(doc, dict):
        raise SettingError(f"{path}:1: the config file must be a mapping (state:, aws:, slurm:, ...)",
                           hint="see docs/settings.md")
    lines = {".".join(map(str, p)): n for p, n in loc.lines.items() if p}
    known = {s.file for s in declared if s.file}
    sections = {k.split(".")[0] for k in known} | set(OTHER_SECTIONS)
    for top, value in doc.items():
        if top in OTHER_SECTIONS:
            continue
        if top not in sections:
            unknown(path, lines, top, sorted(sections))
        if not isinstance(value, dict):
            raise SettingError(f"{path}:{lines.get(top, 1)}: {top}: expected a mapping "
                               f"({', '.join(sorted(k.split('.', 1)[1] for k in known if k.startswith(top + '.')))})",
                               hint=f"write it as `{top}: {{key: value}}`")
        for sub in value:
            dotted = f"{top}.{sub}"
            if dotted not in known:
                unknown(path, lines, dotted, sorted(k for k in known if k.startswith(top + ".")))
    for s in declared:  # every value has its type, whichever setting is asked for first
        if s.file is not None:
            value_in(s, path, doc, lines)
    if doc.get("slurm") is not None:
        _check_slurm(path, doc["slurm"], lines)
    return doc, lines


def _check_slurm(path: str, value: typing.Any, lines: dict) -> None:
    """The ``slurm:`` section against :class:`sftctl.slurm_config.SlurmConfig`, the one
    declaration of its fields: known keys (did-you-mean) and each value of its field's type
    (:func:`sftctl.slurm_config.value_problem`: counts and ports >= 1, prices >= 0, as in a job
    spec's ``slurm:``).

    Raises:
        SettingError: naming the file, line and key (exit 2).
    """
    if not isinstance(value, dict):
        raise SettingError(f"{path}:{lines.get('slurm', 1)}: slurm: expected a mapping (host, partition, ...)",
                           hint="write it as `slurm: {key: value}` (see docs/slurm.md)")
    for key, v in value.items():
        dotted = f"slurm.{key}"
        if key not in FIELD_KINDS:
            unknown(path, lines, dotted, sorted(f"slurm.{f}" for f in FIELD_KINDS))
        expected = value_problem(key, v)
        if expected is not None:
            raise SettingError(f"{path}:{lines.get(dotted, 1)}: {dotted}: expected {expected}, got {v!r}",
                               hint=f"write {dotted} as {expected} (see docs/slurm.md)")


def unknown(path: str, lines: dict, dotted: str, options: list[str]) -> typing.NoReturn:
    """Raise the error for ``dotted``, a key no one declares, at its line of ``path``.

    Raises:
        SettingError: always, with a did-you-mean hint among ``options`` (exit 2).
    """
    import difflib

    close = difflib.get_close_matches(dotted, options, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(options)}"
    raise SettingError(f"{path}:{lines.get(dotted, 1)}: {dotted}: unknown setting", hint=hint)


def value_in(s: Declared, path: str | None, doc: dict, lines: dict) -> typing.Any:
    """The typed value of ``s``'s key in the config ``doc``, or :data:`MISSING`.

    Raises:
        SettingError: the value does not have ``s``'s type (file, line and key named; exit 2).
    """
    node: typing.Any = doc
    for part in (s.file or "").split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    if node is None:
        return MISSING
    where = f"{path}:{lines.get(s.file, 1)}: {s.file}"
    if isinstance(node, list) and s.type in ("list", "paths") and all(isinstance(x, (str, int, float)) for x in node):
        node = (os.pathsep if s.type == "paths" else ",").join(str(x) for x in node)
    if isinstance(node, bool) and s.type != "bool" or isinstance(node, (dict, list)):
        raise SettingError(f"{where}: expected {s.expected()}, got {node!r}",
                           hint=f"write {s.file} as {s.expected()} ({s.meaning}), or set {s.name}")
    value = s.parse(("1" if node else "0") if isinstance(node, bool) else str(node), where)
    return value
