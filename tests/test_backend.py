"""The ``sftensor`` torch.compile backend: CPU eager fallback, FX GEMM rewrite, registration.

The rewrite's numerics run the real Triton kernels under ``TRITON_INTERPRET=1`` in a subprocess
(Triton reads the flag when kernels are decorated, so it must be set before they load).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from conftest import deadline
from sftctl.compiler import backend as be
from sftctl.compiler.target import load_target

REPO = Path(__file__).resolve().parents[1]
aten = torch.ops.aten


def _gpt_module():
    sys.path.insert(0, str(REPO / "examples" / "gpt"))
    try:
        import model as gpt_model
    finally:
        sys.path.pop(0)
    return gpt_model


def _train_two_steps(model, batches, compiled=None):
    """Two AdamW steps; returns (losses, grads after each step)."""
    run = compiled if compiled is not None else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gpt = _gpt_module()
    losses, grads = [], []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = gpt.next_byte_loss(run, (x, y))
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
    return losses, grads


def test_cpu_runs_eager_warns_once_and_matches_eager(home, monkeypatch):
    monkeypatch.delenv("SFTCTL_SFTENSOR_FORCE", raising=False)
    monkeypatch.setattr(be, "_warned_no_gpu", False)
    torch._dynamo.reset()
    gpt = _gpt_module()
    cfg = gpt.GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    ref = gpt.GPT(cfg)
    mine = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (2, 16), generator=gen), torch.randint(0, 256, (2, 16), generator=gen))
               for _ in range(2)]
    ref_losses, ref_grads = _train_two_steps(ref, batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(mine, backend="sftensor")
        losses, grads = _train_two_steps(mine, batches, compiled)
    ours = [w for w in caught if be.NO_GPU_MESSAGE in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for step_a, step_b in zip(grads, ref_grads):
        for a, b in zip(step_a, step_b):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for p, q in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    torch._dynamo.reset()


class _Net(torch.nn.Module):
    """mm + bias add + gelu, addmm + residual behind a view, bmm, and an mm whose value is reused."""

    def forward(self, x, w1, b1, w2, b2, r, q, k, w3):
        h = torch.nn.functional.gelu(torch.ops.aten.mm(x, w1) + b1)      # mm -> add(bias) -> gelu
        y = torch.ops.aten.addmm(b2, h, w2.t())                        # addmm with b^T
        y = y.view(2, 4, -1) + r                                       # residual behind a view
        s = torch.bmm(q, k.transpose(1, 2))                            # bmm with a transposed operand
        z = torch.ops.aten.mm(x, w3)                                   # read twice: no epilogue fusion
        return y, s, torch.relu(z) + z


def _net_inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)

    return (r(8, 32), r(32, 48), r(48), r(24, 48), r(24), r(2, 4, 24), r(3, 16, 32), r(3, 20, 32), r(32, 40))


def _aten_graph(fn, inputs) -> fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*inputs)


def test_rewrite_replaces_gemms_with_fused_epilogues(home):
    gm = _aten_graph(_Net(), _net_inputs())
    before = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert before.count(aten.mm.default) == 2 and aten.addmm.default in before and aten.bmm.default in before
    sites = be.rewrite_gemms(gm, load_target("H100"), force=True, use_disk_cache=False)
    by_start = {s.start.name: s for s in sites}
    assert len(sites) == 4
    epilogues = sorted((s.start.target.__name__, tuple(s.epilogue)) for s in sites)
    assert epilogues == [("addmm.default", ("bias", "residual")), ("bmm.default", ()),
                         ("mm.default", ()), ("mm.default", ("bias", "gelu"))]
    after = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert not any(t in be.GEMM_TARGETS for t in after)
    assert after.count(be.sftensor_gemm) == 4
    assert aten.gelu.default not in after  # absorbed into the first GEMM
    assert aten.relu.default in after      # the reused mm's consumers stay ATen
    # the addmm read w2.t() in place: a K-contiguous B
    addmm = next(s for s in by_start.values() if s.start.target is aten.addmm.default)
    assert addmm.problem.b_transposed and not addmm.problem.a_transposed
    assert addmm.problem.epilogue_bytes_per_elem == 4.0
    for s in sites:
        assert s.config is not None and s.predicted_s > 0
    # not forced: float32 at "highest" precision stays ATen; bfloat16 is rewritten
    gm32 = _aten_graph(_Net(), _net_inputs())
    assert be.find_gemm_sites(gm32, force=False) == []
    gm16 = _aten_graph(_Net(), _net_inputs(torch.bfloat16))
    assert len(be.find_gemm_sites(gm16, force=False)) == 4


def test_rewrite_numerics_with_interpreted_triton_kernels(home, tmp_path):
    """Real codegen kernels on CPU tensors (TRITON_INTERPRET=1): the rewritten graph matches
    eager on fresh random inputs within rtol=1e-4, atol=1e-4 (float32; the kernels accumulate
    in float32, reassociating the K sums), over a small schedule space."""
    pytest.importorskip("triton")
    if not (REPO / "sftctl" / "compiler" / "codegen" / "gemm.py").exists():
        pytest.skip("codegen GEMM not there yet")
    script = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(REPO / "tests")!r})
        from test_backend import _Net, _net_inputs, _aten_graph
        from sftctl.compiler import backend as be
        from sftctl.compiler.target import load_target
        gm = _aten_graph(_Net(), _net_inputs())
        space = {{"BLOCK_M": (16, 32), "BLOCK_N": (16, 32), "BLOCK_K": (16, 32), "split_k": (1, 2),
                  "num_warps": (4,), "num_stages": (2,), "GROUP_M": (1, 4), "layout": (0, 2)}}
        sites = be.rewrite_gemms(gm, load_target("H100"), force=True, space=space, use_disk_cache=False)
        errs = []
        for seed in (1, 2):
            xs = _net_inputs(seed=seed)
            got, want = gm(*xs), _Net()(*xs)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
                errs.append(float((a - b).abs().max()))
        print(json.dumps({{"sites": len(sites), "stats": be.STATS, "max_err": max(errs),
                          "configs": [s.config for s in sites]}}))
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=deadline(300), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sites"] == 4
    assert out["stats"]["triton"] == 8 and out["stats"]["fallback"] == 0, out
    assert out["max_err"] < 1e-4


def test_forced_cpu_training_step_uses_kernels_and_matches_eager(home, monkeypatch):
    """backend=SftensorBackend(force=True) on CPU: AOT forward and backward graphs are rewritten
    and one training step's loss and grads match eager (rtol=1e-4, atol=1e-5)."""
    torch._dynamo.reset()
    gpt = _gpt_module()
    cfg = gpt.GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    ref = gpt.GPT(cfg)
    mine = copy.deepcopy(ref)
    x = torch.randint(0, 256, (2, 8))
    y = torch.randint(0, 256, (2, 8))
    space = {"BLOCK_M": (16,), "BLOCK_N": (16, 32), "BLOCK_K": (16,), "split_k": (1,), "num_warps": (4,),
             "num_stages": (2,), "GROUP_M": (1,), "layout": (0,)}
    backend = be.SftensorBackend(force=True, space=space, use_disk_cache=True)
    before = dict(be.STATS)
    compiled = torch.compile(mine, backend=backend)
    loss = gpt.next_byte_loss(compiled, (x, y))
    loss.backward()
    ref_loss = gpt.next_byte_loss(ref, (x, y))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    for p, q in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    kinds = sorted(r.kind for r in backend.reports)
    assert kinds == ["backward", "forward"]
    fwd = next(r for r in backend.reports if r.kind == "forward")
    assert any("residual" in s["epilogue"] for s in fwd.sites)
    assert fwd.ir.get("lowered", 0) > 0 and fwd.ir.get("kernels", {}).get("gemm", 0) > 0
    n_sites = sum(len(r.sites) for r in backend.reports)
    used = sum(be.STATS[k] - before[k] for k in ("triton", "fallback"))
    assert n_sites > 0 and used == n_sites
    # searches landed in the disk cache
    from sftctl.compiler.cache import cache_dir

    assert list((cache_dir() / "backend" / "gemm").glob("*.json"))
    torch._dynamo.reset()


