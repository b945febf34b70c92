"""Elementwise primitives: unary and binary math, comparisons, logic and bit operations,
selects, casts and the identities (``stop_gradient``, sharding annotations)."""

from __future__ import annotations

from typing import Callable

from sftctl.compiler.frontends.jax.lowering import _PRIMS, _prim
from sftctl.compiler.ir import FLOAT_DTYPES


_UNARY = {"neg": "neg", "exp": "exp", "log": "log", "log1p": "log1p", "expm1": "expm1", "tanh": "tanh",
          "logistic": "sigmoid", "rsqrt": "rsqrt", "sqrt": "sqrt", "abs": "abs", "sign": "sign",
          "sin": "sin", "cos": "cos", "erf": "erf", "floor": "floor", "ceil": "ceil",
          "atan": "atan"}
_BINARY = {"add": "add", "add_any": "add", "sub": "sub", "mul": "mul", "div": "div", "pow": "pow",
           "max": "maximum", "min": "minimum"}
_COMPARE = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
_IDENTITY = {"stop_gradient", "copy", "copy_p", "sharding_constraint", "mesh_cast", "optimization_barrier",
             "device_put", "reduce_precision_noop"}


def _install_elementwise() -> None:
    for name, op in _UNARY.items():
        _PRIMS[name] = lambda self, args, p, shape, dtype, _op=op: [
            self.add(_op, [self.cast(args[0], dtype)], shape, dtype)]
    for name, op in _BINARY.items():
        _PRIMS[name] = lambda self, args, p, shape, dtype, _op=op: [
            self.add(_op, [self.cast(a, dtype) for a in args], shape, dtype)]
    for name, op in _COMPARE.items():
        _PRIMS[name] = lambda self, args, p, shape, dtype, _op=op: [self.add(_op, args, shape, "bool")]
    for name in _IDENTITY:
        _PRIMS[name] = lambda self, args, p, shape, dtype: list(args)


_install_elementwise()


def _logical_rule(name: str) -> Callable:
    def rule(self, args, p, shape, dtype):
        if any(self.dtype(a) != "bool" for a in args):
            if name in ("and", "or", "xor"):  # bitwise on integers (jax.random's bit tricks)
                return [self.add("bitwise_" + name, [self.cast(a, dtype) for a in args], shape, dtype)]
            raise NotImplementedError(f"jax frontend: primitive {name} on integers")
        if name == "not":
            return [self.add("logical_not", args, shape, "bool")]
        if name == "xor":
            return [self.add("ne", args, shape, "bool")]
        return [self.add("logical_" + name, args, shape, "bool")]
    return rule


for _name in ("and", "or", "not", "xor"):
    _PRIMS[_name] = _logical_rule(_name)


@_prim("integer_pow")
def _integer_pow(self, args, p, shape, dtype):
    y = int(p["y"])
    if y == 2:
        return [self.add("mul", [args[0], args[0]], shape, dtype)]
    return [self.add("pow", [args[0], self.const(y, (), dtype)], shape, dtype)]


@_prim("square")
def _square(self, args, p, shape, dtype):
    return [self.add("mul", [args[0], args[0]], shape, dtype)]


@_prim("erfc")
def _erfc(self, args, p, shape, dtype):
    e = self.add("erf", [self.cast(args[0], dtype)], shape, dtype)
    return [self.add("sub", [self.const(1.0, (), dtype), e], shape, dtype)]


@_prim("is_finite")
def _is_finite(self, args, p, shape, dtype):  # |x| < inf is false for inf and nan
    x = args[0]
    ax = self.add("abs", [x], self.shape(x), self.dtype(x))
    return [self.add("lt", [ax, self.const(float("inf"), (), self.dtype(x))], shape, "bool")]


@_prim("exp2")
def _exp2(self, args, p, shape, dtype):
    return [self.add("pow", [self.const(2.0, (), dtype), args[0]], shape, dtype)]


@_prim("select_n")
def _select_n(self, args, p, shape, dtype):
    pred, cases = args[0], args[1:]
    out = self.cast(cases[0], dtype)
    for k, case in enumerate(cases[1:], start=1):
        cond = pred if len(cases) == 2 and self.dtype(pred) == "bool" else self.binary(
            "eq", pred, self.const(k, (), self.dtype(pred)), "bool")
        out = self.add("where", [cond, self.cast(case, dtype), out], shape, dtype)
    return [out]


@_prim("clamp")
def _clamp(self, args, p, shape, dtype):
    lo, x, hi = args
    y = self.add("maximum", [x, self.cast(lo, dtype)], shape, dtype)
    return [self.add("minimum", [y, self.cast(hi, dtype)], shape, dtype)]


