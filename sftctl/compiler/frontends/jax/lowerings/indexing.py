"""Indexing: ``gather`` / ``scatter`` / ``scatter-add`` in the two forms ``jax.numpy`` emits (a *take*
along one axis, a *point gather* at a computed linear index; see the package's docstring) and
``dynamic_slice`` / ``dynamic_update_slice``."""

from __future__ import annotations

import math

from sftctl.compiler.frontends.jax.lowering import _prim
from sftctl.compiler.ir import row_major_strides


@_prim("gather")
def _gather(self, args, p, shape, dtype):
    return [_lower_gather(self, args[0], args[1], p, shape, dtype)]


@_prim("scatter")
def _scatter(self, args, p, shape, dtype):
    if not tuple(p["dimension_numbers"].scatter_dims_to_operand_dims) and self.shape(args[2]) == shape:
        return [self.cast(args[2], dtype)]  # x.at[...].set(v) over the whole array: v
    raise NotImplementedError("jax frontend: primitive scatter has no IR lowering")


@_prim("scatter-add", "scatter_add")
def _scatter_add(self, args, p, shape, dtype):
    return [_lower_scatter_add(self, args[0], args[1], args[2], p, shape, dtype)]


def _clamped_starts(self, operand_shape, starts, sizes) -> list[int]:
    """int64 0-d start of each dim, clamped into [0, dim - size] as XLA clamps them."""
    out = []
    for d, (st, size) in enumerate(zip(starts, sizes)):
        s0 = self.add("maximum", [self.cast(st, "int64"), self.const(0, (), "int64")], (), "int64")
        out.append(self.add("minimum", [s0, self.const(int(operand_shape[d]) - int(size), (), "int64")], (), "int64"))
    return out


def _dynamic_window(self, operand_shape, starts, sizes) -> int:
    """int64 flat index over ``sizes`` into the flattened operand for a window at traced
    ``starts`` (clamped: :func:`_clamped_starts`)."""
    rm = row_major_strides(list(operand_shape))
    flat = None
    for d, s0 in enumerate(_clamped_starts(self, operand_shape, starts, sizes)):
        term = self.add("add", [self.add("iota", [], tuple(sizes), "int64", axis=d),
                                self.add("broadcast_in_dim", [s0], tuple(sizes), "int64", shape=tuple(sizes), dims=())],
                        tuple(sizes), "int64")
        if rm[d] != 1:
            term = self.add("mul", [term, self.const(rm[d], (), "int64")], tuple(sizes), "int64")
        flat = term if flat is None else self.add("add", [flat, term], tuple(sizes), "int64")
    return flat


@_prim("dynamic_slice")
def _dynamic_slice(self, args, p, shape, dtype):
    """``lax.dynamic_slice`` at traced start indices: one gather from the flattened operand."""
    x = self.cast(args[0], dtype)
    xs = self.shape(x)
    if not xs:
        return [x]
    flat = _dynamic_window(self, xs, args[1:1 + len(xs)], shape)
    n = 1
    for v in xs:
        n *= v
    return [self.add("gather", [self.add("reshape", [x], (n,), dtype, shape=(n,)), flat], shape, dtype, axis=0)]


@_prim("dynamic_update_slice")
def _dynamic_update_slice(self, args, p, shape, dtype):
    """``lax.dynamic_update_slice``: the update where the (clamped) window lies, the operand
    elsewhere: a compare of each position with the window and one gather of the update."""
    x, upd = self.cast(args[0], dtype), self.cast(args[1], dtype)
    us = self.shape(upd)
    if not shape:
        return [upd]
    starts = _clamped_starts(self, shape, args[2:2 + len(shape)], us)
    inside = None
    rel = None
    urm = row_major_strides(list(us))
    for d, s0 in enumerate(starts):
        pos = self.add("iota", [], shape, "int64", axis=d)
        off = self.add("sub", [pos, self.add("broadcast_in_dim", [s0], shape, "int64", shape=shape, dims=())], shape, "int64")
        ok = self.add("logical_and", [self.add("ge", [off, self.const(0, (), "int64")], shape, "bool"),
                                      self.add("lt", [off, self.const(us[d], (), "int64")], shape, "bool")], shape, "bool")
        inside = ok if inside is None else self.add("logical_and", [inside, ok], shape, "bool")
        off = self.add("minimum", [self.add("maximum", [off, self.const(0, (), "int64")], shape, "int64"),
                                   self.const(max(us[d] - 1, 0), (), "int64")], shape, "int64")
        term = off if urm[d] == 1 else self.add("mul", [off, self.const(urm[d], (), "int64")], shape, "int64")
        rel = term if rel is None else self.add("add", [rel, term], shape, "int64")
    n = 1
    for v in us:
        n *= v
    if n == 0:
        return [x]
    picked = self.add("gather", [self.add("reshape", [upd], (n,), dtype, shape=(n,)), rel], shape, dtype, axis=0)
    return [self.add("where", [inside, picked, x], shape, dtype)]


