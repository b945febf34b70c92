"""The transformers zoo: tiny HF models (2 layers, small widths, random init, nothing downloaded)
called as Trainer calls them: padded batches with ``attention_mask``, ``labels`` with -100,
``model.train()`` with the configs' dropout on, GQA, RoPE, RMSNorm, SwiGLU, tied embeddings.

For each model and both ``attn_implementation="sdpa"`` and ``"eager"``:
* the step traces in fake mode with dropout on (random ops in the graph);
* with dropout off, the float64 interpreter reproduces torch's float64 loss and gradients (the
  interpreter honours the float32 islands transformers keeps inside a float64 model, RoPE and the
  causal-LM loss, so the tolerance is float32's: rtol 1e-5 plus 1e-5 of each gradient's scale);
* the GEMM FLOPs equal the analytic count (6 x tokens x linear weights, plus for eager the six
  attention products of 2 x B x T^2 x hidden each, for sdpa flash attention's 14 x B x T^2 x
  hidden per layer in attention kernels).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from stepcheck import assert_step_matches  # noqa: E402

from sftctl.compiler.frontends import torch as torch_frontend  # noqa: E402
from sftctl.compiler.fusion import _gemm_dims, fuse  # noqa: E402

V, B, T = 97, 2, 12
H, LAYERS, HEADS, KV_HEADS, INTER = 32, 2, 4, 2, 64
HD = H // HEADS


def _batch(token_types: bool = False) -> dict:
    """Two sequences, the second right-padded by 4 (mask 0, label -100)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -4:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if token_types:
        batch["token_type_ids"] = (torch.arange(T) >= T // 2).long().expand(B, T).clone()
    return batch


def _gpt2(impl, p):
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=H, n_head=HEADS, vocab_size=V, n_positions=32,
                                  resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, attn_implementation=impl,
                                  bos_token_id=0, eos_token_id=0)
    linear = LAYERS * 12 * H * H + V * H  # c_attn, c_proj, c_fc, mlp c_proj; tied lm_head
    return transformers.GPT2LMHeadModel(cfg), linear, 0


def _llama(impl, p):
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=V,
                                   max_position_embeddings=64, tie_word_embeddings=True, attention_dropout=p,
                                   attn_implementation=impl)
    kv = KV_HEADS * HD
    linear = LAYERS * (2 * H * H + 2 * H * kv + 3 * H * INTER) + V * H
    return transformers.LlamaForCausalLM(cfg), linear, 0  # RoPE's K=1 product is elementwise


def _qwen2(impl, p):
    cfg = transformers.Qwen2Config(hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=V,
                                   max_position_embeddings=64, tie_word_embeddings=False, attention_dropout=p,
                                   attn_implementation=impl)
    kv = KV_HEADS * HD
    linear = LAYERS * (2 * H * H + 2 * H * kv + 3 * H * INTER) + V * H
    return transformers.Qwen2ForCausalLM(cfg), linear, 0


def _bert(impl, p):
    cfg = transformers.BertConfig(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                  intermediate_size=INTER, vocab_size=V, max_position_embeddings=64,
                                  hidden_dropout_prob=p, attention_probs_dropout_prob=p, attn_implementation=impl)
    linear = LAYERS * (4 * H * H + 2 * H * INTER) + H * H + V * H  # + MLM transform and tied decoder
    return transformers.BertForMaskedLM(cfg), linear, 0


MODELS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert, "qwen2": _qwen2}


def _loss(model, batch):
    return model(**batch).loss


def _dot_flops(graph) -> float:
    return sum(2.0 * math.prod(_gemm_dims(graph, n)) for n in graph.nodes if n.op == "dot_general")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model_traces_and_matches_torch(name, impl):
    torch.manual_seed(0)
    batch = _batch(token_types=name == "bert")
    # as trained: train mode, the config's dropout on, fake tensors
    model, linear, extra = MODELS[name](impl, 0.1)
    graph, meta = torch_frontend.trace_step(model.train(), batch, _loss)
    ops = graph.op_counts()
    if impl == "sdpa":
        attn = [n for n in graph.nodes if n.op == "attention"]
        assert len(attn) == LAYERS and all(n.attrs["dropout_p"] == pytest.approx(0.1) for n in attn)
        assert ops["attention_grad"] == 3 * LAYERS
        if name in ("llama", "qwen2"):  # GQA: K and V stay at their own head count
            assert all(graph.nodes[n.inputs[1]].type.shape[1] in (KV_HEADS, HEADS) for n in attn)
    else:
        assert "attention" not in ops
    if name in ("gpt2", "bert") or impl == "eager":
        assert ops.get("rng_bernoulli", 0) > 0  # nn.Dropout modules / eager attention dropout

    # GEMM FLOPs: every linear forward + both gradients over all tokens
    tokens = B * T
    expected = 6 * tokens * linear + extra
    attn_flops = sum(k.flops for k in fuse(graph) if k.kind == "attention")
    if impl == "eager":
        expected += LAYERS * 6 * 2 * B * T * T * H
        assert attn_flops == 0
    else:
        # the traced mask is transformers' boolean causal mask and-ed with the batch's padding; the
        # frontend reads its values on this batch (7d1446f): the second sequence is padded, so SDPA
        # runs the combined mask over every tile (its memory-efficient kernel), not causal flash
        kept = [n.attrs["causal"] for n in graph.nodes if n.op == "attention"]
        assert kept == [False] * LAYERS
        scores = T * T
        assert attn_flops == pytest.approx(LAYERS * 14 * B * H * scores, rel=1e-12)
    assert _dot_flops(graph) == pytest.approx(expected, rel=1e-12)

    # numerics: dropout off, float64, interpreter vs torch
    model, _, _ = MODELS[name](impl, 0.0)
    assert_step_matches(model.train(), batch, _loss, fake=True, interp_dtype=None, rtol=1e-5, atol_rel=1e-5)


