"""Attention as one op: every form of F.scaled_dot_product_attention lowers to the IR's
``attention`` / ``attention_grad`` ops, the float64 interpreter reproduces torch's loss and
gradients, fusion costs it as flash attention (FLOPs, bytes) and liveness keeps no S x S scores.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from stepcheck import assert_step_matches  # noqa: E402

from sftctl.compiler.frontends import torch as torch_frontend  # noqa: E402
from sftctl.compiler.fusion import causal_fraction, fuse  # noqa: E402
from sftctl.compiler.memory import peak_memory  # noqa: E402


class Attn(nn.Module):
    """One attention layer: q/k/v projections (``kv_heads`` K/V heads), SDPA, output projection."""

    def __init__(self, d=16, heads=4, kv_heads=4, dv=None):
        super().__init__()
        self.h, self.kvh, self.hd = heads, kv_heads, d // heads
        self.dv = dv or self.hd
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, kv_heads * self.hd)
        self.v = nn.Linear(d, kv_heads * self.dv)
        self.o = nn.Linear(heads * self.dv, d)

    def forward(self, x, **sdpa):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k(x).view(B, T, self.kvh, self.hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.kvh, self.dv).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, **sdpa)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


def _loss(sdpa_kw):
    def loss_fn(model, batch):
        kw = dict(sdpa_kw)
        if "mask" in batch:
            kw["attn_mask"] = batch["mask"]
        return (model(batch["x"], **kw) ** 2).mean()
    return loss_fn


def _forms():
    gen = torch.Generator().manual_seed(0)
    B, T = 2, 7
    bool_mask = torch.rand(B, 1, T, T, generator=gen) > 0.4
    bool_mask[..., 0] = True  # every row keeps a key (torch's math kernel gives NaN-free 0 otherwise)
    float_mask = torch.randn(T, T, generator=gen)  # 2-D, broadcast over batch and heads
    return {
        "plain": (dict(heads=4, kv_heads=4), {}, None),
        "causal": (dict(heads=4, kv_heads=4), {"is_causal": True}, None),
        "bool mask": (dict(heads=4, kv_heads=4), {}, bool_mask),
        "float mask": (dict(heads=4, kv_heads=4), {}, float_mask),
        "gqa causal scale": (dict(heads=4, kv_heads=2), {"is_causal": True, "enable_gqa": True, "scale": 0.3}, None),
        "gqa bool mask": (dict(heads=4, kv_heads=1), {"enable_gqa": True}, bool_mask),
        "dv != d": (dict(heads=2, kv_heads=2, dv=3), {"is_causal": True}, None),
    }


@pytest.mark.parametrize("form", list(_forms()))
def test_sdpa_form_matches_torch_float64(form):
    cfg, sdpa_kw, mask = _forms()[form]
    torch.manual_seed(hash(form) % 1000)
    model = Attn(**cfg)
    batch = {"x": torch.randn(2, 7, 16)}
    if mask is not None:
        batch["mask"] = mask
    graph, _ = assert_step_matches(model, batch, _loss(sdpa_kw))
    ops = graph.op_counts()
    assert ops.get("attention") == 1 and ops.get("attention_grad") == 3
    att = next(n for n in graph.nodes if n.op == "attention")
    assert graph.nodes[att.inputs[1]].type.shape[1] == cfg["kv_heads"]  # K at its own head count
    assert att.attrs["causal"] == bool(sdpa_kw.get("is_causal"))


def test_sdpa_three_dim_and_fully_masked_rows():
    """(N, L, D) inputs, and a bool mask with a row that keeps nothing: torch gives 0 there, so does the op."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(8, 24)

        def forward(self, x, mask):
            q, k, v = self.w(x).chunk(3, dim=-1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    torch.manual_seed(1)
    mask = torch.rand(5, 5) > 0.5
    mask[2] = False
    mask[0, 0] = True
    out = M()(torch.randn(3, 5, 8), mask)
    assert torch.isfinite(out).all() and (out[:, 2] == 0).all()  # what torch does
    assert_step_matches(M(), {"x": torch.randn(3, 5, 8), "mask": mask},
                        lambda m, b: (m(b["x"], b["mask"]) ** 2).sum())


def _fake_attn_graph(B=2, T=256, d=512, heads=8, kv_heads=8, dtype=None, **sdpa):
    with torch.device("meta"):
        model = Attn(d=d, heads=heads, kv_heads=kv_heads)
    x = torch.empty(B, T, d, device="meta")
    return torch_frontend.trace_step(model, {"x": x}, _loss(sdpa), autocast_dtype=dtype)


def test_attention_kernels_cost_flash_attention():
    """Fusion: one forward and one backward attention kernel with flash attention's FLOPs and bytes."""
    B, T, d, H, KVH = 2, 256, 512, 8, 2
    graph, _ = _fake_attn_graph(B, T, d, H, KVH, dtype="bfloat16", is_causal=True, enable_gqa=True)
    kernels = fuse(graph)
    attn = [k for k in kernels if k.kind == "attention"]
    assert [k.attention["direction"] for k in attn] == ["forward", "backward"]
    D = d // H
    frac = causal_fraction(T, T)
    assert frac == pytest.approx((T + 1) / (2 * T))
    fwd, bwd = attn
    assert fwd.flops == pytest.approx(4 * B * H * T * T * D * frac)
    assert bwd.flops == pytest.approx(10 * B * H * T * T * D * frac)
    q_bytes = B * T * d * 2
    kv_bytes = B * T * KVH * D * 2  # GQA: K and V read once per kv head
    lse_bytes = B * H * T * 4
    assert fwd.bytes_read == q_bytes + 2 * kv_bytes
    assert fwd.bytes_written == q_bytes + lse_bytes  # O and the LSE
    assert bwd.bytes_read == q_bytes + 2 * kv_bytes + q_bytes + q_bytes + lse_bytes  # Q K V O dO LSE
    assert bwd.bytes_written == q_bytes + 2 * kv_bytes  # dQ dK dV
    # no tensor of the graph is a T x T score matrix
    assert not any(n.type.shape[-2:] == (T, T) for n in graph.nodes)


def test_sdpa_and_hand_written_attention_differ_in_memory():
    """Hand-written attention keeps its B x H x T x T scores for backward; SDPA keeps O and the LSE."""
    B, T, d, H = 2, 512, 256, 8

    class Eager(Attn):
        def forward(self, x, **_):
            Bq, Tq, _ = x.shape
            q = self.q(x).view(Bq, Tq, self.h, self.hd).transpose(1, 2)
            k = self.k(x).view(Bq, Tq, self.kvh, self.hd).transpose(1, 2)
            v = self.v(x).view(Bq, Tq, self.kvh, self.hd).transpose(1, 2)
            p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.hd), dim=-1)
            return self.o((p @ v).transpose(1, 2).reshape(Bq, Tq, -1))

    x = torch.empty(B, T, d, device="meta")
    peaks = {}
    for name, cls in (("sdpa", Attn), ("eager", Eager)):
        with torch.device("meta"):
            model = cls(d=d, heads=H, kv_heads=H)
        graph, _ = torch_frontend.trace_step(model, {"x": x}, _loss({}))
        peaks[name] = peak_memory(graph, fuse(graph)).transient_peak_bytes
    scores = B * H * T * T * 4
    assert peaks["eager"] - peaks["sdpa"] >= scores  # at least one fp32 score matrix saved
    assert peaks["sdpa"] < scores