@_prim("convert_element_type")
def _convert(self, args, p, shape, dtype):
    return [self.cast(args[0], dtype)]


@_prim("round")
def _round(self, args, p, shape, dtype):
    """``lax.round``: to nearest even (IR ``round``, what ``jnp.round`` asks for) or, by default,
    half away from zero: ``sign(x) * floor(|x| + 0.5)``."""
    x = self.cast(args[0], dtype)
    if int(p.get("rounding_method", 0)) == 1:
        return [self.add("round", [x], shape, dtype)]
    up = self.add("floor", [self.binary("add", self.add("abs", [x], shape, dtype), self.const(0.5, (), dtype))],
                  shape, dtype)
    return [self.add("mul", [self.add("sign", [x], shape, dtype), up], shape, dtype)]


@_prim("rem")
def _rem(self, args, p, shape, dtype):
    """``lax.rem`` (C's fmod, the sign of the dividend): ``x - trunc(x / y) * y``."""
    x, y = (self.cast(a, dtype) for a in args)
    q = self.add("div", [x, y], shape, dtype)
    if dtype in FLOAT_DTYPES:
        q = self.add("trunc", [q], shape, dtype)
    return [self.add("sub", [x, self.binary("mul", q, y)], shape, dtype)]


@_prim("empty", "empty2")
def _empty(self, args, p, shape, dtype):
    """An uninitialized array (JAX's transposes make them for outputs a branch does not write):
    zeros, what the interpreter can compare."""
    return [self.const(0, shape, dtype)]


def _shift_rule(op: str) -> Callable:
    def rule(self, args, p, shape, dtype):
        return [self.add(op, [self.cast(a, dtype) for a in args], shape, dtype)]
    return rule


_PRIMS["shift_right_logical"], _PRIMS["shift_left"] = _shift_rule("shift_right_logical"), _shift_rule("shift_left")


@_prim("bitcast_convert_type")
def _bitcast(self, args, p, shape, dtype):
    """An integer's bits as a float of the same width (``jax.random.uniform`` builds floats in
    [1, 2) from random mantissa bits this way)."""
    if self.shape(args[0]) != tuple(shape) or dtype not in ("float32", "float16", "float64"):
        raise NotImplementedError(f"jax frontend: bitcast_convert_type to {dtype}")
    return [self.add("bitcast", [args[0]], shape, dtype)]


# Giles (2010), "Approximating the erfinv function", single-precision coefficients: the centre
# (w < 5) and tail polynomials in w = -log((1 - x)(1 + x)), refined below by Newton's method
_ERFINV_CENTRE = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                  -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)


@_prim("erf_inv")
def _erf_inv(self, args, p, shape, dtype):
    """``erfinv`` (``jax.random.normal``'s inverse-CDF sampling, ``lax.erf_inv``): Giles's
    approximation (about 1e-7 relative), then two Newton steps on ``erf(x) - y`` (quadratic: to
    float64 rounding); +-1 give +-inf as JAX does."""
    y = self.cast(args[0], dtype)

    def c(v):
        return self.const(v, (), dtype)

    def poly(w, coeffs):
        acc = c(coeffs[0])
        for k in coeffs[1:]:
            acc = self.binary("add", self.binary("mul", acc, w), c(k))
        return acc

    w = self.add("neg", [self.add("log", [self.binary("mul", self.binary("sub", c(1.0), y),
                                                                self.binary("add", c(1.0), y))], shape, dtype)],
                 shape, dtype)
    centre = poly(self.binary("sub", w, c(2.5)), _ERFINV_CENTRE)
    tail = poly(self.binary("sub", self.add("sqrt", [w], shape, dtype), c(3.0)), _ERFINV_TAIL)
    x = self.binary("mul", self.add("where", [self.binary("lt", w, c(5.0), "bool"), centre, tail], shape, dtype), y)
    for _ in range(2):
        err = self.binary("sub", self.add("erf", [x], shape, dtype), y)
        slope = self.binary("mul", c(2.0 / 3.141592653589793 ** 0.5),
                            self.add("exp", [self.add("neg", [self.binary("mul", x, x)], shape, dtype)], shape, dtype))
        x = self.binary("sub", x, self.binary("div", err, slope))
    edge = self.binary("eq", self.add("abs", [y], shape, dtype), c(1.0), "bool")
    inf = self.binary("mul", y, c(float("inf")))
    return [self.add("where", [edge, inf, x], shape, dtype)]
