"""A small byte-level (vocab 256) decoder-only GPT in plain PyTorch, and its training data.

* ``GPTConfig`` / ``GPT``: pre-LayerNorm transformer blocks, causal self-attention through
  ``torch.nn.functional.scaled_dot_product_attention``, learned position embeddings, output head
  tied to the token embedding. ``forward`` has no data-dependent Python control flow, so it can be
  traced (``torch.fx``, ``torch.export``, ``torch.compile``) for any batch size and sequence length
  up to ``block_size``.
* ``build(batch_size, dtype)`` returns ``(model, example_batch, loss_fn)`` for tools (such as the
  sftctl search compiler) that trace or benchmark a training step without reading any data.
* ``load_corpus()`` / ``get_batch()``: training data, the Python standard library's own ``.py``
  sources, read as bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sysconfig

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB_SIZE = 256  # bytes
CORPUS_MAX_BYTES = 8 * 1024 * 1024
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape. The defaults are sized for CPU training (about 0.8 M parameters)."""

    block_size: int = 128  # context length in bytes (tokens)
    vocab_size: int = VOCAB_SIZE
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(self.n_embd, dim=2)
        # [b, t, c] -> [b, n_head, t, head_dim]
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer over bytes. ``forward(idx[b, t] int64) -> logits[b, t, vocab]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)
        # GPT-2 style: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:  # fixed length: unrolled when traced
            x = block(x)
        return self.lm_head(self.ln_f(x))


def next_byte_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross entropy (nats per byte) of predicting ``y`` from ``x``; ``batch = (x, y)``."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32`` etc. Raises ValueError for names that are not dtypes."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def build(batch_size: int = 16, dtype: str = "float32", cfg: GPTConfig | None = None):
    """Build the model and a synthetic batch for tracing or benchmarking.

    Args:
        batch_size: sequences in ``example_batch``.
        dtype: parameter dtype name, e.g. "float32" or "bfloat16".
        cfg: model shape; default ``GPTConfig()``.

    Returns:
        ``(model, example_batch, loss_fn)``: a freshly initialised ``GPT`` (seeded, so
        deterministic) in ``dtype``; ``(x, y)`` int64 tensors of shape ``[batch_size, block_size]``
        with random byte values (no data is read); ``loss_fn(model, batch) -> scalar loss``.
    """
    cfg = cfg or GPTConfig()
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(cfg)
    model = model.to(dtype=torch_dtype(dtype))
    seq = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=gen)
    example_batch = (seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
    return model, example_batch, next_byte_loss


GPT2_SMALL = GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768)


def build_gpt2_small(batch_size: int = 8, dtype: str = "bfloat16"):
    """GPT-2 small (124M parameters: 12 layers, 768 wide, 12 heads, 1024 tokens, vocab 50257)
    with random weights, for planning and compiling (see examples/gpt2-small.yaml).

    Same contract as :func:`build`. Radford et al. 2019, "Language Models are Unsupervised
    Multitask Learners", Table 2 (the 117M model; 124M counting the position embedding).
    """
    return build(batch_size=batch_size, dtype=dtype, cfg=GPT2_SMALL)


#: GPT-3 shapes at 2048 tokens as the FlashAttention repository trains them on The Pile
#: (Dao-AILab/flash-attention training/configs/experiment/pile/: gpt3s/m/l/xl-flash, gpt3-2.7B-flash-hdim128;
#: GPT-2's architecture, learned positions, vocab 50257 padded to a multiple of 8)
GPT3 = {
    "125m": GPTConfig(block_size=2048, vocab_size=50264, n_layer=12, n_head=12, n_embd=768),
    "355m": GPTConfig(block_size=2048, vocab_size=50264, n_layer=24, n_head=16, n_embd=1024),
    "760m": GPTConfig(block_size=2048, vocab_size=50264, n_layer=24, n_head=16, n_embd=1536),
    "1.3b": GPTConfig(block_size=2048, vocab_size=50264, n_layer=24, n_head=16, n_embd=2048),
    "2.7b": GPTConfig(block_size=2048, vocab_size=50264, n_layer=32, n_head=20, n_embd=2560),
}


