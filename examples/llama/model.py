"""A Llama-style decoder (transformers' ``LlamaForCausalLM``, random weights) for planning and
sharded training.

* ``build_tinyllama(batch_size, dtype)``: TinyLlama-1.1B's shape (22 layers, hidden 2048, MLP 5632,
  32 query / 4 key-value heads, vocab 32000, 2048 tokens; Zhang et al. 2024, "TinyLlama: An
  Open-Source Small Language Model", Table 1 / the HF config ``TinyLlama/TinyLlama_v1.1``).
* ``build(batch_size, dtype)``: the same architecture, tiny (2 layers, hidden 64, 128 tokens,
  vocab 256 bytes), which trains on a CPU in seconds (examples/llama/train.py).

Both return ``(model, example_batch, loss_fn)`` as the sftctl compiler expects: ``example_batch``
is ``{"input_ids", "labels", "attention_mask"}``, int64 ``[batch_size, seq_len]``; ``loss_fn(model,
batch)`` is the next-token cross-entropy, a float32 scalar.
"""

from __future__ import annotations

import torch

TINYLLAMA = dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                 intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048)
LLAMA2_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096)
LLAMA2_13B = dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                  intermediate_size=13824, vocab_size=32000, max_position_embeddings=4096)
LLAMA_34B = dict(hidden_size=8192, num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=8,
                 intermediate_size=22016, vocab_size=32000, max_position_embeddings=4096)
LLAMA2_70B = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                  intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096)
LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=128)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def loss_fn(model, batch) -> torch.Tensor:
    return model(**batch).loss


def _build(shape: dict, batch_size: int, dtype: str, seed: int = 0):
    import transformers

    cfg = transformers.LlamaConfig(**shape, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to(dtype=_dtype(dtype)).train()
    seq = shape["max_position_embeddings"]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape["vocab_size"], (batch_size, seq), generator=gen, device="cpu")
    if next(model.parameters()).device.type == "meta":
        ids = ids.to("meta")
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    return model, batch, loss_fn


def build_tinyllama(batch_size: int = 2, dtype: str = "bfloat16"):
    """TinyLlama-1.1B-shaped (1.1 B parameters) with random weights; see the module docstring."""
    return _build(TINYLLAMA, batch_size, dtype)


def build_llama2_7b(batch_size: int = 2, dtype: str = "bfloat16"):
    """Llama-2-7B-shaped (6.7 B parameters: 32 layers, hidden 4096, MLP 11008, 32 heads, vocab
    32000, 4096 tokens; Touvron et al. 2023, "Llama 2", Table 1 and the HF config
    ``meta-llama/Llama-2-7b-hf``) with random weights, for planning only (build it on the meta
    device)."""
    return _build(LLAMA2_7B, batch_size, dtype)


def build_llama2_13b(batch_size: int = 1, dtype: str = "bfloat16"):
    """Llama-2-13B-shaped (40 layers, hidden 5120, MLP 13824, 40 heads, vocab 32000, 4096 tokens;
    the HF config ``meta-llama/Llama-2-13b-hf``), random weights, for planning only (meta device)."""
    return _build(LLAMA2_13B, batch_size, dtype)


def build_llama_34b(batch_size: int = 1, dtype: str = "bfloat16"):
    """A 34B Llama (48 layers, hidden 8192, MLP 22016, 64 query / 8 key-value heads, vocab 32000,
    4096 tokens: the HF config ``codellama/CodeLlama-34b-hf`` with Llama 2's vocabulary and
    context), random weights, for planning only (meta device)."""
    return _build(LLAMA_34B, batch_size, dtype)


def build_llama2_70b(batch_size: int = 1, dtype: str = "bfloat16"):
    """Llama-2-70B-shaped (80 layers, hidden 8192, MLP 28672, 64 query / 8 key-value heads, vocab
    32000, 4096 tokens; the HF config ``meta-llama/Llama-2-70b-hf``), random weights, for planning
    only (meta device)."""
    return _build(LLAMA2_70B, batch_size, dtype)


def build_llama3_8b(batch_size: int = 1, dtype: str = "bfloat16"):
    """Llama-3-8B-shaped (32 layers, hidden 4096, MLP 14336, 32 query / 8 key-value heads, vocab
    128256, 8192 tokens; the HF config ``meta-llama/Meta-Llama-3-8B``), random weights, for
    planning only (meta device)."""
    return _build(LLAMA3_8B, batch_size, dtype)


def build(batch_size: int = 4, dtype: str = "float32"):
    """The Llama architecture at a CPU-trainable size (about 0.1 M parameters)."""
    return _build(TINY, batch_size, dtype)
