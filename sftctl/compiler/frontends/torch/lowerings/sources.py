"""Lowerings of ops that make tensors from nothing: ``full``, ``zeros``/``ones``/``empty`` forms, ``arange``.

Each ``@lowers`` function is the IR lowering of the ATen op packet it is named after (``op_<packet>``),
called as ``fn(lowering, node, *node.args, **node.kwargs)``; see :mod:`..lowering`."""

from __future__ import annotations

import numpy as np
import torch.fx as fx

from sftctl.compiler.frontends.torch.lowering import OPS, lowers


def _fill(self, value):
    shape, dtype = self.out()
    return self.const(value, shape, dtype)


@lowers
def op_full(self, n, size, value, **kw):
    return _fill(self, value)


@lowers
def op_full_like(self, n, x, value, **kw):
    return _fill(self, value)


@lowers
def op_new_full(self, n, x, size, value, **kw):
    return _fill(self, value)


@lowers
def op_scalar_tensor(self, n, value, **kw):
    return _fill(self, value)


@lowers
def op_fill(self, n, x, value):
    if isinstance(value, fx.Node):
        shape, dtype = self.out()
        return self.bcast(self.cast(self.arg(value), dtype), shape)
    return _fill(self, value)


@lowers
def op_zeros(self, n, *a, **kw):
    return _fill(self, 0)


OPS.update(dict.fromkeys(('zeros_like', 'new_zeros', 'empty', 'empty_like', 'new_empty', 'empty_strided'), op_zeros))
OPS.update(dict.fromkeys(('new_empty_strided', 'empty_permuted'), op_zeros))


@lowers
def op_ones(self, n, *a, **kw):
    return _fill(self, 1)


OPS.update(dict.fromkeys(('ones_like', 'new_ones'), op_ones))


@lowers
def op_arange(self, n, *args, **kw):
    nums = [a for a in args if isinstance(a, (int, float))]
    start, step = 0, 1
    if len(nums) == 2:
        start = nums[0]
    elif len(nums) >= 3:
        start, step = nums[0], nums[2]
    shape, dtype = self.out()
    i = self.iota(shape, 0, dtype)
    if step != 1:
        i = self.binary("mul", i, self.const(step, (), dtype))
    if start != 0:
        i = self.binary("add", i, self.const(start, (), dtype))
    return i


@lowers
def op__local_scalar_dense(self, n, x):
    """``Tensor.item()``: the one element as a 0-d IR value (later ops read it as a scalar
    operand); a data-dependent size made from it is refused where it is used."""
    return self.reshape(self.arg(x), ())


@lowers("sym_numel", "sym_storage_offset", "sym_size", "sym_stride")
def op_sym_numel(self, n, x, *dim):
    """A size query traced with static shapes: the value make_fx recorded, an int64 constant
    (a symbolic one goes through the lowering's size expressions instead)."""
    value = n.meta.get("val")
    if not isinstance(value, int):
        self.unsupported(n, f"(size value {value!r})")
    return self.const(int(value), (), "int64")


@lowers("triu_indices", "tril_indices")
def op_triu_indices(self, n, row, col, offset=0, **kw):
    """``torch.triu_indices`` / ``tril_indices``: [2, K] int64 coordinates known at trace time,
    a constant input (DLRM's pairwise interactions index with them)."""
    shape, dtype = self.out()
    upper = n.target._schema.name.endswith("triu_indices")
    i, j = (np.triu_indices if upper else np.tril_indices)(int(row), int(offset), int(col))
    return self.add("input", [], shape, dtype, role="constant", name=n.name, value=np.stack([i, j]).astype(np.int64))
