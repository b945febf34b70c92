"""Attention priced by the implementation the job runs (issue 35 item 4): each implementation's
published point, the detection (HF ``attn_implementation``, torch SDPA's choice per GPU and torch
version, the spec's ``model.attention``), long sequences slower where the figures say so, and
interpolation monotone in sequence length."""

from __future__ import annotations

import pytest

from sftctl.compiler import attention
from sftctl.compiler.target import load_target

H100_PEAK = 989.4e12  # the dense bf16 peak the FlashAttention-3 paper's H100 SXM5 figures divide by
FA2_A100 = {"forward": 0.73, "backward": 0.63}  # FlashAttention-2's plateau on A100 (its abstract)


@pytest.mark.parametrize("impl, acc, direction, causal, hd, seq, tflops", [
    # FlashAttention-3 paper (arXiv:2407.08608) Figures 5 and 6, H100 80GB SXM5, BF16, bar labels
    ("flash2", "H100", "forward", False, 128, 2048, 362),
    ("flash2", "H100", "backward", False, 128, 8192, 318),
    ("flash3", "H100", "forward", True, 128, 4096, 579),
    ("flash3", "H100", "backward", False, 128, 8192, 559),
    ("flash3", "H100", "forward", False, 64, 1024, 392),
    ("cudnn", "H100", "forward", True, 128, 2048, 484),
    ("math", "H100", "forward", False, 128, 4096, 133),
    ("math", "H100", "forward", True, 64, 2048, 18),
    ("math", "H100", "backward", False, 64, 2048, 88),
])
def test_each_implementation_reproduces_its_published_point(impl, acc, direction, causal, hd, seq, tflops):
    """Within 0.1 %: the table's own bar label, not a neighbour's or another kernel's."""
    eff = attention.efficiency(acc, direction, causal, hd, seq, impl)
    assert eff * H100_PEAK / 1e12 == pytest.approx(tflops, rel=1e-3)


def test_relative_implementations_are_their_stated_share_of_flashattention2():
    """efficient / xformers: half of FlashAttention-2 (FlashAttention-1's level, the FA2 paper);
    FlexAttention 0.90 forward / 0.85 backward (PyTorch's FlexAttention blog); llm-foundry's
    Triton kernel 1 / 1.8 (the FA2 paper's 1.3-2.5x); on an A100 at FlashAttention-2's plateau."""
    for impl, fwd, bwd in (("efficient", 0.5, 0.5), ("xformers", 0.5, 0.5), ("flex", 0.9, 0.85),
                           ("triton", 0.55, 0.55)):
        assert attention.efficiency("A100-80GB", "forward", False, 128, 16384, impl) == pytest.approx(fwd * 0.73)
        assert attention.efficiency("A100-80GB", "backward", False, 128, 16384, impl) == pytest.approx(bwd * 0.63)
    # the H100 memory-efficient path: half of FlashAttention-2's 362 TFLOP/s (hd 128, 2k)
    assert attention.efficiency("H100", "forward", False, 128, 2048, "efficient") * H100_PEAK / 1e12 == \
        pytest.approx(181, rel=1e-3)
    # below sm80 every flash-like kernel is the memory-efficient one, at the stated flat 0.35 / 0.25
    assert attention.efficiency("T4", "forward", True, 64, 1024, "flash2") == pytest.approx(0.35)
    assert attention.efficiency("V100", "backward", True, 64, 1024, "triton") == pytest.approx(0.25)


def test_the_math_path_transfers_to_an_a100_by_its_ratio_to_flashattention2():
    """SDPA's math path on an A100: math / FlashAttention-2 on H100 (133 / 368 at hd 128, 4k)
    times FlashAttention-2's A100 rate there."""
    fa2 = attention.efficiency("A100-80GB", "forward", False, 128, 4096, "flash2")
    assert attention.efficiency("A100-80GB", "forward", False, 128, 4096, "math") == pytest.approx(fa2 * 133 / 368)


def test_end_to_end_kernel_time_is_the_published_rate():
    """A big FlashAttention-3 forward on H100 (hd 128, causal, 4k): FLOPs / seconds within 2 % of
    the figure's 579 TFLOP/s (the launch and fill latency is the rest)."""
    from sftctl.compiler.fusion import attention_flops

    t = load_target("H100")
    shape = attention.record_shape({"kernel": "attention", "batch": 16, "heads": 32, "q_len": 4096,
                                    "head_dim": 128, "causal": True, "direction": "forward"})
    flops = attention_flops(shape)
    fa3 = attention.attention_time_s(dict(shape, implementation="flash3"), t)
    fa2 = attention.attention_time_s(dict(shape, implementation="flash2"), t)
    assert flops / fa3 / 1e12 == pytest.approx(579 * 4097 / 8192 / (4096 / 8192) * 1.0, rel=0.02)
    assert fa2 / fa3 == pytest.approx(579 / 319, rel=0.02)


