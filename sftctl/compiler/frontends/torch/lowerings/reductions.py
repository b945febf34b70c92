"""Reduction lowerings: ``sum``, ``mean``, ``amax``/``amin``, ``max``/``min``, ``any``/``all``, ``var``/``var_mean``.

Each ``@lowers`` function is the IR lowering of the ATen op packet it is named after (``op_<packet>``),
called as ``fn(lowering, node, *node.args, **node.kwargs)``; see :mod:`..lowering`."""

from __future__ import annotations

import math

import torch.fx as fx

from sftctl.compiler.frontends.torch.lowering import _Id, _norm_dims, lowers
from sftctl.compiler.frontends.torch.lowerings.elementwise import op_maximum, op_minimum
from sftctl.compiler.ir import FLOAT_DTYPES


def _reduce(self, irop: str, x, dims, keepdim: bool, in_dtype: str | None = None):
    shape, dtype = self.out()
    xi = self.arg(x, in_dtype or dtype)
    rank = len(self.shape(xi))
    axes = _norm_dims(dims, rank)
    if rank == 0 or not axes:
        return self.reshape(self.cast(xi, dtype), shape)
    y = self.add(irop, [xi], shape, in_dtype or dtype, axes=axes, keepdim=bool(keepdim))
    return self.cast(y, dtype)


@lowers
def op_sum(self, n, x, dim=None, keepdim=False, dtype=None):
    return _reduce(self, "sum", x, dim, keepdim)


@lowers
def op_mean(self, n, x, dim=None, keepdim=False, dtype=None):
    shape, odt = self.out()
    s = _reduce(self, "sum", x, dim, keepdim)
    xs = self.val(x).shape
    count = math.prod(xs[d] for d in _norm_dims(dim, len(xs))) if len(xs) else 1
    return self.binary("div", s, self.const(count, (), odt))


@lowers
def op_amax(self, n, x, dim=(), keepdim=False):
    return _reduce(self, "max", x, dim, keepdim)


@lowers
def op_amin(self, n, x, dim=(), keepdim=False):
    return _reduce(self, "min", x, dim, keepdim)


def _max_or_min(self, n, x, rest, kw, largest: bool):
    """``torch.max`` (``largest``) or ``torch.min``: with another tensor, elementwise
    (``maximum``/``minimum``); with ``dim``, ``[values, indices]`` along it; else the whole
    tensor's extreme."""
    if rest or kw:
        if isinstance(rest[0] if rest else None, fx.Node):
            return (op_maximum if largest else op_minimum)(self, n, x, rest[0])
        dim = rest[0] if rest else kw["dim"]
        keepdim = rest[1] if len(rest) > 1 else kw.get("keepdim", False)
        return list(_arg_extreme(self, x, dim, keepdim, largest=largest))
    return _reduce(self, "max" if largest else "min", x, None, False)


@lowers
def op_max(self, n, x, *rest, **kw):
    return _max_or_min(self, n, x, rest, kw, largest=True)


@lowers
def op_min(self, n, x, *rest, **kw):
    return _max_or_min(self, n, x, rest, kw, largest=False)


@lowers
def op_any(self, n, x, dim=None, keepdim=False):
    return _reduce(self, "max", x, dim, keepdim, in_dtype="bool")


@lowers
def op_all(self, n, x, dim=None, keepdim=False):
    return _reduce(self, "min", x, dim, keepdim, in_dtype="bool")


def _var_mean(self, x, dim, correction, keepdim):
    shape, dtype = self.out_at(0)
    xi = self.arg(x, dtype)
    xs = self.shape(xi)
    axes = _norm_dims(dim, len(xs))
    count = math.prod(xs[d] for d in axes)
    kshape = tuple(1 if d in axes else s for d, s in enumerate(xs))
    s = self.add("sum", [xi], kshape, dtype, axes=axes, keepdim=True)
    mean = self.binary("div", s, self.const(count, (), dtype))
    d = self.binary("sub", xi, mean)
    ss = self.add("sum", [self.binary("mul", d, d)], shape, dtype, axes=axes, keepdim=bool(keepdim))
    corr = 1 if correction is None else correction
    var = self.binary("div", ss, self.const(max(count - corr, 0), (), dtype))
    return var, self.reshape(mean, shape)


@lowers
def op_var_mean(self, n, x, dim=None, *, correction=None, keepdim=False, **kw):
    if "unbiased" in kw:
        correction = 1 if kw["unbiased"] else 0
    if isinstance(dim, bool):
        correction, dim = (1 if dim else 0), None
    return list(_var_mean(self, x, dim, correction, keepdim))


