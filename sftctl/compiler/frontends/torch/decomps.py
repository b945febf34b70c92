"""Decompositions of ops the IR has no lowering for into ops it has (issue 43): special functions,
adaptive max pooling, ``grid_sample``'s backward.

* ``lgamma``, ``digamma`` and ``polygamma(n, x)`` for n <= 2 (a Beta / Gamma / Dirichlet
  likelihood, a VAE's KL term, their gradients): the recurrence shifts the argument by 8, where
  the asymptotic (Stirling / de Moivre) series converges to float64 rounding, and the reflection
  formula covers ``x < 1/2``; ``erfinv`` by Giles's approximation and two Newton steps. Torch's
  own decompositions of them are ``prims`` calls.
* ``adaptive_max_pool2d`` and its backward: the input's rows and columns gathered into torch's
  bins (``floor(i H / oh)`` to ``ceil((i + 1) H / oh)``), padded to the widest bin with -inf, a max
  with torch's first-maximum flat index; the backward scatters the gradient to those indices.
* ``linalg.cholesky``, ``linalg.solve_triangular`` and ``cholesky_solve`` (a Gaussian process's
  marginal likelihood, a Gaussian policy's covariance) unrolled over the matrix size: O(n) graph
  nodes, for the small matrices models hold; their backward (torch's formulas: triangular solves
  and products) decomposes the same way.
* ``grid_sample`` (4-D input): while a step is traced, :func:`grid_sample_decomposed` routes
  ``torch.grid_sampler`` to torch's own Python decomposition of ``grid_sampler_2d`` *above*
  autograd, so autograd differentiates its gathers and weights (no ``grid_sampler_2d_backward``
  op, which has no decomposition); the gradients equal torch's to float64 rounding.

:func:`decompositions` is merged into :func:`.capture.decomposition_table`.
"""

from __future__ import annotations

import contextlib
import math

import torch

aten = torch.ops.aten

_SHIFT = 8  # the series below are used at x + 8 >= 8.5, where their next term is < 1e-15


def _shifted(x: torch.Tensor):
    """(reflected?, y >= 1/2, z = y + 8): the argument made >= 1/2 by reflection, then shifted."""
    neg = x < 0.5
    y = torch.where(neg, 1.0 - x, x)
    return neg, y, y + _SHIFT


def lgamma(x: torch.Tensor) -> torch.Tensor:
    """``log |Gamma(x)|``: Stirling's series at ``y + 8`` less ``log y (y + 1) ... (y + 7)``,
    and ``log(pi / |sin(pi x)|) - lgamma(1 - x)`` for ``x < 1/2``."""
    neg, y, z = _shifted(x)
    iz = 1.0 / z
    iz2 = iz * iz
    series = iz * (1 / 12 + iz2 * (-1 / 360 + iz2 * (1 / 1260 + iz2 * (-1 / 1680 + iz2 * (1 / 1188 + iz2 * (
        -691 / 360360 + iz2 / 156))))))
    stirling = (z - 0.5) * torch.log(z) - z + 0.5 * math.log(2 * math.pi) + series
    logs = sum(torch.log(y + k) for k in range(_SHIFT))
    lg = stirling - logs
    return torch.where(neg, math.log(math.pi) - torch.log(torch.abs(torch.sin(math.pi * x))) - lg, lg)


def digamma(x: torch.Tensor) -> torch.Tensor:
    """``psi(x) = d/dx lgamma``: the asymptotic series at ``y + 8`` less ``sum 1 / (y + k)``, and
    ``psi(1 - x) - pi / tan(pi x)`` for ``x < 1/2``."""
    neg, y, z = _shifted(x)
    iz = 1.0 / z
    iz2 = iz * iz
    series = torch.log(z) - 0.5 * iz - iz2 * (1 / 12 + iz2 * (-1 / 120 + iz2 * (1 / 252 + iz2 * (-1 / 240 + iz2 * (
        1 / 132 + iz2 * (-691 / 32760 + iz2 / 12))))))
    psi = series - sum(1.0 / (y + k) for k in range(_SHIFT))
    return torch.where(neg, psi - math.pi / torch.tan(math.pi * x), psi)


