"""Complex tensors and FFTs (issue 43): Fourier neural operators, Hyena's long convolutions,
spectrogram front ends.

The IR has no complex dtype: a complex value is a :class:`~..lowering._Cplx`, its real and
imaginary parts as two real IR tensors of its shape (a complex parameter or AdamW moment is one
IR input ``[..., 2]``, ``view_as_real``'s layout, the same bytes as the interleaved complex
tensor a GPU holds). Ops in :data:`~..lowering.PARTWISE` (layout, slicing, sums, scatters, the
creation of zeros) run their real lowering on each part; the rest are here: products (``mul``,
``mm``/``bmm``: ``(a + ib)(c + id)``, the four real products cuBLAS's complex GEMM does),
``add``/``sub``, conjugation, ``view_as_real`` / ``view_as_complex``, ``abs``, ``angle``,
casts, fills and the FFTs.

FFTs (``_fft_r2c``, ``_fft_c2r``, ``_fft_c2c``: every ``torch.fft`` function decomposes to
them, and so do their gradients) are discrete Fourier transforms along each transformed dim: a
``dot_general`` of each part with the ``cos`` / ``sin`` twiddle matrix of that dim (computed in
the graph from ``iota``, the angle reduced modulo ``n`` so float64 is exact to rounding), each
tagged ``fft`` = ``{"n", "kind", "batch", "share"}`` so the cost model prices the transform at
cuFFT's rate rather than as the dense product (:mod:`sftctl.compiler.fft` reads the tag). A real
transform's one-sided half (``rfft``) keeps ``n // 2 + 1`` frequencies; ``c2r`` (``irfft``)
reads them with Hermitian weights (1 for the zero and Nyquist frequencies, 2 otherwise; their
imaginary parts ignored, as cuFFT and pocketfft do). ``normalization`` is ATen's
``fft_norm_mode``: 0 none, 1 by ``1 / sqrt(n)``, 2 by ``1 / n`` (n: the product of the
transformed sizes).
"""

from __future__ import annotations

import math

import torch.fx as fx

from sftctl.compiler.frontends.torch.lowering import COMPLEX_OPS, OPS, PARTWISE, _Cplx


def lowers_complex(*packets: str, always: bool = False):
    """Register a complex lowering in :data:`COMPLEX_OPS` under ``packets``; ``always``: an op
    whose operand or result is always complex (an FFT, ``view_as_real``), also in :data:`OPS`."""
    def register(fn):
        for p in packets:
            COMPLEX_OPS[p] = fn
            if always:
                OPS[p] = fn
        return fn
    return register


PARTWISE.update({
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "slice", "select", "unsqueeze", "squeeze",
    "clone", "expand", "alias", "flip", "roll", "constant_pad_nd", "cat", "stack", "slice_scatter",
    "select_scatter", "copy", "sum", "mean", "where", "index", "index_select", "neg", "split", "split_with_sizes",
    "unbind", "narrow", "repeat", "as_strided", "lift_fresh_copy", "detach", "index_put", "masked_fill",
    "_unsafe_index", "squeeze_copy", "unsqueeze_copy", "view_copy", "permute_copy", "unfold", "diagonal",
    "tril", "triu", "zeros_like", "new_zeros", "empty", "empty_like", "new_empty", "empty_strided",
    "new_empty_strided", "empty_permuted", "zeros", "pad",
})


def _parts(self, a):
    """``(real, imag)`` of an operand: IR ids (``imag`` None for a real tensor), or Python
    numbers for a scalar (``imag`` None when it is not complex)."""
    if isinstance(a, fx.Node):
        v = self.env[a]
        return (v[0], v[1]) if isinstance(v, _Cplx) else (v, None)
    if isinstance(a, complex):
        return a.real, a.imag
    return a, None


def _operand(self, x, dtype: str, scalar: bool) -> int:
    return self.const(x, (), dtype) if scalar else self.cast(x, dtype)


def _out(self, n):
    v = self.val(n)
    return tuple(int(s) for s in v.shape), self.out()[1]


@lowers_complex("add", "sub")
def op_complex_add(self, n, a, b, alpha=1):
    """``a ± alpha * b`` with either complex: the parts added, a real operand's imaginary part 0."""
    shape, dtype = _out(self, n)
    op = "add" if n.target._schema.name.endswith("add") else "sub"
    sa, sb = not isinstance(a, fx.Node), not isinstance(b, fx.Node)
    pa, pb = _parts(self, a), _parts(self, b)
    out = []
    for k in (0, 1):
        x, y = pa[k], pb[k]
        if x is None and y is None:
            out.append(self.const(0, shape, dtype))
            continue
        xi = self.const(0, (), dtype) if x is None else _operand(self, x, dtype, sa)
        if y is None:
            out.append(self.bcast(xi, shape))
            continue
        yi = _operand(self, y, dtype, sb)
        if alpha != 1:
            yi = self.binary("mul", yi, self.const(alpha, (), dtype))
        out.append(self.add(op, [xi, yi], shape, dtype))
    return _Cplx(*out)


