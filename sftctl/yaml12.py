"""The YAML loader of job specs and the config file: YAML 1.2 (core schema) booleans and numbers,
duplicate keys refused, every value's line recorded, errors as one line naming file and line.

Light on purpose (PyYAML and :mod:`sftctl.errors` only): :mod:`sftctl.settings` reads the config
file with it without importing the job spec's pydantic models. :mod:`sftctl.spec` builds on it.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from sftctl.errors import SpecError

_MAX_NODES = 100_000  # YAML nodes visited while loading; guards against alias bombs
MAX_DEPTH = 32  # mappings and lists nested deeper than this are refused before composing
_SHOWN_CHARS = 60  # an error message shows at most this much of a bad value


def shown(value: Any) -> str:
    """A bad value as an error message shows it: one line, at most ``_SHOWN_CHARS`` characters
    (a 5,000-digit number or a binary blob is cut, with its length said)."""
    text = value if isinstance(value, str) else repr(value)
    one = text if text.isprintable() else repr(text)
    if len(one) <= _SHOWN_CHARS:
        return one
    return f"{one[:_SHOWN_CHARS]}... ({len(text):,} characters)"


Path_ = tuple  # a path into the document: ("resources", "accelerators", 0, "name")


class _Located:
    """Where each value of the document came from: a YAML line or a ``--set`` override."""

    def __init__(self, filename: str):
        self.filename = filename
        self.lines: dict[Path_, int] = {}
        self.overrides: dict[Path_, str] = {}

    def where(self, path: Path_) -> str:
        inside = [shown for p, shown in self.overrides.items() if p[: len(path)] == tuple(path)]
        if inside:  # an override changed something within the failing field
            return f"--set {inside[-1]}"
        prefixes = [tuple(path[:n]) for n in range(len(path), -1, -1)]
        for prefix in prefixes:  # an override of an enclosing field replaced what the file said
            if prefix in self.overrides:
                return f"--set {self.overrides[prefix]}"
        for prefix in prefixes:
            if prefix in self.lines:
                return f"{self.filename}:{self.lines[prefix]}"
        return self.filename


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 (core schema) booleans and numbers.

    Booleans are only true/false, so ``off``, ``no`` and ``on`` stay strings (YAML 1.1 would turn
    ``env: {A: off}`` into ``A=0`` and ``name: no`` into False). Integers are decimal (``010`` is
    10), ``0o17`` octal or ``0x1F`` hex; YAML 1.1's ``1:30`` (90), ``0b11``, ``1_000`` and
    leading-zero octal are not numbers. Values under ``env:`` skip all of this: see :func:`_build`.
    """


_TAG = "tag:yaml.org,2002:"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_TAG + "bool", _TAG + "int", _TAG + "float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _TAG + "bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Loader.add_implicit_resolver(  # before float: `10` is an int
    _TAG + "int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Loader.add_implicit_resolver(
    _TAG + "float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text[:2] in ("0o", "0x"):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)  # "010" is ten; ValueError (caught by the callers) for anything else


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node)
    special = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}
    return special[text.lower()] if text.lower() in special else float(text)


_Loader.add_constructor(_TAG + "int", _construct_int)
_Loader.add_constructor(_TAG + "float", _construct_float)


def _as_written(node: yaml.Node, path: Path_) -> bool:
    """Whether ``node`` is an env or labels value to keep as its text: ``UMASK: 0022`` is "0022", not 18."""
    return (len(path) == 2 and path[0] in ("env", "labels") and isinstance(node, yaml.ScalarNode)
            and node.style is None and node.tag != _TAG + "null")


def _check_depth(text: str, loc: _Located) -> None:
    """Refuse nesting deeper than MAX_DEPTH from the parser's events (no recursion: PyYAML's
    composer recurses once per level and would hit Python's recursion limit first)."""
    depth = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise SpecError(f"{loc.filename}:{event.start_mark.line + 1}: nested more than {MAX_DEPTH} levels deep",
                                hint="a job spec needs a few levels; check the brackets and indentation")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _compose(text: str, loc: _Located) -> Any:
    try:
        _check_depth(text, loc)
        root = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        n_lines = max(1, len(text.splitlines()))
        where = f"{loc.filename}:{min(mark.line + 1, n_lines)}" if mark else loc.filename
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(
            f"{where}: malformed YAML: {problem}",
            hint="check the indentation and quoting on that line; strings with ': ' need quotes",
        ) from None
    if root is None:
        raise SpecError(f"{loc.filename}: the spec is empty", hint="see examples/quickstart.yaml")
    return _build(root, loc)


def _build(root: yaml.Node, loc: _Located, base: Path_ = ()) -> Any:
    """Python values of a composed document whose root sits at ``base`` in the spec, recording
    each value's line in ``loc``; plain scalars under ``env:`` stay text (:func:`_as_written`)."""
    constructor = _Loader("")
    budget = [_MAX_NODES]

    def build(node: yaml.Node, path: Path_, active: frozenset) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise SpecError(f"{loc.filename}: the document is too large (alias expansion?)")
        if id(node) in active:
            raise SpecError(f"{loc.filename}:{node.start_mark.line + 1}: recursive YAML alias")
        loc.lines.setdefault(path, node.start_mark.line + 1)
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            out: dict[str, Any] = {}
            inner = active | {id(node)}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                    raise SpecError(
                        f"{loc.filename}:{key_node.start_mark.line + 1}: "
                        f"{_dotted(path) or 'top level'}: keys must be plain strings",
                        hint="quote the key, or fix the indentation",
                    )
                key = key_node.value
                if key in out:
                    raise SpecError(
                        f"{loc.filename}:{key_node.start_mark.line + 1}: "
                        f"{_dotted(path + (key,))}: duplicate key",
                        hint="remove one of the two",
                    )
                loc.lines[path + (key,)] = key_node.start_mark.line + 1
                out[key] = build(value_node, path + (key,), inner)
            return out
        if isinstance(node, yaml.SequenceNode):
            inner = active | {id(node)}
            return [build(item, path + (i,), inner) for i, item in enumerate(node.value)]
        if _as_written(node, path):
            return node.value
        try:
            return constructor.construct_object(node, deep=True)
        except Exception as e:  # noqa: BLE001 bad timestamps, unknown tags, ...: all the user's input
            raise SpecError(
                f"{loc.filename}:{line}: {_dotted(path) or 'value'}: cannot read {shown(node.value)}: "
                f"{shown(str(e).splitlines()[0] if str(e) else type(e).__name__)}",
                hint="quote the value to make it a string",
            ) from None

    return build(root, base, frozenset())


def _dotted(path: Path_) -> str:
    out = ""
    for p in path:
        if not isinstance(p, int) and not re.fullmatch(r"[\w-]+", p):
            p = repr(p)  # a key with spaces or newlines stays on one readable line
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def parse_duration_s(text: str) -> float:
    """Parse a positive ``90s``, ``30m``, ``6h`` or ``2d`` into seconds. Raises ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"expected a positive duration like '90m', '6h' or '2d', got {text!r}")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
