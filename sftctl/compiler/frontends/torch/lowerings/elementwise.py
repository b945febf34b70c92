"""Elementwise lowerings: arithmetic, comparisons, logical and bitwise ops, ``where``, casts and identities.

Each ``@lowers`` function is the IR lowering of the ATen op packet it is named after (``op_<packet>``),
called as ``fn(lowering, node, *node.args, **node.kwargs)``; see :mod:`..lowering`."""

from __future__ import annotations

import math

import torch

from sftctl.compiler.ir import DTYPE_BYTES, FLOAT_DTYPES
from sftctl.compiler.frontends.torch.lowering import OPS, lowers, _Id


def _unary(self, irop: str, n, x):
    shape, dtype = self.out()
    return self.add(irop, [self.arg(x, dtype)], shape, dtype)


@lowers
def op_logical_not(self, n, x):
    shape, _ = self.out()
    return self.add("logical_not", [self.arg(x)], shape, "bool")


@lowers
def op_isnan(self, n, x):
    shape, _ = self.out()
    i = self.arg(x)
    return self.add("ne", [i, i], shape, "bool")


def _abs_vs_inf(self, irop: str, x):
    shape, _ = self.out()
    i = self.arg(x)
    a = self.add("abs", [i], self.shape(i), self.dtype(i))
    return self.add(irop, [a, self.const(float("inf"), (), self.dtype(i))], shape, "bool")


@lowers
def op_isinf(self, n, x):
    return _abs_vs_inf(self, "eq", x)


@lowers
def op_isfinite(self, n, x):  # |x| < inf: false for inf and nan
    return _abs_vs_inf(self, "lt", x)


def _all_ones(self, dtype: str) -> int:
    """The integer of ``dtype`` with every bit set: -1 signed, 2**bits - 1 unsigned."""
    return self.const((1 << (8 * DTYPE_BYTES[dtype])) - 1 if dtype.startswith("uint") else -1, (), dtype)


@lowers
def op_bitwise_not(self, n, x):
    if self.val(x).dtype == torch.bool:
        return op_logical_not(self, n, x)
    shape, dtype = self.out()
    return self.add("bitwise_xor", [self.arg(x, dtype), _all_ones(self, dtype)], shape, dtype)


@lowers("bitwise_left_shift", "__lshift__")
def op_bitwise_left_shift(self, n, a, b):
    """``x << k`` on integers: two's complement, wrapping in the dtype, as torch (and a GPU) shifts."""
    shape, dtype = self.out()
    if dtype in FLOAT_DTYPES:  # torch's float ``x << k`` is ``x * 2**k``
        return self.add("mul", [self.arg(a, dtype), self.add("pow", [self.const(2.0, (), dtype), self.arg(b, dtype)],
                                                            self.shape(self.arg(b)), dtype)], shape, dtype)
    return self.add("shift_left", [self.arg(a, dtype), self.arg(b, dtype)], shape, dtype)


@lowers("bitwise_right_shift", "__rshift__")
def op_bitwise_right_shift(self, n, a, b):
    """``x >> k``: arithmetic for signed integers (the sign fills in, ``floor(x / 2**k)``), as torch
    does: a negative ``x`` is ``~(~x >> k)`` with ``~x`` non-negative, so the IR's logical shift
    is only ever applied to non-negative values; logical for unsigned ones."""
    shape, dtype = self.out()
    if dtype in FLOAT_DTYPES:
        return self.add("div", [self.arg(a, dtype), self.add("pow", [self.const(2.0, (), dtype), self.arg(b, dtype)],
                                                            self.shape(self.arg(b)), dtype)], shape, dtype)
    x, k = self.arg(a, dtype), self.arg(b, dtype)
    if dtype.startswith("uint"):
        return self.add("shift_right_logical", [x, k], shape, dtype)
    ones = _all_ones(self, dtype)
    pos = self.add("shift_right_logical", [x, k], shape, dtype)
    inv = self.add("bitwise_xor", [x, ones], self.shape(x), dtype)
    neg = self.add("bitwise_xor", [self.add("shift_right_logical", [inv, k], shape, dtype), ones], shape, dtype)
    return self.add("where", [self.binary("ge", x, self.const(0, (), dtype), "bool"), pos, neg], shape, dtype)


