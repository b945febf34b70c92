"""Dense linear algebra decomposed into ops the IR has (issue 43): ``linalg.eigh``, ``linalg.svd``
(and ``svdvals``), ``linalg.qr``, LU (``lu_factor``, ``lu_solve``, ``lu_unpack``, ``linalg.lu``),
``linalg.solve``, ``linalg.inv``, ``det`` and ``slogdet``, each with torch's own backward.

The decompositions run below autograd (they are entries of
:func:`.capture.decomposition_table`), so autograd differentiates the ATen op with its own
formula (``linalg_eigh_backward``, ``svd_backward``, ``linalg_qr_backward``,
``linalg_lu_backward`` / ``lu_solve``'s adjoint, ...), and only the forward is spelled here, in
ops the IR lowers, exact to float64 rounding in the reference interpreter:

* QR: Householder reflections as LAPACK's ``geqrf`` forms them (``dlarfg``: ``beta = -sign(alpha)
  ||x||``, ``tau = 0`` for a column already reduced), so ``R``'s signs are torch's; ``Q``
  accumulated backwards as ``orgqr`` does. ``n`` steps for ``min(m, n) = n`` columns.
* LU: partial pivoting by rows (``argmax |A[j:, j]|``, the first maximum as ``idamax`` takes it),
  the swap a gather by a computed index; pivots 1-based int32 as ``getrf`` returns them.
  ``lu_solve`` applies the swaps as one gather by the composed permutation, then two triangular
  solves (:func:`.decomps.linalg_solve_triangular`); ``adjoint`` solves with the transposes.
* eigh: the parallel cyclic Jacobi method (Brent and Luk's round-robin order: ``n / 2`` disjoint
  rotations per round, one ``n x n`` rotation product ``J^T A J``; ``n - 1`` rounds a sweep), a
  fixed number of sweeps (:func:`jacobi_sweeps`: Jacobi converges quadratically, the count
  reaches float64 rounding for the matrix sizes models hold); eigenvalues sorted ascending by a
  one-hot rank product, as ``syevd`` returns them. Eigenvectors' signs are the Jacobi method's,
  not LAPACK's: both are valid, a loss that depends on them is not well defined (torch documents
  the same).
* SVD: one-sided (Hestenes) Jacobi on the columns (the rotation from the current columns' Gram
  entries each round), singular values descending; ``m < n`` through the transpose;
  ``full_matrices`` completes ``U`` / ``Vh`` with a Householder QR of the thin factor.

Every node a call produces carries ``custom["solver"]`` (``routine``: LAPACK's name, ``m``,
``n``, ``batch``, ``dtype``, ``id``; ``nrhs`` for solves), which the lowering copies to the IR nodes' ``attrs["solver"]``;
:mod:`sftctl.compiler.linalg` prices each call as the one cuSOLVER routine a GPU runs, not as the
many small ops spelled here. The decompositions unroll over the matrix size (O(n) to
O(n^2 sweeps) graph nodes): they serve the small matrices models hold (a 3 x 3 covariance, a
Gaussian process's kernel, a 64 x 64 whitening); a matrix larger than :data:`MAX_UNROLLED` is
refused naming the op.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
from torch.fx import traceback as fx_traceback

from sftctl.compiler.frontends.torch.decomps import linalg_solve_triangular

aten = torch.ops.aten

#: the largest matrix dimension the unrolled decompositions accept (graph size grows as n^2)
MAX_UNROLLED = 256

_ids = itertools.count(1)


@contextlib.contextmanager
def _solver(routine: str, A: torch.Tensor, **extra):
    """Tag the nodes traced inside with ``custom["solver"]`` (one ``id`` per call)."""
    m, n = int(A.shape[-2]), int(A.shape[-1])
    if max(m, n) > MAX_UNROLLED:
        raise NotImplementedError(
            f"torch frontend: {routine} of a {m} x {n} matrix: sftctl unrolls dense linear algebra for "
            f"matrices up to {MAX_UNROLLED} x {MAX_UNROLLED}; compute it outside the step or on smaller blocks")
    info = {"routine": routine, "m": m, "n": n, "batch": math.prod(int(s) for s in A.shape[:-2]),
            "dtype": str(A.dtype).removeprefix("torch."), "id": next(_ids), **extra}
    with fx_traceback.annotate({"solver": info}):
        yield


def jacobi_sweeps(n: int) -> int:
    """Sweeps of the cyclic Jacobi method for an ``n x n`` problem: quadratic convergence once the
    off-diagonal is small takes float64 to rounding in about ``log2(n) + 6`` sweeps (measured on
    random and clustered spectra up to n = 64 by tests/test_linalg.py, with two sweeps to spare)."""
    return 8 + max(1, math.ceil(math.log2(max(n, 2))))


def _round_robin(n: int) -> list[list[tuple[int, int]]]:
    """The ``n - 1`` rounds of ``n / 2`` disjoint pairs covering every pair once (``n`` even)."""
    players = list(range(n))
    rounds = []
    for _ in range(n - 1):
        rounds.append([(min(players[i], players[n - 1 - i]), max(players[i], players[n - 1 - i]))
                       for i in range(n // 2)])
        players = [players[0], players[-1]] + players[1:-1]
    return rounds


def _rotation_maps(pairs: list[tuple[int, int]], n: int, like: torch.Tensor):
    """Constant (n/2, n*n) maps: ``c @ C + s @ S`` is the round's rotation ``J`` flattened
    (``J[p,p] = J[q,q] = c``, ``J[p,q] = s``, ``J[q,p] = -s``)."""
    C = torch.zeros(len(pairs), n * n, dtype=like.dtype, device=like.device)
    S = torch.zeros(len(pairs), n * n, dtype=like.dtype, device=like.device)
    for i, (p, q) in enumerate(pairs):
        C[i, p * n + p] = 1
        C[i, q * n + q] = 1
        S[i, p * n + q] = 1
        S[i, q * n + p] = -1
    return C, S


def _rotation(app, aqq, apq):
    """(c, s) of the Jacobi rotation that zeroes ``apq`` (Golub and Van Loan, sym.schur2)."""
    zero = apq == 0
    theta = (aqq - app) / torch.where(zero, torch.ones_like(apq), 2 * apq)
    sign = torch.where(theta >= 0, torch.ones_like(theta), -torch.ones_like(theta))
    t = sign / (theta.abs() + torch.sqrt(1 + theta * theta))
    t = torch.where(zero, torch.zeros_like(t), t)
    c = 1 / torch.sqrt(1 + t * t)
    return c, t * c


def _jacobi(A: torch.Tensor, one_sided: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-sided (``A`` symmetric: returns ``(J^T A J`` diagonalized, ``V)``) or one-sided
    (returns ``(A V`` with orthogonal columns, ``V)``) Jacobi on ``A`` (..., m, n), n padded even."""
    n = A.shape[-1]
    npad = n + (n % 2)
    if npad != n:  # a zero column (and row): never rotated, dropped after
        A = torch.nn.functional.pad(A, (0, 1, 0, 0 if one_sided else 1))
    V = torch.eye(npad, dtype=A.dtype, device=A.device).expand(*A.shape[:-2], npad, npad)
    rounds = _round_robin(npad)
    maps = [_rotation_maps(r, npad, A) for r in rounds]
    idx = [(torch.tensor([p for p, _ in r], device=A.device), torch.tensor([q for _, q in r], device=A.device))
           for r in rounds]
    for _ in range(jacobi_sweeps(n)):
        for (P, Q), (Cm, Sm) in zip(idx, maps):
            G = A.mT @ A if one_sided else A
            app, aqq, apq = G[..., P, P], G[..., Q, Q], G[..., P, Q]
            c, s = _rotation(app, aqq, apq)
            J = (c @ Cm + s @ Sm).unflatten(-1, (npad, npad))
            A = A @ J if one_sided else J.mT @ A @ J
            V = V @ J
    return A[..., :n, :n] if not one_sided else A[..., :, :n], V[..., :n, :n]


