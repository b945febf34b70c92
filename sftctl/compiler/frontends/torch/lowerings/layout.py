"""Layout lowerings: views, permutes, expands, slices, splits, ``cat`` and padding.

Each ``@lowers`` function is the IR lowering of the ATen op packet it is named after (``op_<packet>``),
called as ``fn(lowering, node, *node.args, **node.kwargs)``; see :mod:`..lowering`."""

from __future__ import annotations

import math

import numpy as np

from sftctl.compiler.ir import FLOAT_DTYPES, row_major_strides
from sftctl.compiler.frontends.torch.lowering import OPS, VIEW_WRITEBACK, lowers


@lowers
def op_view(self, n, x, size):
    if not isinstance(size, (list, tuple)):
        self.unsupported(n, "(dtype view)")
    shape, _ = self.out()
    return self.reshape(self.arg(x), shape)


OPS.update(dict.fromkeys(('_unsafe_view', 'reshape'), op_view))


@lowers
def op_unsqueeze(self, n, x, dim):
    shape, _ = self.out()
    return self.reshape(self.arg(x), shape)


@lowers
def op_squeeze(self, n, x, *dims):
    shape, _ = self.out()
    return self.reshape(self.arg(x), shape)


@lowers
def op_permute(self, n, x, dims):
    i = self.arg(x)
    rank = len(self.shape(i))
    return self.transpose(i, [d % rank for d in dims])


@lowers
def op_t(self, n, x):
    i = self.arg(x)
    return self.transpose(i, (1, 0)) if len(self.shape(i)) == 2 else i


@lowers
def op_transpose(self, n, x, d0, d1):
    i = self.arg(x)
    rank = len(self.shape(i))
    perm = list(range(rank))
    d0, d1 = d0 % rank, d1 % rank
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return self.transpose(i, perm)


@lowers
def op_expand(self, n, x, size, implicit=False):
    shape, _ = self.out()
    return self.bcast(self.arg(x), shape)


@lowers
def op_slice(self, n, x, dim=0, start=None, end=None, step=1):
    i = self.arg(x)
    size = self.shape(i)[dim]
    s, e, st = slice(start, end, step).indices(size)
    return self.slice_dim(i, dim % len(self.shape(i)), s, max(e, s), st)


@lowers
def op_select(self, n, x, dim, index):
    i = self.arg(x)
    rank = len(self.shape(i))
    dim %= rank
    index %= self.shape(i)[dim]
    shape, _ = self.out()
    return self.reshape(self.slice_dim(i, dim, index, index + 1), shape)


@lowers
def op_split_with_sizes(self, n, x, sizes, dim=0):
    i = self.arg(x)
    dim %= len(self.shape(i))
    outs, start = [], 0
    for s in sizes:
        outs.append(self.slice_dim(i, dim, start, start + s))
        start += s
    return outs


@lowers
def op_split(self, n, x, split_size, dim=0):
    i = self.arg(x)
    dim %= len(self.shape(i))
    size = self.shape(i)[dim]
    if isinstance(split_size, (list, tuple)):
        return op_split_with_sizes(self, n, x, split_size, dim)
    sizes = [min(split_size, size - s) for s in range(0, size, split_size)] or [0]
    return op_split_with_sizes(self, n, x, sizes, dim)


@lowers
def op_unbind(self, n, x, dim=0):
    i = self.arg(x)
    rank = len(self.shape(i))
    dim %= rank
    out_shape = self.shape(i)[:dim] + self.shape(i)[dim + 1:]
    return [self.reshape(self.slice_dim(i, dim, k, k + 1), out_shape) for k in range(self.shape(i)[dim])]


@lowers
def op_cat(self, n, tensors, dim=0):
    shape, dtype = self.out()
    ids = [self.arg(t, dtype) for t in tensors]
    ids = [i for i in ids if self.shape(i) != (0,) or len(shape) == 1]
    if len(ids) == 1:
        return ids[0]
    return self.add("concatenate", ids, shape, dtype, axis=dim % len(shape))