def _arith(self, irop: str, a, b):
    shape, dtype = self.out()
    return self.add(irop, [self.arg(a, dtype), self.arg(b, dtype)], shape, dtype)


@lowers
def op_add(self, n, a, b, alpha=1):
    if alpha != 1:
        b = _scaled(self, b, alpha)
    return _arith(self, "add", a, b)


@lowers
def op_sub(self, n, a, b, alpha=1):
    if alpha != 1:
        b = _scaled(self, b, alpha)
    return _arith(self, "sub", a, b)


def _scaled(self, b, alpha):
    _, dtype = self.out()
    bi = self.arg(b, dtype)
    return _Id(self.binary("mul", bi, self.const(alpha, (), dtype), dtype))


@lowers
def op_mul(self, n, a, b):
    return _arith(self, "mul", a, b)


@lowers
def op_div(self, n, a, b, rounding_mode=None):
    """True division, or ``rounding_mode`` ``"trunc"`` / ``"floor"``: the float quotient through
    ``trunc`` / ``floor``; on integers the IR's truncating ``div``, less one where the remainder is
    non-zero and the signs differ (floor)."""
    if rounding_mode is None:
        return _arith(self, "div", a, b)
    if rounding_mode not in ("trunc", "floor"):
        self.unsupported(n, f"with rounding_mode={rounding_mode!r}")
    shape, dtype = self.out()
    x, y = self.arg(a, dtype), self.arg(b, dtype)
    q = self.add("div", [x, y], shape, dtype)
    if dtype in FLOAT_DTYPES:
        return self.add(rounding_mode, [q], shape, dtype)
    if rounding_mode == "trunc":
        return q
    fix = _sign_fix(self, x, y, q, dtype)
    return self.add("where", [fix, self.binary("sub", q, self.const(1, (), dtype)), q], shape, dtype)


def _sign_fix(self, x: int, y: int, q: int, dtype: str) -> int:
    """Where an integer truncating quotient ``q = x / y`` needs flooring: a non-zero remainder
    whose sign differs from ``y``'s (bool, broadcast shape)."""
    r = self.binary("sub", x, self.binary("mul", q, y))
    zero = self.const(0, (), dtype)
    differ = self.binary("ne", self.binary("lt", r, zero, "bool"), self.binary("lt", y, zero, "bool"), "bool")
    return self.binary("logical_and", self.binary("ne", r, zero, "bool"), differ, "bool")


@lowers
def op_fmod(self, n, a, b):
    """C's ``fmod``: ``a - trunc(a / b) * b`` (the sign of ``a``)."""
    shape, dtype = self.out()
    x, y = self.arg(a, dtype), self.arg(b, dtype)
    q = self.add("div", [x, y], shape, dtype)
    if dtype in FLOAT_DTYPES:
        q = self.add("trunc", [q], shape, dtype)
    return self.add("sub", [x, self.binary("mul", q, y)], shape, dtype)


@lowers
def op_remainder(self, n, a, b):
    """Python-style modulo (the sign of ``b``): ``a - floor(a / b) * b`` on floats; on integers
    ``a - trunc(a / b) * b``, plus ``b`` where the remainder's sign differs from ``b``'s."""
    shape, dtype = self.out()
    x, y = self.arg(a, dtype), self.arg(b, dtype)
    if dtype in FLOAT_DTYPES:
        q = self.add("floor", [self.add("div", [x, y], shape, dtype)], shape, dtype)
        return self.add("sub", [x, self.binary("mul", q, y)], shape, dtype)
    r = self.binary("sub", x, self.binary("mul", self.binary("div", x, y), y))
    zero = self.const(0, (), dtype)
    differ = self.binary("ne", self.binary("lt", r, zero, "bool"), self.binary("lt", y, zero, "bool"), "bool")
    fix = self.binary("logical_and", self.binary("ne", r, zero, "bool"), differ, "bool")
    return self.add("where", [fix, self.binary("add", r, y), r], shape, dtype)


