"""Frontends (torch, jax) and the numpy reference interpreter of the IR.

Each numeric test traces one whole training step (forward, loss, backward, AdamW) from a model
with fresh random parameters, optimizer state and batch, runs the IR graph in the interpreter in
float64, and compares loss, updated parameters and both Adam moments with the framework's own
float64 step (torch: ``torch.optim.AdamW`` after ``loss.backward()``; jax: the same step function
run by jax). Tolerance: ``rtol=1e-7, atol=1e-10`` per element (what is achieved is ~1e-15: both
sides compute the same float64 math, in different orders). The seed is in every failure message.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import resource
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sftctl.compiler import interpreter  # noqa: E402
from sftctl.compiler.frontends import torch as torch_frontend  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RTOL, ATOL = 1e-7, 1e-10


def _load_gpt():
    spec = importlib.util.spec_from_file_location("_gpt_example_model", REPO / "examples" / "gpt" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


gpt = _load_gpt()


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**31))


def _feed_torch(graph, meta, params: dict, ms: dict, vs: dict, step: float, batch_leaves) -> dict:
    feed = {meta["params"][n]: params[n].detach().double().numpy() for n in meta["param_names"]}
    for n in meta["param_names"]:
        feed[meta["opt_state"][n + ".exp_avg"]] = ms[n].numpy()
        feed[meta["opt_state"][n + ".exp_avg_sq"]] = vs[n].numpy()
    feed[meta["step"]] = np.float64(step)
    for i, x in zip(meta["batch"], batch_leaves):
        feed[i] = x.numpy()
    return feed


def _check_torch_step(model, batch, loss_fn, ref_loss_fn, seed, *, weight_decay, grad_clip=None,
                      lr=1e-2, betas=(0.9, 0.95), eps=1e-8, step=4):
    """Trace (fake=False), interpret in float64, compare with torch.optim.AdamW in float64."""
    graph, meta = torch_frontend.trace_step(model, batch, loss_fn, fake=False, lr=lr, betas=betas, eps=eps,
                                            weight_decay=weight_decay, grad_clip=grad_clip)
    assert graph.output_roles[0] == "loss"
    rng = np.random.default_rng(seed)
    ref = copy.deepcopy(model).double()
    named = dict(ref.named_parameters())
    assert sorted(named) == sorted(meta["param_names"])
    ms = {n: torch.tensor(rng.normal(size=tuple(p.shape)) * 1e-3) for n, p in named.items()}
    vs = {n: torch.tensor(rng.random(size=tuple(p.shape)) * 1e-5) for n, p in named.items()}
    groups: dict[float, list] = {}
    for n, p in named.items():
        wd = weight_decay(n, p) if callable(weight_decay) else weight_decay
        groups.setdefault(float(wd), []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "weight_decay": wd} for wd, ps in groups.items()], lr=lr,
                            betas=betas, eps=eps, foreach=False)
    for n, p in named.items():  # resume from step - 1 with random moments
        opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": ms[n].clone(), "exp_avg_sq": vs[n].clone()}
    leaves = torch.utils._pytree.tree_leaves(batch)
    feed = _feed_torch(graph, meta, dict(model.named_parameters()), ms, vs, step, leaves)
    buffers = dict(model.named_buffers())
    for n, i in meta["buffers"].items():
        feed[i] = buffers[n].detach().numpy()

    out = interpreter.run(graph, feed, dtype="float64")

    b64 = torch.utils._pytree.tree_map(lambda t: t.double() if t.is_floating_point() else t, batch)
    loss = ref_loss_fn(ref, b64)
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), grad_clip)
    opt.step()
    expected = {"loss": loss.detach().numpy()}
    for n, p in named.items():
        expected[f"param:{n}"] = p.detach().numpy()
        expected[f"opt_state:{n}.exp_avg"] = opt.state[p]["exp_avg"].numpy()
        expected[f"opt_state:{n}.exp_avg_sq"] = opt.state[p]["exp_avg_sq"].numpy()
    assert sorted(expected) == sorted(graph.output_roles)
    worst = _compare(graph.output_roles, out, expected, seed)
    return graph, meta, worst


def _compare(roles, out, expected, seed) -> tuple[float, float]:
    max_abs = max_rel = 0.0
    for role, got in zip(roles, out):
        want = np.asarray(expected[role])
        assert got.shape == want.shape, (role, got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"{role} (seed {seed})")
        err = np.abs(got - want)
        max_abs = max(max_abs, float(err.max(initial=0)))
        max_rel = max(max_rel, float((err / np.maximum(np.abs(want), 1e-300)).max(initial=0)))
    print(f"max abs err {max_abs:.3g}, max rel err {max_rel:.3g}")
    return max_abs, max_rel


def _randomize(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            base = 1.0 if p.dim() == 1 and ("ln" in n and n.endswith("weight")) else 0.0
            p.copy_(base + 0.05 * torch.randn(p.shape, generator=gen))


def _loss64(model, batch):
    """next_byte_loss without its ``.float()`` cast, for the float64 reference run."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def test_gpt_step_matches_torch_float64():
    seed = _seed()
    cfg = gpt.GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32)
    model, _, loss_fn = gpt.build(batch_size=2, cfg=cfg)
    _randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    seq = torch.randint(0, cfg.vocab_size, (2, cfg.block_size + 1), generator=gen)
    batch = (seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
    graph, meta, _ = _check_torch_step(
        model, batch, loss_fn, _loss64, seed,
        weight_decay=lambda name, p: 0.1 if p.dim() >= 2 else 0.0,  # as examples/gpt/train.py
        grad_clip=0.1,
    )
    assert "lm_head.weight" not in meta["params"]  # tied to wte.weight: one input
    roles = {n.attrs["role"] for n in graph.inputs_with_role("param") + graph.inputs_with_role("opt_state")}
    assert roles == {"param", "opt_state"}
    ops = graph.op_counts()
    assert ops["dot_general"] > 0 and ops["gather"] >= 2 and ops["scatter_add"] >= 2


class _MLP(nn.Module):
    def __init__(self, act: nn.Module, d_in=8, d_hidden=16, d_out=4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)
        self.act = act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("kind", ["gelu_xent", "relu_mse"])
def test_mlp_step_matches_torch_float64(kind):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    if kind == "gelu_xent":
        model = _MLP(nn.GELU())
        batch = (torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen))

        def loss_fn(m, b):
            return F.cross_entropy(m(b[0]), b[1])
    else:
        model = _MLP(nn.ReLU())
        batch = {"x": torch.randn(6, 8, generator=gen), "y": torch.randn(6, 4, generator=gen)}

        def loss_fn(m, b):
            return F.mse_loss(m(b["x"]), b["y"])
    _randomize(model, seed)
    model = model.float()
    _check_torch_step(model, batch, loss_fn, loss_fn, seed, weight_decay=0.05, step=1, betas=(0.9, 0.999))


