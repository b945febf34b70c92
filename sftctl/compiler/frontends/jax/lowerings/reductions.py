"""Reductions and scans along an axis: ``reduce_*``, ``argmax`` / ``argmin``, ``cumsum`` /
``cumprod``, and ``sort`` (ranks by comparison, as the torch frontend sorts)."""

from __future__ import annotations

import math
from typing import Callable

from sftctl.compiler.frontends.jax.lowering import _PRIMS, _prim


_REDUCE = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_or": "max", "reduce_and": "min",
           "reduce_prod": "prod"}


def _reduce_rule(op: str) -> Callable:
    def rule(self, args, p, shape, dtype):
        axes = tuple(sorted(int(a) for a in p["axes"]))
        if not axes:
            return [self.cast(args[0], dtype)]
        return [self.add(op, [self.cast(args[0], dtype)], shape, dtype, axes=axes, keepdim=False)]
    return rule


for _name, _op in _REDUCE.items():
    _PRIMS[_name] = _reduce_rule(_op)


def _arg_rule(largest: bool) -> Callable:
    def rule(self, args, p, shape, dtype):
        """``argmax`` / ``argmin`` along one axis: the first index of the extreme, as XLA's."""
        x = args[0]
        xs = self.shape(x)
        d = int(p["axes"][0])
        kshape = tuple(1 if i == d else s_ for i, s_ in enumerate(xs))
        m = self.add("max" if largest else "min", [x], kshape, self.dtype(x), axes=(d,), keepdim=True)
        mb = self.add("broadcast_in_dim", [m], xs, self.dtype(x), shape=xs, dims=tuple(range(len(xs))))
        hit = self.add("eq", [x, mb], xs, "bool")
        cand = self.add("where", [hit, self.add("iota", [], xs, dtype, axis=d), self.const(xs[d], (), dtype)], xs, dtype)
        return [self.reshape(self.add("min", [cand], kshape, dtype, axes=(d,), keepdim=True), shape)]
    return rule


_PRIMS["argmax"], _PRIMS["argmin"] = _arg_rule(True), _arg_rule(False)


@_prim("cumsum")
def _cumsum(self, args, p, shape, dtype):
    """``lax.cumsum`` (``jnp.cumsum``): the IR's inclusive scan; ``reverse`` by flipping."""
    axis = int(p["axis"])
    x = self.cast(args[0], dtype)
    if p.get("reverse"):
        x = self.add("reverse", [x], shape, dtype, axes=(axis,))
    y = self.add("cumsum", [x], shape, dtype, axis=axis)
    return [self.add("reverse", [y], shape, dtype, axes=(axis,)) if p.get("reverse") else y]


@_prim("sort")
def _sort(self, args, p, shape, dtype):
    """``lax.sort`` (``jnp.sort`` / ``argsort``: the operands sorted together by the first one,
    ascending, stable): each element's rank along ``dimension`` by comparisons (an [m, m] compare
    per row and a row sum, as the torch frontend sorts), then every operand scattered to its rank.
    More than one key operand is unsupported."""
    if int(p.get("num_keys", 1)) != 1:
        raise NotImplementedError("jax frontend: sort by more than one key")
    key = args[0]
    ks = self.shape(key)
    if not ks:
        return list(args)
    dim = int(p["dimension"]) % len(ks)
    perm = tuple(d for d in range(len(ks)) if d != dim) + (dim,)
    inv = tuple(perm.index(d) for d in range(len(ks)))
    kt = self.transpose(key, perm)
    ts = self.shape(kt)
    m = ts[-1]
    rows = math.prod(ts[:-1])
    k2 = self.reshape(kt, (rows, m))
    a = self.reshape(k2, (rows, m, 1))
    b = self.reshape(k2, (rows, 1, m))
    kd = self.dtype(k2)
    cube = (rows, m, m)
    bj = self.add("broadcast_in_dim", [b], cube, kd, shape=cube, dims=(0, 1, 2))  # element j
    ai = self.add("broadcast_in_dim", [a], cube, kd, shape=cube, dims=(0, 1, 2))  # element i
    before = self.add("lt", [bj, ai], cube, "bool")
    ties = self.add("eq", [bj, ai], cube, "bool")
    earlier = self.add("lt", [self.add("iota", [], (rows, m, m), "int64", axis=2),
                              self.add("iota", [], (rows, m, m), "int64", axis=1)], (rows, m, m), "bool")
    first = self.add("logical_or", [before, self.add("logical_and", [ties, earlier], (rows, m, m), "bool")],
                     (rows, m, m), "bool")
    rank = self.add("sum", [self.cast(first, "int64")], (rows, m), "int64", axes=(2,), keepdim=False)
    row_base = self.add("mul", [self.add("iota", [], (rows, m), "int64", axis=0), self.const(m, (), "int64")],
                        (rows, m), "int64")
    flat = self.reshape(self.add("add", [rank, row_base], (rows, m), "int64"), (rows * m,))
    outs = []
    for x in args:
        xd = self.dtype(x)
        xt = self.reshape(self.transpose(x, perm), (rows * m,))
        placed = self.add("scatter_add", [xt, flat], (rows * m,), xd, axis=0, size=rows * m)
        outs.append(self.transpose(self.reshape(placed, ts), inv))
    return outs


@_prim("cumprod")
def _cumprod(self, args, p, shape, dtype):
    """``lax.cumprod``: :meth:`GraphBuilder.cumprod`."""
    return [self.cumprod(self.cast(args[0], dtype), int(p["axis"]), bool(p.get("reverse")))]
