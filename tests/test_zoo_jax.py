"""JAX models in the zoo: a flax.linen GPT and a flax.nnx vision transformer (conv patches).

For each: the step traces; the float64 reference interpreter reproduces JAX's float64 loss and
every parameter gradient (fresh random weights and batch; rtol 1e-7 relative to each gradient's
largest magnitude, floored at 1e-6 of the largest gradient of all); the contraction FLOPs equal the analytic count; and no kernel is predicted
above 100 % of its roofline. Gradients are read from the traced AdamW step: with ``beta1 = 0``
and zero moments, ``opt_state:<name>.exp_avg`` is the gradient.

Also: the same ``dtype`` means the same precision scheme in both frontends (float32 master
weights and AdamW state, matmuls in bfloat16).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
flax = pytest.importorskip("flax")
import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from conftest import REPO  # noqa: E402
from sftctl.compiler import interpreter  # noqa: E402
from sftctl.compiler.frontends import jax as jax_frontend  # noqa: E402
from sftctl.compiler.fusion import _gemm_dims  # noqa: E402
from sftctl.compiler.target import load_target  # noqa: E402
from sftctl.compiler.step import compile_graph  # noqa: E402

RTOL = 1e-7


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % (2**31))


def contraction_flops(graph) -> float:
    return sum(2.0 * math.prod(_gemm_dims(graph, n)) for n in graph.nodes if n.op in ("dot_general", "conv"))


def assert_within_roofline(graph, what: str) -> None:
    for target in ("H100", "L4"):
        compiled = compile_graph(graph, load_target(target))
        over = [(k.label, round(k.roofline_fraction, 3)) for k in compiled.kernels if k.roofline_fraction > 1 + 1e-9]
        assert not over, f"{what} on {target}: kernels above their roofline: {over[:5]}"
        assert math.isfinite(compiled.compute_time_s) and compiled.compute_time_s > 0


def check_step_float64(loss_fn, params, batch, grads, loss, seed):
    """Trace, interpret in float64, compare loss and gradients (``grads``: a pytree like the
    traced parameters). Returns the graph."""
    graph, meta = jax_frontend.trace_step(loss_fn, params, batch, betas=(0.0, 0.999))
    if isinstance(params, nnx.Module):
        params = nnx.to_pure_dict(nnx.split(params, nnx.Param, ...)[1])
    leaves = dict(zip(meta["param_names"], jax.tree_util.tree_leaves(params)))
    feed = {meta["params"][n]: np.asarray(leaves[n]) for n in meta["param_names"]}
    for i in meta["opt_state"].values():
        feed[i] = np.zeros(graph.nodes[i].type.shape)
    feed[meta["step"]] = 1.0
    for i, x in zip(meta["batch"], jax.tree_util.tree_leaves(batch)):
        feed[i] = np.asarray(x)
    out = interpreter.run(graph, feed, dtype="float64")
    np.testing.assert_allclose(out[meta["outputs"]["loss"]], float(loss), rtol=RTOL, err_msg=f"loss (seed {seed})")
    gleaves = dict(zip(meta["param_names"], jax.tree_util.tree_leaves(grads)))
    overall = max(float(np.abs(np.asarray(g)).max()) for g in gleaves.values())
    for n in meta["param_names"]:
        want = np.asarray(gleaves[n])
        got = out[meta["outputs"][f"opt_state:{n}.exp_avg"]]
        # a gradient that is zero in exact arithmetic (attention's key bias) is rounding noise:
        # its scale is floored at 1e-6 of the largest gradient
        err = float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-6 * overall)
        assert err < RTOL, f"gradient of {n}: error {err:.3g} of its largest magnitude (seed {seed})"
    return graph, meta


# ------------------------------------------------------------------------------------------------
# flax.linen GPT
# ------------------------------------------------------------------------------------------------


class LinenBlock(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        h = nn.LayerNorm()(x)
        qkv = nn.Dense(3 * d)(h).reshape(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d)
        x = x + nn.Dense(d)(y)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(h), approximate=False))


class LinenGPT(nn.Module):
    vocab: int
    block: int
    dim: int
    heads: int
    layers: int

    @nn.compact
    def __call__(self, idx):
        wte = nn.Embed(self.vocab, self.dim)
        x = wte(idx) + self.param("wpe", nn.initializers.normal(0.02), (self.block, self.dim))[: idx.shape[1]]
        for _ in range(self.layers):
            x = LinenBlock(self.heads)(x)
        return wte.attend(nn.LayerNorm()(x))  # tied output head


def test_flax_linen_gpt_float64_loss_gradients_flops_roofline(x64):
    seed = _seed()
    rng = np.random.default_rng(seed)
    b, t, vocab, dim, heads, layers = 2, 8, 32, 16, 2, 2
    model = LinenGPT(vocab, t, dim, heads, layers)
    idx = jnp.asarray(rng.integers(0, vocab, (b, t)))
    tgt = jnp.asarray(rng.integers(0, vocab, (b, t)))
    variables = model.init(jax.random.PRNGKey(seed), idx)
    variables = jax.tree_util.tree_map(
        lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.3 + (1.0 if p.ndim == 1 else 0.0)), variables)

    def loss_fn(v, batch):
        x, y = batch
        logp = jax.nn.log_softmax(model.apply(v, x))
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))

    loss, grads = jax.value_and_grad(loss_fn)(variables, (idx, tgt))
    graph, meta = check_step_float64(loss_fn, variables, (idx, tgt), grads, loss, seed)
    assert "params.wpe" in meta["param_names"]
    tokens = b * t
    macs = layers * (tokens * 12 * dim * dim + 2 * b * t * t * dim) + tokens * dim * vocab
    assert contraction_flops(graph) == 2 * 3 * macs  # forward, input and weight gradients
    f32 = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), variables)
    g16, m16 = jax_frontend.trace_step(loss_fn, f32, (idx, tgt), compute_dtype="bfloat16")
    assert_within_roofline(g16, "flax.linen GPT")


# ------------------------------------------------------------------------------------------------
# flax.nnx ViT (convolutional patch embedding)
# ------------------------------------------------------------------------------------------------


def _attention(q, k, v, *args, **kwargs):
    """Softmax attention in the inputs' dtype. (flax's default ``dot_product_attention`` forces
    its softmax to float32, which would make the float64 reference a float32 one.)"""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


class NnxViT(nnx.Module):
    def __init__(self, image: int, patch: int, dim: int, heads: int, classes: int, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.patch = nnx.Conv(3, dim, (patch, patch), strides=patch, padding="VALID", **kw)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), ((image // patch) ** 2, dim), param_dtype) * 0.02)
        self.ln1 = nnx.LayerNorm(dim, **kw)
        self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, attention_fn=_attention, **kw)
        self.ln2 = nnx.LayerNorm(dim, **kw)
        self.fc1 = nnx.Linear(dim, 2 * dim, **kw)
        self.fc2 = nnx.Linear(2 * dim, dim, **kw)
        self.head = nnx.Linear(dim, classes, **kw)

    def __call__(self, x):  # x: [B, H, W, 3] (NHWC, flax's layout)
        h = self.patch(x)
        h = h.reshape(h.shape[0], -1, h.shape[-1]) + self.pos[...]
        h = h + self.attn(self.ln1(h))
        h = h + self.fc2(jax.nn.relu(self.fc1(self.ln2(h))))
        return self.head(h.mean(axis=1))


def _nnx_loss(model, batch):
    x, y = batch
    logp = jax.nn.log_softmax(model(x))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))


def test_flax_nnx_vit_float64_loss_gradients_flops_roofline(x64):
    seed = _seed()
    rng = np.random.default_rng(seed)
    b, image, patch, dim, heads, classes = 2, 8, 4, 8, 2, 3
    model = NnxViT(image, patch, dim, heads, classes, rngs=nnx.Rngs(seed), param_dtype=jnp.float64)
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    pure = jax.tree_util.tree_map(lambda p: rng.normal(size=p.shape) * 0.3 + (1.0 if p.ndim == 1 else 0.0),
                                  nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map(jnp.asarray, pure))
    model = nnx.merge(graphdef, state, rest)
    x = jnp.asarray(rng.normal(size=(b, image, image, 3)))
    y = jnp.asarray(rng.integers(0, classes, b))
    loss, grads = nnx.value_and_grad(_nnx_loss)(model, (x, y))
    graph, meta = check_step_float64(_nnx_loss, model, (x, y), nnx.to_pure_dict(grads), loss, seed)
    assert "attn.query.kernel" in meta["param_names"] and "patch.kernel" in meta["param_names"]
    assert graph.op_counts()["conv"] == 2  # patch embedding forward and weight gradient
    t = (image // patch) ** 2
    patch_macs = b * t * dim * 3 * patch * patch
    linear_macs = b * t * (4 * dim * dim + 2 * 2 * dim * dim) + b * dim * classes
    attn_macs = 2 * b * t * t * dim
    assert contraction_flops(graph) == 2 * (2 * patch_macs + 3 * linear_macs + 3 * attn_macs)
    f32 = NnxViT(image, patch, dim, heads, classes, rngs=nnx.Rngs(0))
    g16, _ = jax_frontend.trace_step(_nnx_loss, f32, (x.astype(jnp.float32), y), compute_dtype="bfloat16")
    assert_within_roofline(g16, "flax.nnx ViT")


# ------------------------------------------------------------------------------------------------
# one precision scheme for both frontends
# ------------------------------------------------------------------------------------------------


def test_same_dtype_same_precision_scheme_in_both_frontends():
    """``dtype: bfloat16`` in a spec: float32 master weights and AdamW state, bfloat16
    matmuls, float32 loss, in the torch frontend (autocast) and in the JAX one (casts)."""
    from sftctl.compiler.frontends import torch as torch_frontend

    graphs = {
        "jax": jax_frontend.trace_entrypoint("examples/jax_mlp/model.py:build", str(REPO), 8, "bfloat16"),
        "torch": torch_frontend.trace_entrypoint("examples/gpt/model.py:build", str(REPO), 2, "bfloat16"),
    }
    for name, (graph, meta) in graphs.items():
        for role in ("param", "opt_state"):
            dtypes = {n.type.dtype for n in graph.inputs_with_role(role)}
            assert dtypes == {"float32"}, (name, role, dtypes)
        dots = {n.type.dtype for n in graph.nodes if n.op == "dot_general"}
        assert "bfloat16" in dots, (name, dots)
        assert graph.nodes[graph.outputs[0]].type.dtype == "float32", name
        assert meta["precision"].endswith("bfloat16, float32 master weights"), (name, meta["precision"])
    # without mixed precision, JAX trains the parameters as built: in bfloat16 (the example's
    # ``w / np.sqrt(fan_in)`` promotes its two weight matrices back to float32)
    graph, meta = jax_frontend.trace_entrypoint("examples/jax_mlp/model.py:build", str(REPO), 8, "bfloat16",
                                                mixed_precision=False)
    assert "bfloat16" in {n.type.dtype for n in graph.inputs_with_role("param")}
    assert meta["precision"] == "bfloat16"


# ------------------------------------------------------------------------------------------------
# flax.nnx in train mode: batch statistics are buffers; dropout is refused with a hint
# ------------------------------------------------------------------------------------------------


class NnxConvBN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.conv1 = nnx.Conv(3, 4, (3, 3), strides=2, padding="SAME", use_bias=False, **kw)
        self.bn1 = nnx.BatchNorm(4, momentum=0.9, **kw)
        self.conv2 = nnx.Conv(4, 6, (3, 3), padding=((1, 1), (1, 1)), feature_group_count=2, **kw)
        self.head = nnx.Linear(6, 3, **kw)

    def __call__(self, x):
        h = jax.nn.relu(self.bn1(self.conv1(x)))
        return self.head(jax.nn.relu(self.conv2(h)).mean(axis=(1, 2)))


def test_flax_nnx_batchnorm_train_mode_statistics_are_buffers(x64):
    """nnx.BatchNorm in train mode: batch statistics are ``buffer`` inputs, their updates
    ``buffer:<name>`` outputs; loss, gradients and the updated statistics match nnx in float64."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    model = NnxConvBN(rngs=nnx.Rngs(seed), param_dtype=jnp.float64)
    model.train()
    x = jnp.asarray(rng.normal(size=(4, 8, 8, 3)))
    y = jnp.asarray(rng.integers(0, 3, 4))
    graphdef, pstate, rest = nnx.split(model, nnx.Param, ...)
    before = nnx.to_pure_dict(nnx.split(model, nnx.Param, nnx.RngState, ...)[3])
    graph, meta = jax_frontend.trace_step(_nnx_loss, model, (x, y), betas=(0.0, 0.999))
    assert sorted(meta["buffers"]) == ["bn1.mean", "bn1.var"]
    assert sorted(r for r in meta["outputs"] if r.startswith("buffer:")) == ["buffer:bn1.mean", "buffer:bn1.var"]
    assert graph.op_counts()["conv"] == 5  # 2 forward, 2 weight gradients, 1 input gradient (grouped)
    feed = {meta["params"][n]: np.asarray(v) for n, v in
            zip(meta["param_names"], jax.tree_util.tree_leaves(nnx.to_pure_dict(pstate)))}
    feed.update({i: np.zeros(graph.nodes[i].type.shape) for i in meta["opt_state"].values()})
    feed.update({meta["buffers"][n]: np.asarray(v) for n, v in
                 zip(sorted(meta["buffers"]), jax.tree_util.tree_leaves(before))})
    feed[meta["step"]] = 1.0
    feed[meta["batch"][0]], feed[meta["batch"][1]] = np.asarray(x), np.asarray(y)
    out = dict(zip(graph.output_roles, interpreter.run(graph, feed, dtype="float64")))
    loss, grads = nnx.value_and_grad(_nnx_loss)(model, (x, y))  # updates model's statistics
    np.testing.assert_allclose(out["loss"], float(loss), rtol=RTOL)
    overall = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree_util.tree_leaves(nnx.to_pure_dict(grads)))
    for n, g in zip(meta["param_names"], jax.tree_util.tree_leaves(nnx.to_pure_dict(grads))):
        err = float(np.abs(out[f"opt_state:{n}.exp_avg"] - np.asarray(g)).max())
        assert err <= RTOL * max(float(np.abs(np.asarray(g)).max()), 1e-6 * overall), (n, err, seed)
    after = nnx.to_pure_dict(nnx.split(model, nnx.Param, nnx.RngState, ...)[3])
    np.testing.assert_allclose(out["buffer:bn1.mean"], np.asarray(after["bn1"]["mean"]), rtol=RTOL, atol=1e-14)
    np.testing.assert_allclose(out["buffer:bn1.var"], np.asarray(after["bn1"]["var"]), rtol=RTOL, atol=1e-14)
    assert not np.allclose(out["buffer:bn1.var"], np.asarray(before["bn1"]["var"]))
    # eval mode: statistics are read, never written
    model.eval()
    graph, meta = jax_frontend.trace_step(_nnx_loss, model, (x, y))
    assert meta["buffers"] and not any(r.startswith("buffer:") for r in meta["outputs"])


