"""Tiny Llama and Mixtral-style MoE models written the way :mod:`sftctl.train.parallel` splits models
automatically (torchtitan's convention): ``tok_embeddings``, ``layers`` (an ``nn.ModuleDict`` keyed
``"0" .. "n-1"``, so a pipeline stage that drops layers keeps the others' state-dict names),
``norm``, ``output``; the forward skips any of them that is None (a pipeline stage holds only its
own). Attention names its projections ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and the MLP
``w1``/``w3``/``w2`` (Megatron pairs :func:`sftctl.train.tensor_parallel.default_plan` finds),
reads its local head count from the projection (``view(b, s, -1, head_dim)``) and calls
``F.scaled_dot_product_attention(is_causal=True)`` (which context parallelism replaces). RoPE
reads ``freqs_cos``/``freqs_sin`` buffers ``[max_seq, head_dim / 2]`` by position, so a context-
parallel rank that holds a slice of them rotates by its own positions.

Used by the parallel-training tests (tests/test_parallel_train.py) and as the model a layout is
checked on; shapes: tokens ``[batch, seq]`` int64 -> logits ``[batch, seq, vocab]`` in the
parameters' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyArgs:
    """Sizes of a tiny model: ``dim`` (hidden width), ``n_layers``, ``n_heads`` (head_dim =
    dim / n_heads), ``ffn`` (MLP width per expert), ``vocab``, ``max_seq``; MoE: ``n_experts``
    (0: dense) and ``top_k``."""

    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    ffn: int = 64
    vocab: int = 64
    max_seq: int = 32
    n_experts: int = 0
    top_k: int = 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, h, s, d]`` by position: pairs (even, odd) of the last dim turned by
    ``cos``/``sin`` ``[s, d / 2]``."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, a: TinyArgs) -> None:
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.q_proj = nn.Linear(a.dim, a.dim, bias=False)
        self.k_proj = nn.Linear(a.dim, a.dim, bias=False)
        self.v_proj = nn.Linear(a.dim, a.dim, bias=False)
        self.o_proj = nn.Linear(a.dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routed experts (Mixtral: softmax over all experts, the top-k weights renormalised),
    no auxiliary loss, no capacity limit (no token dropped). ``experts`` is an ``nn.ModuleDict``
    keyed by global expert index, so an expert-parallel rank that keeps only its own experts keeps
    their names. :func:`sftctl.train.expert_parallel.apply_expert_parallel` replaces ``dispatch``."""

    def __init__(self, a: TinyArgs) -> None:
        super().__init__()
        self.n_experts, self.top_k = a.n_experts, a.top_k
        self.router = nn.Linear(a.dim, a.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): FeedForward(a.dim, a.ffn) for e in range(a.n_experts)})

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[tokens, dim]`` -> (weights ``[tokens, k]``, expert index ``[tokens, k]`` int64)."""
        probs = F.softmax(self.router(x), dim=-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        return w / w.sum(-1, keepdim=True), idx

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Each (token, slot)'s expert output ``[tokens, k, dim]``: every expert on this process."""
        out = x.new_zeros(*idx.shape, x.shape[-1])
        for e, expert in self.experts.items():
            tok, slot = (idx == int(e)).nonzero(as_tuple=True)
            if tok.numel():
                out = out.index_put((tok, slot), expert(x[tok]))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = self.route(flat)
        y = (self.dispatch(flat, idx) * w.unsqueeze(-1)).sum(1)
        return y.view(shape)


class Block(nn.Module):
    def __init__(self, a: TinyArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(a.dim)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim)
        self.feed_forward: nn.Module = MoE(a) if a.n_experts else FeedForward(a.dim, a.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    """A Llama (RMSNorm, RoPE, SwiGLU; a MoE feed-forward when ``args.n_experts``). Pipeline
    stages set ``tok_embeddings``/``norm``/``output`` to None and drop layers; the forward then
    takes and returns hidden states ``[b, s, dim]``."""

    def __init__(self, args: TinyArgs | None = None) -> None:
        super().__init__()
        a = args or TinyArgs()
        self.args = a
        self.tok_embeddings: nn.Module | None = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleDict({str(i): Block(a) for i in range(a.n_layers)})
        self.norm: nn.Module | None = RMSNorm(a.dim)
        self.output: nn.Module | None = nn.Linear(a.dim, a.vocab, bias=False)
        hd = a.dim // a.n_heads
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.outer(torch.arange(a.max_seq, dtype=torch.float64), inv)
        self.register_buffer("freqs_cos", ang.cos(), persistent=False)
        self.register_buffer("freqs_sin", ang.sin(), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(h) if self.tok_embeddings is not None else h
        s = h.shape[1]
        cos, sin = self.freqs_cos[:s].to(h.dtype), self.freqs_sin[:s].to(h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float64, **sizes: int) -> TinyLlama:
    """A :class:`TinyLlama` initialised from ``torch.manual_seed(seed)`` (the same weights on
    every process that asks for the same seed and sizes), in ``dtype``."""
    torch.manual_seed(seed)
    return TinyLlama(TinyArgs(**sizes)).to(dtype)


__all__ = ["MoE", "TinyArgs", "TinyLlama", "rope", "tiny_llama"]