def test_sdpa_choice_per_gpu_dtype_mask_and_torch_version():
    """torch's SDPA: cuDNN on sm90 from torch 2.11, FlashAttention-2 before it and on sm80-89,
    the memory-efficient kernel for float32, a float bias (ALiBi through SDPA), a head dim
    over 256 and below sm80; AOTriton on AMD."""
    r = attention.resolve
    assert r("auto", "H100", torch_version=(2, 11)) == "cudnn"
    assert r("auto", "H200", torch_version=(2, 3)) == "flash2"
    assert r(None, "A100-80GB") == "flash2"
    assert r("sdpa", "H100", torch_version=(2, 13), bias=True) == "efficient"
    assert r("auto", "A100-40GB", dtype="float32") == "efficient"
    assert r("auto", "A100-80GB", head_dim=512) == "efficient"
    assert r("auto", "T4") == "efficient"
    assert r("auto", "MI300X") == "aotriton"
    # a named kernel the GPU cannot run falls back as its user would
    assert r("flash3", "A100-80GB") == "flash2"
    assert r("cudnn", "L4") == "flash2"
    assert r("flash2", "V100") == "efficient"
    assert r("math", "T4") == "math"


def test_long_sequences_are_slower_than_before_where_the_figures_say_so():
    """Before, every H100 SDPA call was priced as cuDNN, one with an ALiBi bias too. At 32k tokens (hd 128,
    causal; the tables clamp at their 16k bar): torch 2.3 runs FlashAttention-2, 335 TFLOP/s where
    cuDNN gave 539, and ALiBi through SDPA (a float mask) runs the memory-efficient kernel at half
    of FlashAttention-2 (A100: 0.5 x its causal 16k rate)."""
    old = 539 / 989.4
    new = attention.efficiency("H100", "forward", True, 128, 32768, torch_version=(2, 3))
    assert new == pytest.approx(335 / 989.4, rel=1e-6)
    assert old / new == pytest.approx(1.61, rel=0.01)
    fa2 = attention.efficiency("A100-80GB", "forward", True, 128, 32768)
    alibi_sdpa = attention.efficiency("A100-80GB", "forward", True, 128, 32768, bias=True)
    assert alibi_sdpa == pytest.approx(0.5 * fa2)
    assert fa2 == pytest.approx(0.73 * 335 / 370, rel=1e-6)


