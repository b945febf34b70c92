"""The import rules ARCHITECTURE.md states ("Layers"), checked on the source: no import circle
among sftctl's modules (imports inside functions count: they are edges all the same), no arrow
back up the layers, the compiler knows nothing of clouds, state or the CLI, the providers nothing
of the compiler, and the tools (calibration, predict) are imported by no module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: ARCHITECTURE.md's layers, bottom first: a module imports from its own layer or below, never
#: above. Keys are modules or packages (a package's submodules are in its layer).
LAYERS = [
    # 0: the vocabulary and the leaves every layer reads
    {"sftctl", "sftctl.types", "sftctl.errors", "sftctl.yaml12", "sftctl.slurm_config", "sftctl.settings",
     "sftctl.config_file", "sftctl.paths", "sftctl.procs", "sftctl.catalog", "sftctl.protocol"},
    # 1: what the core is made of
    {"sftctl.compiler", "sftctl.storage", "sftctl.health", "sftctl.templates", "sftctl.failure", "sftctl.state",
     "sftctl.spec", "sftctl.vault"},
    # 2: where jobs run, and what runs on a node
    {"sftctl.providers", "sftctl.train", "sftctl.node", "sftctl.agent", "sftctl.preflight"},
    # 3: deciding and driving a job
    {"sftctl.planner", "sftctl.plan_wording", "sftctl.controller", "sftctl.queue", "sftctl.history",
     "sftctl.history_import", "sftctl.sandboxed_trace", "sftctl.trace_errors"},
    # 4: the one entry to the core (and the client it sends job commands through when a server is configured)
    {"sftctl.api", "sftctl.remote"},
    # 5: presentation, and the server that runs the api for its clients (ui/ a package: views, plan)
    {"sftctl.ui", "sftctl.cli", "sftctl.server", "sftctl.schema"},
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
    # the layout record is vocabulary the planner and training share (no cloud, state or CLI in it)
    allowed = {"sftctl", "sftctl.settings", "sftctl.errors", "sftctl.types.layout", "sftctl.types.record"}
    bad = {m: [t for t in ts if t not in allowed and not t.startswith("sftctl.catalog")]
           for m, ts in _outside("sftctl.compiler").items()}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_the_cost_model_derives_nothing():
    """costmodel.py is arithmetic on the hardware facts and the coefficients it is given: it
    imports no calibration, target or search module."""
    assert GRAPH["sftctl.compiler.costmodel"] <= {"sftctl.compiler.hardware", "sftctl.compiler.problem",
                                                  "sftctl.compiler.coefficients"}
    assert GRAPH["sftctl.compiler.coefficients"] <= {"sftctl.compiler.hardware"}


@pytest.mark.parametrize("prefix", ["sftctl.providers", "sftctl.catalog", "sftctl.storage", "sftctl.health"])
def test_these_know_nothing_of_the_compiler(prefix):
    assert {m: ts for m, ts in _outside(prefix).items() if any(t.startswith("sftctl.compiler") for t in ts)} == {}


def test_cli_imports_only_the_api_and_presentation():
    # sftctl.server is presentation too: the API over HTTP (`sftctl server ...` starts it, adds its users)
    # the package cli/ as a whole: its modules import one another, and from the rest only these
    used = set().union(*(ts for m, ts in GRAPH.items() if m == "sftctl.cli" or m.startswith("sftctl.cli.")))
    outside = {t for t in used if t != "sftctl.cli" and not t.startswith("sftctl.cli.")}
    assert outside <= {"sftctl", "sftctl.api", "sftctl.ui", "sftctl.errors", "sftctl.types", "sftctl.paths",
                       "sftctl.schema", "sftctl.server", "sftctl.server.manifest", "sftctl.server.metrics",
                       "sftctl.server.users"}


def test_ui_views_know_nothing_of_the_plan_table():
    """ui/: plan.py and run.py build on views.py (FitTable, Col, tty_safe), never the other way;
    __init__.py re-exports all three."""
    assert {t for t in GRAPH["sftctl.ui.views"] if t.startswith("sftctl.ui")} == set()
    assert {t for t in GRAPH["sftctl.ui.plan"] if t.startswith("sftctl.ui")} == {"sftctl.ui.views"}
    assert {t for t in GRAPH["sftctl.ui.run"] if t.startswith("sftctl.ui")} == {"sftctl.ui.views"}
    assert GRAPH["sftctl.ui"] == {"sftctl.ui.views", "sftctl.ui.plan", "sftctl.ui.run"}


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
    """controller/ (ARCHITECTURE.md's "Layers"): lifecycle > recovery, drain, run_record > common; lifecycle >
    teardown, preview > launch > submit > placements > slots, and ports. Teardown and preview never import the lifecycle (they work without a Controller);
    slots and ports import no controller module; each placement module imports only the
    placements' base (the package finds them by listing itself); only the package's front door
    and ``__main__`` import the lifecycle."""
    inside = {m: sorted(t for t in ts if t.startswith("sftctl.controller")) for m, ts in GRAPH.items()
              if m.startswith("sftctl.controller.")}
    assert inside == {
        "sftctl.controller.__main__": ["sftctl.controller.lifecycle"],
        "sftctl.controller.common": [],
        "sftctl.controller.launch": ["sftctl.controller.placements", "sftctl.controller.slots",
                                     "sftctl.controller.submit"],
        "sftctl.controller.drain": ["sftctl.controller.preflight", "sftctl.controller.slots"],
        "sftctl.controller.lifecycle": ["sftctl.controller.common", "sftctl.controller.drain",
                                        "sftctl.controller.launch",
                                        "sftctl.controller.ports", "sftctl.controller.preflight",
                                        "sftctl.controller.recovery",
                                        "sftctl.controller.replan", "sftctl.controller.run_record",
                                        "sftctl.controller.slots",
                                        "sftctl.controller.spot", "sftctl.controller.submit"],
        "sftctl.controller.placements": ["sftctl.controller.placements.base"],
        "sftctl.controller.placements.base": [],
        "sftctl.controller.placements.kubernetes": ["sftctl.controller.placements.base"],
        "sftctl.controller.placements.local": ["sftctl.controller.placements.base"],
        "sftctl.controller.placements.server": ["sftctl.controller.placements.base"],
        "sftctl.controller.placements.slurm": ["sftctl.controller.placements.base"],
        "sftctl.controller.ports": [],
        "sftctl.controller.preflight": [],
        "sftctl.controller.preview": ["sftctl.controller.launch"],
        "sftctl.controller.recovery": ["sftctl.controller.ports", "sftctl.controller.slots"],
        "sftctl.controller.replan": [],
        "sftctl.controller.run_record": ["sftctl.controller.common"],
        "sftctl.controller.slots": [],
        "sftctl.controller.spot": [],
        "sftctl.controller.submit": ["sftctl.controller.placements", "sftctl.controller.preflight",
                                     "sftctl.controller.slots"],
        "sftctl.controller.teardown": ["sftctl.controller.placements", "sftctl.controller.submit"],
    }
    assert sorted(m for m in GRAPH_IN["sftctl.controller.lifecycle"]) == [
        "sftctl.api._run", "sftctl.controller", "sftctl.controller.__main__"]


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
    "sftctl.controller.preview", "sftctl.controller.launch", "sftctl.controller.ports", "sftctl.controller.slots",
    "sftctl.controller.common", "sftctl.controller.recovery", "sftctl.controller.run_record",
    "sftctl.controller.preflight", "sftctl.preflight",
    # on the light paths: what they import (settings, errors, types) is there already
    "sftctl.errors", "sftctl.paths", "sftctl.procs", "sftctl.protocol",
    # the node side (daemon, GPU agent, failure records), storage, templates, the provider base
    "sftctl.node", "sftctl.agent", "sftctl.failure", "sftctl.health.sources", "sftctl.storage.checkpoints",
    "sftctl.storage.stream", "sftctl.templates", "sftctl.providers.base", "sftctl.providers.local",
    "sftctl.providers.kubernetes", "sftctl.providers.kubernetes.manifests", "sftctl.providers.kubernetes.provider",
    "sftctl.train", "sftctl.train.checkpoints", "sftctl.train.config", "sftctl.train.report", "sftctl.train.sharded",
    "sftctl.planner", "sftctl.plan_wording", "sftctl.trace_errors",
    # these keep only the imports named: a backend's SDK (boto3, google-cloud), a provider loaded on demand
    "sftctl.storage", "sftctl.providers",
]
#: module -> the function-level sftctl imports it keeps, and why (heavy or loaded only when asked for)
KEPT_FUNCTION_LEVEL = {
    "sftctl.storage": {"sftctl.storage.s3", "sftctl.storage.gcs"},  # boto3, google-cloud-storage
    "sftctl.providers": {"sftctl.providers.slurm"},  # only when slurm's configuration is asked about
    # numpy; compiler.report only where a traced step exists (numpy is then loaded already)
    "sftctl.planner": {"sftctl.compiler.api", "sftctl.compiler.target", "sftctl.compiler.modes",
                       "sftctl.compiler.report"},
    "sftctl.controller.preflight": {"sftctl.compiler.gemm_table", "sftctl.compiler.collectives"},  # GPU offerings only
}


@pytest.mark.parametrize("module", NO_FUNCTION_LEVEL_SFTCTL_IMPORTS)
def test_light_sftctl_imports_are_at_module_level(module):
    kept = KEPT_FUNCTION_LEVEL.get(module, set())
    assert [i for i in _function_level_imports(module) if i.split(": ")[1] not in kept] == []


# --- ARCHITECTURE.md's claims, each read from the document where it names modules (issue 39.6) ---

ARCH = (ROOT / "ARCHITECTURE.md").read_text()


def _module_level_imports(module: str) -> set[str]:
    """Every module ``module`` imports outside its functions (module body, its ifs and trys)."""
    out: set[str] = set()

    def collect(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                out.add(node.module or "")
            elif isinstance(node, (ast.If, ast.Try)):
                collect(node.body)
                collect(node.orelse)
                collect(getattr(node, "finalbody", []))
                for h in getattr(node, "handlers", []):
                    collect(h.body)

    collect(ast.parse(_modules()[module].read_text()).body)
    return out


def _all_imports(module: str) -> set[str]:
    """Every module ``module`` imports anywhere (functions included), absolute names."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(_modules()[module].read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module or "")
    return out


def _reachable(start: str, within: str) -> set[str]:
    """The modules under ``within`` that ``start`` reaches through imports (functions included)."""
    seen, todo = set(), [start]
    while todo:
        for t in GRAPH[todo.pop()]:
            if t.startswith(within) and t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def test_the_layers_table_of_architecture_is_the_one_checked():
    """"Layers": the table in the document is :data:`LAYERS` (the root package is layer 0 too)."""
    block = ARCH.split("## Layers", 1)[1].split("```", 2)[1]
    doc = []
    for line in block.strip().splitlines():
        number, rest = line.split(None, 1)
        names = rest.split("  ")[0].split()  # the modules, then two spaces and what the layer is
        doc.append({"sftctl." + n.rstrip("/") for n in names} | ({"sftctl"} if number == "0" else set()))
        assert int(number) == len(doc) - 1
    assert doc == LAYERS


def _compiler_order() -> list[set[str]]:
    """"Inside the compiler: `api` > `sharding` > ... > `ir`": the modules of each level, top first."""
    sentence = ARCH.split("Inside the compiler: ", 1)[1].split(". ", 1)[0]
    levels = [re.findall(r"`([\w/]+)`", part) for part in sentence.split(" > ")]
    assert all(levels), sentence
    return [{"sftctl.compiler." + n.rstrip("/") for n in names} for names in levels]


def test_the_compilers_stated_order_holds():
    """No module of the compiler's stated order reaches (through any chain of imports, the modules
    it does not name included) a module the document puts above it."""
    order = _compiler_order()
    assert all(m in GRAPH for level in order for m in level), "a module of the order does not exist"
    above: set[str] = set()
    bad = []
    for level in order:
        for m in level:
            starts = [x for x in GRAPH if x == m or x.startswith(m + ".")]  # a package: every module in it
            for s in starts:
                up = {t for t in _reachable(s, "sftctl.compiler")
                      if any(t == a or t.startswith(a + ".") for a in above)}
                bad += [f"{s} reaches {t}" for t in sorted(up)]
        above |= level
    assert bad == []


def test_the_order_check_finds_an_arrow_up(monkeypatch):
    monkeypatch.setitem(GRAPH, "sftctl.compiler.ir", GRAPH["sftctl.compiler.ir"] | {"sftctl.compiler.step"})
    assert "sftctl.compiler.ir" in {m for level in _compiler_order() for m in level}
    with pytest.raises(AssertionError):
        test_the_compilers_stated_order_holds()


def test_the_tools_are_the_ones_architecture_names():
    """"The tools `compiler/calibration.py`, ... sit on top: no module imports them" is :data:`TOOLS`."""
    sentence = ARCH.split("The tools", 1)[1].split("sit on top", 1)[0]
    assert {"sftctl." + p.removesuffix(".py").replace("/", ".") for p in re.findall(r"`([\w/]+\.py)`", sentence)} == TOOLS


def test_every_exit_code_is_documented():
    """Conventions' "Exit codes:" and README's name every errors.ExitCode (128 is the signals' base)."""
    from sftctl.errors import ExitCode

    codes = {int(c) for c in ExitCode}
    arch = ARCH.split("- Exit codes:", 1)[1].split("\n- ", 1)[0]
    readme = (ROOT / "README.md").read_text().split("\nExit codes:", 1)[1].split("\n\n", 1)[0]
    for doc in (arch, readme):
        named = {int(n) for n in re.findall(r"(?<!\w)(\d+)(?= [^+])", doc)} - {128}  # "129 SIGHUP", not "timeout(1)"
        assert named == codes, doc


def test_settings_imports_what_architecture_says():
    """"Settings": the module imports `functools`, `os`, `re`, `typing`, `sftctl.config_file` and
    `sftctl.types.nodes` (a plugin handle's finder) at its top (and no other sftctl module: the
    providers' names come from a listing of sftctl/providers/); `sftctl.config_file` imports
    `sftctl.errors` and `sftctl.slurm_config` at its top, `sftctl.yaml12` only when it reads the file."""
    assert _module_level_imports("sftctl.settings") == {"__future__", "functools", "os", "re", "typing",
                                                        "sftctl.config_file", "sftctl.types.nodes"}
    assert GRAPH["sftctl.settings"] == {"sftctl.config_file", "sftctl.types.nodes"}
    assert {i for i in _module_level_imports("sftctl.config_file") if i.startswith("sftctl")} == {
        "sftctl.errors", "sftctl.slurm_config"}
    assert GRAPH["sftctl.config_file"] == {"sftctl.errors", "sftctl.slurm_config", "sftctl.yaml12"}


def test_the_leaves_the_layout_names():
    """Layout: slurm_config.py is a leaf (no sftctl import); protocol.py does no storage I/O (imports
    no storage module); remote.py knows no api record (imports neither api nor types); the
    controller counts checkpoints through storage/checkpoints.py and never imports train.py;
    problem.py has no numpy; web/ is package data, no Python."""
    assert GRAPH["sftctl.slurm_config"] == set()
    assert not any(t.startswith("sftctl.storage") for t in GRAPH["sftctl.protocol"])
    assert GRAPH["sftctl.remote"].isdisjoint({"sftctl.api", "sftctl.types"})
    assert [m for m in GRAPH if m.startswith("sftctl.controller") and "sftctl.train" in GRAPH[m]] == []
    assert not any(i.split(".")[0] == "numpy" for i in _all_imports("sftctl.compiler.problem"))
    assert list((ROOT / "sftctl" / "web").rglob("*.py")) == []


def test_history_reads_the_compiler_api_only_inside_functions():
    """Layout, history.py: "it reads compiler/accuracy.py at module level and the compiler api only inside"."""
    top = {i for i in _module_level_imports("sftctl.history") | _module_level_imports("sftctl.history_import")
           if i.startswith("sftctl.compiler")}
    assert top == {"sftctl.compiler.accuracy"}
    assert "sftctl.compiler.api" in GRAPH["sftctl.history_import"]


def test_health_detectors_do_no_io():
    """Boundaries: health/ detectors are pure functions from samples to verdicts; all I/O sits in the
    sources and the agent. A detector module imports no I/O module and calls no open()."""
    io = {"os", "io", "sys", "subprocess", "socket", "pathlib", "shutil", "glob", "time", "urllib", "http",
          "pynvml", "csv", "json", "tempfile", "threading"}
    bad = {}
    for m in sorted(x for x in GRAPH if x.startswith("sftctl.health.detectors")):
        tree = ast.parse(_modules()[m].read_text())
        found = sorted(i for i in _all_imports(m) if i.split(".")[0] in io)
        found += [f"open() line {n.lineno}" for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and getattr(n.func, "id", None) in {"open", "print"}]
        if found:
            bad[m] = found
    assert len([m for m in GRAPH if m.startswith("sftctl.health.detectors.")]) >= 7
    assert bad == {}


def test_cloud_sdks_are_imported_at_module_level_only_by_their_backends():
    """Boundaries: cloud SDKs (boto3, google-cloud, kubernetes) are imported inside the modules that
    use them: at module level only by a storage backend that storage/ loads on demand (s3.py,
    gcs.py); a provider imports its SDK inside its functions."""
    sdks = {"boto3", "botocore", "google", "kubernetes"}
    top = {m for m in GRAPH if any(i.split(".")[0] in sdks for i in _module_level_imports(m))}
    assert top <= {"sftctl.storage.s3", "sftctl.storage.gcs"}, top
    loaders = {m for m in GRAPH if GRAPH[m] & {"sftctl.storage.s3", "sftctl.storage.gcs"}}
    assert all({"sftctl.storage.s3", "sftctl.storage.gcs"}.isdisjoint(_module_level_imports(m)) for m in loaders)


def test_nothing_but_the_catalog_opens_the_accelerator_yaml():
    """Layout, hardware.py: "nothing opens the YAML by path": only catalog/accelerators.py names the
    file as a path (a string that is just its name)."""
    users = sorted(m for m, p in _modules().items()
                   if any(isinstance(n, ast.Constant) and n.value == "accelerators.yaml" for n in ast.walk(ast.parse(p.read_text()))))
    assert users == ["sftctl.catalog.accelerators"]


def test_the_queues_waiting_stage_is_light():
    """Layout, queue.py: `python -m sftctl.queue JOB` imports no pydantic and no spec; of providers/
    it imports only local.py (inside a function: the home tag of a dead controller's nodes)."""
    import subprocess
    import sys

    code = ("import sys, sftctl.queue; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic' or m == 'sftctl.spec' "
            "or m.startswith('sftctl.providers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert {t for t in GRAPH["sftctl.queue"] if t.startswith("sftctl.providers")} <= {"sftctl.providers.local"}
    assert not any(t.startswith("sftctl.providers") for t in _module_level_imports("sftctl.queue"))


def test_only_the_compilers_front_door_orchestrates_it():
    """Layout, compiler/api.py: the planner and sftctl.api go through it; nothing outside the compiler
    imports its driver, step, sharding or fusion modules (trace -> compile -> predict is the api's)."""
    inner = {"sftctl.compiler.driver", "sftctl.compiler.step", "sftctl.compiler.sharding", "sftctl.compiler.fusion"}
    outside = {m: sorted(GRAPH[m] & inner) for m in GRAPH if not m.startswith("sftctl.compiler") and GRAPH[m] & inner}
    assert outside == {}
    assert "sftctl.compiler.api" in GRAPH["sftctl.planner"]


def test_optional_libraries_are_imported_when_used():
    """Layout: remote.py imports httpx on the first request, the state imports psycopg only for a
    Postgres store, yaml12.py (the config file's loader) has no pydantic: none at module level."""
    def top(prefix: str) -> set[str]:
        return {i.split(".")[0] for m in GRAPH if m == prefix or m.startswith(prefix + ".")
                for i in _module_level_imports(m)}

    assert "httpx" not in top("sftctl.remote") and "httpx" in {i.split(".")[0] for i in _all_imports("sftctl.remote")}
    assert "psycopg" not in top("sftctl.state")
    assert "pydantic" not in {i.split(".")[0] for i in _all_imports("sftctl.yaml12")}


def test_every_python_m_entry_point_the_documents_name_exists():
    """ARCHITECTURE.md and README name tools as ``python -m sftctl.X``: each is a module with a
    ``__main__`` block, or a package with ``__main__.py``."""
    named = set(re.findall(r"python -m (sftctl[\w.]*)", ARCH + (ROOT / "README.md").read_text()))
    missing = []
    for m in sorted(named):
        if f"{m}.__main__" in GRAPH:
            continue
        if m not in GRAPH or "__main__" not in _modules()[m].read_text():
            missing.append(m)
    assert len(named) >= 8 and missing == []


def test_hardware_is_the_catalogs_record_re_exported():
    """Layout, hardware.py: the compiler's name for the hardware facts re-exports catalog.accelerators
    and imports nothing else of sftctl."""
    assert GRAPH["sftctl.compiler.hardware"] == {"sftctl.catalog.accelerators"}


def _provider_probes() -> list[str]:
    """``getattr`` on a provider instance outside ``providers/`` (what an optional interface of
    providers/base.py declares instead)."""
    probe = re.compile(r"getattr\(\s*(?:self\.)?provider\b")
    return [f"{p.relative_to(ROOT)}:{i}" for m, p in sorted(_modules().items()) if not m.startswith("sftctl.providers")
            for i, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]


def test_providers_are_asked_by_interface_never_probed():
    """Layout, providers/: the planner and controller ask isinstance/issubclass of base.py's optional
    interfaces (KeepsAlive, Quarantines, SecretStore, ...), never ``getattr(provider, ...)``."""
    assert _provider_probes() == []
    assert re.compile(r"getattr\(\s*(?:self\.)?provider\b").search('getattr(self.provider, "keepalive", None)')


def test_no_module_lists_the_providers():
    """Layout, providers/: the providers are found by listing the package (settings.provider_names),
    so no source file spells their list: no literal holds three or more built-in provider names."""
    from sftctl.settings import builtin_providers

    names = set(builtin_providers())
    lists = []
    for p in sorted(_modules().values()):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                found = {e.value for e in node.elts if isinstance(e, ast.Constant)} & names
            elif isinstance(node, ast.Dict):
                found = {k.value for k in node.keys if isinstance(k, ast.Constant)} & names
            else:
                continue
            if len(found) >= 3:
                lists.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert lists == []
    assert len(names) == 5