def test_llama_without_mask_uses_causal_attention_at_kv_heads():
    """No attention_mask: transformers calls SDPA with is_causal and enable_gqa, so the op keeps
    K/V at 2 heads and counts the causal half of the scores."""
    model, _, _ = _llama("sdpa", 0.0)
    batch = {k: v for k, v in _batch().items() if k != "attention_mask"}
    graph, _ = torch_frontend.trace_step(model.train(), batch, _loss)
    attn = [n for n in graph.nodes if n.op == "attention"]
    assert len(attn) == LAYERS and all(n.attrs["causal"] for n in attn)
    assert all(graph.nodes[n.inputs[1]].type.shape[1] == KV_HEADS for n in attn)
    kernels = [k for k in fuse(graph) if k.kind == "attention"]
    assert sum(k.flops for k in kernels) == pytest.approx(LAYERS * 14 * B * T * T * H * (T + 1) / (2 * T))
    fwd = next(k for k in kernels if k.attention["direction"] == "forward")
    assert fwd.bytes_read == 4 * B * T * (H + 2 * KV_HEADS * HD)  # fp32 q, k, v; K/V once per kv head


def _more():
    small = dict(hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 vocab_size=V, max_position_embeddings=64)
    T_ = transformers
    return {
        "mistral": lambda: T_.MistralForCausalLM(T_.MistralConfig(**small, num_key_value_heads=KV_HEADS, sliding_window=8)),
        "gemma": lambda: T_.GemmaForCausalLM(T_.GemmaConfig(**small, num_key_value_heads=KV_HEADS, head_dim=HD)),
        "qwen3": lambda: T_.Qwen3ForCausalLM(T_.Qwen3Config(**small, num_key_value_heads=KV_HEADS, head_dim=HD)),
        "phi": lambda: T_.PhiForCausalLM(T_.PhiConfig(**small)),
        "gpt_neox": lambda: T_.GPTNeoXForCausalLM(T_.GPTNeoXConfig(**small)),
        "opt": lambda: T_.OPTForCausalLM(T_.OPTConfig(hidden_size=H, ffn_dim=INTER, num_hidden_layers=LAYERS,
                                                      num_attention_heads=HEADS, vocab_size=V,
                                                      max_position_embeddings=64, word_embed_proj_dim=H)),
        "roberta": lambda: T_.RobertaForMaskedLM(T_.RobertaConfig(**{**small, "max_position_embeddings": 70})),
        "distilbert": lambda: T_.DistilBertForMaskedLM(T_.DistilBertConfig(dim=H, hidden_dim=INTER, n_layers=LAYERS,
                                                                           n_heads=HEADS, vocab_size=V)),
        "t5": lambda: T_.T5ForConditionalGeneration(T_.T5Config(d_model=H, d_ff=INTER, d_kv=HD, num_layers=LAYERS,
                                                                num_heads=HEADS, vocab_size=V,
                                                                decoder_start_token_id=0, pad_token_id=0)),
    }


@pytest.mark.parametrize("name", list(_more()))
def test_more_hf_models_trace_in_train_mode(name):
    """Models kept aside, as their users write them: each traces with a padded batch, labels and
    the config's dropout on, with SDPA as attention ops (T5's self-attention, whose learned
    position bias needs a gradient, stays materialized: flash kernels give no bias gradient)."""
    torch.manual_seed(0)
    model = _more()[name]().train()
    graph, meta = torch_frontend.trace_step(model, _batch(), _loss)
    ops = graph.op_counts()
    assert ops["attention"] == LAYERS  # per layer (t5: its cross-attention)
    assert ops["attention_grad"] == 3 * ops["attention"]
    assert meta["n_params"] == sum(p.numel() for p in model.parameters())
