"""Data-dependent selects at their bound (see :mod:`..dynamic`): ``nonzero``, ``masked_select`` and
the boolean-mask forms of ``index`` / ``index_put`` (``x[mask]``, ``x[mask] = v``, and the
backward of a select, an accumulating ``index_put``).

A select of ``count`` true elements of a mask of N elements into a bound B is a compaction: the
prefix sum of the mask gives each chosen element its row, a ``scatter_add`` of positions into
B + 1 slots (the last one takes what falls past the bound) the source row of each output row,
and a ``gather`` the rows. Rows past ``count`` read row 0: padding, which the lowering masks
wherever rows meet (:meth:`..lowering._Lowering.pad_fill`). Writing back through a mask needs no
scatter: each masked element takes the row its prefix sum names (a ``gather``) under a ``where``.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from sftctl.compiler.frontends.torch.lowering import lowers


def _compaction(self, mask: int, bound: int) -> tuple[int, int, int]:
    """For a bool mask of any shape: (flat mask [N] bool, position [N] int64 of each element among
    the chosen ones (its row in the select), source index [bound] int64 of each output row)."""
    n = math.prod(self.shape(mask))
    flat = self.reshape(mask if self.dtype(mask) == "bool" else self.cast(mask, "bool"), (n,))
    ones = self.cast(flat, "int64")
    pos = self.binary("sub", self.add("cumsum", [ones], (n,), "int64", axis=0), self.const(1, (), "int64"))
    keep = self.binary("logical_and", flat, self.binary("lt", pos, self.const(bound, (), "int64"), "bool"), "bool")
    slot = self.add("where", [keep, pos, self.const(bound, (), "int64")], (n,), "int64")
    src = self.add("scatter_add", [self.iota((n,), 0, "int64"), slot], (bound + 1,), "int64", axis=0, size=bound + 1)
    return flat, pos, self.slice_dim(src, 0, 0, bound)


def _bool_position(indices) -> tuple[int, fx.Node] | None:
    """(dim, mask) of the one boolean index of an ``index``/``index_put`` (None if none)."""
    found = [(k, t) for k, t in enumerate(indices) if isinstance(t, fx.Node) and t.meta["val"].dtype == torch.bool]
    if not found:
        return None
    if len(found) > 1 or any(t is not None for k, t in enumerate(indices) if k != found[0][0]):
        raise NotImplementedError(
            "torch frontend: a boolean mask index combined with other index tensors is not supported; "
            "index with the mask alone (x[mask]) or use torch.where")
    return found[0]


def bool_index(self, n, x, indices):
    """``x[..., mask, ...]``: the rows ``mask`` selects, compacted to the front of a dim of the
    select's bound (``None``s before the mask keep their dims)."""
    k, mask = _bool_position(indices)
    shape, dtype = self.out()
    xi = self.arg(x)
    xs = self.shape(xi)
    mi = self.arg(mask)
    m = len(self.shape(mi))
    bound = shape[k]
    _, _, src = _compaction(self, mi, bound)
    x2 = self.reshape(xi, xs[:k] + (math.prod(xs[k:k + m]),) + xs[k + m:])
    return self.add("gather", [x2, src], shape, dtype, axis=k)


def bool_index_put(self, n, x, indices, values, accumulate=False):
    """``x[mask] = values`` (``accumulate``: ``+=``): each element under the mask takes the row of
    ``values`` its prefix sum names (or ``values`` broadcast when it has no selected dim)."""
    k, mask = _bool_position(indices)
    shape, dtype = self.out()
    xi = self.arg(x, dtype)
    xs = self.shape(xi)
    mi = self.arg(mask)
    mshape = self.shape(mi)
    m = len(mshape)
    flat, pos, _ = _compaction(self, mi, 1)
    vi = self.arg(values, dtype)
    vs = self.shape(vi)
    rest = xs[k + m:]
    if len(vs) == k + 1 + len(rest) and vs[k] > 1:  # one row per selected element (else broadcast)
        bound = vs[k]
        at = self.binary("minimum", pos, self.const(bound - 1, (), "int64"))
        at = self.binary("maximum", at, self.const(0, (), "int64"))
        rows = self.add("gather", [vi, at], vs[:k] + (math.prod(mshape),) + rest, dtype, axis=k)
        rows = self.reshape(rows, xs)
        if bound < math.prod(mshape):  # rows past the bound were dropped by the select
            inside = self.binary("lt", pos, self.const(bound, (), "int64"), "bool")
            flat = self.binary("logical_and", flat, inside, "bool")
    else:
        rows = self.bcast(vi, xs)
    hit = self.reshape(flat, (1,) * k + tuple(mshape) + (1,) * len(rest))
    hit = self.bcast(hit, xs)
    if accumulate:
        return self.binary("add", xi, self.add("where", [hit, rows, self.const(0, (), dtype)], xs, dtype))
    return self.add("where", [hit, rows, xi], xs, dtype)


@lowers
def op_nonzero(self, n, x):
    """``nonzero(x)``: [bound, rank] int64 coordinates of the nonzero elements in row-major order."""
    shape, dtype = self.out()
    xi = self.arg(x)
    xs = self.shape(xi)
    if not xs:  # a 0-d tensor: [0 or 1, 0], no coordinates to give
        return self.const(0, shape, dtype)
    mask = self.binary("ne", xi, self.const(0, (), self.dtype(xi)), "bool") if self.dtype(xi) != "bool" else xi
    _, _, src = _compaction(self, mask, shape[0])
    cols = []
    stride = math.prod(xs)
    for size in xs:
        stride //= size
        c = self.binary("div", src, self.const(stride, (), "int64")) if stride != 1 else src
        q = self.binary("div", c, self.const(size, (), "int64"))  # c mod size (c >= 0)
        c = self.binary("sub", c, self.binary("mul", q, self.const(size, (), "int64")))
        cols.append(self.reshape(c, (shape[0], 1)))
    if len(cols) == 1:
        return self.cast(cols[0], dtype)
    return self.cast(self.add("concatenate", cols, shape, "int64", axis=1), dtype)


@lowers
def op_masked_select(self, n, x, mask):
    shape, dtype = self.out()
    xi = self.arg(x)
    mi = self.arg(mask)
    bshape = tuple(torch.broadcast_shapes(self.shape(xi), self.shape(mi)))
    xi, mi = self.bcast(xi, bshape), self.bcast(mi, bshape)
    _, _, src = _compaction(self, mi, shape[0])
    return self.add("gather", [self.reshape(xi, (math.prod(bshape),)), src], shape, dtype, axis=0)


@lowers
def op_masked_scatter(self, n, x, mask, source):
    """``x.masked_scatter(mask, source)`` (the backward of ``masked_select``): the k-th True
    element of the broadcast mask takes ``source``'s k-th element (row-major)."""
    shape, dtype = self.out()
    xi = self.arg(x, dtype)
    mi = self.bcast(self.arg(mask), shape)
    flat, pos, _ = _compaction(self, mi, 1)
    si = self.arg(source, dtype)
    total = math.prod(self.shape(si))
    at = self.binary("maximum", self.binary("minimum", pos, self.const(total - 1, (), "int64")),
                     self.const(0, (), "int64"))
    vals = self.add("gather", [self.reshape(si, (total,)), at], (math.prod(shape),), dtype, axis=0)
    inside = self.binary("logical_and", flat, self.binary("lt", pos, self.const(total, (), "int64"), "bool"), "bool")
    return self.add("where", [self.reshape(inside, shape), self.reshape(vals, shape), xi], shape, dtype)