@pytest.mark.parametrize("impl", ["flash2", "flash3", "efficient", "flex", "triton", "math", "xformers"])
@pytest.mark.parametrize("acc", ["H100", "A100-80GB"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_interpolation_is_monotone_in_sequence_length(impl, acc, direction):
    """Non-decreasing from 256 to 64k tokens in quarter-octave steps, causal and not, hd 64/96/128
    (cuDNN is left out: its published hd-128 forward falls from 617 at 2k to 595 at 16k; so is the
    math path's causal backward, derived as backward x causal / non-causal forward, whose published
    forward ratio falls with length: causal flat at 18 TFLOP/s while non-causal rises 67 -> 73)."""
    for causal in (False, True):
        if impl == "math" and causal and direction == "backward":
            continue
        for hd in (64, 96, 128):
            seqs = [int(256 * 2 ** (i / 4)) for i in range(33)]
            rates = [attention.efficiency(acc, direction, causal, hd, s, impl) for s in seqs]
            assert all(b >= a - 1e-12 for a, b in zip(rates, rates[1:])), (causal, hd, rates)
            assert rates[-1] > rates[0]


def test_bad_implementation_is_refused_with_one_line():
    with pytest.raises(ValueError, match=r"^model\.attention: unknown attention implementation 'flash4'; use one of auto, "):
        attention.check_implementation("flash4")
    with pytest.raises(ValueError, match="torch version must be major.minor"):
        attention.with_implementation(_graph(), "auto", "two")


def test_spec_model_attention_is_validated_with_one_line(tmp_path):
    from sftctl.errors import SpecError
    from sftctl.spec import load_spec

    (tmp_path / "m.py").write_text("def build(batch_size, dtype):\n    raise NotImplementedError\n")
    body = "name: demo\nrun: echo\nmodel:\n  entrypoint: m.py:build\n  attention: {}\n"
    (tmp_path / "ok.yaml").write_text(body.format("flash3"))
    assert load_spec(tmp_path / "ok.yaml").model.attention == "flash3"
    (tmp_path / "bad.yaml").write_text(body.format("flash4"))
    with pytest.raises(SpecError) as e:
        load_spec(tmp_path / "bad.yaml")
    msg = str(e.value)
    assert "model.attention" in msg and "'flash4'" in msg and "flash2" in msg and "\n" not in msg.strip()
    (tmp_path / "default.yaml").write_text("name: demo\nrun: echo\nmodel:\n  entrypoint: m.py:build\n")
    assert load_spec(tmp_path / "default.yaml").model.attention == "auto"


def _graph(hf_impl: str | None = None, T: int = 256, mask: str | None = None):
    """One traced SDPA layer (hd 64, causal, bf16, meta tensors); ``hf_impl`` set as HF's
    ``config._attn_implementation``; ``mask``: ``float`` (an ALiBi-like additive bias [1, H, T, T],
    not causal) or ``bool`` (a padding mask [B, 1, T, T])."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from sftctl.compiler.frontends import torch as torch_frontend

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(512, 3 * 512)
            if hf_impl is not None:
                self.config = type("Config", (), {"_attn_implementation": hf_impl})()

        def forward(self, x):
            B, L, _ = x.shape
            q, k, v = self.qkv(x).view(B, L, 3, 8, 64).permute(2, 0, 3, 1, 4)
            if mask == "float":
                bias = torch.zeros(1, 8, L, L, device=x.device, dtype=q.dtype)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            if mask == "bool":
                keep = torch.ones(B, 1, L, L, device=x.device, dtype=torch.bool)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.device("meta"):
        model = Layer()
    x = torch.empty(2, T, 512, device="meta")
    graph, _ = torch_frontend.trace_step(model, {"x": x}, lambda m, b: (m(b["x"]) ** 2).mean(),
                                         autocast_dtype="bfloat16")
    return graph


def _attention_kernels(graph):
    from sftctl.compiler.fusion import fuse

    return [k for k in fuse(graph) if k.kind == "attention"]


def test_hf_attn_implementation_and_the_spec_choose_the_kernel():
    """HF's config._attn_implementation is stamped on the attention nodes (flash_attention_2 ->
    flash2, sdpa -> auto); the spec's model.attention replaces it; each prices differently."""
    plain, fa2, sdpa = _graph(), _graph("flash_attention_2", T=2048), _graph("sdpa", T=2048)
    assert {k.attention["implementation"] for k in _attention_kernels(plain)} == {"auto"}
    assert {k.attention["implementation"] for k in _attention_kernels(fa2)} == {"flash2"}
    assert {k.attention["implementation"] for k in _attention_kernels(sdpa)} == {"auto"}
    assert attention.HF_IMPLEMENTATIONS["flex_attention"] == "flex"
    fa3 = attention.with_implementation(fa2, "flash3", "2.3")
    assert {(k.attention["implementation"], k.attention["torch"]) for k in _attention_kernels(fa3)} == {("flash3", "2.3")}
    assert attention.with_implementation(fa2, "auto") is fa2  # auto keeps what the model said
    assert {k.attention["implementation"] for k in _attention_kernels(fa2)} == {"flash2"}  # a copy
    t = load_target("H100")
    fwd = {name: attention.attention_time_s(_attention_kernels(g)[0].attention, t)
           for name, g in (("fa2", fa2), ("fa3", fa3), ("sdpa", sdpa))}
    # hd 64, causal, 2k: FlashAttention-2 262, cuDNN 334, FlashAttention-3 371 TFLOP/s (FA3 paper)
    flops = _attention_kernels(fa2)[0].flops
    assert attention._installed_torch() >= (2, 11)  # SDPA is cuDNN on H100
    for name, tflops in (("fa2", 262), ("sdpa", 334), ("fa3", 371)):
        fixed = attention.attention_time_s(dict(_attention_kernels(fa2)[0].attention, batch=0), t)
        assert flops / (fwd[name] - fixed) / 1e12 == pytest.approx(tflops, rel=0.01), name


def test_a_float_bias_runs_the_memory_efficient_kernel_and_a_boolean_mask_does_not():
    """ALiBi (or any additive float bias) through SDPA's attn_mask rules out flash and cuDNN: the
    A100 forward at 2k runs at half of FlashAttention-2's rate; a boolean padding mask keeps flash
    (HF drops an all-ones one before SDPA)."""
    t = load_target("A100-80GB")
    (fb, *_), (bm, *_) = _attention_kernels(_graph(T=2048, mask="float")), _attention_kernels(_graph(T=2048, mask="bool"))
    assert fb.attention["bias"] is True and bm.attention["bias"] is False
    assert fb.attention["masked"] and bm.attention["masked"]
    fixed = attention.attention_time_s(dict(fb.attention, batch=0), t)
    rate = {k: fb.flops / (attention.attention_time_s(a.attention, t) - fixed)
            for k, a in (("bias", fb), ("bool", bm))}
    assert rate["bool"] / 312e12 == pytest.approx(attention.efficiency("A100-80GB", "forward", False, 64, 2048))
    assert rate["bias"] / rate["bool"] == pytest.approx(0.5)


def _trace_layer(call, T: int = 1024):
    """One traced layer whose attention is ``call(q, k, v)`` on [B, H, L, D] (hd 64, bf16, meta)."""
    torch = pytest.importorskip("torch")
    from sftctl.compiler.frontends import torch as torch_frontend

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(512, 3 * 512)

        def forward(self, x):
            B, L, _ = x.shape
            q, k, v = self.qkv(x).view(B, L, 3, 8, 64).permute(2, 0, 3, 1, 4)
            return call(q, k, v)

    with torch.device("meta"):
        model = Layer()
    graph, _ = torch_frontend.trace_step(model, {"x": torch.empty(2, T, 512, device="meta")},
                                         lambda m, b: (m(b["x"]) ** 2).mean(), autocast_dtype="bfloat16")
    return graph


def test_the_models_own_flash_attn_func_call_is_flashattention2_with_its_alibi(monkeypatch):
    """A model that did ``from flash_attn import flash_attn_func`` (a stand-in module here: the real
    one needs CUDA) traces as one attention kernel priced as FlashAttention-2, ALiBi noted, on
    an H100 with torch 2.13 (where SDPA would be cuDNN)."""
    import sys
    import types

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, alibi_slopes=None):
        raise RuntimeError("the real kernel: CUDA only")

    fa = types.ModuleType("flash_attn")
    fa.flash_attn_func = flash_attn_func
    user = types.ModuleType("user_model")
    user.flash_attn_func = flash_attn_func  # the user's `from flash_attn import flash_attn_func`
    monkeypatch.setitem(sys.modules, "flash_attn", fa)
    monkeypatch.setitem(sys.modules, "user_model", user)
    slopes = object()
    graph = _trace_layer(lambda q, k, v: user.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, alibi_slopes=slopes).transpose(1, 2))
    assert user.flash_attn_func is flash_attn_func  # put back after tracing
    kernels = _attention_kernels(graph)
    assert [(k.attention["direction"], k.attention["implementation"], k.attention["alibi"], k.attention["causal"])
            for k in kernels] == [("forward", "flash2", True, True), ("backward", "flash2", True, True)]
    t = load_target("H100")
    fixed = attention.attention_time_s(dict(kernels[0].attention, batch=0), t)
    rate = kernels[0].flops / (attention.attention_time_s(kernels[0].attention, t) - fixed) / 1e12
    assert rate == pytest.approx(229, rel=0.01)  # FA2, hd 64, causal, 1k (FA3 paper); cuDNN would be 288


