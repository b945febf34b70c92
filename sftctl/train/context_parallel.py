"""Context parallelism (issue 38 item 3): the plan's ``SFTCTL_CP`` ranks each hold a contiguous
``seq / cp`` slice of every sequence, and causal attention runs as ring attention (Liu et al. 2023,
"Ring Attention with Blockwise Transformers"): the key/value blocks go round the ring of
context-parallel ranks by send/recv, each rank attends its queries to every block at or before its
own (the diagonal block with the causal mask, later blocks skipped) and merges the blocks'
partial results by their log-sum-exp (the online softmax of flash attention).

Why not torch's ``torch.distributed.tensor.experimental.context_parallel``: in torch 2.13 it
replaces only the flash / efficient / cuDNN SDPA kernels (``aten._scaled_dot_product_flash_
attention`` ...), which CPU float64 attention does not dispatch to, so on CPU/gloo it would not be
exercised; the ring here is plain torch ops and runs on any backend. Its backward is autograd
through a send/recv :class:`_RingShift` (each shift's backward sends the gradient the other way
round the ring), so it keeps every block's scores for backward (memory ``O(s_local x s)`` per head,
not flash attention's ``O(s_local)``) and does no load balancing (the last rank attends to the
most blocks; torch's head-tail split is not done).

Usage, on every rank (``mesh`` from :func:`sftctl.train.mesh.build_mesh`)::

    with context_parallel(model, mesh["cp"], seq_len=s):
        logits = model(shard_sequence(tokens, mesh["cp"]))     # [b, s / cp, vocab]
    loss = F.cross_entropy(logits.flatten(0, 1), shard_sequence(targets, mesh["cp"]).flatten())

Inside the block ``F.scaled_dot_product_attention(..., is_causal=True)`` is the ring, and the
model's RoPE buffers (:data:`ROPE_BUFFERS`, ``[max_seq, ...]`` indexed by position) are this rank's
slice, so a model that reads them by ``[:seq]`` rotates by its own positions. Gradients are
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


def ring_attention(q: Any, k: Any, v: Any, group: Any, *, is_causal: bool = True, scale: float | None = None) -> Any:
    """Attention of this rank's queries to the keys/values of every rank of ``group``.

    Args:
        q, k, v: ``[b, heads, s_local, head_dim]`` (k/v with as many heads as q), this rank's
            contiguous slice of the sequence; slice ``r`` of the group is rank ``r``'s.
        is_causal: token ``t`` sees keys ``<= t`` (global positions).
        scale: default ``1 / sqrt(head_dim)``.
    Returns:
        ``[b, heads, s_local, head_dim]`` in q's dtype.
    """
    import torch
    import torch.distributed as dist

    cp, me = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (me + 1) % cp), dist.get_global_rank(group, (me - 1) % cp)
    shift = _ring_shift_class()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    d = k.shape[-1]
    kv = torch.cat((k, v), dim=-1)
    outs, lses, unused = [], [], []
    for t in range(cp):
        src = (me - t) % cp  # whose block we hold now
        if t:
            kv = shift.apply(kv, nxt, prv, group)
        if is_causal and src > me:
            unused.append(kv)  # a later block: masked entirely, passed on only
            continue
        kk, vv = kv[..., :d], kv[..., d:]
        s = torch.matmul(q, kk.transpose(-1, -2)) * scale
        if is_causal and src == me:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        outs.append(torch.matmul(torch.exp(s - lse), vv))
        lses.append(lse)
    total = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(torch.exp(lse - total) * o for lse, o in zip(lses, outs))
    for kv_unused in unused:
        # keep each shift in the graph so its backward (a send/recv its ring neighbours wait
        # for) runs on every rank; adds exactly 0
        out = out + 0.0 * kv_unused.sum()
    return out


def shard_sequence(x: Any, cp_mesh: Any, dim: int = 1) -> Any:
    """This context-parallel rank's contiguous slice of ``x`` along ``dim`` (``size / cp``).

    Raises:
        SpecError: the length does not divide by cp."""
    cp, me = cp_mesh.size(), cp_mesh.get_local_rank()
    n = x.shape[dim]
    if n % cp:
        raise SpecError(f"SFTCTL_CP={cp}: sequence length {n} does not divide by the context-parallel degree",
                        hint=f"use a sequence length that is a multiple of {cp}")
    return x.narrow(dim, me * (n // cp), n // cp)


@contextlib.contextmanager
def context_parallel(model: Any, cp_mesh: Any, *, seq_len: int,
                     rope_buffers: tuple[str, ...] = ROPE_BUFFERS) -> Iterator[None]:
    """Within the block, ``F.scaled_dot_product_attention`` is :func:`ring_attention` over
    ``cp_mesh`` and ``model``'s buffers named in ``rope_buffers`` hold only this rank's positions
    of a ``seq_len`` sequence. A no-op for a 1-rank mesh.

    Raises:
        SpecError: ``seq_len`` not divisible by cp; attention with an explicit mask, dropout or
            grouped heads inside the block (the ring does plain or causal attention only).
    """
    import torch
    import torch.nn.functional as F

    cp = cp_mesh.size()
    if cp == 1:
        yield
        return
    if seq_len % cp:
        raise SpecError(f"SFTCTL_CP={cp}: sequence length {seq_len} does not divide by the context-parallel degree",
                        hint=f"use a sequence length that is a multiple of {cp}")
    me, chunk, group = cp_mesh.get_local_rank(), seq_len // cp, cp_mesh.get_group()
    saved: list[tuple[Any, str, Any]] = []
    for mod in model.modules():
        for name in rope_buffers:
            buf = mod._buffers.get(name)
            if isinstance(buf, torch.Tensor):
                saved.append((mod, name, buf))
                mod._buffers[name] = buf[:seq_len].narrow(0, me * chunk, chunk)
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p or enable_gqa:
            raise SpecError("context parallelism: attention with attn_mask, dropout or enable_gqa is not split "
                            "(the ring does plain or causal attention)",
                            hint="use is_causal=True without a mask, repeat k/v heads, or plan cp=1")
        return ring_attention(query, key, value, group, is_causal=is_causal, scale=scale)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
        for mod, name, buf in saved:
            mod._buffers[name] = buf


__all__ = ["ROPE_BUFFERS", "context_parallel", "ring_attention", "shard_sequence"]
