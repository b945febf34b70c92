"""Mixture-of-experts GEMMs while tracing: ``torch._grouped_mm`` (``F.grouped_mm``, transformers 5's
default ``grouped_mm`` experts path) as the op ``sftctl::grouped_mm``.

transformers casts the tokens to the expert weights' dtype before ``grouped_mm`` (the op is not
autocast-enabled), so under mixed precision with float32 master weights the grouped GEMM takes
float32 operands. torch's fake (meta) kernel of ``_grouped_mm`` accepts bfloat16 only (it copies
the CUDA kernel's check), so the trace died with "Expected inputs of BF16 type". While tracing,
:func:`decompositions` sends ``aten._grouped_mm`` (forward, and the two grouped GEMMs autograd's
formula calls in the backward) to ``sftctl::grouped_mm``, which takes any floating dtype and keeps
the dtypes transformers chose: the GEMM is priced in the dtype it runs in.

Forms (``offs``: int32 cumulative group ends, ``offs[-1]`` <= the jagged length; rows past it
give 0):

* 2-D x 3-D: ``a`` [S, K] rows grouped by ``offs``, ``b`` [E, K, N] -> [S, N]
  (row r of group e: ``a[r] @ b[e]``): the forward and the input gradient;
* 2-D x 2-D: ``a`` [K, S], ``b`` [S, N], the shared S grouped -> [E, K, N]: the weight gradient;
* 3-D x 3-D without ``offs``: a batched matmul.

The lowering (:mod:`.lowerings.moe`) dispatches each group's rows into a padded ``[E, C, .]``
tensor, multiplies with one batched ``dot_general`` and combines back: C is the uniform load
``ceil(S / E * expert_capacity)`` (see :mod:`.dynamic`), so an expert GEMM is priced at its
share of the tokens.
"""

from __future__ import annotations

import torch


def _grouped_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    if offs is None:
        return torch.bmm(a, b)
    ends = [int(e) for e in offs.tolist()]
    starts = [0] + ends[:-1]
    if a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros((a.shape[0], b.shape[-1]))
        for e, (s, t) in enumerate(zip(starts, ends)):
            out[s:t] = a[s:t] @ b[e]
        return out
    if a.dim() == 2 and b.dim() == 2:
        return torch.stack([a[:, s:t] @ b[s:t] for s, t in zip(starts, ends)])
    raise NotImplementedError(f"grouped_mm of {a.dim()}-D x {b.dim()}-D operands with offs")


@torch.library.custom_op("sftctl::grouped_mm", mutates_args=())
def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    return _grouped_reference(a, b, offs)


@grouped_mm_op.register_fake
def _(a, b, offs):
    if offs is None:
        return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
    if a.dim() == 2 and b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[-1]))
    if a.dim() == 2 and b.dim() == 2:
        return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]))
    raise NotImplementedError(f"grouped_mm of {a.dim()}-D x {b.dim()}-D operands with offs")


def _grouped_mm_decomposition(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    if bias is not None or (out_dtype is not None and out_dtype != mat_a.dtype):
        return NotImplemented
    return torch.ops.sftctl.grouped_mm(mat_a, mat_b, offs)


def decompositions() -> dict:
    """``{aten._grouped_mm overloads: -> sftctl::grouped_mm}`` for make_fx's decomposition table."""
    op = getattr(torch.ops.aten, "_grouped_mm", None)
    if op is None:
        return {}
    return {getattr(op, o): _grouped_mm_decomposition for o in op.overloads()}
