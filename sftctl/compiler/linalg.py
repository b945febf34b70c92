"""Library calls priced as the library runs them, not as the IR ops the frontend spells them with:
cuFFT (:mod:`sftctl.compiler.fft`) and cuSOLVER / cuBLAS dense linear algebra.

The torch frontend decomposes ``linalg.eigh``, ``svd``, ``qr``, LU, ``solve``, ``inv``, ``det``,
Cholesky and triangular solves into many small IR ops (:mod:`.frontends.torch.solvers`), exact in
the float64 interpreter; every node of one call carries ``attrs["solver"] = {"routine", "m",
"n", "batch", "dtype", "id", ...}`` and the call's first compute node also ``"lead": True``. A GPU runs the
call as one library routine, so :func:`library_time_s` gives the kernel holding the lead node the
routine's whole time (:func:`solver_time_s`) and every other kernel of the call none
(:func:`is_solver_part`: not launched at all).

The routine model, a roofline with stated efficiencies (not a measurement):

* FLOPs per matrix: LAPACK Working Note 41's operation counts for the factorizations and
  solves (``getrf`` ``m n^2 - n^3 / 3``, ``potrf`` ``n^3 / 3``, ``geqrf`` + ``orgqr``
  ``4 m n^2 - 4 n^3 / 3``, ``getrs`` / ``potrs`` ``2 n^2 nrhs``, ``trsm`` ``n^2 nrhs``), and Golub
  and Van Loan's (*Matrix Computations*, 3rd ed., sections 8.3 and 5.4.5) for the eigen and
  singular value problems: the symmetric QR algorithm ``9 n^3`` with eigenvectors, the R-SVD
  ``6 m n^2 + 20 n^3`` with the thin ``U`` and ``V`` (``4 m^2 n + 22 n^3`` with the full ``U``).
* Small matrices (``max(m, n) <= 32``, a batch of them): one batched kernel, as cuSOLVER's
  ``syevjBatched`` / ``gesvdjBatched`` (documented for sizes up to 32) and cuBLAS's
  ``getrfBatched`` / ``geqrfBatched`` / ``trsmBatched`` run them: each matrix in one thread
  block's shared memory, at :data:`SMALL_EFFICIENCY` of the vector peak (no matrix units, a
  block synchronization per rotation or column), the batch read and written once.
* Larger matrices: the blocked LAPACK algorithm cuSOLVER implements (panel width
  :data:`PANEL`), one call per matrix of the batch: :data:`PANEL_LAUNCHES` kernels per panel;
  the BLAS-3 share of the FLOPs at :data:`BLAS3_EFFICIENCY` of the peak, and for the two-sided
  reductions (``sytrd`` in ``syevd``, ``gebrd`` in ``gesvd``) half their reduction FLOPs as
  BLAS-2 matrix-vector products, bound by HBM bandwidth (each element read per two FLOPs): the
  known bottleneck of dense eigensolvers on GPUs (Tomov, Nath and Dongarra, "Accelerating the
  reduction to upper Hessenberg, tridiagonal, and bidiagonal forms through hybrid GPU-based
  computing", Parallel Computing 36 (2010)).

The peak is the target's vector FLOP/s for the matrix's dtype (float32's where the catalog has no
float64 figure); launches and bytes at the target's calibrated fixed kernel time and HBM
efficiency (:func:`sftctl.compiler.costmodel.memory_bound_time_s`).
"""

from __future__ import annotations

import math

from sftctl.compiler.ir import DTYPE_BYTES, Graph

#: the largest matrix cuSOLVER's batched Jacobi routines and cuBLAS's batched factorizations take
SMALL_MAX = 32
#: fraction of the vector peak a batched small-matrix kernel reaches (stated assumption)
SMALL_EFFICIENCY = 0.1
#: fraction of the vector peak the BLAS-3 part of a blocked factorization reaches (stated assumption)
BLAS3_EFFICIENCY = 0.5
#: panel width of the blocked algorithms (stated: the order of the block sizes MAGMA and cuSOLVER pick for
#: large matrices)
PANEL = 128
#: kernels per panel: panel factorization, row swaps / reflector formation, triangular solve or
#: reflector application, trailing update
PANEL_LAUNCHES = {"getrf": 4, "potrf": 3, "geqrf": 4, "syevd": 4, "gesvd": 5, "getrs": 0, "potrs": 0,
                  "trsm": 0}
