"""MoE dispatch and combine: ``sftctl::grouped_mm`` (see :mod:`..moe`), and the routing ops of
transformers' grouped experts path: ``sort`` (of expert ids) and ``histc`` (tokens per expert).

Grouped GEMM: the group of row r is the number of group ends at or before it; each group's rows
are gathered into a padded ``[E, C, K]`` dispatch tensor (C the capacity: the uniform load
``ceil(S / E * expert_capacity)``, at most S; rows past a group's count are zero), one batched
``dot_general`` multiplies every expert at once, and the combine gathers each row's result back
from ``[E * C, N]`` (zero for rows past the last group end or past the capacity). The weight
gradient form dispatches both operands and contracts over C.

``sort`` is stable and lowered by ranks: an element's position is the number of elements that
sort before it (smaller, or equal and earlier), computed by a broadcast compare and a sum (n^2
compares: meant for routing vectors, n = tokens x top-k), then the indices are placed by a
``scatter_add`` of positions and the values gathered. ``histc`` counts by comparing each element's
bin with every bin.
"""

from __future__ import annotations

import math

from sftctl.compiler.frontends.torch.lowering import lowers


def _group_bounds(self, offs: int, experts: int) -> tuple[int, int]:
    """(starts [E] int64, ends [E] int64) of the groups from int32 cumulative ends."""
    ends = self.cast(offs, "int64")
    if experts == 1:
        return self.const(0, (1,), "int64"), ends
    head = self.slice_dim(ends, 0, 0, experts - 1)
    starts = self.add("pad", [head], (experts,), "int64", low=(1,), high=(0,), value=0)
    return starts, ends


def _dispatch_index(self, starts: int, ends: int, experts: int, cap: int, length: int) -> tuple[int, int]:
    """(row index [E * C] int64 clamped in range, valid [E, C] bool) of each dispatch slot."""
    j = self.iota((experts, cap), 1, "int64")
    row = self.binary("add", self.reshape(starts, (experts, 1)), j)
    valid = self.binary("lt", row, self.reshape(ends, (experts, 1)), "bool")
    valid = self.binary("logical_and", valid, self.binary("lt", row, self.const(length, (), "int64"), "bool"), "bool")
    row = self.add("where", [valid, row, self.const(0, (), "int64")], (experts, cap), "int64")
    return self.reshape(row, (experts * cap,)), valid


def _capacity(self, rows: int, experts: int) -> int:
    return max(1, min(rows, math.ceil(rows / experts * float(getattr(self, "expert_capacity", 1.0)))))


@lowers("sftctl::grouped_mm")
def op_grouped_mm(self, n, a, b, offs=None):
    shape, dtype = self.out()
    ai, bi = self.arg(a), self.arg(b)
    ash, bsh = self.shape(ai), self.shape(bi)
    if offs is None:  # 3-D x 3-D: a batched matmul
        return self.add("dot_general", [ai, bi], shape, dtype, lhs_batch=(0,), rhs_batch=(0,),
                        lhs_contract=(2,), rhs_contract=(1,))
    oi = self.arg(offs)
    experts = self.shape(oi)[0]
    zero = self.const(0, (), dtype)
    if len(ash) == 2 and len(bsh) == 3:
        rows, k = ash
        nn = bsh[2]
        cap = _capacity(self, rows, experts)
        starts, ends = _group_bounds(self, oi, experts)
        row, valid = _dispatch_index(self, starts, ends, experts, cap, rows)
        disp = self.reshape(self.add("gather", [ai, row], (experts * cap, k), dtype, axis=0), (experts, cap, k))
        disp = self.add("where", [self.reshape(valid, (experts, cap, 1)), disp, zero], (experts, cap, k), dtype)
        prod = self.add("dot_general", [disp, bi], (experts, cap, nn), dtype, lhs_batch=(0,), rhs_batch=(0,),
                        lhs_contract=(2,), rhs_contract=(1,), experts=experts, capacity=cap)
        # combine: row r's group g = #ends <= r, its slot r - starts[g]
        r = self.iota((rows, 1), 0, "int64")
        past = self.binary("ge", r, self.reshape(ends, (1, experts)), "bool")
        g = self.add("sum", [self.cast(past, "int64")], (rows,), "int64", axes=(1,), keepdim=False)
        inside = self.binary("lt", g, self.const(experts, (), "int64"), "bool")
        gc = self.binary("minimum", g, self.const(experts - 1, (), "int64"))
        pos = self.binary("sub", self.reshape(r, (rows,)), self.add("gather", [starts, gc], (rows,), "int64", axis=0))
        inside = self.binary("logical_and", inside, self.binary("lt", pos, self.const(cap, (), "int64"), "bool"), "bool")
        slot = self.binary("add", self.binary("mul", gc, self.const(cap, (), "int64")),
                           self.binary("minimum", pos, self.const(cap - 1, (), "int64")))
        out = self.add("gather", [self.reshape(prod, (experts * cap, nn)), slot], (rows, nn), dtype, axis=0)
        return self.add("where", [self.reshape(inside, (rows, 1)), out, zero], (rows, nn), dtype)
    if len(ash) == 2 and len(bsh) == 2:  # weight gradient: [K, S] x [S, N] grouped over S
        k, rows = ash
        nn = bsh[1]
        cap = _capacity(self, rows, experts)
        starts, ends = _group_bounds(self, oi, experts)
        row, valid = _dispatch_index(self, starts, ends, experts, cap, rows)
        da = self.reshape(self.add("gather", [ai, row], (k, experts * cap), dtype, axis=1), (k, experts, cap))
        da = self.add("where", [self.reshape(valid, (1, experts, cap)), da, zero], (k, experts, cap), dtype)
        db = self.reshape(self.add("gather", [bi, row], (experts * cap, nn), dtype, axis=0), (experts, cap, nn))
        db = self.add("where", [self.reshape(valid, (experts, cap, 1)), db, zero], (experts, cap, nn), dtype)
        return self.add("dot_general", [da, db], shape, dtype, lhs_batch=(1,), rhs_batch=(0,),
                        lhs_contract=(2,), rhs_contract=(1,), experts=experts, capacity=cap)
    self.unsupported(n, f"with {len(ash)}-D x {len(bsh)}-D operands and offs")