@lowers
def op_pow(self, n, a, b):
    return _arith(self, "pow", a, b)


@lowers
def op_maximum(self, n, a, b):
    return _arith(self, "maximum", a, b)


@lowers
def op_minimum(self, n, a, b):
    return _arith(self, "minimum", a, b)


@lowers
def op_clamp(self, n, x, min=None, max=None):  # noqa: A002 - ATen's names
    shape, dtype = self.out()
    y = self.arg(x, dtype)
    if min is not None:
        y = self.add("maximum", [y, self.arg(min, dtype)], shape, dtype)
    if max is not None:
        y = self.add("minimum", [y, self.arg(max, dtype)], shape, dtype)
    return y


@lowers
def op_clamp_min(self, n, x, m):
    return op_clamp(self, n, x, min=m)


@lowers
def op_clamp_max(self, n, x, m):
    return op_clamp(self, n, x, max=m)


def _compare(self, irop: str, a, b):
    shape, _ = self.out()
    dt = self.promote(a, b)
    return self.add(irop, [self.arg(a, dt), self.arg(b, dt)], shape, "bool")


def _logical(self, irop: str, n, a, b):
    shape, _ = self.out()
    return self.add(irop, [self.arg(a), self.arg(b)], shape, "bool")


@lowers
def op_logical_and(self, n, a, b):
    return _logical(self, "logical_and", n, a, b)


@lowers
def op_logical_or(self, n, a, b):
    return _logical(self, "logical_or", n, a, b)


@lowers
def op_logical_xor(self, n, a, b):
    shape, _ = self.out()
    return self.add("ne", [self.cast(self.arg(a), "bool"), self.cast(self.arg(b), "bool")], shape, "bool")


def _bitwise(self, irop, n, a, b):
    """A bitwise op: logical on bools, the IR's bitwise op (two's complement) on integers."""
    if self.val(n).dtype == torch.bool:
        if irop == "bitwise_xor":
            return op_logical_xor(self, n, a, b)
        return _logical(self, irop.replace("bitwise_", "logical_"), n, a, b)
    return _arith(self, irop, a, b)


@lowers("bitwise_and", "__and__")
def op_bitwise_and(self, n, a, b):
    return _bitwise(self, "bitwise_and", n, a, b)


@lowers("bitwise_or", "__or__")
def op_bitwise_or(self, n, a, b):
    return _bitwise(self, "bitwise_or", n, a, b)


@lowers("bitwise_xor", "__xor__")
def op_bitwise_xor(self, n, a, b):
    return _bitwise(self, "bitwise_xor", n, a, b)


@lowers
def op_where(self, n, c, a=None, b=None):
    if a is None:
        self.unsupported(n, "(the nonzero form)")
    shape, dtype = self.out()
    return self.add("where", [self.arg(c), self.arg(a, dtype), self.arg(b, dtype)], shape, dtype)


@lowers
def op_masked_fill(self, n, x, mask, value):
    shape, dtype = self.out()
    return self.add("where", [self.arg(mask), self.arg(value, dtype), self.arg(x, dtype)], shape, dtype)


@lowers
def op__to_copy(self, n, x, **kw):
    shape, dtype = self.out()
    return self.cast(self.arg(x), dtype)


def _identity(self, n, x, *args, **kw):
    return self.env[x]


OPS.update(dict.fromkeys(('clone', 'alias', 'detach', 'lift_fresh_copy', 'contiguous'), _identity))


@lowers
def op__assert_tensor_metadata(self, n, *args, **kw):
    return None


