"""Issue 43: dense linear algebra inside the step (``linalg.eigh``, ``svd``, ``svdvals``, ``qr``,
``lu_factor`` / ``lu_solve`` / ``lu``, ``solve``, ``inv``, ``det``, ``slogdet``), traced by the
torch frontend's decompositions (:mod:`sftctl.compiler.frontends.torch.solvers`) and run by the
float64 interpreter against torch in float64, backward included (random inputs; loss and every
gradient within ``rtol`` 1e-7), and priced as cuSOLVER routines (:mod:`sftctl.compiler.linalg`).

Losses that read eigen- or singular vectors use sign-invariant forms (``V diag(f(w)) V^T``,
``U Vh``, squares), as torch documents for gradients through them.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from stepcheck import assert_step_matches  # noqa: E402

from sftctl.compiler.frontends.torch import solvers  # noqa: E402


def _gen(seed):
    return torch.Generator().manual_seed(seed)


class _Whitening(nn.Module):
    """ZCA whitening of learned features (``eigh`` of their covariance; a decorrelated batch
    norm), then a spectral penalty on a learned matrix (``svd``, ``svdvals``)."""

    def __init__(self, d=5):
        super().__init__()
        self.f = nn.Linear(3, d)
        self.w = nn.Parameter(torch.randn(d, 4, generator=_gen(1)))

    def forward(self, x):
        h = self.f(x)
        h = h - h.mean(0)
        cov = h.mT @ h / h.shape[0] + 0.1 * torch.eye(h.shape[1], dtype=h.dtype)
        w, V = torch.linalg.eigh(cov)
        zca = V @ torch.diag_embed(w.rsqrt()) @ V.mT
        z = h @ zca
        U, s, Vh = torch.linalg.svd(self.w, full_matrices=False)
        Uf, sf, Vhf = torch.linalg.svd(self.w.mT @ self.w[:, :3])  # 4 x 3, full_matrices=True
        polar = U @ Vh
        return ((z @ polar).tanh().pow(2).mean() + s.max() + torch.linalg.svdvals(z[:4]).sum()
                + torch.linalg.eigvalsh(cov, UPLO="U").log().sum() + sf.pow(2).sum() + (Uf[:, :3] * sf @ Vhf).sum())


class _Factorizations(nn.Module):
    """QR (an orthogonal parametrization: Q of a learned matrix), LU solves, ``solve``, ``inv``,
    ``det`` and ``slogdet`` of a learned, well-conditioned matrix."""

    def __init__(self, d=4):
        super().__init__()
        self.a = nn.Parameter(torch.randn(d, d, generator=_gen(2)) + 3 * torch.eye(d))
        self.q = nn.Parameter(torch.randn(d + 2, d, generator=_gen(3)))
        self.f = nn.Linear(d, d)

    def forward(self, x):
        Q, R = torch.linalg.qr(self.q)
        Qc, Rc = torch.linalg.qr(self.q[:3], mode="complete")  # 3 x 4: complete is differentiable
        LU, piv = torch.linalg.lu_factor(self.a)
        b = self.f(x)                                            # (n, d)
        y1 = torch.linalg.lu_solve(LU, piv, b.mT)                # A y = b^T
        y2 = torch.linalg.lu_solve(LU, piv, b.mT, adjoint=True)
        y3 = torch.linalg.lu_solve(LU, piv, b, left=False)
        P, L, U = torch.linalg.lu(self.a)
        s = torch.linalg.solve(self.a, b[0])                     # a vector right-hand side
        sign, logdet = torch.linalg.slogdet(self.a)
        return ((x @ Q.mT[:, :4]).pow(2).mean() + R.diagonal().abs().sum() + (Qc @ Rc).sum() + y1.tanh().sum()
                + y2.pow(2).mean() + y3.sum() + (P @ L).pow(2).sum() + U.sum() + s.sum()
                + torch.linalg.inv(self.a).sum() + torch.linalg.det(self.a) + sign * logdet)


def test_eigh_and_svd_with_their_backward_match_torch_in_float64():
    assert_step_matches(_Whitening(), torch.randn(7, 3, generator=_gen(4)), lambda m, x: m(x), rtol=1e-7)


def test_qr_lu_solve_inv_det_with_their_backward_match_torch_in_float64():
    assert_step_matches(_Factorizations(), torch.randn(6, 4, generator=_gen(5)), lambda m, x: m(x), rtol=1e-7)


@pytest.mark.parametrize("n", [3, 8, 17, 64])
def test_jacobi_reaches_float64_rounding(n):
    """The fixed sweep count (:func:`solvers.jacobi_sweeps`) on a spectrum with a cluster: the
    eigenvalues and the reconstruction within 1e-13 of the matrix's norm."""
    d = torch.float64
    Q, _ = torch.linalg.qr(torch.randn(n, n, dtype=d, generator=_gen(n)))
    ev = torch.randn(n, dtype=d, generator=_gen(n + 1)) * 10
    ev[: n // 3] = 1.0 + 1e-9 * torch.arange(n // 3, dtype=d)
    A = Q @ torch.diag(ev) @ Q.mT
    w, V = solvers.linalg_eigh(A)
    scale = ev.abs().max().item()
    assert (w - torch.linalg.eigvalsh(A)).abs().max().item() < 1e-13 * scale
    assert (V @ torch.diag(w) @ V.mT - A).abs().max().item() < 1e-13 * scale
    U, s, Vh = solvers.linalg_svd(A[:, : max(1, n // 2)], full_matrices=False)
    assert (s - torch.linalg.svdvals(A[:, : max(1, n // 2)])).abs().max().item() < 1e-13 * scale


def test_pivots_and_signs_are_lapacks():
    """LU's pivots and QR's signs are LAPACK's (``getrf``, ``geqrf``), so code that reads them
    (``lu_unpack``, ``R.diagonal()``'s signs) sees what torch gives."""
    A = torch.randn(3, 6, 6, dtype=torch.float64, generator=_gen(6))
    LU, piv, _ = solvers.linalg_lu_factor_ex(A)
    LU2, piv2 = torch.linalg.lu_factor(A)
    assert torch.equal(piv, piv2)
    torch.testing.assert_close(LU, LU2, rtol=1e-12, atol=1e-12)
    Q, R = solvers.linalg_qr(A[..., :4])
    Q2, R2 = torch.linalg.qr(A[..., :4])
    torch.testing.assert_close(R, R2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(Q, Q2, rtol=1e-12, atol=1e-12)


def test_solvers_are_priced_as_one_cusolver_call_each():
    """Each call's kernels carry one routine's time (its lead kernel), the rest none and no launch
    in the execution-mode predictions (an 8 x 8 ``eigh``'s Jacobi sweeps are hundreds of small IR
    kernels; cuSOLVER's ``syevjBatched`` is one)."""
    from sftctl.compiler.fusion import fuse
    from sftctl.compiler.linalg import is_solver_part, library_time_s, solver_time_s
    from sftctl.compiler.modes import predict_mode
    from sftctl.compiler.step import cost_kernels
    from sftctl.compiler.target import load_target

    class Spectral(nn.Module):
        def __init__(self, d=8):
            super().__init__()
            self.f = nn.Linear(d, d)

        def forward(self, x):
            h = self.f(x)
            w, V = torch.linalg.eigh(h.mT @ h)
            LU, piv = torch.linalg.lu_factor(h[:4, :4] + 4 * torch.eye(4))
            return w.sum() + (V * V).sum() + torch.linalg.lu_solve(LU, piv, h[:4, :2]).sum()

    from sftctl.compiler.frontends import torch as torch_frontend

    graph, _ = torch_frontend.trace_step(Spectral(), torch.randn(10, 8), lambda m, x: m(x), fake=True)
    target = load_target("H100")
    kernels = fuse(graph)
    costs = cost_kernels(graph, kernels, target)
    leads = {}
    for k, plan in zip(kernels, costs.plans):
        t = library_time_s(graph, k, target)
        if t is None:
            continue
        assert plan.time_s == pytest.approx(t)
        if not is_solver_part(graph, k):
            lead = next(graph.nodes[i].attrs["solver"] for i in k.nodes
                        if graph.nodes[i].attrs.get("solver", {}).get("lead"))
            leads[lead["id"]] = (lead, plan.time_s)
    routines = sorted(s["routine"] for s, _ in leads.values())
    # the forward's three calls; the backward's: getrs (lu_solve's adjoint), trsm (lu_factor's)
    assert {"getrf", "getrs", "syevd"} <= set(routines) <= {"getrf", "getrs", "syevd", "trsm"}, routines
    assert routines.count("syevd") == 1 and routines.count("getrf") == 1, routines
    eigh, t = next(v for v in leads.values() if v[0]["routine"] == "syevd")
    assert t == pytest.approx(solver_time_s(eigh, "float32", target))
    parts = [k for k in kernels if is_solver_part(graph, k)]
    assert len(parts) > 100
    plain = [k for k in kernels if library_time_s(graph, k, target) is None]
    eager = predict_mode(graph, target, "eager")
    assert eager["kernels"] <= len(kernels) - len(parts) + 10  # the foreach optimizer's own count aside
    assert len(plain) < eager["kernels"] + len(parts)


def test_solver_time_model():
    """The routine model's two regimes on an H100 (float32): a batch of small matrices is one
    launch and scales with the batch; a large ``getrf`` approaches its FLOPs at
    ``BLAS3_EFFICIENCY`` of the peak; ``syevd`` pays its tridiagonal reduction's matrix-vector
    half at HBM bandwidth, so it costs more than ``getrf`` per FLOP."""
    from sftctl.compiler import linalg
    from sftctl.compiler.target import load_target

    target = load_target("H100")
    peak = target.hw.vector_peak("float32")
    one = linalg.solver_time_s({"routine": "syevd", "m": 8, "n": 8, "batch": 1}, "float32", target)
    many = linalg.solver_time_s({"routine": "syevd", "m": 8, "n": 8, "batch": 1_000_000}, "float32", target)
    more = linalg.solver_time_s({"routine": "syevd", "m": 8, "n": 8, "batch": 2_000_000}, "float32", target)
    assert 1e-6 < one < 2e-5  # a launch
    assert many > 50 * one
    assert more == pytest.approx(2 * many, rel=0.1)  # compute-bound: linear in the batch
    n = 8192
    lu = linalg.solver_time_s({"routine": "getrf", "m": n, "n": n, "batch": 1}, "float32", target)
    floor = (2 / 3) * n ** 3 / (peak * linalg.BLAS3_EFFICIENCY)
    assert floor < lu < 1.2 * floor
    eig = linalg.solver_time_s({"routine": "syevd", "m": n, "n": n, "batch": 1}, "float32", target)
    assert eig / sum(linalg.solver_flops({"routine": "syevd", "m": n, "n": n})) > lu / ((2 / 3) * n ** 3)