def test_flax_nnx_dropout_in_train_mode_is_refused_with_a_hint():
    class Drop(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    model = Drop(nnx.Rngs(0))
    batch = (jnp.ones((2, 4)), jnp.zeros(2, jnp.int32))
    with pytest.raises(NotImplementedError, match="model.eval()"):
        jax_frontend.trace_step(_nnx_loss, model, batch)
    model.eval()
    graph, meta = jax_frontend.trace_step(_nnx_loss, model, batch)
    assert meta["param_names"] == ["lin.bias", "lin.kernel"]


# ------------------------------------------------------------------------------------------------
# flax.linen CNN with max and average pooling (reduce_window, select_and_scatter_add)
# ------------------------------------------------------------------------------------------------


class LinenPoolCNN(nn.Module):
    """The flax examples' CNN shape: conv, relu, max_pool (padded, overlapping windows), conv,
    avg_pool (strided), mean over space, dense head."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        x = nn.relu(nn.Conv(6, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(3)(x.mean(axis=(1, 2)))


def check_linen_classifier(model, x_shape, classes: int = 3):
    """A flax.linen classifier's step (cross-entropy on random labels) against JAX in float64:
    fresh seed, random weights; returns the graph."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=x_shape))
    y = jnp.asarray(rng.integers(0, classes, x_shape[0]))
    params = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.5),
                                    model.init(jax.random.PRNGKey(0), x)["params"])

    def loss_fn(p, batch):
        xb, yb = batch
        logits = model.apply({"params": p}, xb)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], axis=1))

    loss, grads = jax.value_and_grad(loss_fn)(params, (x, y))
    graph, _ = check_step_float64(loss_fn, params, (x, y), grads, loss, seed)
    return graph


