"""Context parallelism (issue 38 item 3): each of the plan's ``SFTCTL_CP`` ranks holds ``seq / cp``
positions of every sequence, and causal attention runs as ring attention (Liu et al. 2023, "Ring
Attention with Blockwise Transformers"): the key/value chunks go round the ring of context-parallel
ranks by send/recv, each rank attends its queries to the chunks at or before them (a chunk's own
with the causal mask, later ones skipped) and merges the partial results by their log-sum-exp (the
online softmax of flash attention).

Load balance: a contiguous split gives rank ``i`` chunk ``i`` of ``cp``, and under a causal mask
the last rank attends to ``(2 cp - 1) / cp`` times the mean (1.5x at cp 2, 1.875x at cp 8) while
rank 0 idles. The default (:data:`LOAD_BALANCE`) is the zigzag split torchtitan and Megatron-Core
use: the sequence in ``2 cp`` chunks, rank ``i`` holding chunks ``i`` and ``2 cp - 1 - i``
(:func:`sequence_chunks`), so every rank computes ``2 cp + 1`` of the chunk-pair blocks
(:func:`attention_work` counts the pairs). ``load_balance=False`` keeps the contiguous split; the
planner prices whichever runs (``sftctl.compiler.layouts.price``, ``cp_load_balance``).

Why not torch's ``torch.distributed.tensor.experimental.context_parallel``: in torch 2.13 it
replaces only the flash / efficient / cuDNN SDPA kernels (``aten._scaled_dot_product_flash_
attention`` ...), which CPU float64 attention does not dispatch to, so on CPU/gloo it would not be
exercised; the ring here is plain torch ops and runs on any backend. Its backward is autograd
through a send/recv :class:`_RingShift` (each shift's backward sends the gradient the other way
round the ring), so it keeps every block's scores for backward (memory ``O(s_local x s)`` per head,
not flash attention's ``O(s_local)``).

Usage, on every rank (``mesh`` from :func:`sftctl.train.mesh.build_mesh`)::

    with context_parallel(model, mesh["cp"], seq_len=s):     # s divisible by 2 cp
        logits = model(shard_sequence(tokens, mesh["cp"]))     # [b, s / cp, vocab], zigzag positions
    loss = F.cross_entropy(logits.flatten(0, 1), shard_sequence(targets, mesh["cp"]).flatten())

Inside the block ``F.scaled_dot_product_attention(..., is_causal=True)`` is the ring, and the
model's RoPE buffers (:data:`ROPE_BUFFERS`, ``[max_seq, ...]`` indexed by position) hold this rank's
positions (its two chunks), so a model that reads them by ``[:seq]`` rotates by its own positions. Gradients are
averaged over ``dp`` x ``cp`` (FSDP over :func:`sftctl.train.mesh.data_mesh`): each rank's loss is
the mean over its own tokens, and the slices are equal.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

from sftctl.errors import SpecError

#: buffer names read as per-position tables (dim 0 = position) and sliced to the rank's positions
ROPE_BUFFERS = ("freqs_cos", "freqs_sin", "freqs_cis")
#: the zigzag split by default (torchtitan's and Megatron-Core's): every rank's causal attention
#: the same share; the planner prices it so (``sftctl.compiler.layouts.price``'s ``cp_load_balance``)
LOAD_BALANCE = True


def _exchange(x: Any, dst: int, src: int, group: Any) -> Any:
    import torch
    import torch.distributed as dist

    x = x.contiguous()
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, dst, group), dist.P2POp(dist.irecv, out, src, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


def _ring_shift_class() -> Any:
    import torch

    class _RingShift(torch.autograd.Function):
        """``x`` sent to global rank ``dst``, the tensor from ``src`` returned; backward sends
        the gradient to ``src`` and takes ``dst``'s."""

        @staticmethod
        def forward(ctx: Any, x: Any, dst: int, src: int, group: Any) -> Any:
            ctx.dst, ctx.src, ctx.group = dst, src, group
            return _exchange(x, dst, src, group)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return _exchange(grad, ctx.src, ctx.dst, ctx.group), None, None, None

    return _RingShift


