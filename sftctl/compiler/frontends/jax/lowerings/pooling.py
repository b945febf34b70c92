"""Windowed reductions (pooling): ``reduce_window_sum`` / ``_max`` / ``_min`` and the max
pooling gradient ``select_and_scatter_add``."""

from __future__ import annotations

from typing import Callable

from sftctl.compiler.frontends.jax.lowering import _PRIMS, _prim
from sftctl.compiler.frontends.jax.lowerings.layout import _pad_general
from sftctl.compiler.ir import FLOAT_DTYPES


_WINDOW_INIT = {"reduce_window_sum": 0.0, "reduce_window_max": float("-inf"), "reduce_window_min": float("inf")}
_WINDOW_OP = {"reduce_window_sum": "add", "reduce_window_max": "maximum", "reduce_window_min": "minimum"}


def _window_taps(self, x: int, p, out_shape, dtype: str, fill):
    """(tap, strided view of the padded ``x`` [out_shape]) for every window position of a
    ``reduce_window``-style primitive (``window_dimensions``, ``window_strides``, ``padding``,
    ``window_dilation``; a ``base_dilation`` other than 1 is unsupported)."""
    import itertools

    dims = [int(w) for w in p["window_dimensions"]]
    strides = [int(s) for s in p["window_strides"]]
    wdil = [int(d) for d in (p.get("window_dilation") or (1,) * len(dims))]
    if any(int(b) != 1 for b in (p.get("base_dilation") or ())):
        raise NotImplementedError("jax frontend: reduce_window with base dilation")
    xp = _pad_general(self, x, [(lo, hi, 0) for lo, hi in p["padding"]], fill, dtype)
    for tap in itertools.product(*(range(w) for w in dims)):
        start = [t * d for t, d in zip(tap, wdil)]
        limit = [st + s * (o - 1) + 1 for st, s, o in zip(start, strides, out_shape)]
        yield tap, self.add("slice", [xp], tuple(out_shape), dtype, start=tuple(start), limit=tuple(limit),
                            step=tuple(strides))


def _reduce_window(kind: str) -> Callable:
    def rule(self, args, p, shape, dtype):
        """``lax.reduce_window`` sum / max / min (flax's ``avg_pool`` / ``max_pool``): one
        strided slice of the padded operand per window tap, combined elementwise."""
        x = self.cast(args[0], dtype)
        fill = _WINDOW_INIT[kind] if dtype in FLOAT_DTYPES else {"reduce_window_sum": 0}.get(kind)
        if fill is None:
            raise NotImplementedError(f"jax frontend: {kind} of {dtype}")
        out = None
        for _, v in _window_taps(self, x, p, shape, dtype, fill):
            out = v if out is None else self.add(_WINDOW_OP[kind], [out, v], shape, dtype)
        return [out]
    return rule


for _name in _WINDOW_OP:
    _PRIMS[_name] = _reduce_window(_name)


@_prim("select_and_scatter_add")
def _select_and_scatter_add(self, args, p, shape, dtype):
    """The gradient of ``reduce_window_max`` (``select_prim`` ge) / ``_min`` (le): each window's
    cotangent added at the first element of the window the select keeps (XLA's
    SelectAndScatter), as the torch lowering of max pooling's backward: the winning tap per
    output, then each tap's share placed back by an interior pad."""
    source, operand = args[0], self.cast(args[1], dtype)
    select = str(p["select_prim"])
    fill = float("-inf") if "ge" in select else float("inf")
    cmp = "gt" if "ge" in select else "lt"
    out_shape = self.shape(source)
    best = win = None
    taps = []
    for k, (tap, v) in enumerate(_window_taps(self, operand, p, out_shape, dtype, fill)):
        taps.append(tap)
        if best is None:
            best, win = v, self.const(0, out_shape, "int64")
            continue
        better = self.add(cmp, [v, best], out_shape, "bool")
        win = self.add("where", [better, self.const(k, out_shape, "int64"), win], out_shape, "int64")
        best = self.add("maximum" if cmp == "gt" else "minimum", [best, v], out_shape, dtype)
    strides = [int(s) for s in p["window_strides"]]
    wdil = [int(d) for d in (p.get("window_dilation") or (1,) * len(strides))]
    pads = [(int(lo), int(hi)) for lo, hi in p["padding"]]
    padded = [s + lo + hi for s, (lo, hi) in zip(shape, pads)]
    src = self.cast(source, dtype)
    total = None
    for k, tap in enumerate(taps):
        part = self.add("where", [self.add("eq", [win, self.const(k, out_shape, "int64")], out_shape, "bool"), src,
                                  self.const(0.0, out_shape, dtype)], out_shape, dtype)
        cfg = []
        for d, o in enumerate(out_shape):
            lo = tap[d] * wdil[d]
            span = (o - 1) * strides[d] + 1 if o else 0
            cfg.append((lo, padded[d] - lo - span, strides[d] - 1))
        placed = _pad_general(self, part, cfg, 0.0, dtype)
        total = placed if total is None else self.add("add", [total, placed], tuple(padded), dtype)
    crop = [(-lo, -hi, 0) for lo, hi in pads]
    return [_pad_general(self, total, crop, 0.0, dtype)]