@lowers
def op_copy(self, n, dst, src, non_blocking=False):
    shape, dtype = self.out()
    return self.bcast(self.cast(self.arg(src), dtype), shape)


_UNARY = {"abs": "abs", "neg": "neg", "exp": "exp", "log": "log", "tanh": "tanh", "rsqrt": "rsqrt",
          "sqrt": "sqrt", "relu": "relu", "sigmoid": "sigmoid", "erf": "erf", "reciprocal": "reciprocal",
          "sin": "sin", "cos": "cos", "sign": "sign", "log1p": "log1p", "expm1": "expm1"}
for _name, _irop in _UNARY.items():
    OPS[_name] = lambda self, n, x, _op=_irop: _unary(self, _op, n, x)
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    OPS[_name] = lambda self, n, a, b, _op=_name: _compare(self, _op, a, b)


@lowers("floor", "ceil", "trunc", "fix")
def op_rounding(self, n, x):
    """``floor`` / ``ceil`` / ``trunc`` (``fix``): the IR op of that name; the identity on integers."""
    shape, dtype = self.out()
    if dtype not in FLOAT_DTYPES:
        return self.arg(x, dtype)
    op = n.target._schema.name.split("::")[-1].rstrip("_")
    return self.add("trunc" if op == "fix" else op, [self.arg(x, dtype)], shape, dtype)


@lowers
def op_round(self, n, x, decimals=0):
    """``torch.round``: half to even (IR ``round``); with ``decimals``, of ``x * 10**decimals``
    divided back, as torch computes it."""
    shape, dtype = self.out()
    xi = self.arg(x, dtype)
    if dtype not in FLOAT_DTYPES:
        return xi
    if not decimals:
        return self.add("round", [xi], shape, dtype)
    scale = self.const(10.0 ** int(decimals), (), dtype)
    y = self.add("round", [self.binary("mul", xi, scale)], shape, dtype)
    return self.add("div", [y, scale], shape, dtype)


# Inverse trigonometric, hyperbolic and base-2/10 logarithms: compositions of the IR's
# transcendentals (``atan`` is the one IR op they add), written in the forms that keep float64's
# relative precision (log1p / expm1 near 0, (1 - x)(1 + x) near |x| = 1). Integer inputs compute
# in the output's float dtype, as torch promotes them.
def _math(self, x):
    shape, dtype = self.out()
    xi = self.arg(x, dtype)

    def u(op, a):
        return self.add(op, [a], shape, dtype)

    def b(op, p, q):
        return self.add(op, [p, q], shape, dtype)

    def c(v):
        return self.const(v, (), dtype)
    return xi, u, b, c


@lowers
def op_tan(self, n, x):
    xi, u, b, c = _math(self, x)
    return b("div", u("sin", xi), u("cos", xi))


@lowers
def op_sinh(self, n, x):
    """``(expm1(x) - expm1(-x)) / 2``: no cancellation near 0."""
    xi, u, b, c = _math(self, x)
    return b("mul", b("sub", u("expm1", xi), u("expm1", u("neg", xi))), c(0.5))


@lowers
def op_cosh(self, n, x):
    xi, u, b, c = _math(self, x)
    return b("mul", b("add", u("exp", xi), u("exp", u("neg", xi))), c(0.5))


@lowers
def op_atan(self, n, x):
    xi, u, b, c = _math(self, x)
    return u("atan", xi)


@lowers
def op_asin(self, n, x):
    """``atan(x / sqrt((1 - x)(1 + x)))``: +-pi/2 at +-1, NaN outside [-1, 1]."""
    xi, u, b, c = _math(self, x)
    one = c(1.0)
    return u("atan", b("div", xi, u("sqrt", b("mul", b("sub", one, xi), b("add", one, xi)))))


@lowers
def op_acos(self, n, x):
    """``2 atan(sqrt((1 - x) / (1 + x)))``: exact at 1 (0) and -1 (pi)."""
    xi, u, b, c = _math(self, x)
    one = c(1.0)
    return b("mul", c(2.0), u("atan", u("sqrt", b("div", b("sub", one, xi), b("add", one, xi)))))


