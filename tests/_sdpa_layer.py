"""One SDPA layer whose boolean mask is built as transformers builds it, traced on meta tensors:
tests/test_attention_causal_mask.py and tests/test_attention_padding.py price its attention."""

from __future__ import annotations

import pytest


def trace_masked_layer(mask_kind: str | None, seq: int):
    """One traced SDPA layer (8 heads of 64, bf16 autocast, batch 2 of ``seq`` tokens, meta
    tensors: no mask values) whose mask is ``mask_kind``: ``causal`` (HF's: key <= query AND the
    batch's padding mask), ``anticausal`` (key >= query), ``padding`` (the batch's mask only),
    ``is_causal`` (no mask, ``is_causal=True``) or None. Returns trace_step's (graph, meta)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from sftctl.compiler.frontends.torch import trace_step

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(512, 3 * 512)

        def forward(self, x, attention_mask):
            B, L, _ = x.shape
            q, k, v = self.qkv(x).view(B, L, 3, 8, 64).permute(2, 0, 3, 1, 4)
            pos = torch.arange(L, device=x.device) + 0  # HF adds the cache position offset
            pad = attention_mask.bool()[:, None, None, :]
            masks = {"causal": (pos[None, None, None, :] <= pos[None, None, :, None]) & pad,
                     "anticausal": (pos[None, None, None, :] >= pos[None, None, :, None]) & pad,
                     "padding": pad.expand(B, 1, L, L)}
            if mask_kind == "is_causal":
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=masks.get(mask_kind))

    with torch.device("meta"):
        model = Layer()
    batch = {"x": torch.empty(2, seq, 512, device="meta"),
             "attention_mask": torch.ones(2, seq, dtype=torch.int64, device="meta")}
    return trace_step(model, batch, lambda m, b: (m(b["x"], b["attention_mask"]) ** 2).mean(),
                      autocast_dtype="bfloat16")
