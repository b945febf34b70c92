"""The import rules ARCHITECTURE.md states ("Layers"), checked on the source: no import circle
among sftctl's modules (imports inside functions count: they are edges all the same), no arrow
back up the layers, the compiler knows nothing of clouds, state or the CLI, the providers nothing
of the compiler, and the tools (calibration, predict) are imported by no module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: ARCHITECTURE.md's layers, bottom first: a module imports from its own layer or below, never
#: above. Keys are modules or packages (a package's submodules are in its layer).
LAYERS = [
    # 0: the vocabulary and the leaves every layer reads
    {"sftctl", "sftctl.types", "sftctl.errors", "sftctl.yaml12", "sftctl.slurm_config", "sftctl.settings",
     "sftctl.paths", "sftctl.procs", "sftctl.catalog", "sftctl.protocol"},
    # 1: what the core is made of
    {"sftctl.compiler", "sftctl.storage", "sftctl.health", "sftctl.templates", "sftctl.failure", "sftctl.state",
     "sftctl.spec"},
    # 2: where jobs run, and what runs on a node
    {"sftctl.providers", "sftctl.train", "sftctl.node", "sftctl.agent"},
    # 3: deciding and driving a job
    {"sftctl.planner", "sftctl.controller", "sftctl.queue"},
    # 4: the one entry to the core (and the client it sends job commands through when a server is configured)
    {"sftctl.api", "sftctl.remote"},
    # 5: presentation, and the server that runs the api for its clients
    {"sftctl.ui", "sftctl.cli", "sftctl.server"},
]

#: Tools at the top: ``python -m`` entry points no module imports.
TOOLS = {"sftctl.compiler.calibration", "sftctl.compiler.predict", "sftctl.compiler.accuracy_cv"}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in (ROOT / "sftctl").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


def _graph() -> dict[str, set[str]]:
    """module -> the sftctl modules it imports (anywhere in the file)."""
    mods = _modules()

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    g: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                r = resolve(t) if t.split(".")[0] == "sftctl" else ""
                if r and r != m:
                    g[m].add(r)
    return g


GRAPH = _graph()


def _layer(module: str) -> int:
    best, depth = None, -1
    for i, layer in enumerate(LAYERS):
        for key in layer:
            # the root package is a layer-0 module of its own, not a prefix that places every module
            if (module == key or (key != "sftctl" and module.startswith(key + "."))) and key.count(".") > depth:
                best, depth = i, key.count(".")
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and to ARCHITECTURE.md's Layers")
    return best


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_one():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [["a", "b", "c"]]


def test_every_module_has_a_layer_and_no_arrow_goes_back_up():
    up = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
          for m, ts in sorted(GRAPH.items()) for t in sorted(ts) if _layer(t) > _layer(m)]
    assert up == []


def test_tools_are_imported_by_no_module():
    importers = {m: sorted(GRAPH_IN[m]) for m in TOOLS if GRAPH_IN[m]}
    assert importers == {}
    assert all(m in GRAPH for m in TOOLS)


GRAPH_IN: dict[str, set[str]] = {m: set() for m in GRAPH}
for _m, _ts in GRAPH.items():
    for _t in _ts:
        GRAPH_IN[_t].add(_m)


def _outside(prefix: str) -> dict[str, list[str]]:
    return {m: sorted(t for t in ts if not t.startswith(prefix))
            for m, ts in sorted(GRAPH.items()) if m.startswith(prefix)}


def test_the_compiler_knows_nothing_of_clouds_state_or_the_cli():
    allowed = {"sftctl", "sftctl.settings", "sftctl.errors"}
    bad = {m: [t for t in ts if t not in allowed and not t.startswith("sftctl.catalog")]
           for m, ts in _outside("sftctl.compiler").items()}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_the_cost_model_derives_nothing():
    """costmodel.py is arithmetic on the hardware facts and the coefficients it is given: it
    imports no calibration, target or search module."""
    assert GRAPH["sftctl.compiler.costmodel"] <= {"sftctl.compiler.hardware", "sftctl.compiler.problem"}


@pytest.mark.parametrize("prefix", ["sftctl.providers", "sftctl.catalog", "sftctl.storage", "sftctl.health"])
def test_these_know_nothing_of_the_compiler(prefix):
    assert {m: ts for m, ts in _outside(prefix).items() if any(t.startswith("sftctl.compiler") for t in ts)} == {}


def test_cli_imports_only_the_api_and_presentation():
    # sftctl.server is presentation too: the API over HTTP (`sftctl server ...` starts it, adds its users)
    assert GRAPH["sftctl.cli"] <= {"sftctl", "sftctl.api", "sftctl.ui", "sftctl.errors", "sftctl.types", "sftctl.paths",
                                   "sftctl.server", "sftctl.server.manifest", "sftctl.server.users"}


def test_architecture_names_every_module():
    """ARCHITECTURE.md's layout names each module file (``name.py``) and each package (``name/``)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    missing = []
    for m, p in sorted(_modules().items()):
        rel = p.relative_to(ROOT / "sftctl")
        if rel.parts[0] == "templates" or "calibrations" in rel.parts:
            continue  # data and its helpers, named as a folder
        name = f"{rel.parent.name}/" if p.name == "__init__.py" else p.name
        if p.name == "__init__.py" and rel.parent == Path("."):
            continue
        if name not in text:
            missing.append(f"{m} ({name})")
    assert missing == []