def test_entry_point_and_registration():
    """The installed entry point is discoverable (``pip install -e .``) and resolves to the backend."""
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="torch_dynamo_backends") if ep.name == "sftensor"]
    if not eps:
        pytest.skip("sftctl is not installed with its entry points (pip install -e .)")
    assert eps[0].value == "sftctl.compiler.backend:sftensor"
    assert "sftensor" in torch._dynamo.list_backends()
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("sftensor") is be.sftensor


def test_import_registers_only_when_torch_is_imported():
    code = ("import sys; import sftctl.compiler; assert 'torch' not in sys.modules, 'torch imported'; "
            "import torch; import importlib; importlib.reload(sftctl.compiler); "
            "from torch._dynamo.backends.registry import lookup_backend; "
            "from sftctl.compiler.backend import sftensor; assert lookup_backend('sftensor') is sftensor; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=deadline(120),
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_train_script_compile_opt_in(tmp_path):
    """examples/gpt/train.py with SFTCTL_COMPILE=sftensor trains (eager on CPU, one warning);
    an unknown value is refused."""
    env = dict(os.environ, SFTCTL_HOME=str(tmp_path / "home"), SFTCTL_COMPILE="sftensor", SFTCTL_TRAIN_STEPS="2",
               SFTCTL_BATCH_SIZE="2", SFTCTL_CHECKPOINT_DIR=str(tmp_path / "ck"), PYTHONPATH=str(REPO))
    script = str(REPO / "examples" / "gpt" / "train.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=deadline(300),
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val loss" in proc.stdout
    assert proc.stderr.count(be.NO_GPU_MESSAGE) == 1, proc.stderr
    bad = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=deadline(300), cwd=tmp_path,
                         env=dict(env, SFTCTL_COMPILE="bogus"))
    assert bad.returncode != 0 and "SFTCTL_COMPILE must be one of" in bad.stderr


def test_two_gemms_summed_share_no_epilogue(home):
    """``A(x) + B(x)`` (Llama's backward sums the input grads of gate/up and q/k/v so): the
    ``add`` is absorbed by one site only, the rewrite keeps a valid graph, values match."""
    def f(x, a, b, c):
        return torch.ops.aten.mm(x, a) + torch.ops.aten.mm(x, b), torch.relu(torch.ops.aten.mm(x, c))

    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, 16, generator=g), torch.randn(16, 24, generator=g), torch.randn(16, 24, generator=g),
          torch.randn(16, 24, generator=g)]
    gm = _aten_graph(f, xs)
    sites = be.rewrite_gemms(gm, load_target("H100"), force=True, use_disk_cache=False)
    assert len(sites) == 3
    assert sorted(tuple(s.epilogue) for s in sites) == [(), ("relu",), ("residual",)]
    absorbed = [n for s in sites for n in s.chain[1:]]
    assert len(absorbed) == len(set(absorbed))
    after = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert after.count(be.sftensor_gemm) == 3 and aten.add.Tensor not in after
    fresh = [torch.randn(x.shape, generator=g) for x in xs]
    for got, want in zip(gm(*fresh), f(*fresh)):  # no codegen under plain CPU: reference math
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_hf_gpt2_and_llama_train_through_the_rewrite(home, tmp_path):
    """Tiny HF GPT-2 and Llama (random init, eager attention), forward and backward through
    ``SftensorBackend(force=True)`` with every GEMM site on an interpreted Triton kernel
    (``TRITON_INTERPRET=1``), against the same model in float64 eager: loss within rtol 2e-5 and
    every parameter's gradient within 2e-5 of that gradient's largest magnitude (float32 kernels;
    measured about 6e-7)."""
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    script = textwrap.dedent("""
        import copy, json, torch, transformers
        from sftctl.compiler import backend as be
        F = torch.nn.functional
        V = 64

        def make(name):
            if name == "gpt2":
                return transformers.GPT2LMHeadModel(transformers.GPT2Config(
                    vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                    attn_implementation="eager"))
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
                attn_implementation="eager"))

        space = {"BLOCK_M": (16,), "BLOCK_N": (16, 32), "BLOCK_K": (16,), "split_k": (1,), "num_warps": (4,),
                 "num_stages": (2,), "GROUP_M": (1,), "layout": (0,)}
        out = {}
        for name in ("gpt2", "llama"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = make(name)
            ref = copy.deepcopy(model).double()
            ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(7))

            def loss_of(m):  # our own loss: HF's upcasts logits to float32, spoiling the reference
                logits = m(input_ids=ids).logits
                return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))

            backend = be.SftensorBackend(force=True, space=space, use_disk_cache=False, analyze=False)
            before = dict(be.STATS)
            loss = loss_of(torch.compile(model, backend=backend))
            loss.backward()
            ref_loss = loss_of(ref)
            ref_loss.backward()
            grad_rel = max(float((p.grad.double() - q.grad).abs().max()) / float(q.grad.abs().max())
                           for p, q in zip(model.parameters(), ref.parameters()) if q.grad.abs().max() > 0)
            out[name] = {"loss_rel": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), "grad_rel": grad_rel,
                         "kinds": sorted(set(r.kind for r in backend.reports)),
                         "sites": sum(len(r.sites) for r in backend.reports),
                         "residual_sites": sum("residual" in s["epilogue"] for r in backend.reports for s in r.sites),
                         "triton": be.STATS["triton"] - before["triton"],
                         "fallback": be.STATS["fallback"] - before["fallback"]}
        print(json.dumps(out))
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=deadline(300), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in out.items():
        assert r["kinds"] == ["backward", "forward"], (name, r)
        assert r["sites"] >= 20 and r["triton"] == r["sites"] and r["fallback"] == 0, (name, r)
        assert r["loss_rel"] < 2e-5 and r["grad_rel"] < 2e-5, (name, r)
    assert out["llama"]["residual_sites"] > 0


def test_analyze_ir_prices_like_compile_graph_on_the_example_gpt(home):
    """``analyze_ir`` (the backend's per-graph report) and ``compile_graph`` price through one
    costing loop (``step.cost_kernels``): on the example GPT's real AOTAutograd forward and
    backward graphs they agree exactly, in both float32 matmul precisions. (Before, analyze_ir
    was a drifted copy: it searched IEEE float32 GEMMs as TF32, dropped GEMM output dtypes and
    epilogue FLOPs and priced every non-GEMM kernel at the float32 vector peak; it was 0.4% off
    on the forward graph under ``highest``.)"""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from sftctl.compiler.step import compile_graph

    graphs: list[fx.GraphModule] = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    gpt = _gpt_module()
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=128))
    x, y = torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
        gpt.next_byte_loss(compiled, (x, y)).backward()
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 2  # forward and backward, no graph breaks
    hw = load_target("H100")
    seen = {}
    for g, gm in enumerate(graphs):
        for precision in ("highest", "high"):
            ir = be.analyze_ir(gm, hw, matmul_precision=precision)
            assert "error" not in ir, ir
            graph, _ = be.lower_fx_to_ir(gm)
            step = compile_graph(graph, hw, matmul_precision=precision)
            assert ir["predicted_s"] == step.compute_time_s
            kinds = {}
            for k in step.kernels:
                kinds[k.kind] = kinds.get(k.kind, 0) + 1
            assert ir["kernels"] == kinds and kinds.get("gemm", 0) >= 8
            seen[(g, precision)] = ir["predicted_s"]
    # the precision is priced, not ignored: IEEE float32 on the CUDA cores is slower than TF32
    assert seen[(0, "highest")] > seen[(0, "high")]
