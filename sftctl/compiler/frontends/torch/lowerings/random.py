"""Random-op lowerings: dropout's ``rng_bernoulli`` keep-mask, ``rand``/``randn``/``randint``/``bernoulli`` and the in-place samplers as ``rng_uniform`` draws.

Each ``@lowers`` function is the IR lowering of the ATen op packet it is named after (``op_<packet>``),
called as ``fn(lowering, node, *node.args, **node.kwargs)``; see :mod:`..lowering`."""

from __future__ import annotations

import math

import torch.fx as fx

from sftctl.compiler.ir import FLOAT_DTYPES
from sftctl.compiler.frontends.torch.lowering import OPS, lowers


@lowers
def op_native_dropout(self, n, x, p, train):
    """(x * keep / (1 - p), keep) with keep ~ Bernoulli(1 - p): an ``rng_bernoulli`` mask,
    saved for backward as torch saves it (bool, 1 byte per element)."""
    shape, dtype = self.out_at(0)
    xi = self.arg(x, dtype)
    if not train or p == 0:
        return [xi, self.const(True, shape, "bool")]
    if p >= 1:
        return [self.const(0, shape, dtype), self.const(False, shape, "bool")]
    self._rng += 1
    keep = self.add("rng_bernoulli", [], shape, "bool", p=1.0 - float(p), rng=self._rng)
    scaled = self.binary("mul", xi, self.const(1.0 / (1.0 - float(p)), (), dtype))
    return [self.add("where", [keep, scaled, self.const(0, (), dtype)], shape, dtype), keep]


@lowers
def op_native_dropout_backward(self, n, grad, mask, scale):
    shape, dtype = self.out()
    g = self.binary("mul", self.arg(grad, dtype), self.const(float(scale), (), dtype))
    return self.add("where", [self.arg(mask, "bool"), g, self.const(0, (), dtype)], shape, dtype)


def _bernoulli(self, n, p):
    shape, dtype = self.out()
    if isinstance(p, fx.Node):
        self.unsupported(n, "with a tensor of probabilities")
    self._rng += 1
    keep = self.add("rng_bernoulli", [], shape, "bool", p=float(p), rng=self._rng)
    return self.cast(keep, dtype)


def _uniform(self, shape, dtype: str, low=0.0, high=1.0) -> int:
    """U[low, high) of ``shape`` (float ``dtype``) from a fresh random stream."""
    self._rng += 1
    u = self.add("rng_uniform", [], shape, dtype, rng=self._rng)
    if high - low != 1.0:
        u = self.binary("mul", u, self.const(high - low, (), dtype))
    if low != 0.0:
        u = self.binary("add", u, self.const(low, (), dtype))
    return u


def _normal(self, shape, dtype: str, mean=0.0, std=1.0) -> int:
    """N(mean, std^2) by Box-Muller: sqrt(-2 log(1 - u1)) * cos(2 pi u2)."""
    u1, u2 = _uniform(self, shape, dtype), _uniform(self, shape, dtype)
    one = self.const(1.0, (), dtype)
    r = self.add("sqrt", [self.binary("mul", self.add("log", [self.binary("sub", one, u1)], shape, dtype),
                                      self.const(-2.0, (), dtype))], shape, dtype)
    z = self.binary("mul", r, self.add("cos", [self.binary("mul", u2, self.const(2 * math.pi, (), dtype))],
                                       shape, dtype))
    if std != 1.0:
        z = self.binary("mul", z, self.const(std, (), dtype))
    if mean != 0.0:
        z = self.binary("add", z, self.const(mean, (), dtype))
    return z


def _float_out(self, n):
    shape, dtype = self.out()
    if dtype not in FLOAT_DTYPES:
        self.unsupported(n, f"with dtype {dtype}")
    return shape, dtype


@lowers
def op_rand(self, n, *args, **kw):
    return _uniform(self, *_float_out(self, n))


OPS.update(dict.fromkeys(('rand_like',), op_rand))


@lowers
def op_randn(self, n, *args, **kw):
    return _normal(self, *_float_out(self, n))


OPS.update(dict.fromkeys(('randn_like',), op_randn))


@lowers
def op_uniform(self, n, x, low=0.0, high=1.0, *, generator=None):
    return _uniform(self, *_float_out(self, n), float(low), float(high))


@lowers
def op_normal(self, n, x, mean=0.0, std=1.0, *, generator=None):
    if isinstance(x, fx.Node) and not isinstance(mean, fx.Node) and not isinstance(std, fx.Node):
        return _normal(self, *_float_out(self, n), float(mean), float(std))
    self.unsupported(n, "with tensor mean or std")


@lowers
def op_randint(self, n, *args, **kw):
    """``randint(high, size)`` / ``randint(low, high, size)``: low + trunc(u * (high - low))."""
    nums = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
    low, high = (0, nums[0]) if len(nums) == 1 else (nums[0], nums[1])
    shape, dtype = self.out()
    u = _uniform(self, shape, "float32", 0.0, float(high - low))
    i = self.cast(u, dtype)  # truncation toward zero: u >= 0
    return self.binary("add", i, self.const(low, (), dtype)) if low else i


OPS.update(dict.fromkeys(('randint_like',), op_randint))


@lowers
def op_bernoulli(self, n, x, p=None, *, generator=None):
    if p is None:
        self.unsupported(n, "with a tensor of probabilities")
    return _bernoulli(self, n, p)


@lowers
def op_randperm(self, n, size, **kw):
    """``torch.randperm(n)``: the ranks of ``n`` uniform draws (ties broken by position), so
    position ``rank[i]`` holds ``i``: a random permutation (PointNet++'s and NeRF's sampling,
    a shuffled batch). O(n^2) compares, as a sort by ranks (:func:`.moe.op_sort`)."""
    shape, dtype = self.out()
    m = int(shape[0]) if shape else 0
    if m <= 1:
        return self.const(0, shape, dtype)
    u = _uniform(self, (m,), "float32")
    ua, ub = self.reshape(u, (m, 1)), self.reshape(u, (1, m))
    before = self.binary("lt", ub, ua, "bool")
    earlier = self.binary("lt", self.iota((m, m), 1, "int64"), self.iota((m, m), 0, "int64"), "bool")
    tie = self.binary("logical_and", self.binary("eq", ub, ua, "bool"), earlier, "bool")
    first = self.binary("logical_or", before, tie, "bool")
    rank = self.add("sum", [self.cast(first, "int64")], (m,), "int64", axes=(1,), keepdim=False)
    perm = self.add("scatter_add", [self.iota((m,), 0, "int64"), rank], (m,), "int64", axis=0, size=m)
    return self.cast(perm, dtype)