def _bilinear(self, n, f, a, b):
    """``f(a, b)`` for a real-bilinear ``f`` (``f(x, y)`` on real IR ids) with complex operands:
    ``(ar + i ai)(br + i bi) = (ar br - ai bi) + i (ar bi + ai br)``."""
    (ar, ai), (br, bi) = _parts(self, a), _parts(self, b)
    re = f(ar, br)
    if ai is not None and bi is not None:
        re = self.binary("sub", re, f(ai, bi))
    ims = [f(x, y) for x, y in ((ar, bi), (ai, br)) if x is not None and y is not None]
    im = ims[0] if len(ims) == 1 else self.binary("add", ims[0], ims[1]) if ims else self.const(0, self.shape(re), self.dtype(re))
    return _Cplx(re, im)


@lowers_complex("mul")
def op_complex_mul(self, n, a, b):
    shape, dtype = _out(self, n)
    sa, sb = not isinstance(a, fx.Node), not isinstance(b, fx.Node)
    return _bilinear(self, n, lambda x, y: self.add("mul", [_operand(self, x, dtype, sa), _operand(self, y, dtype, sb)],
                                                     shape, dtype), a, b)


@lowers_complex("div")
def op_complex_div(self, n, a, b, rounding_mode=None):
    """``a / b``: ``a * conj(b) / |b|^2`` (a real ``b`` divides each part)."""
    shape, dtype = _out(self, n)
    sa, sb = not isinstance(a, fx.Node), not isinstance(b, fx.Node)
    (ar, ai), (br, bi) = _parts(self, a), _parts(self, b)
    x = [None if p is None else _operand(self, p, dtype, sa) for p in (ar, ai)]
    yr = _operand(self, br, dtype, sb)
    if bi is None:
        return _Cplx(*(self.add("div", [p, yr], shape, dtype) if p is not None else self.const(0, shape, dtype) for p in x))
    yi = _operand(self, bi, dtype, sb)
    den = self.binary("add", self.binary("mul", yr, yr), self.binary("mul", yi, yi))
    zero = self.const(0, (), dtype)
    xr, xi = (p if p is not None else zero for p in x)
    re = self.binary("add", self.binary("mul", xr, yr), self.binary("mul", xi, yi))
    im = self.binary("sub", self.binary("mul", xi, yr), self.binary("mul", xr, yi))
    return _Cplx(self.bcast(self.binary("div", re, den), shape), self.bcast(self.binary("div", im, den), shape))


def _matmul_like(packet: str):
    def lower(self, n, a, b):
        real = OPS[packet]
        env = self.env

        def f(x, y):
            saved = (env.get(a), env.get(b))
            env[a], env[b] = x, y
            try:
                return real(self, n, a, b)
            finally:
                env[a], env[b] = saved
        return _bilinear(self, n, f, a, b)
    return lower


for _p in ("mm", "bmm", "mv", "dot"):
    COMPLEX_OPS[_p] = _matmul_like(_p)


@lowers_complex("_conj", "conj_physical", "conj", always=True)
def op_complex_conj(self, n, x):
    re, im = _parts(self, x)
    if im is None:
        return re
    return _Cplx(re, self.add("neg", [im], self.shape(im), self.dtype(im)))


@lowers_complex("resolve_conj", "resolve_neg", always=True)
def op_complex_identity(self, n, x):
    return self.env[x]


@lowers_complex("view_as_real", always=True)
def op_view_as_real(self, n, x):
    return self.complex_join(self.env[x])


@lowers_complex("view_as_complex", always=True)
def op_view_as_complex(self, n, x):
    return self.complex_split(self.arg(x))


@lowers_complex("real")
def op_complex_real(self, n, x):
    return _parts(self, x)[0]


@lowers_complex("imag")
def op_complex_imag(self, n, x):
    return _parts(self, x)[1]


@lowers_complex("abs")
def op_complex_abs(self, n, x):
    re, im = _parts(self, x)
    shape, dtype = self.out()
    sq = self.binary("add", self.binary("mul", re, re), self.binary("mul", im, im))
    return self.add("sqrt", [sq], shape, dtype)


@lowers_complex("angle")
def op_complex_angle(self, n, x):
    re, im = _parts(self, x)
    env = self.env
    saved = env[x]
    env[x] = im
    try:  # atan2(im, re) by the real lowering
        from sftctl.compiler.frontends.torch.lowerings.elementwise import op_atan2
        from sftctl.compiler.frontends.torch.lowering import _Id

        return op_atan2(self, n, x, _Id(re))
    finally:
        env[x] = saved