class _OpZoo(nn.Module):
    """Exercises lowerings the GPT and the MLPs do not: split/cat, var/mean, gather, advanced
    indexing, masked_fill, unbind/stack, pad, index_put, scatter_add, remainder, a buffer and a
    tensor constant, softmax/log_softmax/logsumexp, amax/max, where."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 5))
        self.emb = nn.Embedding(7, 5)
        self.ln = nn.LayerNorm(5, elementwise_affine=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x, idx):
        h = (x @ self.w) * self.scale + self.emb(idx)
        a, b = h.split([2, 3], dim=1)
        h = torch.cat([b.sigmoid(), a.clamp(-0.5, 0.5)], 1)
        h = self.ln(h) + h.var(1, keepdim=True) + h.mean(0)
        h = h + h[torch.arange(4), idx % 5][:, None] + torch.gather(h, 1, idx[:, None] % 5)
        h = h.masked_fill(h > 2.0, 2.0)
        r = torch.stack(h.unbind(0), 1).T
        r = F.pad(r, (1, 2))[:, 1:-1]
        r = r[:, 1:4].contiguous() + r[1].abs()[1:4]
        z = torch.zeros(4, 3, dtype=r.dtype).index_put((idx % 4,), r * r.sum(), accumulate=True)
        sc = torch.zeros(4, 3, dtype=r.dtype).scatter_add(1, (idx % 3)[:, None], r[:, :1])
        const = torch.tensor([1.0, 2.0, 3.0], dtype=r.dtype)
        out = F.softmax(z + sc + const, -1).amax(-1).sum() + torch.where(r > 0, r, r.exp() - 1).pow(2).mean()
        return out + F.log_softmax(r, 0).logsumexp(0).sum() + h.tanh().max() + torch.rsqrt(h.pow(2) + 1).sum()


def test_torch_op_zoo_matches_torch_float64():
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    model = _OpZoo()
    _randomize(model, seed)
    batch = (torch.randn(4, 6, generator=gen), torch.randint(0, 7, (4,), generator=gen))
    graph, _, _ = _check_torch_step(model, batch, lambda m, b: m(*b), lambda m, b: m(*b), seed, weight_decay=0.0)
    assert any(n.attrs.get("role") == "constant" for n in graph.nodes if n.op == "input")
    assert {"pad", "concatenate", "scatter_add", "gather", "slice"} <= set(graph.op_counts())


def test_jax_mlp_step_matches_jax_float64():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from sftctl.compiler.frontends import jax as jax_frontend

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        seed = _seed()
        rng = np.random.default_rng(seed)

        def loss_fn(p, b):
            x, y, tok = b
            e = p["emb"][tok].mean(axis=1)  # gather; its gradient is a scatter-add
            h = jax.nn.gelu(x @ p["w1"] + p["b1"] + e)
            logits = jnp.tanh(h) @ p["w2"] + p["b2"]
            logp = jax.nn.log_softmax(logits)
            xent = -jnp.mean(jnp.sum(jax.nn.one_hot(y, 4) * logp, axis=-1))
            picked = jnp.take_along_axis(logp, y[:, None], axis=1)  # point gather
            return xent + 0.1 * jnp.mean(picked) + 0.01 * jnp.mean(jax.nn.logsumexp(logits, -1))

        params = {"w1": rng.normal(size=(8, 16)) * 0.3, "b1": rng.normal(size=16) * 0.1,
                  "w2": rng.normal(size=(16, 4)) * 0.3, "b2": rng.normal(size=4) * 0.1,
                  "emb": rng.normal(size=(10, 16))}
        params = {k: jnp.asarray(v) for k, v in params.items()}
        batch = (jnp.asarray(rng.normal(size=(6, 8))), jnp.asarray(rng.integers(0, 4, 6)),
                 jnp.asarray(rng.integers(0, 10, (6, 3)).astype(np.int32)))
        hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        graph, meta = jax_frontend.trace_step(loss_fn, params, batch, **hyper)
        m = {k: jnp.asarray(rng.normal(size=v.shape) * 1e-2) for k, v in params.items()}
        v = {k: jnp.asarray(rng.random(size=v.shape) * 1e-3) for k, v in params.items()}
        step = 3.0
        feed = {meta["params"][k]: np.asarray(params[k]) for k in params}
        for k in params:
            feed[meta["opt_state"][k + ".exp_avg"]] = np.asarray(m[k])
            feed[meta["opt_state"][k + ".exp_avg_sq"]] = np.asarray(v[k])
        feed[meta["step"]] = step
        for i, x in zip(meta["batch"], jax.tree_util.tree_leaves(batch)):
            feed[i] = np.asarray(x)

        out = interpreter.run(graph, feed, dtype="float64")

        ref_loss, ref_p, ref_m, ref_v = jax.jit(jax_frontend.make_step(loss_fn, **hyper))(
            params, m, v, jnp.float64(step), batch)
        expected = {"loss": np.asarray(ref_loss)}
        for name in meta["param_names"]:
            expected[f"param:{name}"] = np.asarray(ref_p[name])
            expected[f"opt_state:{name}.exp_avg"] = np.asarray(ref_m[name])
            expected[f"opt_state:{name}.exp_avg_sq"] = np.asarray(ref_v[name])
        assert sorted(expected) == sorted(graph.output_roles)
        _compare(graph.output_roles, out, expected, seed)
        ops = graph.op_counts()
        assert ops["gather"] >= 2 and ops["scatter_add"] >= 2 and ops["dot_general"] >= 2
    finally:
        jax.config.update("jax_enable_x64", previous)


def _dot_flops(graph) -> int:
    total = 0
    for n in graph.nodes:
        if n.op == "dot_general":
            lhs = graph.nodes[n.inputs[0]].type.shape
            total += 2 * math.prod(n.type.shape) * math.prod(lhs[d] for d in n.attrs["lhs_contract"])
    return total


def test_gpt2_small_fake_trace_flops():
    """GPT-2 small (12 x 768, 12 heads, block 1024, vocab 50257, batch 8), traced in fake mode.

    Expected matmul FLOPs = 6 * n_params * tokens (2 forward + 4 backward per parameter and token;
    counts the embeddings as if multiplied, an overestimate of <1%), within 10%. Attention is one
    op (flash attention): exactly 14 * n_layer * B * T^2 * C * (T+1)/(2T) FLOPs (QK^T and PV
    forward, 4 * B * T^2 * C; five products backward, 10 * B * T^2 * C; causal keeps (T+1)/(2T)).
    """
    L, B, T, C, V = 12, 8, 1024, 768, 50257
    cfg = gpt.GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=12, n_embd=C)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    with torch.device("meta"):
        model, batch, loss_fn = gpt.build(batch_size=B, cfg=cfg)
    t1 = time.perf_counter()
    graph, meta = torch_frontend.trace_step(model, batch, loss_fn, fake=True)
    t2 = time.perf_counter()
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert all(p.device.type == "meta" for p in model.parameters())
    # real tensors would need 0.5 GB of parameters and 1.6 GB for the logits alone
    assert grew_mib < 1024, f"peak RSS grew {grew_mib:.0f} MiB"
    n_params = model.num_params()
    assert meta["n_params"] == n_params
    flops = _dot_flops(graph)
    expected = 6 * n_params * B * T
    from sftctl.compiler.fusion import fuse

    attn = [k for k in fuse(graph) if k.kind == "attention"]
    assert len(attn) == 2 * L
    assert sum(k.flops for k in attn) == pytest.approx(14 * L * B * T * T * C * (T + 1) / (2 * T), rel=1e-12)
    print(f"GPT-2 small: build {t1 - t0:.2f}s, trace+lower {t2 - t1:.2f}s (make_fx {meta['trace_s']:.2f}s), "
          f"{len(graph.nodes)} IR nodes, {meta['fx_nodes']} fx nodes, flops {flops:.4e} vs {expected:.4e} "
          f"({flops / expected:.4f}), peak RSS +{grew_mib:.0f} MiB")
    assert abs(flops / expected - 1) < 0.10
    assert graph.output_roles[0] == "loss"
    assert len(graph.outputs) == 1 + 3 * len(meta["param_names"])
    logits = [n for n in graph.nodes if n.op == "dot_general" and n.type.shape[-1] == V]
    assert logits, "no lm_head matmul"


def test_trace_entrypoint_bfloat16_autocast():
    graph, meta = torch_frontend.trace_entrypoint("examples/gpt/model.py:build", str(REPO), 4, "bfloat16")
    assert meta["built_on"] == "meta"
    dots = {n.type.dtype for n in graph.nodes if n.op == "dot_general"}
    assert dots == {"bfloat16"}
    assert {n.type.dtype for n in graph.inputs_with_role("param")} == {"float32"}  # master weights
    assert {n.type.dtype for n in graph.inputs_with_role("opt_state")} == {"float32"}
    assert graph.nodes[graph.outputs[0]].type.dtype == "float32"


def test_bfloat16_interpretation_close_to_float64():
    seed = _seed()
    cfg = gpt.GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    model, batch, loss_fn = gpt.build(batch_size=2, cfg=cfg)
    graph, meta = torch_frontend.trace_step(model, batch, loss_fn, fake=False, autocast_dtype="bfloat16")
    params = dict(model.named_parameters())
    feed = {meta["params"][n]: params[n].detach().numpy() for n in meta["param_names"]}
    for i in meta["opt_state"].values():
        feed[i] = np.zeros(graph.nodes[i].type.shape, np.float32)
    feed[meta["step"]] = 1.0
    for i, x in zip(meta["batch"], batch):
        feed[i] = x.numpy()
    exact = interpreter.run(graph, feed, dtype="float64")[0]
    low = interpreter.run(graph, feed, dtype=None)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch_loss = loss_fn(model, batch).item()
    assert low.dtype == np.float32
    assert abs(low - exact) / exact < 2e-2, (low, exact, seed)
    assert abs(low - torch_loss) / torch_loss < 2e-2, (low, torch_loss)


def test_round_to_bfloat16_matches_torch():
    rng = np.random.default_rng(_seed())
    x = (rng.normal(size=4096) * 10.0 ** rng.uniform(-40, 38, 4096)).astype(np.float32)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.4e38]
    x = np.concatenate([x, np.array(special, np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(interpreter.round_to_bfloat16(x), want)


def test_unsupported_aten_op_is_named():
    model = nn.Linear(4, 4)
    with pytest.raises(NotImplementedError, match=r"aten\.special_i0e"):
        torch_frontend.trace_step(model, torch.randn(3, 4), lambda m, x: torch.special.i0e(m(x)).sum())
    with pytest.raises(NotImplementedError, match=r"aten\.linalg_matrix_exp"):
        torch_frontend.trace_step(model, torch.randn(3, 4), lambda m, x: torch.linalg.matrix_exp(m(x).T @ m(x)).sum())


def test_unsupported_jax_primitive_is_named():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from sftctl.compiler.frontends import jax as jax_frontend

    from jax import lax

    def loss(p, b):
        return jnp.sum(lax.lgamma(p["w"] * b + 2.0))

    # the primitive and the user's line that emitted it
    with pytest.raises(NotImplementedError, match=r"primitive lgamma has no IR lowering \(at .*test_frontends\.py:\d+ "):
        jax_frontend.trace_step(loss, {"w": jnp.ones(3)}, jnp.ones(3))


def test_interpreter_layout_and_data_ops():
    from sftctl.compiler.ir import Graph

    g = Graph()
    x = g.add("input", [], (2, 3), "float32", role="batch", name="x")
    idx = g.add("input", [], (4,), "int64", role="batch", name="i")
    pad = g.add("pad", [x], (3, 4), "float32")
    g.nodes[pad].attrs.update(low=(1, -1), high=(0, 2), value=7.0)
    sl = g.add("slice", [x], (2, 2), "float32")
    g.nodes[sl].attrs.update(start=(0, 0), limit=(2, 3), step=(1, 2))
    cat = g.add("concatenate", [x, x], (2, 6), "float32", axis=1)
    bc = g.add("broadcast_in_dim", [x], (2, 5, 3), "float32")
    g.nodes[bc].attrs.update(shape=(2, 5, 3), dims=(0, 2))
    io = g.add("iota", [], (2, 3), "int32", axis=1)
    ga = g.add("gather", [x, idx], (2, 4), "float32", axis=1)
    sc = g.add("scatter_add", [ga, idx], (2, 3), "float32", axis=1, size=3)
    mn = g.add("min", [x], (3,), "float32", axes=(0,), keepdim=False)
    dv = g.add("div", [io, g.add("constant", [], (), "int32", value=-2)], (2, 3), "int32")
    g.outputs = [pad, sl, cat, bc, io, ga, sc, mn, dv]
    xv = np.arange(6, dtype=np.float32).reshape(2, 3)
    iv = np.array([0, 2, 2, -1])
    out = interpreter.run(g, {x: xv, idx: iv}, dtype=None)
    np.testing.assert_array_equal(out[0], np.pad(xv, ((1, 0), (0, 2)), constant_values=7.0)[:, 1:])
    np.testing.assert_array_equal(out[1], xv[:, ::2])
    np.testing.assert_array_equal(out[2], np.concatenate([xv, xv], 1))
    np.testing.assert_array_equal(out[3], np.broadcast_to(xv[:, None, :], (2, 5, 3)))
    np.testing.assert_array_equal(out[4], np.broadcast_to(np.arange(3), (2, 3)))
    np.testing.assert_array_equal(out[5], np.take(xv, iv, axis=1))
    np.testing.assert_array_equal(out[6], xv * np.array([1, 0, 3]))  # column 2 picked three times
    np.testing.assert_array_equal(out[7], xv.min(0))
    np.testing.assert_array_equal(out[8], np.array([[0, 0, -1], [0, 0, -1]]))  # truncates toward 0
    with pytest.raises(KeyError):
        interpreter.run(g, {x: xv})