def _sort_by(keys: torch.Tensor, descending: bool) -> torch.Tensor:
    """(..., n, n) one-hot ``P`` with ``(keys @ P)`` sorted (stable): ``P[i, r] = rank(i) == r``."""
    n = keys.shape[-1]
    ki, kj = keys[..., :, None], keys[..., None, :]
    before = (kj > ki) if descending else (kj < ki)
    tie = (kj == ki) & (torch.arange(n, device=keys.device)[None, :] < torch.arange(n, device=keys.device)[:, None])
    rank = (before | tie).sum(-1)  # (..., n): how many go before i
    return (rank[..., :, None] == torch.arange(n, device=keys.device)).to(keys.dtype)


def linalg_eigh(A: torch.Tensor, UPLO: str = "L", compute_v: bool = True):
    """``(eigenvalues ascending (..., n), eigenvectors (..., n, n))`` of the symmetric matrix
    ``A``'s ``UPLO`` triangle; ``compute_v=False`` returns an empty eigenvector tensor, as torch."""
    with _solver("syevd", A):
        T = A.tril() if UPLO.upper() == "L" else A.triu()
        S = T + (T.tril(-1).mT if UPLO.upper() == "L" else T.triu(1).mT)
        D, V = _jacobi(S, one_sided=False)
        w = torch.diagonal(D, dim1=-2, dim2=-1)
        P = _sort_by(w, descending=False)
        w = (w[..., None, :] @ P)[..., 0, :]
        V = V @ P
    return w, (V if compute_v else A.new_empty((0,)))