def _take_form(self, dn, operand_shape, slice_sizes, index_shape):
    """The axis of a *take* gather/scatter (one indexed axis, full slices), else None."""
    smap = tuple(dn.start_index_map if hasattr(dn, "start_index_map") else dn.scatter_dims_to_operand_dims)
    collapsed = tuple(dn.collapsed_slice_dims if hasattr(dn, "collapsed_slice_dims") else dn.inserted_window_dims)
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    if len(smap) != 1 or collapsed != smap or batching or index_shape[-1] != 1:
        return None
    a = smap[0]
    if slice_sizes is not None and any(s != (1 if d == a else operand_shape[d])
                                       for d, s in enumerate(slice_sizes)):
        return None
    return a


def _point_index(self, dn, operand_shape, idx: int) -> int:
    """Linear index into the flattened operand for a point gather/scatter (all slices size 1)."""
    smap = tuple(dn.start_index_map if hasattr(dn, "start_index_map") else dn.scatter_dims_to_operand_dims)
    obatch = tuple(getattr(dn, "operand_batching_dims", ()))
    ibatch = tuple(getattr(dn, "start_indices_batching_dims", ()) or getattr(dn, "scatter_indices_batching_dims", ()))
    ishape = self.shape(idx)
    bshape = ishape[:-1]
    strides = row_major_strides(operand_shape)
    flat = None
    idx64 = self.cast(idx, "int64")
    for j, d in enumerate(smap):
        col = self.reshape(_slice_last(self, idx64, j), bshape)
        term = col if strides[d] == 1 else self.binary("mul", col, self.const(strides[d], (), "int64"))
        flat = term if flat is None else self.binary("add", flat, term)
    for od, idim in zip(obatch, ibatch):
        term = self.add("iota", [], bshape, "int64", axis=int(idim))
        if strides[od] != 1:
            term = self.binary("mul", term, self.const(strides[od], (), "int64"))
        flat = term if flat is None else self.binary("add", flat, term)
    if flat is None:
        flat = self.const(0, bshape, "int64")
    if self.shape(flat) != bshape:
        flat = self.add("broadcast_in_dim", [flat], bshape, "int64", shape=bshape,
                        dims=tuple(range(len(bshape) - len(self.shape(flat)), len(bshape))))
    return flat


def _slice_last(self, idx: int, j: int) -> int:
    s = self.shape(idx)
    if s[-1] == 1:
        return idx
    return self.add("slice", [idx], s[:-1] + (1,), self.dtype(idx), start=(0,) * (len(s) - 1) + (j,),
                    limit=s[:-1] + (j + 1,), step=(1,) * len(s))


def _lower_gather(self, x: int, idx: int, p, shape, dtype) -> int:
    dn = p["dimension_numbers"]
    xs, ishape = self.shape(x), self.shape(idx)
    a = _take_form(self, dn, xs, tuple(p["slice_sizes"]), ishape)
    if a is not None:
        i = self.reshape(idx, ishape[:-1])
        nb = len(ishape) - 1
        take_shape = xs[:a] + ishape[:-1] + xs[a + 1:]
        t = self.add("gather", [x, i], take_shape, dtype, axis=a)
        offset = tuple(int(d) for d in dn.offset_dims)
        perm, j = [], 0
        for pos in range(len(shape)):
            if pos in offset:
                k = offset.index(pos)
                perm.append(k if k < a else k + nb)
            else:
                perm.append(a + j)
                j += 1
        return self.transpose(t, perm)
    if not tuple(dn.offset_dims) and all(int(s) == 1 for s in p["slice_sizes"]):
        flat = _point_index(self, dn, xs, idx)
        return self.add("gather", [self.reshape(x, (math.prod(xs),)), flat], shape, dtype, axis=0)
    raise NotImplementedError(f"jax frontend: primitive gather with dimension numbers {dn}")


def _lower_scatter_add(self, x: int, idx: int, upd: int, p, shape, dtype) -> int:
    dn = p["dimension_numbers"]
    xs, ishape, us = self.shape(x), self.shape(idx), self.shape(upd)
    upd = self.cast(upd, dtype)
    a = _take_form(self, dn, xs, None, ishape)
    if a is not None and len(us) == len(xs) - 1 + len(ishape) - 1:
        nb = len(ishape) - 1
        window = tuple(int(d) for d in dn.update_window_dims)
        # updates -> take order: operand dims < a, scatter (batch) dims, operand dims > a
        scatter_pos = [d for d in range(len(us)) if d not in window]
        perm = list(window[:a]) + scatter_pos + list(window[a:])
        u = self.transpose(upd, perm)
        i = self.reshape(idx, ishape[:-1])
        full = all(us[wd] == xs[k if k < a else k + 1] for k, wd in enumerate(window))
        if len(scatter_pos) != nb or not full:
            raise NotImplementedError(f"jax frontend: primitive scatter-add with dimension numbers {dn}")
        sc = self.add("scatter_add", [u, i], xs, dtype, axis=a, size=xs[a])
    elif not tuple(dn.update_window_dims):
        flat = _point_index(self, dn, xs, idx)
        total = (math.prod(xs),)
        sc = self.reshape(self.add("scatter_add", [upd, flat], total, dtype, axis=0, size=total[0]), xs)
    else:
        raise NotImplementedError(f"jax frontend: primitive scatter-add with dimension numbers {dn}")
    n = self.g.nodes[x]
    if n.op == "constant" and n.attrs["value"] == 0:
        return sc
    return self.add("add", [x, sc], shape, dtype)