def trigamma(x: torch.Tensor) -> torch.Tensor:
    """``psi_1(x)``: the asymptotic series at ``y + 8`` plus ``sum 1 / (y + k)^2``, and
    ``pi^2 / sin^2(pi x) - psi_1(1 - x)`` for ``x < 1/2``."""
    neg, y, z = _shifted(x)
    iz = 1.0 / z
    iz2 = iz * iz
    series = iz + 0.5 * iz2 + iz * iz2 * (1 / 6 + iz2 * (-1 / 30 + iz2 * (1 / 42 + iz2 * (-1 / 30 + iz2 * (
        5 / 66 + iz2 * (-691 / 2730 + iz2 * 7 / 6))))))
    psi1 = series + sum(1.0 / ((y + k) * (y + k)) for k in range(_SHIFT))
    return torch.where(neg, (math.pi ** 2) / torch.sin(math.pi * x) ** 2 - psi1, psi1)


def tetragamma(x: torch.Tensor) -> torch.Tensor:
    """``psi_2(x)`` (trigamma's derivative): the differentiated series at ``y + 8`` less
    ``sum 2 / (y + k)^3``, and ``psi_2(1 - x) - 2 pi^3 cot(pi x) / sin^2(pi x)`` for ``x < 1/2``."""
    neg, y, z = _shifted(x)
    iz = 1.0 / z
    iz2 = iz * iz
    series = -iz2 - iz2 * iz - iz2 * iz2 * (0.5 + iz2 * (-1 / 6 + iz2 * (1 / 6 + iz2 * (-3 / 10 + iz2 * (
        5 / 6 + iz2 * (-691 / 210 + iz2 * 35 / 2))))))
    psi2 = series - sum(2.0 / ((y + k) * (y + k) * (y + k)) for k in range(_SHIFT))
    s = torch.sin(math.pi * x)
    return torch.where(neg, psi2 - 2 * math.pi ** 3 * torch.cos(math.pi * x) / (s * s * s), psi2)


def polygamma(n: int, x: torch.Tensor) -> torch.Tensor:
    """``polygamma(n, x)`` for n <= 2 (a trigamma's gradient); higher orders are not decomposed."""
    if n == 0:
        return digamma(x)
    if n == 1:
        return trigamma(x)
    if n == 2:
        return tetragamma(x)
    return NotImplemented  # no decomposition: the op stays and is named as missing


# Giles (2010), "Approximating the erfinv function": centre (w < 5) and tail polynomials
_ERFINV_CENTRE = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                  -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
_ERFINV_TAIL = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)


def erfinv(y: torch.Tensor) -> torch.Tensor:
    """``erfinv``: Giles's approximation (about 1e-7 relative), then two Newton steps on
    ``erf(x) - y`` (to float64 rounding); +-1 give +-inf, |y| > 1 NaN, as torch."""
    w = -torch.log((1.0 - y) * (1.0 + y))
    def poly(t, coeffs):
        acc = torch.full_like(t, coeffs[0])
        for k in coeffs[1:]:
            acc = acc * t + k
        return acc
    x = torch.where(w < 5.0, poly(w - 2.5, _ERFINV_CENTRE), poly(torch.sqrt(w) - 3.0, _ERFINV_TAIL)) * y
    for _ in range(2):
        x = x - (torch.erf(x) - y) / (2.0 / math.sqrt(math.pi) * torch.exp(-x * x))
    return torch.where(torch.abs(y) == 1.0, y * math.inf, x)


