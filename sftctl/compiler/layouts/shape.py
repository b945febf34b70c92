"""A decoder-only transformer's dimensions: what a parallel layout splits.

Tensor parallelism (Megatron-LM's column/row split, Shoeybi et al. 2019, section 3) divides each
block's query/key/value and MLP-up GEMMs along their output columns and the attention-output and
MLP-down GEMMs along their input rows, so every GEMM of a block is ``1/t`` as wide; pipeline
parallelism divides the blocks; context parallelism the sequence; expert parallelism the experts.
:class:`TransformerShape` holds the dimensions those divisions need; :func:`shape_from_graph`
reads them off a traced step.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer trained on ``seq_len``-token sequences.

    ``hidden``: model width; ``ffn``: the MLP's inner width (per expert for MoE); ``heads`` query
    heads, ``kv_heads`` key/value heads (grouped-query attention; = heads for multi-head);
    ``gated_mlp``: SwiGLU's three matrices (Llama) instead of two (GPT); ``experts`` > 0: every
    block's MLP is that many experts, ``top_k`` of them per token; ``tied_embeddings``: the LM
    head is the embedding matrix. ``dtype``: the compute dtype of GEMMs (mixed precision).
    ``expert_capacity``: the tokens each expert processes as a multiple of the router's uniform
    share (GShard's capacity factor, Megatron-Core's ``--moe-expert-capacity-factor``: 1.0 drops
    or pads to exactly the uniform load; the spec's ``model.expert_capacity``); the busiest
    expert-parallel rank's GEMMs and all-to-all carry that many tokens. ``dropout``: the blocks
    keep dropout masks for backward (GPT, Megatron-LM's models; Llama and Mixtral train without).
    """

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    gated_mlp: bool = False
    experts: int = 0
    top_k: int = 0
    tied_embeddings: bool = False
    dtype: str = "bfloat16"
    expert_capacity: float = 1.0
    dropout: bool = True

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "seq_len"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"TransformerShape.{f} must be positive, got {getattr(self, f)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"TransformerShape: hidden {self.hidden} must divide by heads {self.heads} and heads "
                             f"by kv_heads {self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_width(self) -> int:
        """Output columns of the fused query/key/value projection."""
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def attention_params(self) -> int:
        """Query/key/value and output projections of one block (biases left out)."""
        return self.hidden * self.qkv_width + self.heads * self.head_dim * self.hidden

    @property
    def mlp_params(self) -> int:
        """One block's MLP: every expert's for MoE (the router is negligible and left out)."""
        return self.mlp_matrices * self.hidden * self.ffn * max(1, self.experts)

    @property
    def layer_params(self) -> int:
        return self.attention_params + self.mlp_params + 2 * self.hidden  # + two norms

    @property
    def embedding_params(self) -> int:
        """The token embedding and (untied) LM head."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.hidden

    @property
    def active_params(self) -> int:
        """Parameters a token passes through (MoE: ``top_k`` experts of each block)."""
        if not self.experts:
            return self.params
        per = self.mlp_matrices * self.hidden * self.ffn
        return self.params - self.layers * per * (self.experts - self.top_k)


_BLOCK = re.compile(r"^(.*?\.)(\d+)\.")


def shape_from_graph(graph) -> TransformerShape | None:
    """The :class:`TransformerShape` of a traced step (:class:`sftctl.compiler.ir.Graph`), or None
    when the step is not a recognisable decoder (no ``attention`` op, no numbered blocks, no 2-D
    embedding): layers = numbered blocks (``model.layers.3.``), vocab x hidden = the embedding
    (the largest 2-D parameter outside the blocks), ffn = the widest dimension of a block's 2-D
    weights other than hidden (gated: three weights have it), heads / kv heads / sequence length
    from the first attention op (key/value heads from the key/value projections' width where the
    op sees them repeated), dropout from its ``dropout_p``. MoE experts (3-D grouped weights) are not read yet: None.
    """
    from sftctl.compiler.fusion import attention_shape

    att = next((n for n in graph.nodes if n.op == "attention"), None)
    params = [(n.attrs.get("name", ""), n.type.shape) for n in graph.inputs_with_role("param")]
    if att is None or not params:
        return None
    blocks: dict[str, list] = {}
    outside = []
    for name, shp in params:
        m = _BLOCK.match(name)
        if m:
            blocks.setdefault(m.group(1) + m.group(2), []).append(shp)
        else:
            outside.append(shp)
    two_d = [s for s in outside if len(s) == 2]
    if not blocks or not two_d:
        return None
    if any(len(s) == 3 for ws in blocks.values() for s in ws):
        return None  # grouped expert weights: not read yet
    vocab, hidden = max(two_d, key=lambda s: s[0] * s[1])
    if vocab < hidden:
        vocab, hidden = hidden, vocab
    first = next(iter(blocks.values()))
    others = Counter(d for s in first if len(s) == 2 and hidden in s for d in s if d != hidden)
    if not others:
        return None
    ffn = max(others)
    a = attention_shape(graph, att)
    heads, kv_heads = int(a["q_heads"]), int(a["kv_heads"])
    if hidden % heads or heads % kv_heads:
        return None
    # grouped-query attention: the attention op sees K and V after repeat_kv (as many heads as Q);
    # the key/value projections' width (two weights narrower than hidden) says how many there are
    hd = hidden // heads
    kv_widths = [d for d, n in others.items() if d < hidden and n >= 2 and d % hd == 0 and heads % (d // hd) == 0]
    if kv_heads == heads and kv_widths:
        kv_heads = min(kv_widths) // hd
    untied = sum(1 for s in two_d if tuple(sorted(s)) == tuple(sorted((vocab, hidden))))
    return TransformerShape(layers=len(blocks), hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv_heads, vocab=vocab,
                            seq_len=int(a["q_len"]), gated_mlp=others[ffn] >= 3, tied_embeddings=untied < 2,
                            dtype=a["dtype"] if a["dtype"] in ("bfloat16", "float16") else "float32",
                            dropout=float(att.attrs.get("dropout_p", 0.0) or 0.0) > 0)