def test_flax_linen_cnn_with_max_and_avg_pooling_float64(x64):
    """reduce_window_max / _sum and max pooling's gradient (select_and_scatter_add), and
    average pooling's (an interior pad), against JAX in float64."""
    ops = check_linen_classifier(LinenPoolCNN(), (2, 9, 9, 2)).op_counts()
    assert ops["maximum"] >= 8 and ops["conv"] >= 4, ops  # 9 window taps; forward and weight-gradient convs


def test_flax_linen_dropout_in_train_mode_traces_drawing_from_the_ir_stream():
    """flax.linen dropout in train mode with its PRNG key carried in the batch: the key's
    plumbing carries no value, ``random_bits`` draws from the IR's random stream, and the mantissa
    trick (shift, or, bitcast) makes uniforms in [0, 1): the interpreted keep fraction is
    1 - rate (it failed with numpy's "Cannot interpret 'key<fry>' as a data type")."""

    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dropout(0.25, deterministic=False)(jnp.ones((x.shape[0], 4000)))
            return nn.Dense(1)(x).mean() + 0.0 * h.sum(), h

    model, x = Drop(), jnp.ones((2, 5))
    params = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}, x)["params"]

    def loss_fn(p, batch):
        xb, key = batch
        return model.apply({"params": p}, xb, rngs={"dropout": key})[0]

    graph, _ = jax_frontend.trace_step(loss_fn, params, (x, jax.random.PRNGKey(2)))
    ops = graph.op_counts()
    assert ops.get("rng_uniform") == 1 and ops.get("bitcast") == 1, ops

    def mask(p, key):
        return model.apply({"params": p}, x, rngs={"dropout": key})[1]

    closed = jax.make_jaxpr(mask)(params, jax.random.PRNGKey(2))
    leaves = jax.tree_util.tree_leaves((params, jax.random.PRNGKey(2)))
    g, ids = jax_frontend._Lowering().run(closed, [("batch", f"x{i}") for i in range(len(leaves))], ["mask"])
    [kept] = interpreter.run(g, {i: np.asarray(v) for i, v in zip(ids, leaves)}, dtype="float64")
    frac = float((kept != 0).mean())
    assert abs(frac - 0.75) < 0.02, frac  # 8000 draws: 5 standard deviations
    assert set(np.unique(kept)) <= {0.0, 1.0 / 0.75}