def _bins(size: int, out: int) -> tuple[list[int], list[int], int]:
    """torch's adaptive pooling bins of ``size`` into ``out``: starts, lengths, widest length."""
    starts = [(i * size) // out for i in range(out)]
    ends = [-(-((i + 1) * size) // out) for i in range(out)]
    lengths = [e - s for s, e in zip(starts, ends)]
    return starts, lengths, max(lengths)


def adaptive_max_pool2d(x: torch.Tensor, output_size) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, flat indices ``h * W + w`` into each input plane), as ``aten.adaptive_max_pool2d``."""
    oh, ow = output_size
    H, W = x.shape[-2], x.shape[-1]
    hs, hl, kh = _bins(H, oh)
    ws, wl, kw = _bins(W, ow)
    dev = x.device
    hidx = torch.tensor([[min(s + k, H - 1) for k in range(kh)] for s in hs], device=dev)   # oh, kh
    widx = torch.tensor([[min(s + k, W - 1) for k in range(kw)] for s in ws], device=dev)   # ow, kw
    hok = torch.tensor([[k < n for k in range(kh)] for n in hl], device=dev)
    wok = torch.tensor([[k < n for k in range(kw)] for n in wl], device=dev)
    rows = x[..., hidx.reshape(-1), :].unflatten(-2, (oh, kh))                      # ..., oh, kh, W
    win = rows[..., widx.reshape(-1)].unflatten(-1, (ow, kw))                       # ..., oh, kh, ow, kw
    ok = hok[:, :, None, None] & wok[None, None, :, :]                              # oh, kh, ow, kw
    win = torch.where(ok, win, torch.tensor(float("-inf"), dtype=x.dtype, device=dev))
    win = win.transpose(-3, -2).flatten(-2)                                         # ..., oh, ow, kh*kw
    flat = (hidx[:, None, :, None] * W + widx[None, :, None, :]).flatten(-2)        # oh, ow, kh*kw
    # torch keeps the first maximum, and a NaN wins
    nan = torch.isnan(win)
    key = torch.where(nan, torch.tensor(float("inf"), dtype=x.dtype, device=dev), win)
    pos = torch.argmax(key, dim=-1, keepdim=True)
    values = torch.gather(win, -1, pos).squeeze(-1)
    index = torch.gather(flat.expand(win.shape), -1, pos).squeeze(-1)
    return values, index


def adaptive_max_pool2d_backward(grad: torch.Tensor, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The gradient scattered (added) to the input position each output took its max from."""
    plane = x.shape[-2] * x.shape[-1]
    g = torch.zeros(*x.shape[:-2], plane, dtype=grad.dtype, device=grad.device)
    g = g.scatter_add(-1, indices.flatten(-2), grad.flatten(-2))
    return g.reshape(x.shape)


def linalg_cholesky_ex(A: torch.Tensor, upper: bool = False, check_errors: bool = False):
    """``(L, info)``: the Cholesky factor by columns (``n`` steps, each a matrix-vector product
    with the columns so far, a square root and a division), batched over leading dims; ``info``
    0. For small matrices (a Gaussian process's kernel, a covariance): O(n) graph nodes."""
    n = A.shape[-1]
    i = torch.arange(n, device=A.device)
    cols: list[torch.Tensor] = []
    for j in range(n):
        c = A[..., :, j]
        if cols:
            done = torch.stack(cols, -1)                                   # ..., n, j
            c = c - (done @ done[..., j, :, None])[..., 0]
        d = torch.sqrt(c[..., j:j + 1])
        cols.append(torch.where(i > j, c / d, torch.where(i == j, d, torch.zeros_like(c))))
    L = torch.stack(cols, -1)
    info = torch.zeros(A.shape[:-2], dtype=torch.int32, device=A.device)
    return (L.mT if upper else L), info


def _forward_substitution(L: torch.Tensor, B: torch.Tensor, unit: bool) -> torch.Tensor:
    """``L^-1 B`` for lower-triangular ``L``, row by row."""
    rows: list[torch.Tensor] = []
    for r in range(L.shape[-1]):
        x = B[..., r:r + 1, :]
        if rows:
            x = x - L[..., r:r + 1, :r] @ torch.cat(rows, -2)
        rows.append(x if unit else x / L[..., r:r + 1, r:r + 1])
    return torch.cat(rows, -2) if rows else B.clone()  # a 0 x 0 system: B is empty too


def linalg_solve_triangular(A: torch.Tensor, B: torch.Tensor, *, upper: bool, left: bool = True,
                            unitriangular: bool = False) -> torch.Tensor:
    """``X`` with ``A X = B`` (``X A = B`` when not ``left``) for triangular ``A``: forward
    substitution; an upper ``A`` is a lower one with rows and columns reversed."""
    if not left:
        return linalg_solve_triangular(A.mT, B.mT, upper=not upper, left=True, unitriangular=unitriangular).mT
    if upper:
        return _forward_substitution(A.flip(-2, -1), B.flip(-2), unitriangular).flip(-2)
    return _forward_substitution(A, B, unitriangular)


def cholesky_solve(B: torch.Tensor, L: torch.Tensor, upper: bool = False) -> torch.Tensor:
    """``X`` with ``(L L^T) X = B`` (``U^T U`` when ``upper``): two triangular solves."""
    if upper:
        L = L.mT
    y = linalg_solve_triangular(L, B, upper=False)
    return linalg_solve_triangular(L.mT, y, upper=True)


def diagonal_scatter(x: torch.Tensor, src: torch.Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1):
    out = x.clone()
    out.diagonal(offset, dim1, dim2).copy_(src)
    return out


def weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim: int):
    """``(grad_v, grad_g)`` of ``w = v g / ||v||`` (norm over every dim but ``dim``, kept):
    ``grad_g = sum(grad_w v) / ||v||``, ``grad_v = g / ||v|| (grad_w - v sum(grad_w v) / ||v||^2)``
    (``nn.utils.weight_norm``, wav2vec2's positional convolution)."""
    dims = [i for i in range(saved_v.dim()) if i != dim % max(saved_v.dim(), 1)]
    norms = saved_norms.to(grad_w.dtype)
    s = (grad_w * saved_v).sum(dims, keepdim=True)
    grad_g = (s / norms).to(saved_g.dtype)
    grad_v = (saved_g / norms) * (grad_w - saved_v * (s / (norms * norms)))
    return grad_v, grad_g


def decompositions() -> dict:
    """ATen overload -> Python decomposition, for :func:`.capture.decomposition_table`."""
    return {
        aten.lgamma.default: lgamma,
        aten.erfinv.default: erfinv,
        aten.digamma.default: digamma,
        aten.polygamma.default: polygamma,
        aten.adaptive_max_pool2d.default: adaptive_max_pool2d,
        aten.adaptive_max_pool2d_backward.default: adaptive_max_pool2d_backward,
        aten.linalg_cholesky_ex.default: linalg_cholesky_ex,
        aten.linalg_solve_triangular.default: linalg_solve_triangular,
        aten.cholesky_solve.default: cholesky_solve,
        aten.diagonal_scatter.default: diagonal_scatter,
        aten._weight_norm_interface_backward.default: weight_norm_interface_backward,
        aten._linalg_check_errors.default: lambda *args, **kwargs: None,
    }


@contextlib.contextmanager
def grid_sample_decomposed():
    """While a step is traced: ``torch.grid_sampler`` (what ``F.grid_sample`` calls) of a 4-D
    input runs torch's Python decomposition of ``grid_sampler_2d`` above autograd, so its
    backward is autograd's derivative of those ops (gathers, weights, a scatter-add)."""
    from torch._decomp.decompositions import grid_sampler_2d

    orig = torch.grid_sampler

    def grid_sampler(input, grid, interpolation_mode, padding_mode, align_corners):
        if input.dim() == 4:
            return grid_sampler_2d(input, grid, interpolation_mode, padding_mode, align_corners)
        return orig(input, grid, interpolation_mode, padding_mode, align_corners)

    torch.grid_sampler = grid_sampler
    try:
        yield
    finally:
        torch.grid_sampler = orig