def test_flex_attention_and_xformers_calls_are_their_own_kernels(monkeypatch):
    """torch's flex_attention (bound by name, as models import it) traces as a FlexAttention kernel
    (0.9 x FlashAttention-2 forward on an A100), causal when its block mask's mask_mod says so;
    xformers' memory_efficient_attention with a LowerTriangularMask as a causal xformers kernel."""
    import sys
    import types

    from torch.nn.attention.flex_attention import flex_attention

    user = types.ModuleType("user_flex")
    user.flex_attention = flex_attention
    monkeypatch.setitem(sys.modules, "user_flex", user)
    causal_mask = types.SimpleNamespace(mask_mod=type("m", (), {"__name__": "causal_mask"})())
    graph = _trace_layer(lambda q, k, v: user.flex_attention(q, k, v, block_mask=causal_mask))
    assert user.flex_attention is flex_attention
    (fwd, bwd) = _attention_kernels(graph)
    assert (fwd.attention["implementation"], fwd.attention["causal"], bwd.attention["implementation"]) == \
        ("flex", True, "flex")
    t = load_target("A100-80GB")
    fixed = attention.attention_time_s(dict(fwd.attention, batch=0), t)
    rate = fwd.flops / (attention.attention_time_s(fwd.attention, t) - fixed)
    assert rate == pytest.approx(0.9 * attention.efficiency("A100-80GB", "forward", True, 64, 1024) * 312e12)

    class LowerTriangularMask:
        pass

    def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None):
        raise RuntimeError("the real kernel")

    ops = types.ModuleType("xformers.ops")
    ops.memory_efficient_attention = memory_efficient_attention
    monkeypatch.setitem(sys.modules, "xformers.ops", ops)
    graph = _trace_layer(lambda q, k, v: ops.memory_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias=LowerTriangularMask()).transpose(1, 2))
    assert {(k.attention["implementation"], k.attention["causal"]) for k in _attention_kernels(graph)} == \
        {("xformers", True)}