def sequence_chunks(cp: int, rank: int, load_balance: bool = True) -> tuple[int, ...]:
    """The chunks of a sequence context-parallel rank ``rank`` of ``cp`` holds, in order: with
    ``load_balance`` the sequence is cut into ``2 cp`` equal chunks and rank ``i`` holds chunks
    ``i`` and ``2 cp - 1 - i`` (the zigzag / head-tail split of torchtitan's
    ``_HeadTailLoadBalancer`` and Megatron-Core's CP: under a causal mask every rank then attends
    to the same number of keys); without, ``cp`` chunks and rank ``i`` holds chunk ``i`` (the
    contiguous split, where the last rank attends to ``(2 cp - 1) / cp`` times the mean)."""
    return (rank, 2 * cp - 1 - rank) if load_balance else (rank,)


def attention_work(seq_len: int, cp: int, load_balance: bool = True) -> list[int]:
    """Query-key pairs each rank's causal attention computes (the scores :func:`ring_attention`
    evaluates, key ``<=`` query), one count per rank. Their sum is ``seq_len (seq_len + 1) / 2``
    at any split; load-balanced, every rank's is equal (``seq_len`` divisible by ``2 cp``).

    Raises:
        SpecError: ``seq_len`` not divisible by the chunk count."""
    n = 2 * cp if load_balance else cp
    if seq_len % n:
        raise SpecError(f"SFTCTL_CP={cp}: sequence length {seq_len} does not divide into {n} chunks",
                        hint=f"use a sequence length that is a multiple of {n}")
    c = seq_len // n
    out = []
    for r in range(cp):
        # chunk a sees every earlier chunk whole and itself causally: a c^2 + c (c + 1) / 2
        out.append(sum(a * c * c + c * (c + 1) // 2 for a in sequence_chunks(cp, r, load_balance)))
    return out


def ring_attention(q: Any, k: Any, v: Any, group: Any, *, is_causal: bool = True, scale: float | None = None,
                   load_balance: bool = True) -> Any:
    """Attention of this rank's queries to the keys/values of every rank of ``group``.

    Each rank's slice is the concatenation of its :func:`sequence_chunks` (what
    :func:`shard_sequence` gives it with the same ``load_balance``). At every ring step the rank
    holds another rank's key/value chunks and computes only the (query chunk, key chunk) pairs
    the causal mask does not hide: an earlier chunk whole, its own chunk with the triangular mask,
    a later one not at all; the partial results of each query chunk are merged by log-sum-exp.

    Args:
        q, k, v: ``[b, heads, s_local, head_dim]`` (k/v with as many heads as q), any float dtype.
        is_causal: token ``t`` sees keys ``<= t`` (global positions).
        scale: default ``1 / sqrt(head_dim)``.
        load_balance: the zigzag split (True) or the contiguous one (False), as the slices were cut.
    Returns:
        ``[b, heads, s_local, head_dim]`` in q's dtype.
    Raises:
        SpecError: ``s_local`` not divisible by the rank's chunk count.
    """
    import torch
    import torch.distributed as dist

    cp, me = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (me + 1) % cp), dist.get_global_rank(group, (me - 1) % cp)
    shift = _ring_shift_class()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    d = k.shape[-1]
    mine = sequence_chunks(cp, me, load_balance)
    n_local = q.shape[-2]
    if n_local % len(mine):
        raise SpecError(f"SFTCTL_CP={cp}: {n_local} local positions do not split into {len(mine)} chunks",
                        hint=f"use a sequence length that is a multiple of {2 * cp if load_balance else cp}")
    c = n_local // len(mine)
    qs = [q[..., a * c:(a + 1) * c, :] for a in range(len(mine))]
    kv = torch.cat((k, v), dim=-1)
    parts: list[list[tuple[Any, Any]]] = [[] for _ in mine]  # per query chunk: (output, lse)
    unused = []
    triu = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    for t in range(cp):
        src = (me - t) % cp  # whose chunks we hold now
        if t:
            kv = shift.apply(kv, nxt, prv, group)
        used = False
        for b, kchunk in enumerate(sequence_chunks(cp, src, load_balance)):
            kk, vv = kv[..., b * c:(b + 1) * c, :d], kv[..., b * c:(b + 1) * c, d:]
            for a, qchunk in enumerate(mine):
                if is_causal and kchunk > qchunk:
                    continue  # a later chunk: masked entirely
                s = torch.matmul(qs[a], kk.transpose(-1, -2)) * scale
                if is_causal and kchunk == qchunk:
                    s = s.masked_fill(triu, float("-inf"))
                lse = torch.logsumexp(s, dim=-1, keepdim=True)
                parts[a].append((torch.matmul(torch.exp(s - lse), vv), lse))
                used = True
        if not used:
            unused.append(kv)
    outs = []
    for got in parts:  # every query chunk sees at least its own chunk's diagonal
        total = torch.logsumexp(torch.stack([lse for _, lse in got]), dim=0)
        outs.append(sum(torch.exp(lse - total) * o for o, lse in got))
    out = torch.cat(outs, dim=-2) if len(outs) > 1 else outs[0]
    for kv_unused in unused:
        # keep each shift in the graph so its backward (a send/recv its ring neighbours wait
        # for) runs on every rank; adds exactly 0
        out = out + 0.0 * kv_unused.sum()
    return out


def shard_sequence(x: Any, cp_mesh: Any, dim: int = 1, *, load_balance: bool = True) -> Any:
    """This context-parallel rank's slice of ``x`` along ``dim`` (``size / cp`` positions): its
    :func:`sequence_chunks` concatenated (zigzag with ``load_balance``, else contiguous).

    Raises:
        SpecError: the length does not divide into the chunks (``2 cp`` or ``cp``)."""
    import torch

    cp, me = cp_mesh.size(), cp_mesh.get_local_rank()
    n = x.shape[dim]
    pieces = 2 * cp if load_balance else cp
    if n % pieces:
        raise SpecError(f"SFTCTL_CP={cp}: sequence length {n} does not divide into the {pieces} chunks "
                        "context parallelism splits it into", hint=f"use a sequence length that is a multiple of {pieces}")
    c = n // pieces
    got = [x.narrow(dim, a * c, c) for a in sequence_chunks(cp, me, load_balance)]
    return torch.cat(got, dim=dim) if len(got) > 1 else got[0]


@contextlib.contextmanager
def context_parallel(model: Any, cp_mesh: Any, *, seq_len: int, rope_buffers: tuple[str, ...] = ROPE_BUFFERS,
                     load_balance: bool = LOAD_BALANCE) -> Iterator[None]:
    """Within the block, ``F.scaled_dot_product_attention`` is :func:`ring_attention` over
    ``cp_mesh`` and ``model``'s buffers named in ``rope_buffers`` hold only this rank's positions
    of a ``seq_len`` sequence (its :func:`sequence_chunks`: zigzag with ``load_balance``, as
    :func:`shard_sequence` must then cut the batch). A no-op for a 1-rank mesh.

    Raises:
        SpecError: ``seq_len`` not divisible by ``2 cp`` (``cp`` without ``load_balance``);
            attention with an explicit mask, dropout or grouped heads inside the block (the ring
            does plain or causal attention only).
    """
    import torch
    import torch.nn.functional as F

    cp = cp_mesh.size()
    if cp == 1:
        yield
        return
    pieces = 2 * cp if load_balance else cp
    if seq_len % pieces:
        raise SpecError(f"SFTCTL_CP={cp}: sequence length {seq_len} does not divide into the {pieces} chunks "
                        "context parallelism splits it into", hint=f"use a sequence length that is a multiple of {pieces}")
    me, chunk, group = cp_mesh.get_local_rank(), seq_len // pieces, cp_mesh.get_group()
    saved: list[tuple[Any, str, Any]] = []
    for mod in model.modules():
        for name in rope_buffers:
            buf = mod._buffers.get(name)
            if isinstance(buf, torch.Tensor):
                saved.append((mod, name, buf))
                got = [buf.narrow(0, a * chunk, chunk) for a in sequence_chunks(cp, me, load_balance)]
                mod._buffers[name] = torch.cat(got) if len(got) > 1 else got[0]
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p or enable_gqa:
            raise SpecError("context parallelism: attention with attn_mask, dropout or enable_gqa is not split "
                            "(the ring does plain or causal attention)",
                            hint="use is_causal=True without a mask, repeat k/v heads, or plan cp=1")
        return ring_attention(query, key, value, group, is_causal=is_causal, scale=scale, load_balance=load_balance)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
        for mod, name, buf in saved:
            mod._buffers[name] = buf


__all__ = ["LOAD_BALANCE", "ROPE_BUFFERS", "attention_work", "context_parallel", "ring_attention", "sequence_chunks",
           "shard_sequence"]
