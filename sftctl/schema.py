"""The job spec's JSON Schema, for editors, and the spec reference (``docs/spec.md``) made from it.

``sftctl schema`` prints :func:`json_schema`; ``sftctl schema --markdown`` prints :func:`markdown`,
which is ``docs/spec.md`` (a test checks that the file is current). Both are made from
:class:`sftctl.spec.JobSpec` (``JobSpec.model_json_schema()``), so a field, default, bound or
description changes in one place: ``sftctl/spec.py``.

The schema describes the spec *as written in its YAML file*, which is what an editor checks,
not only the validated model: ``name`` may be left out (it defaults to the file's name), an
accelerator may be written ``H100:8`` and ``accelerators`` a single one, ``spot`` may be the
spot policy's mapping, ``storage`` a URL string, and ``env``/``labels`` values numbers or
booleans. It is JSON Schema draft-07 (``definitions``, no ``$ref`` with siblings), what
yaml-language-server reads ("JSON Schema 7 and below"); ``jsonschema``'s Draft7Validator
accepts exactly the examples ``sftctl`` loads (``tests/test_schema.py``). What a schema cannot
say is checked only when sftctl loads the spec: ``${VAR}`` in a number field, that the
entrypoint's file and function exist, that an accelerator name is known, and the rules across
fields (``recovery.min_nodes`` at most ``resources.nodes``, ``controller.partition`` only for
``place: slurm``).

This module is presentation (layer 5, beside ``cli``): it imports ``sftctl.spec`` (pydantic), so
import it inside a function on light paths.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

#: the schema dialect: yaml-language-server supports draft-07 and below
DIALECT = "http://json-schema.org/draft-07/schema#"
#: ``resources.accelerators`` written as text: ``NAME`` or ``NAME:COUNT`` (spec._parse_accelerator)
ACCELERATOR_TEXT = r"^\s*[^:\s][^:]*?\s*(:\s*[0-9]+\s*)?$"
#: a duration (yaml12.parse_duration_s): 90s, 30m, 6h, 2d
DURATION = r"^\s*[0-9]+(\.[0-9]+)?\s*[smhd]\s*$"
#: an env or labels value: YAML numbers and booleans are accepted and become text
SCALAR = {"type": ["string", "number", "boolean"]}

MODELINE = "# yaml-language-server: $schema=sftctl-spec.schema.json"


def json_schema() -> dict[str, Any]:
    """The job spec file's JSON Schema (draft-07) as a dict; see the module's docstring for
    what it adds to ``JobSpec.model_json_schema()``. Raises nothing."""
    from sftctl.compiler.attention import IMPLEMENTATIONS
    from sftctl.spec import JobSpec

    raw = JobSpec.model_json_schema()
    defs = raw.pop("$defs")
    top = raw["properties"]

    raw["required"] = [k for k in raw.get("required", []) if k != "name"]
    top["name"]["description"] = ("the job's name; job ids are <name>-<6 hex>. Default: the spec file's "
                                  "name, lowercased (2024-exp.yaml -> job-2024-exp)")
    top["workdir"]["description"] = ("the directory sent to the nodes, relative to the spec file's "
                                     "directory; setup and run run in it")
    top["model"]["description"] = ("what the planner traces and prices; without it plan ranks by price "
                                   "only and the script decides the rest")
    top["setup"]["description"] = "a shell script every node runs in the workdir before run (once per node)"
    top["run"]["description"] = ("the training command, a shell script every node runs in the workdir "
                                 "(SFTCTL_* variables say the node's rank, the node count, the rendezvous)")
    top["env"]["description"] = ("environment variables of the training processes; numbers and booleans "
                                 "become text (true -> 1, false -> 0)")
    for field in ("env", "labels"):
        top[field]["additionalProperties"] = dict(SCALAR)
    top["storage"]["anyOf"].insert(0, {"type": "string", "minLength": 1,
                                       "description": "the storage URL alone: s3://, gs://, pvc:// or a directory"})

    one = {"anyOf": [{"type": "string", "pattern": ACCELERATOR_TEXT, "description": "NAME or NAME:COUNT, e.g. H100:8"},
                     {"$ref": "#/$defs/Accelerator"}]}
    res = defs["ResourcesSpec"]["properties"]
    res["accelerators"] = {
        "anyOf": [one, {"type": "array", "minItems": 1, "items": copy.deepcopy(one)}],
        "description": "the accelerators a node may have, any one of them will do (the planner picks): "
                       "NAME:COUNT per node, e.g. [H100:8, A100-80GB:8]; cpu:N on the local machine. Default: [cpu:1]",
        "title": res["accelerators"].get("title", "Accelerators"),
    }
    spot = res["spot"]
    res["spot"] = {"anyOf": [{"type": "boolean"}, {"$ref": "#/$defs/SpotPolicy"}],
                   **{k: v for k, v in spot.items() if k not in ("type", "anyOf")}}
    res["deadline"]["anyOf"][0]["pattern"] = DURATION
    defs["SpotPolicy"]["properties"]["zone_cooldown"]["pattern"] = DURATION
    defs["ModelSpec"]["properties"]["attention"]["enum"] = list(IMPLEMENTATIONS)

    schema = {"$schema": DIALECT, "title": "sftctl job spec",
              "description": ("A training job for sftctl run / plan. Strings (not setup and run: their shell "
                              "does that) may refer to your environment as ${VAR} or ${VAR:-default}. "
                              "Reference: docs/spec.md; `sftctl schema` prints this schema."),
              **{k: v for k, v in raw.items() if k not in ("title", "description")}}
    schema["definitions"] = defs
    return _draft7(schema)


def _draft7(node: Any) -> Any:
    """``#/$defs/X`` -> ``#/definitions/X``, and a ``$ref`` with siblings (which draft-07
    ignores) wrapped in ``allOf``."""
    if isinstance(node, list):
        return [_draft7(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _draft7(v) for k, v in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str):
        out["$ref"] = ref.replace("#/$defs/", "#/definitions/")
        if len(out) > 1:
            return {"allOf": [{"$ref": out.pop("$ref")}], **out}
    return out


def dumps(schema: dict[str, Any] | None = None) -> str:
    """The schema as the JSON text ``sftctl schema`` prints (indented, ending in a newline)."""
    return json.dumps(json_schema() if schema is None else schema, indent=2) + "\n"


# ------------------------------------------------------------------------ the Markdown reference

def _ref_name(node: dict) -> str | None:
    ref = node.get("$ref") or next((s.get("$ref") for s in node.get("allOf", []) if "$ref" in s), None)
    return ref.rsplit("/", 1)[-1] if ref else None


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def _clean(text: str) -> str:
    text = re.sub(r":\w+:`~?([^`]*)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    text = text.replace("``", "`")
    return " ".join(text.split()).replace("|", "\\|")


def _bounds(node: dict) -> str:
    parts = []
    for key, sign in (("exclusiveMinimum", ">"), ("minimum", ">="), ("exclusiveMaximum", "<"), ("maximum", "<=")):
        if key in node:
            parts.append(f"{sign} {node[key]:,}" if isinstance(node[key], int) else f"{sign} {node[key]}")
    return f" ({', '.join(parts)})" if parts else ""


def _type(node: dict, sections: dict[str, str], branch: bool = False) -> str:
    """How ``node`` is written, in words; ``branch``: one of a field's forms (``anyOf``)."""
    name = _ref_name(node)
    if name:
        return f"[{name}](#{_slug(sections[name])})" if name in sections else name
    if "anyOf" in node:
        branches = [s for s in node["anyOf"] if s.get("type") != "null"]
        single = [s for s in branches if s.get("type") != "array"]
        listed = [s for s in branches if s.get("type") == "array"]
        if len(listed) == 1 and len(single) == 1 and listed[0].get("items") == single[0]:
            return f"{_type(single[0], sections, True)}, or a list of them"  # accelerators: one, or a list
        return " or ".join(dict.fromkeys(_type(s, sections, True) for s in branches))
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    kind = node.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        return f"list of {_type(node.get('items', {}), sections)}"
    if kind == "object":
        inner = node.get("additionalProperties")
        return f"map of text to {_type(inner, sections)}" if isinstance(inner, dict) else "mapping"
    text = kind or "any"
    if branch and kind == "string" and node.get("description"):  # a form of a field: say it in words
        return f"{text} ({_clean(node['description'])})"
    if "pattern" in node:
        text += f" matching `{node['pattern']}`".replace("|", "\\|")
    if "minLength" in node and node["minLength"] > 0 and "pattern" not in node:
        text += ", not empty"
    return text + _bounds(node)