@lowers_complex("_to_copy", "_to_copy_")
def op_complex_to_copy(self, n, x, **kw):
    """A cast: complex to complex each part, real to complex with a zero imaginary part, complex
    to real the real part (torch discards the imaginary part, with a warning)."""
    shape, dtype = self.out()
    re, im = _parts(self, x)
    out_complex = self.val(n).is_complex()
    if not out_complex:
        return self.cast(re, dtype)
    return _Cplx(self.cast(re, dtype), self.cast(im, dtype) if im is not None else self.const(0, shape, dtype))


@lowers_complex("full", "full_like", "new_full", "scalar_tensor", "fill", "ones", "ones_like", "new_ones")
def op_complex_fill(self, n, *args, **kw):
    shape, dtype = self.out()
    packet = n.target._schema.name.split("::")[-1].rstrip("_")
    if packet in ("ones", "ones_like", "new_ones"):
        value = 1
    else:
        value = args[1] if packet in ("full", "full_like", "fill") else args[2] if packet == "new_full" else args[0]
    if isinstance(value, fx.Node):
        re, im = _parts(self, value)
        return _Cplx(self.bcast(self.cast(re, dtype), shape),
                     self.bcast(self.cast(im, dtype), shape) if im is not None else self.const(0, shape, dtype))
    value = complex(value)
    return _Cplx(self.const(value.real, shape, dtype), self.const(value.imag, shape, dtype))


# --- FFTs -------------------------------------------------------------------------------------------
_NORM = {0: "none", 1: "by_root_n", 2: "by_n"}


def _twiddle(self, rows: int, cols: int, n: int, dtype: str) -> tuple[int, int]:
    """``cos`` and ``sin`` of ``2 pi (r c mod n) / n`` as ``[rows, cols]`` IR tensors."""
    r = self.iota((rows, cols), 0, "int64")
    c = self.iota((rows, cols), 1, "int64")
    prod = self.binary("mul", r, c)
    nn = self.const(n, (), "int64")
    m = self.binary("sub", prod, self.binary("mul", self.binary("div", prod, nn), nn))
    ang = self.binary("mul", self.cast(m, dtype), self.const(2 * math.pi / n, (), dtype))
    return (self.add("cos", [ang], (rows, cols), dtype), self.add("sin", [ang], (rows, cols), dtype))


def _contract(self, t: int, mat: int, axis: int, n: int, kind: str, share: float) -> int:
    """``t`` contracted along ``axis`` with ``mat`` [size, K]: the result has K at ``axis``. The
    ``dot_general`` carries ``fft`` (the transform's size, kind and batch) for the cost model."""
    shape = self.shape(t)
    k = self.shape(mat)[1]
    rest = [s for d, s in enumerate(shape) if d != axis]
    out = self.add("dot_general", [t, mat], rest + [k], self.dtype(t), lhs_batch=(), rhs_batch=(),
                   lhs_contract=(axis,), rhs_contract=(0,),
                   fft={"n": n, "kind": kind, "batch": math.prod(rest), "share": share})
    rank = len(shape)
    if axis == rank - 1:
        return out
    perm = list(range(rank - 1))
    perm.insert(axis, rank - 1)
    return self.transpose(out, perm)


def _dft(self, re: int, im: int | None, axis: int, forward: bool, keep: int | None = None) -> _Cplx:
    """The DFT of ``re + i im`` along ``axis`` (``e^{-2 pi i k m / n}`` forward, ``e^{+...}``
    inverse, unnormalized), keeping the first ``keep`` frequencies (all by default)."""
    n = self.shape(re)[axis]
    keep = n if keep is None else keep
    dtype = self.dtype(re)
    c, s = _twiddle(self, n, keep, n, dtype)
    kind = "c2c" if im is not None else "r2c"
    share = 0.25 if im is not None else 0.5  # of the transform: four real products, or two
    rc, rs = _contract(self, re, c, axis, n, kind, share), _contract(self, re, s, axis, n, kind, share)
    sign = -1 if forward else 1
    if im is None:
        return _Cplx(rc, rs if sign > 0 else self.add("neg", [rs], self.shape(rs), dtype))
    ic, is_ = _contract(self, im, c, axis, n, kind, share), _contract(self, im, s, axis, n, kind, share)
    if forward:  # (re + i im)(cos - i sin)
        return _Cplx(self.binary("add", rc, is_), self.binary("sub", ic, rs))
    return _Cplx(self.binary("sub", rc, is_), self.binary("add", ic, rs))