def test_a_prng_keys_value_used_as_data_is_refused_naming_the_line():
    """A key's raw data used as numbers cannot be priced: one line with what to do and the
    user's file:line."""

    def loss_fn(p, batch):
        xb, key = batch
        return (p["w"] * xb).sum() + jax.random.key_data(jax.random.wrap_key_data(key)).sum().astype(jnp.float32)

    with pytest.raises(NotImplementedError, match=r"draws random numbers from a PRNG key .*deterministic=True"
                                                  r".*\(at .*test_zoo_jax\.py:\d+ \(.*loss_fn\)\)"):
        jax_frontend.trace_step(loss_fn, {"w": jnp.ones(3)}, (jnp.ones(3), jax.random.PRNGKey(2)))


class LinenLSTM(nn.Module):
    """A flax sequence classifier: ``nn.RNN(nn.OptimizedLSTMCell)`` (a ``lax.scan`` over time)
    and a dense head on the last step."""

    @nn.compact
    def __call__(self, x):
        cell = nn.OptimizedLSTMCell(6, dtype=x.dtype, param_dtype=x.dtype)
        return nn.Dense(3)(nn.RNN(cell)(x)[:, -1])


def test_flax_linen_lstm_over_nn_rnn_float64(x64):
    """``lax.scan`` unrolled over 7 steps; loss and every gradient against JAX in float64 (it
    failed on ``random_seed`` / ``random_split``, the lifted scan's unused key splits, before)."""
    graph = check_linen_classifier(LinenLSTM(), (2, 7, 4))
    assert graph.op_counts()["dot_general"] >= 7 * 2, graph.op_counts()  # a recurrent GEMM per step, and its gradient


def test_flax_linen_batch_stats_update_left_out_of_the_step_is_said():
    """flax.linen BatchNorm in train mode with ``mutable=["batch_stats"]`` inside the loss: the
    running statistics' update cannot leave a loss function; the trace says so (a warning and a
    note on the graph that ``sftctl compile`` prints) instead of pricing silently without it."""
    from sftctl.errors import SftctlWarning

    class BN(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))).mean()

    model, x = BN(), jnp.ones((4, 3))
    variables = model.init(jax.random.PRNGKey(0), x)

    def loss_fn(p, batch):
        out, _updates = model.apply({"params": p, "batch_stats": variables["batch_stats"]}, batch,
                                    mutable=["batch_stats"])
        return out

    with pytest.warns(SftctlWarning, match=r"apply\(mutable=\['batch_stats'\]\) in the loss"):
        graph, meta = jax_frontend.trace_step(loss_fn, variables["params"], x)
    notes = [n.attrs["note"] for n in graph.nodes if "note" in n.attrs]
    assert len(notes) == 1 and "not part of the traced step" in notes[0], notes