def markdown(schema: dict[str, Any] | None = None) -> str:
    """The spec reference (``docs/spec.md``): one table per section (field, type, default,
    description), sections in the order the spec nests them. Raises nothing."""
    schema = json_schema() if schema is None else schema
    defs = schema["definitions"]
    sections: dict[str, str] = {}  # definition -> its heading (the path it is first written at)
    order: list[tuple[str, str | None, dict]] = [("top level", None, schema)]

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            name = _ref_name(node)
            if name and name not in sections:
                sections[name] = path
                order.append((path, name, defs[name]))
                walk_props(defs[name], path)
            for key in ("anyOf", "allOf"):
                for sub in node.get(key, []):
                    walk(sub, path)
            if isinstance(node.get("items"), dict):
                walk(node["items"], path + "[]")

    def walk_props(model: dict, prefix: str) -> None:
        for field, sub in model.get("properties", {}).items():
            walk(sub, f"{prefix}.{field}" if prefix else field)

    walk_props(schema, "")
    lines = [
        "# Job spec reference",
        "",
        "<!-- generated by `sftctl schema --markdown` from sftctl/spec.py: do not edit; "
        "tests/test_schema.py checks it is current -->",
        "",
        "A job spec is a YAML file (`examples/quickstart.yaml`). `sftctl run`, `plan`, `compile` and",
        "`run --dry-run` read it; `--set key.path=value` overrides a field. Strings (not `setup` and `run`:",
        "their shell does that) may refer to your environment as `${VAR}` or `${VAR:-default}`.",
        "",
        "Editors: `sftctl schema --output sftctl-spec.schema.json` writes the spec's JSON Schema",
        "(draft-07); a first line",
        "",
        "```yaml",
        MODELINE,
        "```",
        "",
        "in a spec makes yaml-language-server (VS Code's YAML extension, Neovim, Helix, Emacs' lsp-mode)",
        "complete fields and flag a wrong one (a path is relative to the spec's file). What the schema",
        "cannot say is checked when sftctl loads the spec: the entrypoint's file and function, the",
        "accelerator names (`sftctl catalog`), `${VAR}` in a number field, and rules across fields.",
        "",
        "Sections: " + ", ".join(f"[{p}](#{_slug(p)})" for p, _, _ in order[1:]) + ".",
    ]
    for heading, name, model in order:
        lines += ["", f"## {heading}", ""]
        if model.get("description") and model is not schema:
            lines += [_clean(model["description"]) + (f" (`{name}`)" if name else ""), ""]
        required = set(model.get("required", []))
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        for field, sub in model.get("properties", {}).items():
            if field in required:
                default = "**required**"
            elif "default" in sub:
                default = f"`{json.dumps(sub['default'])}`".replace("|", "\\|")
            else:
                default = "see its section" if _ref_name(sub) else "-"
            ref = _ref_name(sub) or next(filter(None, map(_ref_name, sub.get("anyOf", []))), None)
            about = sub.get("description") or (defs[ref].get("description", "").split(". ")[0].rstrip(".")
                                                if ref else "")
            lines.append(f"| `{field}` | {_type(sub, sections)} | {default} | {_clean(about)} |")
    return "\n".join(lines) + "\n"


def write(path, text: str) -> None:
    """Write ``text`` to ``path`` (``sftctl schema --output``).

    Raises:
        SftctlError: (exit code 2) the file cannot be written, with the reason and a fix.
    """
    from pathlib import Path

    from sftctl.errors import SftctlError

    path = Path(path)
    try:
        path.write_text(text)
    except OSError as e:
        raise SftctlError(f"--output {path}: cannot write it: {e.strerror or e}",
                          hint="name a file in a directory that exists and you can write to") from None