def test_tinyllama_2x2048_bf16_fits_40gib():
    """TinyLlama-1.1B (HF config, random init on meta) at 2 x 2048 bf16: predicted peak < 40 GiB
    (62 GiB with materialized attention scores)."""
    transformers = pytest.importorskip("transformers")

    cfg = transformers.LlamaConfig(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                                   num_key_value_heads=4, intermediate_size=5632, vocab_size=32000,
                                   max_position_embeddings=2048, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    model.train()
    ids = torch.zeros(2, 2048, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    graph, _ = torch_frontend.trace_step(model, batch, lambda m, b: m(**b).loss, autocast_dtype="bfloat16")
    assert graph.op_counts()["attention"] == 22
    peak = peak_memory(graph, fuse(graph))  # what compile_graph reports, without the schedule search
    gib = peak.total_bytes / 2**30
    print(f"TinyLlama 2x2048 bf16 predicted peak {gib:.1f} GiB")
    assert gib < 40
    assert peak.total_bytes > 3 * 4 * 1.1e9  # parameters + AdamW state alone (fp32)


# ------------------------------------------------------------------------------------------------
# JAX: jax.nn.dot_product_attention(implementation="cudnn") lowers to the same op
# ------------------------------------------------------------------------------------------------


def _jax_attention_ref(q, k, v, mask, bias, causal, scale):
    """float64 attention written out in jax.numpy ([B, L, N, H] layout, GQA by head groups)."""
    import jax.numpy as jnp

    N, K = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    s = jnp.einsum("blnh,bsnh->bnls", q, k) * scale
    if bias is not None:
        s = s + bias
    keep = jnp.ones(s.shape, bool)
    if mask is not None:
        keep = keep & mask
    if causal:
        keep = keep & jnp.tril(jnp.ones(s.shape[-2:], bool))
    s = jnp.where(keep, s, -jnp.inf)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return jnp.einsum("bnls,bsnh->blnh", p, v)


@pytest.mark.parametrize("kind", ["causal", "mask", "bias"])
def test_jax_dot_product_attention_cudnn_lowers_to_attention_op(kind):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from sftctl.compiler import interpreter
    from sftctl.compiler.frontends.jax import trace_step as jax_trace_step

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        B, T, D, N, K, Hd = 2, 6, 16, 4, 2, 4

        def make_loss(impl):
            def loss(p, batch):
                x = batch["x"]
                q = (x @ p["wq"]).reshape(B, T, N, Hd)
                k = (x @ p["wk"]).reshape(B, T, K, Hd)
                v = (x @ p["wv"]).reshape(B, T, K, Hd)
                mask = batch["mask"] if kind == "mask" else None
                bias = batch["bias"] if kind == "bias" else None
                if impl == "ref":
                    o = _jax_attention_ref(q, k, v, mask, bias, kind == "causal", 0.3)
                else:
                    o = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=kind == "causal",
                                                     scale=0.3, implementation=impl)
                return jnp.mean((o.reshape(B, T, N * Hd) @ p["wo"]) ** 2)
            return loss

        rng = np.random.default_rng(0)
        params = {"wq": rng.normal(size=(D, N * Hd)), "wk": rng.normal(size=(D, K * Hd)),
                  "wv": rng.normal(size=(D, K * Hd)), "wo": rng.normal(size=(N * Hd, D))}
        mask = rng.random((B, 1, T, T)) > 0.4
        mask[..., 0] = True
        batch = {"x": rng.normal(size=(B, T, D)), "mask": mask, "bias": rng.normal(size=(1, N, T, T))}
        graph, meta = jax_trace_step(make_loss("cudnn"), params, batch, betas=(0.5, 0.999), weight_decay=0.0)
        assert graph.op_counts()["attention"] == 1 and graph.op_counts()["attention_grad"] == 3
        att = next(n for n in graph.nodes if n.op == "attention")
        assert graph.nodes[att.inputs[1]].type.shape == (B, K, T, Hd)  # K at its own 2 heads
        feed = {meta["params"][n]: params[n] for n in meta["param_names"]}
        feed.update({i: np.zeros(graph.nodes[i].type.shape) for i in meta["opt_state"].values()})
        feed[meta["step"]] = 1.0
        for i, name in zip(meta["batch"], meta["batch_names"]):
            feed[i] = batch[name.split(".")[-1]]
        out = dict(zip(graph.output_roles, interpreter.run(graph, feed)))
        ref_loss, ref_grads = jax.value_and_grad(make_loss("ref"))(params, batch)
        np.testing.assert_allclose(out["loss"], ref_loss, rtol=1e-12)
        for n in params:
            np.testing.assert_allclose(2 * out[f"opt_state:{n}.exp_avg"], ref_grads[n], rtol=1e-9,
                                       atol=1e-12 * float(np.abs(ref_grads[n]).max()))
        # the XLA implementation (float32 softmax inside) agrees to float32's precision, and stays materialized
        xla_graph, _ = jax_trace_step(make_loss("xla"), params, batch)
        assert "attention" not in xla_graph.op_counts()
        np.testing.assert_allclose(out["loss"], jax.value_and_grad(make_loss("xla"))(params, batch)[0], rtol=1e-6)
    finally:
        jax.config.update("jax_enable_x64", previous)