@lowers
def op_asinh(self, n, x):
    """``sign(x) log1p(|x| + x^2 / (1 + sqrt(1 + x^2)))``: odd, precise near 0, no overflow
    of the sum for large |x| before the log."""
    xi, u, b, c = _math(self, x)
    a = u("abs", xi)
    sq = b("mul", a, a)
    inner = b("add", a, b("div", sq, b("add", c(1.0), u("sqrt", b("add", c(1.0), sq)))))
    # x^2 overflows past 1e154: there asinh(|x|) = log(2|x|)
    big = self.add("gt", [a, c(1e150)], self.shape(xi), "bool")
    mag = self.add("where", [big, b("add", u("log", a), c(0.6931471805599453)), u("log1p", inner)],
                   self.shape(xi), self.dtype(xi))
    return b("mul", u("sign", xi), mag)


@lowers
def op_acosh(self, n, x):
    """``log1p((x - 1) + sqrt((x - 1)(x + 1)))``: precise near 1, NaN below 1."""
    xi, u, b, c = _math(self, x)
    t = b("sub", xi, c(1.0))
    big = self.add("gt", [xi, c(1e150)], self.shape(xi), "bool")
    small = u("log1p", b("add", t, u("sqrt", b("mul", t, b("add", xi, c(1.0))))))
    return self.add("where", [big, b("add", u("log", xi), c(0.6931471805599453)), small],
                    self.shape(xi), self.dtype(xi))


@lowers
def op_atanh(self, n, x):
    """``(log1p(x) - log1p(-x)) / 2``."""
    xi, u, b, c = _math(self, x)
    return b("mul", b("sub", u("log1p", xi), u("log1p", u("neg", xi))), c(0.5))


@lowers
def op_log2(self, n, x):
    xi, u, b, c = _math(self, x)
    return b("mul", u("log", xi), c(1.4426950408889634))  # 1 / ln 2


@lowers
def op_log10(self, n, x):
    xi, u, b, c = _math(self, x)
    return b("mul", u("log", xi), c(0.4342944819032518))  # 1 / ln 10


@lowers
def op_atan2(self, n, y, x):
    """``atan(y / x)`` moved to the quadrant of ``(x, y)``: +-pi where x < 0 (the sign of y),
    +-pi/2 (or 0) where x == 0, as C's atan2."""
    shape, dtype = self.out()
    yi, xi = self.bcast(self.arg(y, dtype), shape), self.bcast(self.arg(x, dtype), shape)

    def cmp(op, p, v):
        return self.add(op, [p, self.const(v, (), dtype)], shape, "bool")

    def sel(m, p, q):
        return self.add("where", [m, p, q], shape, dtype)
    base = self.add("atan", [self.add("div", [yi, xi], shape, dtype)], shape, dtype)
    pi = self.const(math.pi, (), dtype)
    ysign = sel(cmp("lt", yi, 0.0), self.const(-1.0, shape, dtype), self.const(1.0, shape, dtype))
    neg_x = self.add("add", [base, self.add("mul", [ysign, pi], shape, dtype)], shape, dtype)
    half = self.add("mul", [self.add("sign", [yi], shape, dtype), self.const(math.pi / 2, (), dtype)], shape, dtype)
    return sel(cmp("lt", xi, 0.0), neg_x, sel(cmp("eq", xi, 0.0), half, base))


@lowers
def op_exp2(self, n, x):
    xi, u, b, c = _math(self, x)
    return u("exp", b("mul", xi, c(0.6931471805599453)))  # ln 2


@lowers
def op_erfc(self, n, x):
    """``1 - erf(x)`` (absolute precision: erfc's tail below 1e-16 reads as 0)."""
    xi, u, b, c = _math(self, x)
    return b("sub", c(1.0), u("erf", xi))
