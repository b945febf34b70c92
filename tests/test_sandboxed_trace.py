"""sftctl.sandboxed_trace: a server traces a user's model in a sandboxed child process and reads
the step back as JSON (sftctl.compiler.ir.to_json / from_json), so the model's code never runs
in the server's process, yet the server still predicts its step times.

Real bwrap (Debian's bubblewrap, as .ci/run installs it), real torch models, a real server."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest

from conftest import write_spec

from sftctl.compiler import ir

pytest.importorskip("torch")
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)")

MLP = (
    "import torch\n"
    "def build(batch_size, dtype):\n"
    "    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))\n"
    "    return model, torch.randn(batch_size, 16), lambda m, x: m(x).float().pow(2).mean()\n")


def _trace(tmp_path: Path, monkeypatch, mode: str, source: str = MLP, entry: str = "m.py:build"):
    from sftctl import sandboxed_trace

    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "m.py").write_text(source)
    monkeypatch.setenv("SFTCTL_NODE_SANDBOX", mode)
    return sandboxed_trace.trace("torch", entry, str(work), 4, "float32")


def test_a_graph_survives_json_exactly():
    """to_json / from_json: every node, attribute (tuples of tuples, inf) and output back equal."""
    g = ir.Graph()
    x = g.add("input", [], (4, 3, 8, 8), "float32", role="batch", name="x")
    w = g.add("input", [], (6, 3, 3, 3), "float32", role="param", name="w")
    c = g.add("conv", [x, w], (4, 6, 8, 8), "float32", stride=(1, 1), padding=((1, 1), (1, 1)),
              lhs_dilation=(1, 1), rhs_dilation=(1, 1), feature_group_count=1, batch_group_count=1)
    m = g.add("constant", [], (), "float32", value=-math.inf)
    s = g.add("max", [c, m], (4, 6, 8, 8), "float32")
    loss = g.add("sum", [s], (), "float32", axes=(0, 1, 2, 3), keepdim=False)
    g.outputs, g.output_roles = [loss], ["loss"]
    back = ir.from_json(ir.to_json(g))
    assert back == g
    assert back.nodes[c].attrs["padding"] == ((1, 1), (1, 1)) and back.nodes[m].attrs["value"] == -math.inf


@pytest.mark.parametrize("text, why", [
    ('{"format": "sftctl-ir/1", "nodes": [["exec", [], [1], "float32", {}]], "outputs": [], "output_roles": []}',
     "node 0: unknown IR op 'exec'"),
    ('{"format": "sftctl-ir/1", "nodes": [["neg", [0], [1], "float32", {}]], "outputs": [], "output_roles": []}',
     "node 0: neg: operands must be earlier nodes"),
    ('{"format": "sftctl-ir/1", "nodes": [["input", [], [-1], "float32", {}]], "outputs": [], "output_roles": []}',
     "node 0 (input): shape must be a list of non-negative integers"),
    ('{"format": "sftctl-ir/1", "nodes": [["input", [], [1], "float32", {"role": {"a": 1}}]], "outputs": [0],'
     ' "output_roles": ["loss"]}', "node 0 (input) attribute role: dict is not an attribute value"),
    ('{"format": "sftctl-ir/1", "nodes": [], "outputs": [3], "output_roles": ["loss"]}',
     "outputs must be ids of the graph's nodes"),
    ('{"format": "pickle", "nodes": []}', "not a serialized graph: format is not 'sftctl-ir/1'"),
    ("[" * 100000, "not a serialized graph"),
])
def test_a_forged_graph_is_refused_by_name(text, why):
    with pytest.raises(ValueError) as e:
        ir.from_json(text)
    assert str(e.value).startswith(why), str(e.value)


@pytest.mark.parametrize("mode", [pytest.param("bwrap", marks=needs_bwrap), "off"])
def test_a_sandboxed_trace_is_the_in_process_trace(tmp_path, monkeypatch, mode):
    from sftctl.compiler import api

    got = _trace(tmp_path, monkeypatch, mode)
    assert got == api.trace("torch", "m.py:build", str(tmp_path / "work"), 4, "float32", use_cache=False)
    # two layers: their forward and weight gradients, and the second's input gradient
    assert sum(n.op == "dot_general" for n in got.nodes) == 5


@needs_bwrap
def test_the_models_code_sees_nothing_of_the_server(tmp_path, monkeypatch, home):
    """The model's module, run by the trace: the server's home (its state) is not there to read or
    write, its environment's secrets are not in the child's, and its prints never reach the result."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "state.db").write_text("the server's state")
    monkeypatch.setenv("SFTCTL_SERVER_TOKEN", "the-servers-token")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-servers-key")
    probe = (
        "import os, pathlib\n"
        f"home = pathlib.Path({str(home)!r})\n"
        "seen = [str(p) for p in home.glob('*')] if home.exists() else []\n"
        "try:\n"
        "    (home / 'planted').write_text('x'); wrote = True\n"
        "except OSError:\n"
        "    wrote = False\n"
        "env = sorted(k for k in os.environ if 'TOKEN' in k or 'SECRET' in k)\n"
        "print('{\"graph\": 1}')\n"  # a forged result on the model's stdout goes to stderr
        "if seen or wrote or env:\n"
        "    raise RuntimeError(f'saw {seen}, wrote {wrote}, env {env}')\n" + MLP)
    graph = _trace(tmp_path, monkeypatch, "bwrap", source=probe)
    assert any(n.op == "dot_general" for n in graph.nodes)
    assert sorted(p.name for p in home.iterdir()) == ["state.db"]