#: kernels per matrix besides the panels (the solves' triangular sweeps and swaps; the eigen and
#: singular value solvers' tridiagonal / bidiagonal stage and back-transformations)
FIXED_LAUNCHES = {"getrf": 1, "potrf": 1, "geqrf": 2, "syevd": 12, "gesvd": 16, "getrs": 3, "potrs": 2,
                  "trsm": 1}


def solver_flops(solver: dict) -> tuple[float, float]:
    """(BLAS-3-like FLOPs, BLAS-2 FLOPs) of one matrix of the call ``solver`` (``attrs["solver"]``)."""
    routine = solver["routine"]
    m, n = float(solver["m"]), float(solver["n"])
    nrhs = float(solver.get("nrhs", n))
    if routine == "getrf":
        k = min(m, n)
        return max(m, n) * k * k - k ** 3 / 3, 0.0
    if routine == "potrf":
        return n ** 3 / 3, 0.0
    if routine == "geqrf":
        big, k = max(m, n), min(m, n)
        return 4 * big * k * k - 4 * k ** 3 / 3, 0.0
    if routine in ("getrs", "potrs"):
        return 2 * n * n * nrhs, 0.0
    if routine == "trsm":
        return n * n * nrhs, 0.0
    if routine == "syevd":
        reduction = 4 * n ** 3 / 3  # sytrd: half of it symmetric matrix-vector products
        return 9 * n ** 3 - reduction / 2, reduction / 2
    if routine == "gesvd":
        big, k = max(m, n), min(m, n)
        total = (4 * big * big * k + 22 * k ** 3) if solver.get("full") else (6 * big * k * k + 20 * k ** 3)
        reduction = 4 * big * k * k - 4 * k ** 3 / 3  # gebrd: half of it matrix-vector products
        return total - reduction / 2, reduction / 2
    raise ValueError(f"unknown solver routine {routine!r}")


def solver_time_s(solver: dict, dtype: str, target) -> float:
    """Seconds of the whole library call ``solver`` (``attrs["solver"]``) on ``target`` for a
    batch of ``solver["batch"]`` matrices of ``dtype`` (see the module docstring)."""
    from sftctl.compiler.costmodel import memory_bound_time_s

    hw, coeffs = target.hw, target.coeffs
    m, n, batch = int(solver["m"]), int(solver["n"]), max(1, int(solver.get("batch", 1)))
    elem = DTYPE_BYTES.get(dtype, 4)
    blas3, blas2 = solver_flops(solver)
    peak = hw.vector_peak(dtype)
    launch = float(memory_bound_time_s(0, hw, coeffs))
    io = 2.0 * batch * (m * n + m * m + n * n) * elem  # the matrix in, the factors out
    if max(m, n) <= SMALL_MAX:
        compute = batch * (blas3 + blas2) / (peak * SMALL_EFFICIENCY)
        return launch + max(compute, float(memory_bound_time_s(io, hw, coeffs)) - launch)
    routine = solver["routine"]
    launches = batch * (PANEL_LAUNCHES[routine] * math.ceil(min(m, n) / PANEL) + FIXED_LAUNCHES[routine])
    compute = batch * blas3 / (peak * BLAS3_EFFICIENCY)
    blas2_bytes = batch * blas2 / 2 * elem
    memory = float(memory_bound_time_s(io + blas2_bytes, hw, coeffs)) - launch
    return launches * launch + max(compute, memory) + batch * blas2 / peak


def _lead(graph: Graph, k) -> dict | None:
    for i in k.nodes:
        s = graph.nodes[i].attrs.get("solver")
        if s is not None and s.get("lead"):
            return s
    return None


def is_solver_part(graph: Graph, k) -> bool:
    """Whether kernel ``k`` is a part of a library call other than the one that carries its time
    (no kernel of its own on a GPU)."""
    return "solver" in graph.nodes[k.anchor].attrs and _lead(graph, k) is None


def library_time_s(graph: Graph, k, target) -> float | None:
    """Seconds of kernel ``k`` (of ``fuse(graph)``) as a library runs it: cuFFT for a DFT product
    (``attrs["fft"]``), the whole cuSOLVER routine for the kernel holding a call's lead node, 0
    for the call's other kernels; None for an ordinary kernel."""
    anchor = graph.nodes[k.anchor]
    fft = anchor.attrs.get("fft") if k.kind == "gemm" else None
    if fft:
        from sftctl.compiler.fft import fft_time_s

        return fft_time_s(fft, anchor.type.dtype, target)
    lead = _lead(graph, k)
    if lead is not None:
        return solver_time_s(lead, lead.get("dtype", anchor.type.dtype), target)
    return 0.0 if "solver" in anchor.attrs else None