@lowers
def op_var(self, n, x, dim=None, *, correction=None, keepdim=False, **kw):
    return op_var_mean(self, n, x, dim, correction=correction, keepdim=keepdim, **kw)[0]


def _arg_extreme(self, x, dim, keepdim: bool, largest: bool) -> tuple[int, int]:
    """``(values, indices)`` of the maximum (``largest``) or minimum of ``x`` along ``dim``
    (``None``: the flattened tensor), indices int64, the first index among equal values as
    torch returns it: the reduced extreme, an ``eq`` against it, and a ``min`` reduction of an
    ``iota`` where it holds (two reductions and elementwise ops; what a GPU argmax reads)."""
    xi = self.arg(x)
    if dim is None:
        xi = self.reshape(xi, (max(1, math.prod(self.shape(xi))),))
        dim = 0
    xs = self.shape(xi)
    if not xs:
        return xi, self.const(0, (), "int64")
    d = dim % len(xs)
    kshape = tuple(1 if i == d else s for i, s in enumerate(xs))
    oshape = kshape if keepdim else tuple(s for i, s in enumerate(xs) if i != d)
    dt = self.dtype(xi)
    m = self.add("max" if largest else "min", [xi], kshape, dt, axes=(d,), keepdim=True)
    hit = self.add("eq", [xi, self.bcast(m, xs)], xs, "bool")
    cand = self.add("where", [hit, self.iota(xs, d), self.const(xs[d], (), "int64")], xs, "int64")
    idx = self.add("min", [cand], kshape, "int64", axes=(d,), keepdim=True)
    return self.reshape(m, oshape), self.reshape(idx, oshape)


@lowers
def op_argmax(self, n, x, dim=None, keepdim=False):
    shape, _ = self.out()
    return self.reshape(_arg_extreme(self, x, dim, keepdim, True)[1], shape)


@lowers
def op_argmin(self, n, x, dim=None, keepdim=False):
    shape, _ = self.out()
    return self.reshape(_arg_extreme(self, x, dim, keepdim, False)[1], shape)


@lowers
def op_topk(self, n, x, k, dim=-1, largest=True, sorted=True):
    """``torch.topk`` for the small ``k`` of MoE routers and top-k sampling: ``k`` rounds of
    arg-extreme, each masking its pick with -inf (+inf for the smallest) before the next, so the
    result is sorted (ties: the lower index first). Returns ``[values, indices]``."""
    xi = self.arg(x)
    xs = self.shape(xi)
    if not xs:
        return [xi, self.const(0, (), "int64")]
    d = dim % len(xs)
    k = int(k)
    if k > 16:
        self.unsupported(n, f"with k={k} (lowered for k <= 16, as routers and samplers use it)")
    dt = self.dtype(xi)
    fill = self.const(float("-inf") if largest else float("inf"), (), dt) if dt in FLOAT_DTYPES else None
    if fill is None:
        self.unsupported(n, f"on {dt}")
    vals, idxs = [], []
    cur = _Id(xi)
    for j in range(k):
        v, i = _arg_extreme(self, cur, d, True, largest)
        vals.append(v)
        idxs.append(i)
        if j + 1 < k:
            pick = self.add("eq", [self.iota(xs, d), self.bcast(i, xs)], xs, "bool")
            cur = _Id(self.add("where", [pick, fill, int(cur)], xs, dt))
    (vshape, vdt), _ = self.out_at(0), self.out_at(1)
    cat = lambda parts, dtype: parts[0] if len(parts) == 1 else self.add(  # noqa: E731
        "concatenate", parts, vshape, dtype, axis=d)
    return [self.cast(cat(vals, dt), vdt), cat(idxs, "int64")]


@lowers
def op_prod(self, n, x, dim=None, keepdim=False, dtype=None):
    """``torch.prod`` over all elements or one ``dim``: the IR ``prod`` reduction (bool and
    integer inputs in the output's integer dtype, as torch promotes them)."""
    return _reduce(self, "prod", x, dim, keepdim)


@lowers
def op_cumprod(self, n, x, dim, dtype=None):
    """``torch.cumprod``: :meth:`GraphBuilder.cumprod` (float dtypes; its backward, which torch
    writes with cumprod and cumsum, traces through it)."""
    shape, odt = self.out()
    xi = self.arg(x, odt)
    if not shape:
        return xi
    if odt not in FLOAT_DTYPES:
        self.unsupported(n, f"of {odt}")
    return self.cumprod(xi, dim % len(shape))
