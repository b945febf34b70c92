"""FFTs priced as cuFFT runs them, not as the dense products the IR spells them with.

The torch frontend lowers ``_fft_r2c`` / ``_fft_c2r`` / ``_fft_c2c`` (every ``torch.fft``
function and their gradients) to ``dot_general`` nodes with the twiddle matrices
(:mod:`sftctl.compiler.frontends.torch.lowerings.complex`), exact in the float64 interpreter.
Each carries ``attrs["fft"] = {"n", "kind", "batch", "share"}``: the transform's length, kind
(``c2c``, ``r2c``, ``c2r``), the number of transforms, and this node's share of the transform
(a complex transform is four real products, a real one two). A GPU runs the transform as cuFFT
does, O(n log n), so the cost model prices each such node as its share of
:func:`fft_time_s` instead of as a GEMM of K = n.

cuFFT's batched transforms are bandwidth-bound: a length up to 4096 is done in one kernel that
reads the batch once and writes it once from shared memory (the single-upload regime whose
"achieved global bandwidth", system size / time per upload + download, VkFFT's benchmark reports
for cuFFT on A100 over all lengths 2..4096: https://github.com/DTolm/VkFFT, README "Benchmark
results in comparison to cuFFT"); longer transforms take one more read and write of the data per
factor of 4096 (the four-step algorithm). The FLOPs, ``5 n log2 n`` per complex transform (half
for a real one: the convention cuFFT's and FFTW's GFLOPS figures use), are a floor at the vector
peak. Bytes are at the target's calibrated HBM efficiency (:func:`costmodel.memory_bound_time_s`,
the same as every other memory-bound kernel).
"""

from __future__ import annotations

import math

from sftctl.compiler.costmodel import memory_bound_time_s
from sftctl.compiler.ir import DTYPE_BYTES

#: the longest transform cuFFT does in one pass over global memory (shared memory holds it)
ONE_PASS_MAX = 4096


def fft_bytes_flops(fft: dict, dtype: str) -> tuple[float, float]:
    """(bytes moved, FLOPs) of a whole batched transform ``fft`` (``attrs["fft"]``) in ``dtype``
    (the real dtype of its parts): input and output once per pass."""
    n, batch, kind = int(fft["n"]), int(fft["batch"]), fft["kind"]
    half = 2 * (n // 2 + 1)  # real values of a one-sided complex spectrum
    values = {"c2c": 4 * n, "r2c": n + half, "c2r": half + n}.get(kind, 4 * n)
    passes = max(1, math.ceil(math.log2(max(n, 2)) / math.log2(ONE_PASS_MAX)))
    flops = 5.0 * n * math.log2(max(n, 2)) * batch * (1.0 if kind == "c2c" else 0.5)
    return float(passes * values * batch * DTYPE_BYTES.get(dtype, 4)), flops


def fft_time_s(fft: dict, dtype: str, target) -> float:
    """Seconds of one IR node's share (``fft["share"]``) of a cuFFT transform on ``target``: the
    larger of its bytes at HBM bandwidth and its FLOPs at the vector peak, one launch."""
    hw, coeffs = target.hw, target.coeffs
    moved, flops = fft_bytes_flops(fft, dtype)
    mem = float(memory_bound_time_s(moved, hw, coeffs))
    fixed = float(memory_bound_time_s(0, hw, coeffs))
    compute = fixed + flops / (hw.vector_peak(dtype) * coeffs.vector_efficiency)
    return float(fft.get("share", 1.0)) * max(mem, compute)