@pytest.mark.parametrize("mode", [pytest.param("bwrap", marks=needs_bwrap), "off"])
def test_the_childs_errors_are_raised_as_the_in_process_traces(tmp_path, monkeypatch, mode):
    from sftctl.compiler.frontends import EntrypointFunctionNotFound
    from sftctl.sandboxed_trace import TraceFailed

    with pytest.raises(EntrypointFunctionNotFound) as e:
        _trace(tmp_path, monkeypatch, mode, entry="m.py:nosuch")
    assert "nosuch" in str(e.value)
    with pytest.raises(ModuleNotFoundError) as m:
        _trace(tmp_path, monkeypatch, mode, source="import not_a_module_here\n" + MLP)
    assert m.value.name == "not_a_module_here"
    with pytest.raises(TraceFailed) as t:
        _trace(tmp_path, monkeypatch, mode, source=MLP.replace("return model", "raise ValueError('bad shape')\n    return model"))
    assert (t.value.remote_type, str(t.value)) == ("ValueError", "bad shape")
    with pytest.raises(TraceFailed) as k:  # the child dies before it answers
        _trace(tmp_path, monkeypatch, mode, source="import os\nos._exit(7)\n")
    assert "ended with code 7" in str(k.value)


def test_a_server_plans_a_users_model_with_predictions_never_in_its_process(tmp_path, monkeypatch, home):
    """api.plan as the server runs it (SFTCTL_NODE_SANDBOX set, serving): the offerings are
    predicted (step times, not price only) and the model's module ran in another process."""
    import warnings

    from sftctl import api
    from sftctl.api import _base

    marker = tmp_path / "pids"
    work = tmp_path / "work"
    work.mkdir()
    (work / "m.py").write_text(f"import os\nopen({str(marker)!r}, 'a').write(f'{{os.getpid()}}\\n')\n" + MLP)
    spec = write_spec(tmp_path / "job.yaml", f"name: m\nworkdir: {work}\nmodel: {{entrypoint: m.py:build, batch_size: 4}}\n"
                                             "resources: {accelerators: ['cpu:1', 'H100:1'], clouds: [local, aws]}\nrun: echo\n")
    monkeypatch.setenv("SFTCTL_NODE_SANDBOX", "off")  # a plain child: the marker is then visible here
    monkeypatch.setattr(_base, "_serving", lambda: True)
    monkeypatch.setattr("sftctl.api._specs._serving", lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = api.plan(str(spec), strict=True)
    assert [str(w.message) for w in caught if "price only" in str(w.message)] == []
    predicted = [c for c in plan.candidates if c.step_time_s]
    assert predicted and all(c.step_time_s > 0 for c in predicted)
    pids = {int(p) for p in marker.read_text().split()}
    assert pids and os.getpid() not in pids