@lowers("sort", "sort.stable")
def op_sort(self, n, x, *args, **kwargs):
    """``sort(x, dim=-1, descending=False)`` / ``sort.stable(x, *, stable, dim, descending)``:
    stable, by ranks (see the module docstring)."""
    (_, vdtype), (_, idtype) = self.out_at(0), self.out_at(1)
    if n.target._overloadname == "stable":
        dim, descending = kwargs.get("dim", -1), kwargs.get("descending", False)
    else:
        dim = args[0] if args else kwargs.get("dim", -1)
        descending = args[1] if len(args) > 1 else kwargs.get("descending", False)
    xi = self.arg(x)
    shp = self.shape(xi)
    if not shp:
        return [xi, self.const(0, (), idtype)]
    dim %= len(shp)
    last = len(shp) - 1
    perm = tuple(d for d in range(len(shp)) if d != dim) + (dim,)
    inv = tuple(perm.index(d) for d in range(len(shp)))
    xt = self.transpose(xi, perm)
    ts = self.shape(xt)
    m = ts[-1]
    xa = self.reshape(xt, ts + (1,))        # element i (rows)
    xb = self.reshape(xt, ts[:-1] + (1, m))  # element j (columns)
    before = self.binary("gt" if descending else "lt", xb, xa, "bool")
    ties = self.binary("eq", xb, xa, "bool")
    earlier = self.binary("lt", self.iota((m, m), 1, "int64"), self.iota((m, m), 0, "int64"), "bool")
    first = self.binary("logical_or", before, self.binary("logical_and", ties, earlier, "bool"), "bool")
    rank = self.add("sum", [self.cast(first, "int64")], ts, "int64", axes=(len(ts),), keepdim=False)
    # indices: sorted position p holds the i whose rank is p (scatter i at its rank, per row)
    rows = math.prod(ts[:-1])
    flat_rank = self.reshape(rank, (rows * m,))
    if rows > 1:
        base = self.binary("mul", self.iota((rows, m), 0, "int64"), self.const(m, (), "int64"))
        flat_rank = self.binary("add", flat_rank, self.reshape(base, (rows * m,)))
    src = self.reshape(self.iota(ts, last, "int64"), (rows * m,))
    idx = self.add("scatter_add", [src, flat_rank], (rows * m,), "int64", axis=0, size=rows * m)
    flat_x = self.reshape(xt, (rows * m,))
    gidx = idx
    if rows > 1:
        gidx = self.binary("add", idx, self.reshape(base, (rows * m,)))
    vals = self.add("gather", [flat_x, gidx], (rows * m,), self.dtype(xi), axis=0)
    vals = self.transpose(self.reshape(vals, ts), inv)
    idx = self.transpose(self.reshape(idx, ts), inv)
    return [self.cast(vals, vdtype), self.cast(idx, idtype)]


@lowers
def op_histc(self, n, x, bins=100, min=0, max=0):  # noqa: A002 - torch's names
    """``histc`` with a given range (``min < max``): counts per equal-width bin, ``max`` in the
    last bin, elements outside the range not counted."""
    shape, dtype = self.out()
    if not max > min:
        self.unsupported(n, "without a range (min < max): the range would come from the data")
    xi = self.arg(x, "float64" if self.dtype(self.arg(x)) == "float64" else "float32")
    fd = self.dtype(xi)
    total = math.prod(self.shape(xi))
    flat = self.reshape(xi, (total,))
    scaled = self.binary("mul", self.binary("sub", flat, self.const(min, (), fd)), self.const(bins / (max - min), (), fd))
    b = self.cast(self.add("floor", [scaled], (total,), fd), "int64")
    b = self.binary("minimum", b, self.const(bins - 1, (), "int64"))
    inside = self.binary("logical_and", self.binary("ge", flat, self.const(min, (), fd), "bool"),
                         self.binary("le", flat, self.const(max, (), fd), "bool"), "bool")
    hit = self.binary("eq", self.reshape(b, (total, 1)), self.iota((1, bins), 1, "int64"), "bool")
    hit = self.binary("logical_and", hit, self.reshape(inside, (total, 1)), "bool")
    return self.add("sum", [self.cast(hit, dtype)], (bins,), dtype, axes=(0,), keepdim=False)
