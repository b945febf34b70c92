"""MoE in the zoo (issue 22): transformers 5's Mixtral and Qwen3-MoE (tiny configs, random init)
on their default ``grouped_mm`` experts path, and a Mixtral-style layer written by hand that
dispatches through ``torch.where(expert_mask[e])`` (nonzero).

* the grouped path traced in fake mode under bfloat16 autocast with float32 master weights: it
  failed with "Expected inputs of BF16 type" (transformers casts the tokens to the weights' dtype;
  torch's fake grouped_mm takes bfloat16 only); the expert GEMMs keep the dtype transformers chose;
* float64 loss and gradients equal torch's (the reference runs transformers' ``batched_mm``
  experts, the same math: CPU grouped_mm has no float64 kernel) with ``expert_capacity`` = E;
* at the default capacity each expert's GEMM is priced at the uniform top-k load, T * k / E rows.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from stepcheck import assert_step_matches, interpreted_loss_and_grads, torch_loss_and_grads  # noqa: E402

from sftctl.compiler.frontends import torch as torch_frontend  # noqa: E402

V, B, T, E, K = 97, 2, 12, 4, 2


def _mixtral():
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=V, max_position_embeddings=64,
                                     num_local_experts=E, num_experts_per_tok=K, attn_implementation="sdpa")
    return transformers.MixtralForCausalLM(cfg)


def _qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      vocab_size=V, max_position_embeddings=64, num_experts=E, num_experts_per_tok=K,
                                      decoder_sparse_step=1, attn_implementation="sdpa")
    return transformers.Qwen3MoeForCausalLM(cfg)


def _batch():
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _loss(model, batch):
    return model(**batch).loss


def _expert_gemm_rows(graph):
    """Rows per expert of the forward grouped GEMMs (batched dot_generals with E batches)."""
    return sorted({n.type.shape[1] for n in graph.nodes if n.op == "dot_general" and len(n.type.shape) == 3
                   and n.type.shape[0] == E and n.attrs.get("phase") == "forward"})


@pytest.mark.parametrize("build", [_mixtral, _qwen3_moe], ids=["mixtral", "qwen3_moe"])
def test_hf_moe_grouped_mm_matches_torch_in_float64(build):
    torch.manual_seed(0)
    model = build()
    assert model.config._experts_implementation == "grouped_mm"
    loss, grads, graph, _ = interpreted_loss_and_grads(model, _batch(), _loss, fake=True, expert_capacity=E,
                                                       interp_dtype=None)
    model.config._experts_implementation = "batched_mm"
    ref, ref_grads = torch_loss_and_grads(model, _batch(), _loss)
    assert abs(loss - ref) <= 1e-7 * abs(ref)
    for name, g in ref_grads.items():  # float32 islands (RoPE, the loss) inside the float64 model
        np.testing.assert_allclose(grads[name], g, rtol=1e-5, atol=1e-5 * float(np.abs(g).max(initial=1e-30)),
                                   err_msg=name)
    assert _expert_gemm_rows(graph) == [B * T * K]  # capacity E: every routed row fits any expert


@pytest.mark.parametrize("build", [_mixtral, _qwen3_moe], ids=["mixtral", "qwen3_moe"])
def test_hf_moe_traces_under_bf16_autocast_priced_at_the_uniform_load(build):
    graph, _ = torch_frontend.trace_step(build(), _batch(), _loss, autocast_dtype="bfloat16")
    assert _expert_gemm_rows(graph) == [B * T * K // E]
    experts = [n for n in graph.nodes if n.op == "dot_general" and len(n.type.shape) == 3 and n.type.shape[0] == E]
    # transformers casts the tokens to the float32 master weights: the expert GEMMs run in float32
    assert experts and {n.type.dtype for n in experts} == {"float32"}
    attn = [n for n in graph.nodes if n.op == "dot_general" and n.type.dtype == "bfloat16"]
    assert attn  # the dense projections stay under autocast


class _LoopMoE(torch.nn.Module):
    """A Mixtral-style sparse layer as research code writes it: softmax router, top-k, and a loop
    over experts dispatching with ``torch.where(expert_mask[e])`` and combining with ``index_add_``."""

    def __init__(self, d=8, experts=E, k=K):
        super().__init__()
        self.k = k
        self.gate = torch.nn.Linear(d, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.SiLU(),
                                                               torch.nn.Linear(16, d)) for _ in range(experts))

    def forward(self, x):
        probs = torch.softmax(self.gate(x), dim=-1)
        w, sel = torch.topk(probs, self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        expert_mask = torch.nn.functional.one_hot(sel, len(self.experts)).permute(2, 1, 0)  # E, k, T
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            slot, tok = torch.where(expert_mask[e])
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return (out + x).square().mean()


def test_handwritten_nonzero_dispatch_matches_torch_and_is_bounded_at_the_uniform_load():
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(4))
    assert_step_matches(_LoopMoE(), x, lambda m, b: m(b), fake=True, expert_capacity=E)
    graph, _ = torch_frontend.trace_step(_LoopMoE(), x, lambda m, b: m(b))
    rows = sorted({n.type.shape[0] for n in graph.nodes if n.op == "dot_general" and n.attrs.get("phase") == "forward"
                   and n.attrs.get("module", "").startswith("experts.")})
    assert rows == [10 * K // E]  # 5 of the 20 routed slots per expert
    said = [n.attrs["assumption"] for n in graph.nodes if "assumption" in n.attrs]
    assert len(said) == E and all("MoE dispatch at" in s and "5 of 20 routed slots" in s for s in said), said


_TINY_MIXTRAL = """import torch
import transformers


def build(batch_size=2, dtype="float32"):
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2)
    ids = torch.randint(0, 97, (batch_size, 16))
    return transformers.MixtralForCausalLM(cfg), {"input_ids": ids, "labels": ids}, lambda m, b: m(**b).loss
"""


def test_plan_of_an_moe_names_expert_parallelism_as_not_supported(tmp_path, home):
    """A Mixtral-shaped spec plans (FSDP/DDP over its experts like any weight) and each priced row
    says that expert parallelism is not modelled (sftctl plan prints it as a note)."""
    from sftctl import api

    (tmp_path / "model.py").write_text(_TINY_MIXTRAL)
    spec = tmp_path / "job.yaml"
    spec.write_text("name: mixtral\nmodel: {entrypoint: model.py:build, batch_size: 2}\nrun: echo hi\n")
    plan = api.plan(str(spec))
    note = plan.chosen.note or ""
    assert "MoE: 4 experts" in note and "16 rows per expert" in note, note  # 2 x 16 tokens x top-2 / 4
    assert "expert parallelism (all-to-all dispatch) is not yet supported" in note


def test_eager_experts_loop_is_untraceable_with_the_fix_named():
    """transformers' eager experts loop iterates over ``expert_hit.nonzero()``: a trip count the
    trace cannot know. The refusal names the library's line and the experts implementation to use."""
    model = _mixtral()
    model.config._experts_implementation = "eager"
    with pytest.raises(NotImplementedError) as e:
        torch_frontend.trace_step(model, _batch(), _loss)
    msg = str(e.value)
    assert "modeling_mixtral.py:" in msg and "_experts_implementation = 'grouped_mm'" in msg, msg
