"""Pooling and resampling lowerings: max pooling over strided slices with torch's first-maximum indices, average and adaptive-average pooling, and their backwards; the backwards of nearest, linear and cubic upsampling.

Each ``@lowers`` function is the IR lowering of the ATen op packet it is named after (``op_<packet>``),
called as ``fn(lowering, node, *node.args, **node.kwargs)``; see :mod:`..lowering`."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np

from sftctl.compiler.frontends.torch.lowering import lowers
from sftctl.compiler.frontends.torch.lowerings.indexing import _take_along_index
from sftctl.compiler.frontends.torch.lowerings.linalg import _per_dim


def _nsp(n) -> int:
    """The spatial dims of a pooling node: the ``Nd`` in its ATen packet's name (2 for
    ``avg_pool2d``, 3 for ``max_pool3d_with_indices``)."""
    return int(re.search(r"(\d)d", n.target._schema.name.split("::")[-1]).group(1))


def _pool_geometry(self, in_sp, out_sp, kernel, stride, padding, dilation):
    """Per spatial dim (low pad, high pad) so that ``out_sp`` windows fit (ceil_mode's extra
    window included; a negative high pad crops)."""
    return [(padding[d], (out_sp[d] - 1) * stride[d] + dilation[d] * (kernel[d] - 1) + 1 - in_sp[d] - padding[d])
            for d in range(len(in_sp))]


def _taps(self, xp: int, out_sp, kernel, stride, dilation):
    """(tap index tuple, strided window view [.., *out_sp]) for every kernel tap of padded ``xp``."""
    lead = len(self.shape(xp)) - len(kernel)
    for tap in itertools.product(*(range(k) for k in kernel)):
        v = xp
        for d, t in enumerate(tap):
            start = t * dilation[d]
            v = self.slice_dim(v, lead + d, start, start + stride[d] * (out_sp[d] - 1) + 1, stride[d])
        yield tap, v


def _pad_spatial(self, x: int, pads, value) -> int:
    xs = self.shape(x)
    lead = len(xs) - len(pads)
    if not any(lo or hi for lo, hi in pads):
        return x
    low = (0,) * lead + tuple(lo for lo, _ in pads)
    high = (0,) * lead + tuple(hi for _, hi in pads)
    shape = xs[:lead] + tuple(s + lo + hi for s, (lo, hi) in zip(xs[lead:], pads))
    return self.add("pad", [x], shape, self.dtype(x), low=low, high=high, value=value)


def _pool_args(self, x: int, kernel_size, stride, padding, dilation, n_out_sp):
    nsp = n_out_sp
    kernel = _per_dim(kernel_size, nsp)
    stride = _per_dim(stride, nsp) if stride not in (None, [], ()) else list(kernel)
    return kernel, stride, _per_dim(padding, nsp), _per_dim(dilation, nsp)


@lowers("max_pool2d_with_indices", "max_pool3d_with_indices")
def op_max_pool2d_with_indices(self, n, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """Max over each window of the -inf-padded input (strided slices, one per tap, and
    ``maximum``); indices (int64, flat over the input's spatial dims) follow torch: the
    first tap holding the maximum wins."""
    (shape, dtype), (_, idt) = self.out_at(0), self.out_at(1)
    xi = self.arg(x, dtype)
    xs = self.shape(xi)
    nsp = _nsp(n)
    in_sp, out_sp = xs[-nsp:], shape[-nsp:]
    kernel, stride, padding, dilation = _pool_args(self, xi, kernel_size, stride, padding, dilation, nsp)
    pads = _pool_geometry(self, in_sp, out_sp, kernel, stride, padding, dilation)
    xp = _pad_spatial(self, xi, pads, float("-inf"))
    best = idx = None
    for tap, v in _taps(self, xp, out_sp, kernel, stride, dilation):
        # flat input position of this tap for every output position
        pos = None
        for d in range(nsp):
            term = self.iota(tuple(out_sp), d, "int64")
            term = self.binary("add", self.binary("mul", term, self.const(stride[d], (), "int64")),
                               self.const(tap[d] * dilation[d] - padding[d], (), "int64"))
            term = self.binary("mul", term, self.const(math.prod(in_sp[d + 1:]), (), "int64"))
            pos = term if pos is None else self.binary("add", pos, term)
        pos = self.bcast(pos, shape)
        if best is None:
            best, idx = v, pos
            continue
        better = self.add("gt", [v, best], shape, "bool")
        idx = self.add("where", [better, pos, idx], shape, "int64")
        best = self.add("maximum", [best, v], shape, dtype)
    return [best, self.cast(idx, idt)]


@lowers("max_pool2d_with_indices_backward", "max_pool3d_with_indices_backward")
def op_max_pool2d_with_indices_backward(self, n, gy, x, kernel_size, stride, padding, dilation, ceil_mode,
                                        indices):
    """The output gradient added at each window's argmax: a ``scatter_add`` over the
    flattened spatial dims (as torch's kernel does)."""
    shape, dtype = self.out()
    gyi = self.arg(gy, dtype)
    gs = self.shape(gyi)
    nsp = _nsp(n)
    lead = gs[:-nsp]
    flat_out, flat_in = math.prod(gs[-nsp:]), math.prod(shape[-nsp:])
    g2 = self.reshape(gyi, lead + (flat_out,))
    i2 = self.reshape(self.arg(indices, "int64"), lead + (flat_out,))
    sc = _scatter_flat(self, len(lead), i2, g2, lead + (flat_in,), dtype)
    return self.reshape(sc, shape)


def _scatter_flat(self, dim: int, idx: int, src: int, xs, dtype: str) -> int:
    flat = _take_along_index(self, xs, dim, idx)
    total = (math.prod(xs),)
    return self.reshape(self.add("scatter_add", [self.reshape(src, (math.prod(self.shape(src)),)),
                                                 self.reshape(flat, (math.prod(self.shape(flat)),))],
                                 total, dtype, axis=0, size=total[0]), xs)


def _avg_divisor(self, in_sp, out_sp, kernel, stride, padding, pads, count_include_pad, divisor_override,
                 dtype: str):
    """The divisor of every window: ``divisor_override``, else the taps inside the input
    (plus its zero padding when ``count_include_pad``), as torch's kernels count them."""
    if divisor_override:
        return self.const(divisor_override, (), dtype)
    if all(lo == padding[d] and hi == padding[d] for d, (lo, hi) in enumerate(pads)) and (
            count_include_pad or not any(padding)):
        return self.const(math.prod(kernel), (), dtype)
    if count_include_pad:  # padding counts, ceil_mode's overflow beyond it does not
        ones = self.const(1, tuple(s + 2 * p for s, p in zip(in_sp, padding)), dtype)
        mask = _pad_spatial(self, ones, [(0, hi - p) for (lo, hi), p in zip(pads, padding)], 0.0)
    else:
        mask = _pad_spatial(self, self.const(1, tuple(in_sp), dtype), pads, 0.0)
    total = None
    for _, v in _taps(self, mask, out_sp, kernel, stride, [1] * len(kernel)):
        total = v if total is None else self.binary("add", total, v)
    return total


@lowers("avg_pool2d", "avg_pool3d")
def op_avg_pool2d(self, n, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                  divisor_override=None):
    shape, dtype = self.out()
    xi = self.arg(x, dtype)
    nsp = _nsp(n)
    in_sp, out_sp = self.shape(xi)[-nsp:], shape[-nsp:]
    kernel, stride, padding, dilation = _pool_args(self, xi, kernel_size, stride, padding, 1, nsp)
    pads = _pool_geometry(self, in_sp, out_sp, kernel, stride, padding, dilation)
    xp = _pad_spatial(self, xi, pads, 0.0)
    total = None
    for _, v in _taps(self, xp, out_sp, kernel, stride, dilation):
        total = v if total is None else self.binary("add", total, v)
    div = _avg_divisor(self, in_sp, out_sp, kernel, stride, padding, pads, count_include_pad, divisor_override,
                            dtype)
    return self.binary("div", total, div)


def _place_strided(self, g: int, sp_axis: int, tap: int, stride: int, size: int) -> int:
    """``g`` along ``sp_axis`` moved to positions ``tap + stride * i`` of a zero tensor of
    length ``size`` on that axis (the transpose of a strided slice), with reshapes and pads."""
    gs = self.shape(g)
    count = gs[sp_axis]
    if stride > 1:
        g = self.reshape(g, gs[:sp_axis + 1] + (1,) + gs[sp_axis + 1:])
        low = [0] * (len(gs) + 1)
        high = [0] * (len(gs) + 1)
        high[sp_axis + 1] = stride - 1
        shp = gs[:sp_axis + 1] + (stride,) + gs[sp_axis + 1:]
        g = self.add("pad", [g], shp, self.dtype(g), low=tuple(low), high=tuple(high), value=0.0)
        g = self.reshape(g, gs[:sp_axis] + (count * stride,) + gs[sp_axis + 1:])
    cur = self.shape(g)[sp_axis]
    low = [0] * len(gs)
    high = [0] * len(gs)
    low[sp_axis], high[sp_axis] = tap, size - tap - cur
    if tap == 0 and size == cur:
        return g
    shp = gs[:sp_axis] + (size,) + gs[sp_axis + 1:]
    return self.add("pad", [g], shp, self.dtype(g), low=tuple(low), high=tuple(high), value=0.0)


@lowers("avg_pool2d_backward", "avg_pool3d_backward")
def op_avg_pool2d_backward(self, n, gy, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                           divisor_override):
    shape, dtype = self.out()
    gyi = self.arg(gy, dtype)
    nsp = _nsp(n)
    rank = len(shape)
    in_sp, out_sp = shape[-nsp:], self.shape(gyi)[-nsp:]
    kernel, stride, padding, dilation = _pool_args(self, gyi, kernel_size, stride, padding, 1, nsp)
    pads = _pool_geometry(self, in_sp, out_sp, kernel, stride, padding, dilation)
    div = _avg_divisor(self, in_sp, out_sp, kernel, stride, padding, pads, count_include_pad, divisor_override,
                            dtype)
    g = self.binary("div", gyi, div)
    padded = [s + lo + max(hi, 0) for s, (lo, hi) in zip(in_sp, pads)]  # a cropped tail gets no gradient
    total = None
    for tap in itertools.product(*(range(k) for k in kernel)):
        v = g
        for d in range(nsp):
            v = _place_strided(self, v, rank - nsp + d, tap[d], stride[d], padded[d])
        total = v if total is None else self.binary("add", total, v)
    for d, (lo, _) in enumerate(pads):  # drop the padding
        total = self.slice_dim(total, rank - nsp + d, lo, lo + in_sp[d])
    return total


@lowers("_adaptive_avg_pool2d", "_adaptive_avg_pool3d")
def op__adaptive_avg_pool2d(self, n, x, output_size):
    """Adaptive average pooling where each input size is a multiple of the output's: an
    average pool with kernel = stride = input / output (other sizes: unsupported)."""
    shape, _ = self.out()
    nsp = _nsp(n)
    xs = self.val(x).shape
    if any(i % o for i, o in zip(xs[-nsp:], shape[-nsp:])):
        self.unsupported(n, f"(input {tuple(xs[-nsp:])} not a multiple of output {shape[-nsp:]})")
    k = [i // o for i, o in zip(xs[-nsp:], shape[-nsp:])]
    return op_avg_pool2d(self, n, x, k, k, 0)


@lowers("_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward")
def op__adaptive_avg_pool2d_backward(self, n, gy, x):
    shape, _ = self.out()
    nsp = _nsp(n)
    gs = self.val(gy).shape
    if any(i % o for i, o in zip(shape[-nsp:], gs[-nsp:])):
        self.unsupported(n, f"(input {shape[-nsp:]} not a multiple of output {tuple(gs[-nsp:])})")
    k = [i // o for i, o in zip(shape[-nsp:], gs[-nsp:])]
    return op_avg_pool2d_backward(self, n, gy, x, k, k, 0, False, True, None)


@lowers("upsample_nearest1d_backward", "upsample_nearest2d_backward", "upsample_nearest3d_backward")
def op_upsample_nearest2d_backward(self, n, gy, output_size, input_size, *scales):
    """The gradient of nearest upsampling: each output gradient added at its source pixel
    ``floor(o * in / out)`` per spatial dim (``scales`` given: ``floor(o / scale)``, as torch's
    kernel), one ``scatter_add`` over the flattened spatial dims."""
    shape, dtype = self.out()
    nsp = _nsp(n)
    gyi = self.arg(gy, dtype)
    gs = self.shape(gyi)
    out_sp, in_sp, lead = gs[-nsp:], shape[-nsp:], gs[:-nsp]
    pos = None
    for d in range(nsp):
        o = self.iota(tuple(out_sp), d, "int64")
        scale = scales[d] if d < len(scales) and scales[d] else None
        if scale:  # torch: src = min(floor(o * (1 / scale)), in - 1), in float
            src = self.cast(self.add("floor", [self.binary("mul", self.cast(o, "float64"),
                                                              self.const(1.0 / scale, (), "float64"))],
                                     tuple(out_sp), "float64"), "int64")
        else:
            src = self.binary("div", self.binary("mul", o, self.const(in_sp[d], (), "int64")),
                              self.const(out_sp[d], (), "int64"))
        src = self.binary("minimum", src, self.const(in_sp[d] - 1, (), "int64"))
        term = self.binary("mul", src, self.const(math.prod(in_sp[d + 1:]), (), "int64"))
        pos = term if pos is None else self.binary("add", pos, term)
    flat_out, flat_in = math.prod(out_sp), math.prod(in_sp)
    g2 = self.reshape(gyi, lead + (flat_out,))
    i2 = self.bcast(self.reshape(pos, (flat_out,)), lead + (flat_out,))
    return self.reshape(_scatter_flat(self, len(lead), i2, g2, lead + (flat_in,), dtype), shape)


def _src_scale(in_size: int, out_size: int, align_corners: bool, scale) -> float:
    """torch's ``area_pixel_compute_scale`` (aten/src/ATen/native/UpSample.h)."""
    if align_corners:
        return (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    return 1.0 / scale if scale else in_size / out_size


def _interp_taps(in_size: int, out_size: int, align_corners: bool, scale, cubic: bool):
    """Per output position of one dim, the input taps of torch's linear (2 taps) or cubic (4 taps,
    A = -0.75, indices clamped) interpolation: a list of (int64 index [out], float64 weight [out])."""
    o = np.arange(out_size, dtype=np.float64)
    s = _src_scale(in_size, out_size, align_corners, scale)
    if align_corners:
        src = s * o
    else:
        src = s * (o + 0.5) - 0.5
        if not cubic:
            src = np.maximum(src, 0.0)
    if not cubic:
        i0 = src.astype(np.int64)  # C's truncation of a non-negative index
        i1 = i0 + (i0 < in_size - 1)
        l1 = src - i0
        return [(i0, 1.0 - l1), (i1, l1)]
    base = np.floor(src)
    t = src - base
    a = -0.75

    def conv1(x):
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def conv2(x):
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    weights = [conv2(t + 1.0), conv1(t), conv1(1.0 - t), conv2(2.0 - t)]
    return [(np.clip(base.astype(np.int64) - 1 + k, 0, in_size - 1), w) for k, w in enumerate(weights)]


def _interp_backward(self, n, gy, input_size, align_corners, scales, cubic: bool):
    """The gradient of separable linear / cubic upsampling: per spatial dim, each tap's weighted
    output gradient ``scatter_add``-ed at its input index (constants computed at trace time)."""
    shape, dtype = self.out()
    g = self.arg(gy, dtype)
    nsp = len(input_size) - 2 if len(input_size) > 2 else len(scales)
    rank = len(shape)
    for d in range(nsp):
        axis = rank - nsp + d
        gs = self.shape(g)
        in_d, out_d = shape[axis], gs[axis]
        scale = scales[d] if d < len(scales) else None
        total = None
        for k, (idx, w) in enumerate(_interp_taps(in_d, out_d, bool(align_corners), scale, cubic)):
            wshape = tuple(out_d if a == axis else 1 for a in range(rank))
            wid = self.add("input", [], wshape, dtype, role="constant", name=f"{n.name}_w{d}_{k}",
                           value=w.reshape(wshape))
            iid = self.add("input", [], (out_d,), "int64", role="constant", name=f"{n.name}_i{d}_{k}", value=idx)
            out_shape = tuple(in_d if a == axis else s for a, s in enumerate(gs))
            part = self.add("scatter_add", [self.binary("mul", g, wid), iid], out_shape, dtype, axis=axis, size=in_d)
            total = part if total is None else self.binary("add", total, part)
        g = total
    return g


@lowers("upsample_linear1d_backward", "upsample_bilinear2d_backward", "upsample_trilinear3d_backward")
def op_upsample_bilinear2d_backward(self, n, gy, output_size, input_size, align_corners, *scales):
    """Gradient of ``F.interpolate(mode="linear" | "bilinear" | "trilinear")`` (the forward
    decomposes into gathers; see :func:`_interp_backward`)."""
    return _interp_backward(self, n, gy, list(input_size), align_corners, list(scales), cubic=False)


@lowers
def op_upsample_bicubic2d_backward(self, n, gy, output_size, input_size, align_corners, *scales):
    """Gradient of ``F.interpolate(mode="bicubic")``: 4 clamped taps per dim, A = -0.75."""
    return _interp_backward(self, n, gy, list(input_size), align_corners, list(scales), cubic=True)
