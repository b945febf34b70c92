"""Layout lowerings: views, permutes, expands, slices, splits, ``cat`` and padding.

Each ``@lowers`` function is the IR lowering of the ATen op packet it is named after (``op_<packet>``),
called as ``fn(lowering, node, *node.args, **node.kwargs)``; see :mod:`..lowering`."""

from __future__ import annotations

from sftctl.compiler.ir import FLOAT_DTYPES
from sftctl.compiler.frontends.torch.lowering import OPS, lowers


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
