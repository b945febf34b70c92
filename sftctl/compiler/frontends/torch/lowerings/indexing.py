"""Data-movement lowerings: embedding, ``index``/``index_put``, ``gather``/``scatter``, slice/select scatters, ``cumsum``, ``flip``.

Each ``@lowers`` function is the IR lowering of the ATen op packet it is named after (``op_<packet>``),
called as ``fn(lowering, node, *node.args, **node.kwargs)``; see :mod:`..lowering`."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from sftctl.compiler.ir import FLOAT_DTYPES, row_major_strides
from sftctl.compiler.frontends.torch.lowering import OPS, lowers, _Id
from sftctl.compiler.frontends.torch.lowerings.select import _bool_position, bool_index, bool_index_put


@lowers
def op_embedding(self, n, weight, indices, *rest):
    shape, dtype = self.out()
    return self.add("gather", [self.arg(weight), self.arg(indices)], shape, dtype, axis=0)


@lowers
def op_index_select(self, n, x, dim, index):
    shape, dtype = self.out()
    i = self.arg(x)
    if not self.shape(i):  # a 0-d tensor: index 0 of it
        idx = self.arg(index)
        return self.reshape(self.add("gather", [self.reshape(i, (1,)), idx], self.shape(idx), dtype, axis=0), shape)
    return self.add("gather", [i, self.arg(index)], shape, dtype, axis=dim % len(self.shape(i)))


def _nonneg(self, idx: int, size: int) -> int:
    """``idx + size`` where negative (python-style wrap), int64."""
    idx = self.cast(idx, "int64")
    neg = self.binary("lt", idx, self.const(0, (), "int64"), "bool")
    wrapped = self.binary("add", idx, self.const(size, (), "int64"))
    return self.add("where", [neg, wrapped, idx], self.shape(idx), "int64")


def _linear_index(self, idxs: list[int], sizes: list[int], bshape) -> int:
    """Row-major linear index into dims of ``sizes`` from per-dim index tensors (broadcast to ``bshape``)."""
    strides = row_major_strides(sizes)
    flat = None
    for idx, size, stride in zip(idxs, sizes, strides):
        term = _nonneg(self, idx, size)
        if stride != 1:
            term = self.binary("mul", term, self.const(stride, (), "int64"))
        flat = term if flat is None else self.binary("add", flat, term)
    return self.bcast(flat, bshape)


def _advanced(self, x: int, indices) -> tuple[int, list[int], tuple[int, ...]]:
    """For ``x[indices]`` (adjacent tensor indices): (first indexed dim k, index ids, broadcast shape)."""
    pos = [k for k, t in enumerate(indices) if t is not None]
    if not pos or pos != list(range(pos[0], pos[0] + len(pos))):
        raise NotImplementedError(f"torch frontend: ATen op {self._node.target} with non-adjacent index tensors")
    ids = [self.arg(indices[k]) for k in pos]
    if any(self.dtype(i) == "bool" for i in ids):
        raise NotImplementedError(f"torch frontend: ATen op {self._node.target} with a boolean mask index")
    bshape = tuple(torch.broadcast_shapes(*[self.shape(i) for i in ids]))
    return pos[0], ids, bshape


@lowers
def op_index(self, n, x, indices):
    if _bool_position(indices) is not None:
        return bool_index(self, n, x, indices)
    shape, dtype = self.out()
    xi = self.arg(x)
    k, ids, bshape = _advanced(self, xi, indices)
    xs = self.shape(xi)
    if len(ids) == 1:
        return self.add("gather", [xi, ids[0]], shape, dtype, axis=k)
    merged = xs[k:k + len(ids)]
    flat = _linear_index(self, ids, list(merged), bshape)
    x2 = self.reshape(xi, xs[:k] + (math.prod(merged),) + xs[k + len(ids):])
    return self.add("gather", [x2, flat], shape, dtype, axis=k)


OPS.update(dict.fromkeys(('_unsafe_index',), op_index))


def _write_count(self, flat: int, axis: int, shape, idx_shape_full) -> int:
    """How many index entries write each position (int32, ``shape``)."""
    ones = self.const(1, idx_shape_full, "int32")
    return self.add("scatter_add", [ones, flat], shape, "int32", axis=axis, size=shape[axis])


def _written_mask(self, flat: int, axis: int, shape, idx_shape_full) -> int:
    return self.binary("gt", _write_count(self, flat, axis, shape, idx_shape_full), self.const(0, (), "int32"), "bool")


def _assigned(self, summed: int, count: int, dtype: str) -> int:
    """Values assigned (not accumulated) through a ``scatter_add`` ``summed``: where an index
    repeats, the mean of its values (torch leaves which one wins undefined; max_unpool's
    repeats carry one value, which this keeps exactly). Integer values stay summed."""
    if dtype not in FLOAT_DTYPES:
        return summed
    return self.binary("div", summed, self.cast(self.binary("maximum", count, self.const(1, (), "int32")), dtype))


@lowers
def op_index_put(self, n, x, indices, values, accumulate=False):
    if _bool_position(indices) is not None:
        return bool_index_put(self, n, x, indices, values, accumulate)
    shape, dtype = self.out()
    xi = self.arg(x, dtype)
    xs = self.shape(xi)
    k, ids, bshape = _advanced(self, xi, indices)
    m = len(ids)
    merged = xs[k:k + m]
    flat = ids[0] if m == 1 else _linear_index(self, ids, list(merged), bshape)
    flat = self.bcast(flat, bshape)
    target = xs[:k] + bshape + xs[k + m:]
    vals = self.bcast(self.arg(values, dtype), target)
    mshape = xs[:k] + (math.prod(merged),) + xs[k + m:]
    sc = self.add("scatter_add", [vals, flat], mshape, dtype, axis=k, size=mshape[k])
    sc = self.reshape(sc, xs)
    if accumulate:
        return sc if self.is_const(xi, 0) else self.binary("add", xi, sc)
    count = self.reshape(_write_count(self, flat, k, mshape, target), xs)
    sc = _assigned(self, sc, count, dtype)
    if self.is_const(xi, 0):
        return sc
    mask = self.binary("gt", count, self.const(0, (), "int32"), "bool")
    return self.add("where", [mask, sc, xi], xs, dtype)


def _take_along_index(self, xs, dim: int, idx: int) -> int:
    ishape = self.shape(idx)
    strides = row_major_strides(xs)
    flat = _nonneg(self, idx, xs[dim])
    if strides[dim] != 1:
        flat = self.binary("mul", flat, self.const(strides[dim], (), "int64"))
    for d in range(len(ishape)):
        if d == dim or ishape[d] == 1:
            continue
        term = self.iota(ishape, d, "int64")
        if strides[d] != 1:
            term = self.binary("mul", term, self.const(strides[d], (), "int64"))
        flat = self.binary("add", flat, term)
    return flat


@lowers
def op_gather(self, n, x, dim, index, sparse_grad=False):
    shape, dtype = self.out()
    xi = self.arg(x)
    xs = self.shape(xi)
    dim %= max(len(xs), 1)
    flat = _take_along_index(self, xs, dim, self.arg(index))
    return self.add("gather", [self.reshape(xi, (math.prod(xs),)), flat], shape, dtype, axis=0)


def _scatter(self, n, x, dim, index, src, mode: str):
    shape, dtype = self.out()
    xi = self.arg(x, dtype)
    xs = self.shape(xi)
    dim %= max(len(xs), 1)
    idx = self.arg(index)
    ishape = self.shape(idx)
    if len(ishape) == len(xs) and ishape[dim] == 1 and all(
            ishape[d] == xs[d] for d in range(len(xs)) if d != dim):
        # one index per row (nll_loss backward, one-hot targets): a compare against the
        # position along ``dim``, elementwise, so it fuses into its consumer as Inductor's
        # lowering does, instead of a materialized "written" mask of the whole tensor
        pos = self.iota(tuple(xs[d] if d == dim else 1 for d in range(len(xs))), dim, "int64")
        hit = self.binary("eq", pos, _nonneg(self, idx, xs[dim]), "bool")
        if isinstance(src, (fx.Node, _Id)):
            s = self.arg(src, dtype)
            for d, size in enumerate(ishape):
                s = self.slice_dim(s, d, 0, size)
        else:
            s = self.const(src, (), dtype)
        if mode == "add":
            contrib = self.add("where", [hit, s, self.const(0, (), dtype)], xs, dtype)
            return contrib if self.is_const(xi, 0) else self.binary("add", xi, contrib)
        return self.add("where", [hit, s, xi], xs, dtype)
    flat = _take_along_index(self, xs, dim, idx)
    total = (math.prod(xs),)
    if isinstance(src, (fx.Node, _Id)):
        s = self.arg(src, dtype)
        for d, size in enumerate(ishape):
            s = self.slice_dim(s, d, 0, size)
    else:
        s = self.const(src, ishape, dtype)
    if mode == "add":
        sc = self.reshape(self.add("scatter_add", [s, flat], total, dtype, axis=0, size=total[0]), xs)
        return sc if self.is_const(xi, 0) else self.binary("add", xi, sc)
    count = self.reshape(_write_count(self, flat, 0, total, ishape), xs)
    mask = self.binary("gt", count, self.const(0, (), "int32"), "bool")
    if isinstance(src, (fx.Node, _Id)):
        new = self.reshape(self.add("scatter_add", [s, flat], total, dtype, axis=0, size=total[0]), xs)
        new = _assigned(self, new, count, dtype)
    else:
        new = self.const(src, (), dtype)
    return self.add("where", [mask, new, xi], xs, dtype)


@lowers
def op_scatter(self, n, x, dim, index, src, reduce=None):
    if reduce is not None:
        self.unsupported(n, f"with reduce={reduce!r}")
    return _scatter(self, n, x, dim, index, src, "set")


@lowers
def op_scatter_add(self, n, x, dim, index, src):
    return _scatter(self, n, x, dim, index, src, "add")


@lowers
def op_scatter_reduce(self, n, x, dim, index, src, reduce, *, include_self=True):
    """``scatter_reduce`` with ``reduce="sum"`` or ``"mean"`` (float): ``scatter_add`` of the
    values and, for the mean, of their count; ``include_self=False`` keeps ``x`` only where
    nothing was written. ``amax`` / ``amin`` / ``prod``: unsupported (the IR scatters by adding)."""
    if reduce not in ("sum", "mean"):
        self.unsupported(n, f"with reduce={reduce!r} (sum and mean are lowered)")
    shape, dtype = self.out()
    if reduce == "mean" and dtype not in FLOAT_DTYPES:
        self.unsupported(n, f"mean of {dtype} (torch rounds it)")
    xi = self.arg(x, dtype)
    xs = self.shape(xi)
    dim %= max(len(xs), 1)
    idx = self.arg(index)
    ishape = self.shape(idx)
    s = self.arg(src, dtype)
    for d, size in enumerate(ishape):
        s = self.slice_dim(s, d, 0, size)
    flat = _take_along_index(self, xs, dim, idx)
    total = (math.prod(xs),)
    summed = self.reshape(self.add("scatter_add", [s, flat], total, dtype, axis=0, size=total[0]), xs)
    count = self.reshape(self.add("scatter_add", [self.const(1, ishape, dtype), flat], total, dtype, axis=0,
                                  size=total[0]), xs)
    written = self.binary("gt", count, self.const(0, (), dtype), "bool")
    if include_self:
        out = self.binary("add", xi, summed)
        if reduce == "mean":
            out = self.binary("div", out, self.binary("add", count, self.const(1, (), dtype)))
        return out
    if reduce == "mean":
        summed = self.binary("div", summed, self.binary("maximum", count, self.const(1, (), dtype)))
    return self.add("where", [written, summed, xi], xs, dtype)


@lowers
def op_slice_scatter(self, n, x, src, dim=0, start=None, end=None, step=1):
    shape, dtype = self.out()
    xi = self.arg(x, dtype)
    rank = len(shape)
    dim %= rank
    s, e, st = slice(start, end, step).indices(shape[dim])
    si = self.arg(src, dtype)
    if st != 1:
        return _strided_slice_scatter(self, xi, si, shape, dtype, dim, s, e, st)
    low, high = [0] * rank, [0] * rank
    low[dim], high[dim] = s, shape[dim] - max(e, s)
    padded = si if not any(low) and not any(high) else self.add(
        "pad", [si], shape, dtype, low=tuple(low), high=tuple(high),
        value=0.0 if dtype in FLOAT_DTYPES else (False if dtype == "bool" else 0))
    if self.is_const(xi, 0) or (s == 0 and e >= shape[dim]):
        return padded
    ishape = tuple(shape[d] if d == dim else 1 for d in range(rank))
    pos = self.iota(ishape, dim, "int64")
    inside = self.binary("logical_and", self.binary("ge", pos, self.const(s, (), "int64"), "bool"),
                         self.binary("lt", pos, self.const(e, (), "int64"), "bool"), "bool")
    return self.add("where", [inside, padded, xi], shape, dtype)


def _strided_slice_scatter(self, xi: int, si: int, shape, dtype: str, dim: int, s: int, e: int, st: int) -> int:
    """``x`` with ``src`` written at positions ``s, s + st, ... < e`` of ``dim`` (Swin's window
    masks, ``y[:, 1::2] = ...``): ``src`` gathered along ``dim`` by ``(pos - s) // st`` and
    selected where ``pos`` is one of those positions (one elementwise pass, as Inductor lowers it)."""
    rank = len(shape)
    count = len(range(s, e, st))
    if count == 0:
        return xi
    ishape = tuple(shape[d] if d == dim else 1 for d in range(rank))
    pos = self.iota((shape[dim],), 0, "int64")
    off = self.binary("sub", pos, self.const(s, (), "int64"))
    k = self.binary("div", off, self.const(st, (), "int64"))  # trunc: only read where off >= 0
    hit = self.binary("logical_and", self.binary("ge", off, self.const(0, (), "int64"), "bool"),
                      self.binary("lt", pos, self.const(e, (), "int64"), "bool"), "bool")
    hit = self.binary("logical_and", hit, self.binary("eq", self.binary("mul", k, self.const(st, (), "int64")),
                                                      off, "bool"), "bool")
    k = self.binary("minimum", self.binary("maximum", k, self.const(0, (), "int64")), self.const(count - 1, (), "int64"))
    placed = self.add("gather", [si, k], shape, dtype, axis=dim)
    return self.add("where", [self.reshape(hit, ishape), placed, xi], shape, dtype)


@lowers
def op_select_scatter(self, n, x, src, dim, index):
    shape, _ = self.out()
    dim %= len(shape)
    index %= shape[dim]
    si = self.arg(src)
    s_shape = tuple(shape[:dim]) + (1,) + tuple(shape[dim + 1:])
    return op_slice_scatter(self, n, x, _Id(self.reshape(si, s_shape)), dim, index, index + 1)


@lowers
def op_cumsum(self, n, x, dim, *, dtype=None):
    shape, odt = self.out()
    xi = self.arg(x, odt)
    if not shape:
        return xi
    return self.add("cumsum", [xi], shape, odt, axis=dim % len(shape))


@lowers
def op_flip(self, n, x, dims):
    shape, _ = self.out()
    i = self.arg(x)
    axes = tuple(sorted({d % len(shape) for d in dims if shape[d % len(shape)] > 1})) if shape else ()
    return self.add("reverse", [i], shape, self.dtype(i), axes=axes) if axes else i


def _bag_of(self, n_idx: int, offsets: int, bags: int) -> int:
    """int64 [n_idx]: the bag of each index position, ``(#offsets <= i) - 1`` over the first
    ``bags`` offsets (a compare of [n_idx, bags] and a row sum: what a GPU kernel reads once)."""
    off = self.cast(self.arg(offsets), "int64")
    if self.shape(off)[0] != bags:
        off = self.slice_dim(off, 0, 0, bags)
    pos = self.iota((n_idx, 1), 0, "int64")
    ge = self.add("ge", [self.bcast(pos, (n_idx, bags)), self.bcast(self.reshape(off, (1, bags)), (n_idx, bags))],
                  (n_idx, bags), "bool")
    cnt = self.add("sum", [self.cast(ge, "int64")], (n_idx,), "int64", axes=(1,), keepdim=False)
    return self.binary("sub", cnt, self.const(1, (), "int64"))


def _bag_keep(self, idx: int, padding_idx) -> int | None:
    """bool [N]: the index positions that count (not ``padding_idx``); None when all do."""
    if padding_idx is None or padding_idx < 0:
        return None
    return self.binary("ne", idx, self.const(int(padding_idx), (), "int64"), "bool")


@lowers("_embedding_bag", "_embedding_bag_forward_only")
def op__embedding_bag(self, n, weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                      per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """``nn.EmbeddingBag`` / ``F.embedding_bag`` (recommender models), ``mode`` sum (0) or mean
    (1): a gather of the rows, times ``per_sample_weights``, ``scatter_add`` into the bags
    (mean: over the bag's non-padding count). Returns ``[output [B, D], offset2bag, bag_size,
    max_indices]`` in the shapes torch gives them. ``max`` (2): unsupported."""
    if mode not in (0, 1):
        self.unsupported(n, "with mode='max' (sum and mean are lowered)")
    (oshape, dtype) = self.out_at(0)
    bags, dim = oshape
    w = self.arg(weight, dtype)
    idx = self.cast(self.arg(indices), "int64")
    count = self.shape(idx)[0]
    rows = self.add("gather", [w, idx], (count, dim), dtype, axis=0)
    if per_sample_weights is not None:
        psw = self.reshape(self.arg(per_sample_weights, dtype), (count, 1))
        rows = self.binary("mul", rows, psw)
    keep = _bag_keep(self, idx, padding_idx)
    if keep is not None:
        rows = self.add("where", [self.reshape(keep, (count, 1)), rows, self.const(0, (), dtype)], (count, dim), dtype)
    bag = _bag_of(self, count, offsets, bags)
    out = self.add("scatter_add", [rows, bag], (bags, dim), dtype, axis=0, size=bags)
    ones = self.const(1, (count,), "int64") if keep is None else self.cast(keep, "int64")
    size = self.add("scatter_add", [ones, bag], (bags,), "int64", axis=0, size=bags)
    if mode == 1:
        div = self.cast(self.binary("maximum", size, self.const(1, (), "int64")), dtype)
        out = self.binary("div", out, self.reshape(div, (bags, 1)))
    results = [out]
    for k, value in ((1, bag), (2, size)):
        shape, odt = self.out_at(k)
        results.append(self.cast(value, odt) if tuple(shape) == self.shape(value) else self.const(0, shape, odt))
    shape, odt = self.out_at(3)
    results.append(self.const(0, shape, odt))
    return results


@lowers
def op__embedding_bag_dense_backward(self, n, grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                     scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):
    """The weight gradient of :func:`op__embedding_bag`: each bag's gradient gathered back to
    its index positions (mean: over the bag's size; times ``per_sample_weights``; padding rows
    0) and ``scatter_add`` into the table's rows."""
    if mode not in (0, 1) or scale_grad_by_freq:
        self.unsupported(n, "with mode='max' or scale_grad_by_freq")
    shape, dtype = self.out()
    g = self.arg(grad, dtype)
    idx = self.cast(self.arg(indices), "int64")
    count, dim = self.shape(idx)[0], shape[1]
    bag = self.cast(self.arg(offset2bag), "int64")
    rows = self.add("gather", [g, bag], (count, dim), dtype, axis=0)
    if mode == 1:
        size = self.add("gather", [self.cast(self.arg(bag_size), dtype), bag], (count,), dtype, axis=0)
        rows = self.binary("div", rows, self.reshape(self.binary("maximum", size, self.const(1, (), dtype)), (count, 1)))
    if per_sample_weights is not None:
        rows = self.binary("mul", rows, self.reshape(self.arg(per_sample_weights, dtype), (count, 1)))
    keep = _bag_keep(self, idx, padding_idx)
    if keep is not None:
        rows = self.add("where", [self.reshape(keep, (count, 1)), rows, self.const(0, (), dtype)], (count, dim), dtype)
    return self.add("scatter_add", [rows, idx], tuple(shape), dtype, axis=0, size=shape[0])


@lowers
def op__embedding_bag_backward(self, n, grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                               scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    """Autograd's entry for the table's gradient: the dense one (``sparse=True`` is priced as
    dense: the same rows are read and written)."""
    return op__embedding_bag_dense_backward(self, n, grad, indices, offset2bag, bag_size, maximum_indices,
                                            num_weights, scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@lowers
def op__embedding_bag_per_sample_weights_backward(self, n, grad, weight, indices, offsets, offset2bag, mode,
                                                  padding_idx=-1):
    """The ``per_sample_weights`` gradient (sum mode): each position's bag gradient dotted with
    its table row (0 at padding)."""
    shape, dtype = self.out()
    idx = self.cast(self.arg(indices), "int64")
    count = self.shape(idx)[0]
    g = self.arg(grad, dtype)
    dim = self.shape(g)[1]
    bag = self.cast(self.arg(offset2bag), "int64")
    prod = self.binary("mul", self.add("gather", [g, bag], (count, dim), dtype, axis=0),
                       self.add("gather", [self.arg(weight, dtype), idx], (count, dim), dtype, axis=0))
    out = self.add("sum", [prod], (count,), dtype, axes=(1,), keepdim=False)
    keep = _bag_keep(self, idx, padding_idx)
    if keep is not None:
        out = self.add("where", [keep, out, self.const(0, (), dtype)], (count,), dtype)
    return self.reshape(out, shape)


@lowers
def op_embedding_renorm(self, n, weight, indices, max_norm, norm_type):
    """``embedding_renorm_`` (``max_norm=`` of nn.Embedding / EmbeddingBag): each row the
    indices name whose ``norm_type``-norm exceeds ``max_norm`` scaled to ``max_norm / (norm +
    1e-7)``, as torch's kernel; the other rows unchanged."""
    shape, dtype = self.out()
    w = self.arg(weight, dtype)
    rows, dim = shape
    ids = self.cast(self.arg(indices), "int64")
    idx = self.reshape(ids, (math.prod(self.shape(ids)),))
    hits = self.add("scatter_add", [self.const(1, self.shape(idx), "int32"), idx], (rows,), "int32", axis=0, size=rows)
    p = float(norm_type)
    a = self.add("abs", [w], shape, dtype)
    if p == 2.0:
        norm = self.add("sqrt", [self.add("sum", [self.binary("mul", a, a)], (rows, 1), dtype, axes=(1,), keepdim=True)],
                        (rows, 1), dtype)
    elif p == 1.0:
        norm = self.add("sum", [a], (rows, 1), dtype, axes=(1,), keepdim=True)
    else:
        s = self.add("sum", [self.binary("pow", a, self.const(p, (), dtype))], (rows, 1), dtype, axes=(1,), keepdim=True)
        norm = self.binary("pow", s, self.const(1.0 / p, (), dtype))
    over = self.add("logical_and", [self.reshape(self.binary("gt", hits, self.const(0, (), "int32"), "bool"), (rows, 1)),
                                    self.binary("gt", norm, self.const(float(max_norm), (), dtype), "bool")], (rows, 1), "bool")
    scale = self.binary("div", self.const(float(max_norm), (), dtype), self.binary("add", norm, self.const(1e-7, (), dtype)))
    return self.add("where", [self.bcast(over, shape), self.binary("mul", w, scale), w], shape, dtype)