#: NeMo's GPT3-5B (24 layers, hidden 4096, 32 heads, MLP 4x, 2048 tokens: NVIDIA/NeMo
#: examples/nlp/language_modeling/conf/ and its performance summary), GPT-2 vocabulary
GPT3_5B = GPTConfig(block_size=2048, vocab_size=50257, n_layer=24, n_head=32, n_embd=4096)


def build_gpt3_5b(batch_size: int = 4, dtype: str = "bfloat16"):
    """NeMo's GPT3-5B shape (:data:`GPT3_5B`); same contract as :func:`build`."""
    return build(batch_size=batch_size, dtype=dtype, cfg=GPT3_5B)


def build_gpt3_125m(batch_size: int = 32, dtype: str = "bfloat16"):
    """GPT-3 125M at 2048 tokens (:data:`GPT3`); same contract as :func:`build`."""
    return build(batch_size=batch_size, dtype=dtype, cfg=GPT3["125m"])


def build_gpt3_355m(batch_size: int = 16, dtype: str = "bfloat16"):
    """GPT-3 355M at 2048 tokens (:data:`GPT3`)."""
    return build(batch_size=batch_size, dtype=dtype, cfg=GPT3["355m"])


def build_gpt3_760m(batch_size: int = 16, dtype: str = "bfloat16"):
    """GPT-3 760M at 2048 tokens (:data:`GPT3`)."""
    return build(batch_size=batch_size, dtype=dtype, cfg=GPT3["760m"])


def build_gpt3_1_3b(batch_size: int = 8, dtype: str = "bfloat16"):
    """GPT-3 1.3B at 2048 tokens (:data:`GPT3`)."""
    return build(batch_size=batch_size, dtype=dtype, cfg=GPT3["1.3b"])


def build_gpt3_2_7b(batch_size: int = 4, dtype: str = "bfloat16"):
    """GPT-3 2.7B at 2048 tokens, head dim 128 (:data:`GPT3`)."""
    return build(batch_size=batch_size, dtype=dtype, cfg=GPT3["2.7b"])


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def load_corpus(max_bytes: int = CORPUS_MAX_BYTES) -> bytes:
    """Return the standard library's ``.py`` sources concatenated, at most ``max_bytes`` long.

    Files are read from ``sysconfig.get_paths()["stdlib"]`` recursively in sorted path order,
    skipping ``site-packages``, ``test``/``tests``, ``idlelib`` and ``__pycache__`` directories and
    symlinked directories, so the result is deterministic for a given Python installation. Each
    file is followed by a newline; the last file is cut at ``max_bytes``.

    Raises:
        RuntimeError: fewer than 64 KiB of sources were found.
    """
    root = sysconfig.get_paths()["stdlib"]
    parts: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for fname in sorted(filenames):
            if not fname.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, fname), "rb") as fh:
                    data = fh.read() + b"\n"
            except OSError:
                continue
            data = data[: max_bytes - total]
            parts.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(parts)
    if total < 64 * 1024:
        raise RuntimeError(f"only {total} bytes of Python sources found under {root}")
    return b"".join(parts)


def get_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` random windows from ``data`` (1-D uint8).

    Returns:
        ``(x, y)`` int64 tensors of shape ``[batch_size, block_size]`` with ``y`` = ``x`` shifted
        left by one byte.

    Raises:
        ValueError: ``data`` is not 1-D or is not longer than ``block_size + 1``.
    """
    if data.dim() != 1 or data.numel() <= block_size + 1:
        raise ValueError(
            f"data must be 1-D and longer than block_size+1={block_size + 1}, got {tuple(data.shape)}"
        )
    starts = torch.randint(0, data.numel() - block_size, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(block_size + 1)
    chunk = data[idx].long()
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
