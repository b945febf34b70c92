"""Layout primitives: broadcast, reshape, squeeze / expand_dims, transpose, reverse, iota,
concatenate, stack / unstack, pad, slice and split."""

from __future__ import annotations

from sftctl.compiler.frontends.jax.lowering import _prim


@_prim("broadcast_in_dim")
def _broadcast_in_dim(self, args, p, shape, dtype):
    x = args[0]
    if self.shape(x) == shape:
        return [x]
    n = self.g.nodes[x]
    if n.op == "constant":
        return [self.const(n.attrs["value"], shape, dtype)]
    return [self.add("broadcast_in_dim", [x], shape, dtype, shape=shape,
                     dims=tuple(int(d) for d in p["broadcast_dimensions"]))]


@_prim("reshape")
def _reshape(self, args, p, shape, dtype):
    x = args[0]
    if p.get("dimensions") not in (None, ()):  # lax.reshape's transpose-first form
        x = self.transpose(x, tuple(int(d) for d in p["dimensions"]))
    return [self.reshape(x, shape)]


@_prim("squeeze", "expand_dims")
def _squeeze(self, args, p, shape, dtype):
    return [self.reshape(args[0], shape)]


@_prim("transpose")
def _transpose(self, args, p, shape, dtype):
    return [self.transpose(args[0], p["permutation"])]


@_prim("rev")
def _rev(self, args, p, shape, dtype):
    return [self.add("reverse", [args[0]], shape, dtype, axes=tuple(int(d) for d in p["dimensions"]))]


@_prim("iota")
def _iota(self, args, p, shape, dtype):
    return [self.add("iota", [], shape, dtype, axis=int(p["dimension"]))]


@_prim("concatenate")
def _concatenate(self, args, p, shape, dtype):
    return [self.add("concatenate", [self.cast(a, dtype) for a in args], shape, dtype, axis=int(p["dimension"]))]


@_prim("stack")
def _stack(self, args, p, shape, dtype):
    """``jnp.stack`` (its own primitive in newer JAX): each operand with a unit axis inserted at
    ``axis``, concatenated there."""
    axis = int(p["axis"]) % len(shape)
    unit = tuple(1 if d == axis else s for d, s in enumerate(shape))
    parts = [self.reshape(self.cast(a, dtype), unit) for a in args]
    return [parts[0] if len(parts) == 1 else self.add("concatenate", parts, shape, dtype, axis=axis)]


@_prim("unstack")
def _unstack(self, args, p, shape, dtype):
    """``unstack`` (the transpose of ``stack``): the slices along ``axis``, the axis dropped."""
    x = args[0]
    xs = self.shape(x)
    axis = int(p["axis"]) % len(xs)
    out_shape = xs[:axis] + xs[axis + 1:]
    outs = []
    for k in range(xs[axis]):
        start = [0] * len(xs)
        limit = list(xs)
        start[axis], limit[axis] = k, k + 1
        sl = self.add("slice", [x], tuple(1 if d == axis else s for d, s in enumerate(xs)), self.dtype(x),
                      start=tuple(start), limit=tuple(limit), step=(1,) * len(xs))
        outs.append(self.reshape(sl, out_shape))
    return outs


def _pad_general(self, x: int, cfg, value, dtype: str) -> int:
    """``lax.pad``: per dim (low, high, interior); interior zeros between elements (the
    transpose of a strided window sum) by a reshape to [.., n, 1 + interior], a pad and a crop;
    negative low/high crop."""
    shape = list(self.shape(x))
    for d, (_, _, interior) in enumerate(cfg):
        interior = int(interior)
        if not interior or shape[d] == 0:
            continue
        n = shape[d]
        wide = shape[:d + 1] + [1] + shape[d + 1:]
        x = self.add("reshape", [x], wide, dtype, shape=tuple(wide))
        grown = list(wide)
        grown[d + 1] = 1 + interior
        hi = [0] * len(wide)
        hi[d + 1] = interior
        x = self.add("pad", [x], grown, dtype, low=(0,) * len(wide), high=tuple(hi), value=value)
        flat = shape[:d] + [n * (1 + interior)] + shape[d + 1:]
        x = self.add("reshape", [x], flat, dtype, shape=tuple(flat))
        shape = shape[:d] + [n + (n - 1) * interior] + shape[d + 1:]
        x = self.add("slice", [x], shape, dtype, start=(0,) * len(shape), limit=tuple(shape), step=(1,) * len(shape))
    lows = [max(int(c[0]), 0) for c in cfg]
    highs = [max(int(c[1]), 0) for c in cfg]
    if any(lows) or any(highs):
        shape = [s + lo + hi for s, lo, hi in zip(shape, lows, highs)]
        x = self.add("pad", [x], shape, dtype, low=tuple(lows), high=tuple(highs), value=value)
    if any(int(c[0]) < 0 or int(c[1]) < 0 for c in cfg):
        start = [-min(int(c[0]), 0) for c in cfg]
        limit = [s + min(int(c[1]), 0) for s, c in zip(shape, cfg)]
        shape = [hi - lo for lo, hi in zip(start, limit)]
        x = self.add("slice", [x], shape, dtype, start=tuple(start), limit=tuple(limit), step=(1,) * len(shape))
    return x


@_prim("pad")
def _pad(self, args, p, shape, dtype):
    value = self.g.nodes[args[1]]
    if value.op != "constant":
        raise NotImplementedError("jax frontend: pad with a non-constant padding value")
    return [_pad_general(self, self.cast(args[0], dtype), p["padding_config"], value.attrs["value"], dtype)]


@_prim("slice")
def _slice(self, args, p, shape, dtype):
    xs = self.shape(args[0])
    strides = p.get("strides") or (1,) * len(xs)
    return [self.add("slice", [args[0]], shape, dtype, start=tuple(int(s) for s in p["start_indices"]),
                     limit=tuple(int(s) for s in p["limit_indices"]), step=tuple(int(s) for s in strides))]


@_prim("split")
def _split(self, args, p, shape, dtype):
    axis = int(p["axis"])
    xs = self.shape(args[0])
    res, start = [], 0
    for size in p["sizes"]:
        st, lim = [0] * len(xs), list(xs)
        st[axis], lim[axis] = start, start + int(size)
        out = list(xs)
        out[axis] = int(size)
        res.append(self.add("slice", [args[0]], out, dtype, start=tuple(st), limit=tuple(lim), step=(1,) * len(xs)))
        start += int(size)
    return res