def _normalized(self, c: _Cplx | int, normalization: int, size: int):
    mode = _NORM.get(int(normalization), "none")
    if mode == "none":
        return c
    scale = 1.0 / (math.sqrt(size) if mode == "by_root_n" else size)
    parts = c if isinstance(c, _Cplx) else (c,)
    out = [self.binary("mul", p, self.const(scale, (), self.dtype(p))) for p in parts]
    return _Cplx(*out) if isinstance(c, _Cplx) else out[0]


def _dims(dim, rank: int) -> list[int]:
    return [d % rank for d in (dim if isinstance(dim, (list, tuple)) else [dim])]


@lowers_complex("_fft_r2c", always=True)
def op_fft_r2c(self, n, x, dim, normalization, onesided):
    """``rfft``/``fft`` of a real tensor: the last dim of ``dim`` one-sided when ``onesided``
    (``n // 2 + 1`` frequencies), then the others complex-to-complex."""
    xi = self.arg(x, self.out()[1])
    shape = self.shape(xi)
    dims = _dims(dim, len(shape))
    last = dims[-1]
    c = _dft(self, xi, None, last, True, keep=shape[last] // 2 + 1 if onesided else None)
    for d in dims[:-1]:
        c = _dft(self, c[0], c[1], d, True)
    return _normalized(self, c, normalization, math.prod(shape[d] for d in dims))


@lowers_complex("_fft_c2c", always=True)
def op_fft_c2c(self, n, x, dim, normalization, forward):
    re, im = _parts(self, x)
    shape = self.shape(re)
    dims = _dims(dim, len(shape))
    c = (re, im)
    for d in dims:
        c = _dft(self, c[0], c[1], d, bool(forward))
    return _normalized(self, _Cplx(*c), normalization, math.prod(shape[d] for d in dims))


@lowers_complex("_fft_c2r", always=True)
def op_fft_c2r(self, n, x, dim, normalization, last_dim_size):
    """``irfft``: the dims but the last complex-to-complex inverse, then the last one from its
    ``last_dim_size // 2 + 1`` Hermitian half to ``last_dim_size`` real values."""
    re, im = _parts(self, x)
    shape = self.shape(re)
    dims = _dims(dim, len(shape))
    last, size = dims[-1], int(last_dim_size)
    for d in dims[:-1]:
        re, im = _dft(self, re, im, d, False)
    half = shape[last]
    if half != size // 2 + 1:
        self.unsupported(n, f"with {half} input frequencies for {size} outputs (expected {size // 2 + 1})")
    dtype = self.dtype(re)
    c, s = _twiddle(self, half, size, size, dtype)
    k = self.iota((half, 1), 0, "int64")
    edge = self.binary("logical_or", self.binary("eq", k, self.const(0, (), "int64"), "bool"),
                       self.binary("eq", self.binary("mul", k, self.const(2, (), "int64")),
                                   self.const(size, (), "int64"), "bool"), "bool")
    w = self.add("where", [edge, self.const(1.0, (1, 1), dtype), self.const(2.0, (1, 1), dtype)], (half, 1), dtype)
    c, s = self.binary("mul", c, w), self.binary("mul", s, w)
    out = self.binary("sub", _contract(self, re, c, last, size, "c2r", 0.5), _contract(self, im, s, last, size, "c2r", 0.5))
    total = math.prod(shape[d] for d in dims[:-1]) * size
    return _normalized(self, out, normalization, total)



@lowers_complex("eq", "ne")
def op_complex_eq(self, n, a, b):
    """``a == b`` (both parts equal) / ``a != b`` (either differs); a real operand's imaginary part 0."""
    shape, _ = self.out()
    ne = n.target._schema.name.endswith("ne")
    sa, sb = not isinstance(a, fx.Node), not isinstance(b, fx.Node)
    pa, pb = _parts(self, a), _parts(self, b)
    dtype = self.dtype((pa if not sa else pb)[0])
    out = None
    for x, y in zip(pa, pb):
        xi = self.const(0, (), dtype) if x is None else _operand(self, x, dtype, sa)
        yi = self.const(0, (), dtype) if y is None else _operand(self, y, dtype, sb)
        c = self.add("ne" if ne else "eq", [xi, yi], shape, "bool")
        out = c if out is None else self.add("logical_or" if ne else "logical_and", [out, c], shape, "bool")
    return out


def op_angle(self, n, x):
    """``angle`` of a real tensor: pi where negative, else 0 (NaN stays NaN), as torch."""
    shape, dtype = self.out()
    xi = self.arg(x, dtype)
    ang = self.add("where", [self.binary("lt", xi, self.const(0, (), dtype), "bool"), self.const(math.pi, (), dtype),
                             self.const(0.0, (), dtype)], shape, dtype)
    return self.add("where", [self.binary("ne", xi, xi, "bool"), xi, ang], shape, dtype)


OPS.setdefault("angle", op_angle)