def _householder(A: torch.Tensor):
    """(R with the reflectors applied (..., m, n), [(v (..., m-j), tau (..., 1))] for each column j)."""
    m, n = A.shape[-2], A.shape[-1]
    R = A
    refl = []
    for j in range(min(m, n)):
        x = R[..., j:, j]
        alpha, tail = x[..., :1], x[..., 1:]
        xnorm2 = (tail * tail).sum(-1, keepdim=True)
        norm = torch.sqrt(alpha * alpha + xnorm2)
        beta = torch.where(alpha >= 0, -norm, norm)
        done = xnorm2 == 0
        safe = torch.where(done, torch.ones_like(beta), beta)
        tau = torch.where(done, torch.zeros_like(beta), (beta - alpha) / safe)
        scale = torch.where(done, torch.zeros_like(beta), 1 / torch.where(done, torch.ones_like(beta), alpha - beta))
        v = torch.cat([torch.ones_like(alpha), tail * scale], -1)
        sub = R[..., j:, :]
        w = v[..., None, :] @ sub
        sub = sub - (tau * v)[..., :, None] * w
        R = torch.cat([R[..., :j, :], sub], -2) if j else sub
        refl.append((v, tau))
    return R, refl


def _form_q(refl, m: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """``H_1 H_2 ... H_k I[:, :cols]`` (``orgqr``), applied from the last reflector back."""
    Q = torch.eye(m, cols, dtype=like.dtype, device=like.device).expand(*like.shape[:-2], m, cols)
    for j in reversed(range(len(refl))):
        v, tau = refl[j]
        sub = Q[..., j:, :]
        sub = sub - (tau * v)[..., :, None] * (v[..., None, :] @ sub)
        Q = torch.cat([Q[..., :j, :], sub], -2) if j else sub
    return Q


def linalg_qr(A: torch.Tensor, mode: str = "reduced"):
    """``(Q, R)`` as ``torch.linalg.qr`` (``reduced``, ``complete``; ``r``: Q empty)."""
    m, n = A.shape[-2], A.shape[-1]
    k = min(m, n)
    with _solver("geqrf", A):
        R, refl = _householder(A)
        R = R.triu()
        if mode == "r":
            return A.new_empty((0,)), R[..., :k, :]
        if mode == "complete":
            return _form_q(refl, m, m, A), R
        return _form_q(refl, m, k, A), R[..., :k, :]


def _lu(A: torch.Tensor):
    """(LU packed (..., m, n), pivots (..., k) 1-based int32)."""
    m, n = A.shape[-2], A.shape[-1]
    if A.numel() == 0:  # no matrix, or an empty batch: nothing to pivot (pivots 1..k)
        k = min(m, n)
        return A.clone(), torch.arange(1, k + 1, dtype=torch.int32, device=A.device).expand(*A.shape[:-2], k).clone()
    rows = torch.arange(m, device=A.device)
    pivots = []
    for j in range(min(m, n)):
        p = torch.argmax(A[..., j:, j].abs(), dim=-1, keepdim=True) + j       # (..., 1)
        idx = torch.where(rows == j, p, torch.where(rows == p, torch.full_like(p, j), rows))
        A = torch.take_along_dim(A, idx[..., :, None].expand(A.shape), -2)
        pivots.append(p)
        if j + 1 < m:
            col = A[..., j + 1:, j:j + 1] / A[..., j:j + 1, j:j + 1]
            below = torch.cat([A[..., j + 1:, :j], col, A[..., j + 1:, j + 1:] - col * A[..., j:j + 1, j + 1:]], -1)
            A = torch.cat([A[..., :j + 1, :], below], -2)
    return A, (torch.cat(pivots, -1) + 1).to(torch.int32)


def linalg_lu_factor_ex(A: torch.Tensor, pivot: bool = True, check_errors: bool = False):
    """``(LU, pivots, info)`` as ``getrf``: ``info`` 0 (singularity is not checked while tracing)."""
    if not pivot:
        raise NotImplementedError("torch frontend: lu_factor(pivot=False) (CUDA-only in torch) has no lowering")
    with _solver("getrf", A):
        LU, piv = _lu(A)
    return LU, piv, torch.zeros(A.shape[:-2], dtype=torch.int32, device=A.device)


def _permutation(pivots: torch.Tensor, m: int, inverse: bool) -> torch.Tensor:
    """(..., m) int64 ``perm`` with ``P^T B = B[perm]`` (``inverse``: ``P B = B[perm]``) for
    LAPACK's sequential row swaps ``pivots`` (1-based)."""
    rows = torch.arange(m, device=pivots.device)
    perm = rows.expand(*pivots.shape[:-1], m)
    k = pivots.shape[-1]
    order = reversed(range(k)) if inverse else range(k)
    for i in order:
        p = pivots[..., i:i + 1].to(torch.int64) - 1
        a, b = perm[..., i:i + 1], torch.take_along_dim(perm, p, -1)
        perm = torch.where(rows == i, b, torch.where(rows == p, a, perm))
    return perm


def _rows(B: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return torch.take_along_dim(B, perm[..., :, None].expand(B.shape), -2)


def _lu_solve(LU, pivots, B, left: bool = True, adjoint: bool = False):
    if not left:  # X A = B  <=>  A^T X^T = B^T
        return _lu_solve(LU, pivots, B.mT, left=True, adjoint=not adjoint).mT
    batch = torch.broadcast_shapes(LU.shape[:-2], B.shape[:-2])
    LU = LU.expand(*batch, *LU.shape[-2:])
    B = B.expand(*batch, *B.shape[-2:])
    pivots = pivots.expand(*batch, pivots.shape[-1])
    n = LU.shape[-1]
    if not adjoint:
        y = linalg_solve_triangular(LU, _rows(B, _permutation(pivots, n, inverse=False)), upper=False,
                                    unitriangular=True)
        return linalg_solve_triangular(LU, y, upper=True)
    z = linalg_solve_triangular(LU.mT, B, upper=False)
    w = linalg_solve_triangular(LU.mT, z, upper=True, unitriangular=True)
    return _rows(w, _permutation(pivots, n, inverse=True))


def linalg_lu_solve(LU: torch.Tensor, pivots: torch.Tensor, B: torch.Tensor, *, left: bool = True,
                    adjoint: bool = False):
    """``X`` with ``A X = B`` (``A^H X = B`` when ``adjoint``; ``X A = B`` when not ``left``) from
    ``lu_factor``'s ``(LU, pivots)``, as ``getrs``."""
    with _solver("getrs", LU, nrhs=int(B.shape[-1] if left else B.shape[-2])):
        return _lu_solve(LU, pivots, B, left, adjoint)


def lu_unpack(LU_data: torch.Tensor, LU_pivots: torch.Tensor, unpack_data: bool = True,
              unpack_pivots: bool = True):
    """``(P, L, U)`` with ``A = P L U``; skipped parts are empty tensors, as torch."""
    m, n = LU_data.shape[-2], LU_data.shape[-1]
    k = min(m, n)
    if unpack_pivots:
        perm = _permutation(LU_pivots, m, inverse=False)         # P^T = I[perm]
        P = (torch.arange(m, device=perm.device)[:, None] == perm[..., None, :]).to(LU_data.dtype)
    else:
        P = LU_data.new_empty((0,))
    if unpack_data:
        L = LU_data[..., :, :k].tril(-1) + torch.eye(m, k, dtype=LU_data.dtype, device=LU_data.device)
        U = LU_data[..., :k, :].triu()
    else:
        L = U = LU_data.new_empty((0,))
    return P, L, U


def linalg_lu(A: torch.Tensor, pivot: bool = True):
    """``(P, L, U)`` of ``torch.linalg.lu``."""
    LU, piv, _ = linalg_lu_factor_ex(A, pivot)
    return lu_unpack(LU, piv)


def _vector_rhs(A: torch.Tensor, B: torch.Tensor) -> bool:
    """torch's rule: ``B`` is a (batch of) vector(s) when 1-D or of shape ``A.shape[:-1]``."""
    return B.dim() == 1 or (B.dim() == A.dim() - 1 and tuple(B.shape) == tuple(A.shape[:-1]))


def linalg_solve_ex(A: torch.Tensor, B: torch.Tensor, *, left: bool = True, check_errors: bool = False):
    """``(X, LU, pivots, info)`` of ``aten._linalg_solve_ex`` (``gesv``: ``getrf`` then ``getrs``)."""
    vec = _vector_rhs(A, B)
    Bm = B.unsqueeze(-1) if vec else B
    LU, piv, info = linalg_lu_factor_ex(A)
    X = linalg_lu_solve(LU, piv, Bm, left=left)
    return (X.squeeze(-1) if vec else X), LU, piv, info


def linalg_inv_ex(A: torch.Tensor, check_errors: bool = False):
    """``(A^-1, info)``: ``getrf`` and ``getrs`` against the identity."""
    LU, piv, info = linalg_lu_factor_ex(A)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand(A.shape)
    return linalg_lu_solve(LU, piv, eye), info


def _det_parts(A: torch.Tensor):
    """(LU, pivots) of ``A^T`` (what torch's ``_linalg_det`` / ``_linalg_slogdet`` return and their
    backward reads: a row-major ``A`` is LAPACK's column-major ``A^T``), ``U``'s diagonal, the
    pivots' parity (+-1)."""
    LU, piv, _ = linalg_lu_factor_ex(A.mT)
    n = A.shape[-1]
    diag = torch.diagonal(LU, dim1=-2, dim2=-1)
    swaps = (piv != torch.arange(1, n + 1, device=A.device, dtype=torch.int32)).sum(-1)
    parity = 1 - 2 * (swaps % 2).to(A.dtype)
    return LU, piv, diag, parity


def linalg_det(A: torch.Tensor):
    """``(det, LU, pivots)`` of ``aten._linalg_det``: the product of ``U``'s diagonal, signed by
    the pivots' parity."""
    LU, piv, diag, parity = _det_parts(A)
    return parity * diag.prod(-1), LU, piv


def linalg_slogdet(A: torch.Tensor):
    """``(sign, log|det|, LU, pivots)`` of ``aten._linalg_slogdet``."""
    LU, piv, diag, parity = _det_parts(A)
    return parity * torch.sign(diag).prod(-1), diag.abs().log().sum(-1), LU, piv


def linalg_svd(A: torch.Tensor, full_matrices: bool = False, compute_uv: bool = True, driver=None):
    """``(U, S, Vh)`` of ``aten._linalg_svd`` (singular values descending); with ``compute_uv``
    False, ``U`` and ``Vh`` are empty, as torch."""
    m, n = A.shape[-2], A.shape[-1]
    with _solver("gesvd", A, full=bool(full_matrices and compute_uv)):
        if m < n:
            Vt, S, Ut = _svd_tall(A.mT, full_matrices)
            U, Vh = Ut.mT, Vt.mT
        else:
            U, S, Vh = _svd_tall(A, full_matrices)
    if not compute_uv:
        return A.new_empty((0,)), S, A.new_empty((0,))
    return U, S, Vh


def _svd_tall(A: torch.Tensor, full_matrices: bool):
    """SVD of ``A`` (..., m, n) with m >= n by one-sided Jacobi."""
    m, n = A.shape[-2], A.shape[-1]
    W, V = _jacobi(A, one_sided=True)
    S = torch.sqrt((W * W).sum(-2))
    P = _sort_by(S, descending=True)
    S = (S[..., None, :] @ P)[..., 0, :]
    W, V = W @ P, V @ P
    U = W / torch.where(S == 0, torch.ones_like(S), S)[..., None, :]
    if full_matrices and m > n:
        _, refl = _householder(U)
        Q = _form_q(refl, m, m, U)
        U = torch.cat([U, Q[..., :, n:]], -1)
    return U, S, V.mT


def _tagged(routine: str, fn, nrhs_arg: int | None = None):
    """``fn`` (a decomposition whose first tensor argument is the matrix) tagged as ``routine``."""
    def run(*args, **kwargs):
        extra = {"nrhs": int(args[nrhs_arg].shape[-1])} if nrhs_arg is not None else {}
        matrix = args[1] if routine == "potrs" else args[0]
        with _solver(routine, matrix, **extra):
            return fn(*args, **kwargs)
    return run


def decompositions() -> dict:
    """ATen overload -> decomposition, merged into :func:`.capture.decomposition_table` after
    :func:`.decomps.decompositions` (whose Cholesky and triangular solves it tags)."""
    from sftctl.compiler.frontends.torch.decomps import cholesky_solve, linalg_cholesky_ex

    return {
        aten.linalg_cholesky_ex.default: _tagged("potrf", linalg_cholesky_ex),
        aten.linalg_solve_triangular.default: _tagged("trsm", linalg_solve_triangular, 1),
        aten.cholesky_solve.default: _tagged("potrs", cholesky_solve, 0),
        aten._linalg_eigh.default: linalg_eigh,
        aten._linalg_svd.default: linalg_svd,
        aten.linalg_qr.default: linalg_qr,
        aten.linalg_lu_factor_ex.default: linalg_lu_factor_ex,
        aten.linalg_lu_solve.default: linalg_lu_solve,
        aten.lu_unpack.default: lu_unpack,
        aten.linalg_lu.default: linalg_lu,
        aten._linalg_solve_ex.default: linalg_solve_ex,
        aten.linalg_inv_ex.default: linalg_inv_ex,
        aten._linalg_det.default: linalg_det,
        aten._linalg_slogdet.default: linalg_slogdet,
    }