def test_the_controller_is_split_by_job():
    """controller/ (ARCHITECTURE.md's "Layers"): lifecycle > teardown, preview > submit > slots,
    and ports. Teardown and preview never import the lifecycle (they work without a Controller);
    slots and ports import no controller module; only the package's front door and ``__main__``
    import the lifecycle."""
    inside = {m: sorted(t for t in ts if t.startswith("sftctl.controller")) for m, ts in GRAPH.items()
              if m.startswith("sftctl.controller.")}
    assert inside == {
        "sftctl.controller.__main__": ["sftctl.controller.lifecycle"],
        "sftctl.controller.lifecycle": ["sftctl.controller.ports", "sftctl.controller.slots",
                                        "sftctl.controller.spot", "sftctl.controller.submit"],
        "sftctl.controller.ports": [],
        "sftctl.controller.preview": ["sftctl.controller.slots", "sftctl.controller.submit"],
        "sftctl.controller.slots": [],
        "sftctl.controller.spot": [],
        "sftctl.controller.submit": ["sftctl.controller.slots"],
        "sftctl.controller.teardown": ["sftctl.controller.submit"],
    }
    assert sorted(m for m in GRAPH_IN["sftctl.controller.lifecycle"]) == [
        "sftctl.api", "sftctl.controller", "sftctl.controller.__main__"]


def _function_level_imports(module: str) -> list[str]:
    """``line: module`` of each import of an sftctl module inside a function of ``module``."""
    path = _modules()[module]
    out = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "sftctl":
                    out.append(f"{node.lineno}: {node.module}")
                elif isinstance(node, ast.Import):
                    out += [f"{node.lineno}: {a.name}" for a in node.names if a.name.split(".")[0] == "sftctl"]
    return sorted(set(out))


#: Modules whose sftctl imports are all at module level (ARCHITECTURE.md, "Layers": a
#: function-level import is for a heavy third-party module, never for a light sftctl one). None of
#: these makes `import sftctl.api`, `sftctl status` or the queue's waiting stage import more
#: (test_api and test_cli check those paths).
NO_FUNCTION_LEVEL_SFTCTL_IMPORTS = [
    "sftctl.controller", "sftctl.controller.lifecycle", "sftctl.controller.submit", "sftctl.controller.teardown",
    "sftctl.controller.preview", "sftctl.controller.ports", "sftctl.controller.slots",
    # on the light paths: what they import (settings, errors, types) is there already
    "sftctl.errors", "sftctl.paths", "sftctl.procs", "sftctl.protocol",
    # the node side (daemon, GPU agent, failure records), storage, templates, the provider base
    "sftctl.node", "sftctl.agent", "sftctl.failure", "sftctl.health.sources", "sftctl.storage.checkpoints",
    "sftctl.storage.stream", "sftctl.templates", "sftctl.providers.base", "sftctl.providers.local",
    "sftctl.providers.kubernetes", "sftctl.train", "sftctl.planner",
    # these keep only the imports named: a backend's SDK (boto3, google-cloud), a provider loaded on demand
    "sftctl.storage", "sftctl.providers",
]
#: module -> the function-level sftctl imports it keeps, and why (heavy or loaded only when asked for)
KEPT_FUNCTION_LEVEL = {
    "sftctl.storage": {"sftctl.storage.s3", "sftctl.storage.gcs"},  # boto3, google-cloud-storage
    "sftctl.providers": {"sftctl.providers.slurm"},  # only when slurm's configuration is asked about
    "sftctl.planner": {"sftctl.compiler.api", "sftctl.compiler.target", "sftctl.compiler.modes"},  # numpy
}


@pytest.mark.parametrize("module", NO_FUNCTION_LEVEL_SFTCTL_IMPORTS)
def test_light_sftctl_imports_are_at_module_level(module):
    kept = KEPT_FUNCTION_LEVEL.get(module, set())
    assert [i for i in _function_level_imports(module) if i.split(": ")[1] not in kept] == []
