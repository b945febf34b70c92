"""Contractions and convolutions: ``mm``/``bmm``/``addmm``/... as ``dot_general``, ``convolution`` and its backward as IR ``conv``.

Each ``@lowers`` function is the IR lowering of the ATen op packet it is named after (``op_<packet>``),
called as ``fn(lowering, node, *node.args, **node.kwargs)``; see :mod:`..lowering`."""

from __future__ import annotations

import numpy as np
import torch

from sftctl.compiler.frontends.torch.lowering import lowers


def _dot(self, a: int, b: int, lb, rb, lc, rc, dtype: str) -> int:
    sa, sb = self.shape(a), self.shape(b)
    shape = ([sa[d] for d in lb] + [sa[d] for d in range(len(sa)) if d not in lb and d not in lc]
             + [sb[d] for d in range(len(sb)) if d not in rb and d not in rc])
    return self.add("dot_general", [a, b], shape, dtype, lhs_batch=tuple(lb), rhs_batch=tuple(rb),
                    lhs_contract=tuple(lc), rhs_contract=tuple(rc))


@lowers
def op_mm(self, n, a, b):
    _, dtype = self.out()
    return _dot(self, self.arg(a), self.arg(b), (), (), (1,), (0,), dtype)


@lowers
def op_bmm(self, n, a, b):
    _, dtype = self.out()
    return _dot(self, self.arg(a), self.arg(b), (0,), (0,), (2,), (1,), dtype)


@lowers
def op_mv(self, n, a, b):
    _, dtype = self.out()
    return _dot(self, self.arg(a), self.arg(b), (), (), (1,), (0,), dtype)


@lowers
def op_dot(self, n, a, b):
    _, dtype = self.out()
    return _dot(self, self.arg(a), self.arg(b), (), (), (0,), (0,), dtype)


def _addmm(self, n, bias, prod: int, beta, alpha):
    shape, dtype = self.out()
    if alpha != 1:
        prod = self.binary("mul", prod, self.const(alpha, (), dtype))
    c = self.arg(bias, dtype)
    if beta == 0:
        return prod
    if beta != 1:
        c = self.binary("mul", c, self.const(beta, (), dtype))
    return self.add("add", [prod, c], shape, dtype)


@lowers
def op_addmm(self, n, bias, a, b, beta=1, alpha=1):
    return _addmm(self, n, bias, op_mm(self, n, a, b), beta, alpha)


@lowers
def op_baddbmm(self, n, bias, a, b, beta=1, alpha=1):
    return _addmm(self, n, bias, op_bmm(self, n, a, b), beta, alpha)