@lowers
def op_constant_pad_nd(self, n, x, pad, value=0):
    shape, dtype = self.out()
    i = self.arg(x)
    rank = len(self.shape(i))
    low, high = [0] * rank, [0] * rank
    for k in range(len(pad) // 2):
        low[rank - 1 - k], high[rank - 1 - k] = pad[2 * k], pad[2 * k + 1]
    if not any(low) and not any(high):
        return i
    return self.add("pad", [i], shape, dtype, low=tuple(low), high=tuple(high), value=float(value)
                    if dtype in FLOAT_DTYPES else int(value))


def _strided_index(self, shape, strides, offset: int) -> int:
    """int64 ``offset + sum_d i_d * strides[d]`` over ``shape``, built from ``iota``."""
    idx = self.const(int(offset), shape, "int64")
    for d, st in enumerate(strides):
        if shape[d] == 1 or not st:
            continue
        term = self.binary("mul", self.iota(shape, d), self.const(int(st), (), "int64"))
        idx = self.binary("add", idx, term)
    return idx


def _strided_gather(self, x: int, shape, strides, offset: int, dtype: str) -> int:
    """The view of ``x``'s row-major storage with ``shape``, element ``strides`` and
    ``offset`` (torch's ``as_strided`` semantics): one ``gather`` from the flattened tensor at
    :func:`_strided_index` (what a GPU reads: one strided copy)."""
    shape = tuple(int(s) for s in shape)
    flat = self.reshape(x, (math.prod(self.shape(x)),))
    return self.add("gather", [flat, _strided_index(self, shape, strides, offset)], shape, dtype, axis=0)


def _strided_writeback(self, base: int, shape, strides, offset: int, new: int, *, check_overlap: bool) -> int:
    """``base`` after an in-place write of ``new`` into its strided view (``shape``, element
    ``strides``, ``offset`` into the row-major base): ``base + scatter_add(new - old)`` at the
    view's positions. Raises NotImplementedError (via ``unsupported``) where ``check_overlap``
    finds a position the view holds twice."""
    shape = tuple(int(s) for s in shape)
    if not math.prod(shape) or not math.prod(self.shape(base)):
        return base  # nothing written
    if check_overlap:
        pos = np.full(shape, int(offset), dtype=np.int64)
        for d, st in enumerate(strides):
            pos = pos + np.arange(shape[d]).reshape([-1 if k == d else 1 for k in range(len(shape))]) * int(st)
        if np.unique(pos).size != pos.size:
            self.unsupported(self._node, "(an in-place write into an as_strided view whose elements overlap)")
    bshape, dtype = self.shape(base), self.dtype(base)
    total = math.prod(bshape)
    delta = self.add("sub", [self.bcast(self.cast(new, dtype), shape),
                             _strided_gather(self, base, shape, strides, offset, dtype)], shape, dtype)
    count = math.prod(shape)
    idx = self.reshape(_strided_index(self, shape, strides, offset), (count,))
    sc = self.add("scatter_add", [self.reshape(delta, (count,)), idx], (total,), dtype, axis=0, size=total)
    return self.binary("add", base, self.reshape(sc, bshape))


def _writeback_as_strided(self, view, base: int, new: int) -> int:
    size, stride = view.args[1], view.args[2]
    offset = (view.args[3] if len(view.args) > 3 else view.kwargs.get("storage_offset")) or 0
    return _strided_writeback(self, base, size, stride, offset, new, check_overlap=True)


def _writeback_slice(self, view, base: int, new: int) -> int:
    bshape = self.shape(base)
    dim = (view.args[1] if len(view.args) > 1 else 0) % len(bshape)
    start = view.args[2] if len(view.args) > 2 else None
    end = view.args[3] if len(view.args) > 3 else None
    step = view.args[4] if len(view.args) > 4 else 1
    s, _, st = slice(start, end, step).indices(bshape[dim])
    rm = list(row_major_strides(bshape))
    strides = list(rm)
    strides[dim] = rm[dim] * st
    return _strided_writeback(self, base, self.shape(new), strides, s * rm[dim], new, check_overlap=False)


def _writeback_select(self, view, base: int, new: int) -> int:
    bshape = self.shape(base)
    dim = view.args[1] % len(bshape)
    index = view.args[2] % bshape[dim]
    rm = list(row_major_strides(bshape))
    strides = [r for k, r in enumerate(rm) if k != dim]
    return _strided_writeback(self, base, self.shape(new), strides, index * rm[dim], new, check_overlap=False)


def _writeback_permute(self, view, base: int, new: int) -> int:
    bshape = self.shape(base)
    rank = len(bshape)
    if view.target._schema.name.endswith("permute"):
        perm = [d % rank for d in view.args[1]]
    else:  # transpose / t
        perm = list(range(rank))
        d0, d1 = (view.args[1] % rank, view.args[2] % rank) if len(view.args) > 2 else (0, 1)
        perm[d0], perm[d1] = perm[d1], perm[d0]
    inverse = [perm.index(k) for k in range(rank)]
    return self.transpose(self.cast(new, self.dtype(base)), inverse)


def _writeback_reshape(self, view, base: int, new: int) -> int:
    return self.reshape(self.cast(new, self.dtype(base)), self.shape(base))


def _writeback_diagonal(self, view, base: int, new: int) -> int:
    """A write into ``diagonal(base, offset, dim1, dim2)`` (``torch.func.jacrev``'s basis:
    ``zeros(n, n).diagonal().fill_(1)``): the strided view :func:`op_diagonal` reads."""
    bshape = self.shape(base)
    rank = len(bshape)
    args = list(view.args[1:]) + [None] * 3
    offset = args[0] if args[0] is not None else view.kwargs.get("offset", 0)
    d1 = (args[1] if args[1] is not None else view.kwargs.get("dim1", 0)) % rank
    d2 = (args[2] if args[2] is not None else view.kwargs.get("dim2", 1)) % rank
    rm = list(row_major_strides(bshape))
    start = offset * rm[d2] if offset >= 0 else -offset * rm[d1]
    strides = [rm[k] for k in range(rank) if k not in (d1, d2)] + [rm[d1] + rm[d2]]
    return _strided_writeback(self, base, self.shape(new), strides, start, new, check_overlap=False)


def _writeback_alias(self, view, base: int, new: int) -> int:
    return self.cast(new, self.dtype(base))


VIEW_WRITEBACK.update({"diagonal": _writeback_diagonal, "alias": _writeback_alias, "detach": _writeback_alias})
VIEW_WRITEBACK.update({"as_strided": _writeback_as_strided, "slice": _writeback_slice, "select": _writeback_select,
                       "permute": _writeback_permute, "transpose": _writeback_permute, "t": _writeback_permute,
                       **dict.fromkeys(("view", "_unsafe_view", "reshape", "unsqueeze", "squeeze"), _writeback_reshape)})


@lowers("resize", "resize_")
def op_resize(self, n, x, size, memory_format=None):
    """``resize_`` (an ``out=`` tensor sized to its result): the row-major prefix of the old
    contents when the new size is not larger; new elements, which torch leaves uninitialized,
    are 0."""
    shape, dtype = self.out()
    xi = self.arg(x, dtype)
    old, new = math.prod(self.shape(xi)), math.prod(shape)
    flat = self.reshape(xi, (old,))
    if new <= old:
        return self.reshape(self.slice_dim(flat, 0, 0, new) if new < old else flat, shape)
    pad = self.add("pad", [flat], (new,), dtype, low=(0,), high=(new - old,),
                   value=False if dtype == "bool" else 0 if dtype not in ("float64", "float32", "bfloat16", "float16") else 0.0)
    return self.reshape(pad, shape)


@lowers
def op_as_strided(self, n, x, size, stride, storage_offset=None):
    """``as_strided`` of a tensor the graph made (contiguous, offset 0, as functionalized
    graphs hand it over, e.g. ``nn.GroupNorm``'s views): a strided gather."""
    shape, dtype = self.out()
    src = self.val(x)
    if not src.is_contiguous() or src.storage_offset():
        self.unsupported(n, "(of a non-contiguous or offset tensor)")
    return _strided_gather(self, self.arg(x, dtype), shape, stride, storage_offset or 0, dtype)


@lowers
def op_diagonal(self, n, x, offset=0, dim1=0, dim2=1):
    """``torch.diagonal``: the other dims first, the diagonal last, as a strided gather of the
    row-major input (stride of the diagonal: the two dims' strides summed)."""
    shape, dtype = self.out()
    xi = self.arg(x, dtype)
    xs = self.shape(xi)
    rank = len(xs)
    d1, d2 = dim1 % rank, dim2 % rank
    rm = list(row_major_strides(xs))
    if not math.prod(shape):
        return self.const(0, shape, dtype)
    start = offset * rm[d2] if offset >= 0 else -offset * rm[d1]
    strides = [rm[k] for k in range(rank) if k not in (d1, d2)] + [rm[d1] + rm[d2]]
    return _strided_gather(self, xi, shape, strides, start, dtype)
