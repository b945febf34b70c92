"""BERT for SQuAD question answering written with ``torch.nn`` only, for tracing.

* ``Bert`` (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers", Section 3
  and Appendix A): word, position (learned, 512) and token-type (2) embeddings summed, then
  LayerNorm (eps 1e-12) and dropout 0.1; post-LayerNorm encoder layers (self-attention with the
  1 / sqrt(head_dim) scaled scores materialised, an additive key mask, softmax and dropout, as
  NVIDIA DeepLearningExamples' ``modeling.py`` computes it; then a 4x feed-forward with erf GELU;
  dropout 0.1 before each residual add).
* The SQuAD head (Section 4.2): one ``Linear(hidden, 2)`` gives start and end logits over the
  sequence; the loss is the mean of the two cross-entropies.
* ``build_bert_large_squad(batch_size, dtype)`` follows the ``build(batch_size, dtype) ->
  (model, example_batch, loss_fn)`` contract of ``examples/gpt/model.py``: ``example_batch`` is
  ``(input_ids [batch, seq] int64, token_type_ids [batch, seq] int64, attention_mask [batch, seq]
  int64 (all ones), start [batch] int64, end [batch] int64)``, random (no data is read); the model
  is seeded (deterministic), in ``dtype`` and in train mode. BERT-large: 24 layers, hidden 1024,
  16 heads, feed-forward 4096, vocabulary 30522 (334 M parameters with the head), sequence 384 as
  SQuAD v1.1 fine-tuning runs it (``--max_seq_length=384``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class BertConfig:
    """Shape of a BERT encoder; defaults are BERT-large (uncased) at SQuAD's 384 tokens."""

    vocab_size: int = 30522
    hidden: int = 1024
    layers: int = 24
    heads: int = 16
    ffn: int = 4096
    max_positions: int = 512
    type_vocab: int = 2
    seq_len: int = 384
    dropout: float = 0.1
    eps: float = 1e-12


class BertLayer(nn.Module):
    """Post-LayerNorm encoder layer: x = LN(x + drop(attn(x))); x = LN(x + drop(ffn(x)))."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // self.heads) + mask_bias
        att = self.drop(F.softmax(scores, dim=-1)) @ v
        x = self.ln1(x + self.drop(self.proj(att.transpose(1, 2).reshape(b, s, h))))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class BertForSquad(nn.Module):
    """Embeddings, ``cfg.layers`` encoder layers and the start/end span head."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type = nn.Embedding(cfg.type_vocab, cfg.hidden)
        self.ln = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.layers))
        self.qa = nn.Linear(cfg.hidden, 2)

    def forward(self, input_ids, token_type_ids, attention_mask):
        """Start and end logits, each ``[batch, seq]``."""
        s = input_ids.shape[1]
        pos = torch.arange(s, device=input_ids.device)
        x = self.drop(self.ln(self.word(input_ids) + self.pos(pos) + self.token_type(token_type_ids)))
        # the additive key mask, [batch, 1, 1, seq]: 0 where attended, -10000 where padded
        mask_bias = ((1 - attention_mask[:, None, None, :]) * -10000.0).to(x.dtype)
        for layer in self.layers:
            x = layer(x, mask_bias)
        start, end = self.qa(x).unbind(-1)
        return start, end


def squad_loss(model: BertForSquad, batch) -> torch.Tensor:
    """Mean of the start and end positions' cross-entropies (float32 logits)."""
    ids, types, mask, start, end = batch
    s_logits, e_logits = model(ids, types, mask)
    return (F.cross_entropy(s_logits.float(), start) + F.cross_entropy(e_logits.float(), end)) / 2


def build(batch_size: int = 8, dtype: str = "float32", cfg: BertConfig | None = None):
    """The model and a random batch (see the module docstring); ``cfg`` defaults to BERT-large.
    Raises ``AttributeError`` for a ``dtype`` torch has no attribute for."""
    cfg = cfg or BertConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BertForSquad(cfg)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len), generator=gen)
    types = (torch.arange(cfg.seq_len) >= cfg.seq_len // 4).long().expand(batch_size, -1).contiguous()
    mask = torch.ones(batch_size, cfg.seq_len, dtype=torch.long)
    start = torch.randint(0, cfg.seq_len, (batch_size,), generator=gen)
    end = torch.randint(0, cfg.seq_len, (batch_size,), generator=gen)
    return model.to(getattr(torch, dtype)).train(), (ids, types, mask, start, end), squad_loss


def build_bert_large_squad(batch_size: int = 32, dtype: str = "float16"):
    """BERT-large fine-tuned on SQuAD v1.1 at 384 tokens; see :func:`build`."""
    return build(batch_size, dtype)