def _conv(self, x: int, w: int, dtype: str, *, stride, padding, lhs_dilation, rhs_dilation,
          fgc: int = 1, bgc: int = 1) -> int:
    """An IR ``conv`` node (shape inferred); ``padding`` as (low, high) pairs."""
    from sftctl.compiler.ir import conv_output_spatial

    xs, ws = self.shape(x), self.shape(w)
    nsp = len(xs) - 2
    attrs = dict(stride=tuple(stride), padding=tuple((int(lo), int(hi)) for lo, hi in padding),
                 lhs_dilation=tuple(lhs_dilation), rhs_dilation=tuple(rhs_dilation),
                 feature_group_count=int(fgc), batch_group_count=int(bgc))
    sp = conv_output_spatial(xs[2:], ws[2:], attrs["stride"], attrs["padding"], attrs["lhs_dilation"],
                             attrs["rhs_dilation"])
    assert len(sp) == nsp
    return self.add("conv", [x, w], (xs[0] // bgc, ws[0]) + sp, dtype, **attrs)


def _per_dim(v, nsp: int) -> list[int]:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return [int(x) for x in (v * nsp if len(v) == 1 else v)]


def _conv_input_grad(self, gy: int, w: int, dtype: str, in_spatial, stride, padding, dilation, groups: int,
                     output_padding=None) -> int:
    """The transposed convolution: the gradient w.r.t. the input of ``conv(x, w)`` (and the
    forward of ``ConvTranspose``), a ``conv`` of ``gy`` dilated by the stride with the
    flipped kernel whose in/out channels are swapped per group. Returns ``[N, C, *in_spatial]``."""
    ws = self.shape(w)
    o, cg, ks = ws[0], ws[1], ws[2:]
    nsp = len(ks)
    wt = self.reshape(w, (groups, o // groups, cg) + tuple(ks))
    wt = self.transpose(wt, (0, 2, 1) + tuple(range(3, 3 + nsp)))
    wt = self.reshape(wt, (groups * cg, o // groups) + tuple(ks))
    wt = self.add("reverse", [wt], self.shape(wt), self.dtype(wt), axes=tuple(range(2, 2 + nsp)))
    out_sp = self.shape(gy)[2:]
    pads = []
    for d in range(nsp):
        lo = dilation[d] * (ks[d] - 1) - padding[d]
        hi = in_spatial[d] - 1 - stride[d] * (out_sp[d] - 1) + padding[d]
        pads.append((lo, hi))
    return _conv(self, gy, wt, dtype, stride=[1] * nsp, padding=pads, lhs_dilation=stride,
                      rhs_dilation=dilation, fgc=groups)


def _conv_weight_grad(self, x: int, gy: int, dtype: str, kernel, stride, padding, dilation, groups: int) -> int:
    """The gradient w.r.t. the weight of ``conv(x, w)``: a ``conv`` of the input (batch and
    channels swapped) with the output gradient as the kernel, batch-grouped by ``groups``.
    Returns ``[O, C / groups, *kernel]``."""
    xs, out_sp = self.shape(x), self.shape(gy)[2:]
    nsp = len(kernel)
    rest = tuple(range(2, 2 + nsp))
    xt = self.transpose(x, (1, 0) + rest)
    gt = self.transpose(gy, (1, 0) + rest)
    pads = [(padding[d], dilation[d] * (kernel[d] - 1) + stride[d] * (out_sp[d] - 1) + 1 - xs[2 + d] - padding[d])
            for d in range(nsp)]
    g = _conv(self, xt, gt, dtype, stride=dilation, padding=pads, lhs_dilation=[1] * nsp, rhs_dilation=stride,
                   bgc=groups)
    return self.transpose(g, (1, 0) + rest)


@lowers
def op_convolution(self, n, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    shape, dtype = self.out()
    xi, wi = self.arg(x, dtype), self.arg(w, dtype)
    nsp = len(self.shape(xi)) - 2
    stride, padding, dilation = (_per_dim(v, nsp) for v in (stride, padding, dilation))
    if transposed:
        y = _conv_input_grad(self, xi, wi, dtype, shape[2:], stride, padding, dilation, groups)
    else:
        y = _conv(self, xi, wi, dtype, stride=stride, padding=[(p, p) for p in padding], lhs_dilation=[1] * nsp,
                       rhs_dilation=dilation, fgc=groups)
    if tuple(self.shape(y)) != shape:
        self.unsupported(n, f"(lowered shape {self.shape(y)} != {shape})")
    if bias is not None:
        b = self.reshape(self.arg(bias, dtype), (1, shape[1]) + (1,) * nsp)
        y = self.binary("add", y, b)
    return y


@lowers
def op_convolution_backward(self, n, gy, x, w, bias_sizes, stride, padding, dilation, transposed,
                            output_padding, groups, output_mask):
    gyi = self.arg(gy)
    xi, wi = self.arg(x), self.arg(w)
    nsp = len(self.shape(xi)) - 2
    stride, padding, dilation = (_per_dim(v, nsp) for v in (stride, padding, dilation))
    outs: list[int | None] = [None, None, None]
    # a transposed convolution is the adjoint of the convolution with the same weight: its
    # input gradient is that convolution, its weight gradient has input and output swapped
    if output_mask[0]:
        gx_shape, gx_dt = self.out_at(0)
        gyc, wc = self.cast(gyi, gx_dt), self.cast(wi, gx_dt)
        outs[0] = (_conv(self, gyc, wc, gx_dt, stride=stride, padding=[(p, p) for p in padding],
                              lhs_dilation=[1] * nsp, rhs_dilation=dilation, fgc=groups) if transposed else
                   _conv_input_grad(self, gyc, wc, gx_dt, gx_shape[2:], stride, padding, dilation, groups))
    if output_mask[1]:
        gw_dt = self.out_at(1)[1]
        a, b = (gyi, xi) if transposed else (xi, gyi)
        outs[1] = _conv_weight_grad(self, self.cast(a, gw_dt), self.cast(b, gw_dt), gw_dt,
                                         self.shape(wi)[2:], stride, padding, dilation, groups)
    if output_mask[2]:
        gb_shape, gb_dt = self.out_at(2)
        axes = (0,) + tuple(range(2, 2 + nsp))
        outs[2] = self.add("sum", [self.cast(gyi, gb_dt)], gb_shape, gb_dt, axes=axes, keepdim=False)
    for k, o in enumerate(outs):
        if o is not None and tuple(self.shape(o)) != self.out_at(k)[0]:
            self.unsupported(n, f"(output {k}: lowered shape {self.shape(o)} != {self.out_at(k)[0]})")
    return outs


def _pairwise_p(self, a: int, b: int, p: float, shape, dtype: str) -> int:
    """``(sum_k |a_k - b_k|^p)^(1/p)`` over the last dim of broadcast ``a`` [.., P, 1, M] and
    ``b`` [.., 1, R, M] -> ``shape`` [.., P, R]; ``p = 0`` counts the nonzero differences,
    ``p = inf`` takes their maximum."""
    full = tuple(torch.broadcast_shapes(self.shape(a), self.shape(b)))
    d = self.add("abs", [self.add("sub", [self.bcast(a, full), self.bcast(b, full)], full, dtype)], full, dtype)
    axes = (len(full) - 1,)
    if p == float("inf"):
        return self.add("max", [d], shape, dtype, axes=axes, keepdim=False)
    if p == 0:
        nz = self.cast(self.add("ne", [d, self.const(0.0, (), dtype)], full, "bool"), dtype)
        return self.add("sum", [nz], shape, dtype, axes=axes, keepdim=False)
    if p == 1:
        return self.add("sum", [d], shape, dtype, axes=axes, keepdim=False)
    if p == 2:
        s = self.add("sum", [self.binary("mul", d, d)], shape, dtype, axes=axes, keepdim=False)
        return self.add("sqrt", [s], shape, dtype)
    s = self.add("sum", [self.binary("pow", d, self.const(p, (), dtype))], shape, dtype, axes=axes, keepdim=False)
    return self.binary("pow", s, self.const(1.0 / p, (), dtype))


@lowers
def op__cdist_forward(self, n, x1, x2, p, compute_mode=None):
    """``torch.cdist``: x1 [.., P, M], x2 [.., R, M] -> [.., P, R], the p-norm of every
    difference (an elementwise pass over [.., P, R, M] and a reduction; torch's matmul form
    for p = 2 reads less, and differs in the last bits)."""
    shape, dtype = self.out()
    a, b = self.arg(x1, dtype), self.arg(x2, dtype)
    sa, sb = self.shape(a), self.shape(b)
    a = self.reshape(a, sa[:-1] + (1, sa[-1]))
    b = self.reshape(b, sb[:-2] + (1,) + sb[-2:])
    return _pairwise_p(self, a, b, float(p), shape, dtype)


@lowers
def op__pdist_forward(self, n, x, p=2.0):
    """``torch.pdist``: x [N, M] -> the distances of the N (N - 1) / 2 pairs i < j in row-major
    order: :func:`_pairwise_p` of all pairs, then one gather of the upper triangle."""
    shape, dtype = self.out()
    xi = self.arg(x, dtype)
    rows, m = self.shape(xi)
    full = _pairwise_p(self, self.reshape(xi, (rows, 1, m)), self.reshape(xi, (1, rows, m)), float(p),
                       (rows, rows), dtype)
    i, j = np.triu_indices(rows, k=1)
    pick = self.add("input", [], (len(i),), "int64", role="constant", name="pdist_pairs",
                    value=(i * rows + j).astype(np.int64))
    return self.add("gather", [self.reshape(full, (rows * rows,)), pick], shape, dtype, axis=0)
