"""The fitted analytical model of a library GEMM's GPU time (cuBLAS, hipBLASLt), per accelerator:
the library's best of tile shapes x split-K factors::

    t = floor + max(waves * (2 BM BN ceil(k/s) / (eff(BM, BN) * peak / SMs) + wave_s)
                    + reduce(s), bytes / (hbm_frac * HBM))
    waves = ceil(b ceil(m/BM) ceil(n/BN) s / SMs); eff(BM, BN) = eff / (1 + tile_penalty (128/BM + 128/BN - 2))
    reduce(s) = (s > 1) * (s + 1) * 4 b m n / (hbm_frac * HBM)   (fp32 partials written, read)

Two published ceilings bound it (:func:`mamf_fraction`): no GEMM runs faster than the
accelerator's measured maximum achievable matmul FLOPS (``t >= 2 b m n k / (mamf * peak)``,
:func:`mamf_time_s`), and coefficients fitted on one accelerator's table carry to another (the
A100 priced with the H100's ``sm_90`` fit) with ``eff`` scaled by the two accelerators' MAMF
ratio (:func:`transfer`): the A100 reaches 86.9 % of its bf16 peak where the H100 reaches 80.3 %.

``floor`` is the fixed GPU time of one kernel (about 5 us on H100 and B200 for the smallest
GEMMs), ``wave_s`` the per-wave prologue/epilogue. The five coefficients (:data:`PARAMS`) are
fitted per measured table (:func:`fit`: least squares on log time) and shipped with it
(:mod:`sftctl.compiler.matmul_interpolator`); SMs, peaks and HBM bandwidth are the accelerator's
own (:mod:`sftctl.catalog.accelerators`), the tiles its library's (``Accelerator.gemm_tiles``).

This module knows no table and no accelerator by name: it takes an ``Accelerator`` and the
coefficients. :mod:`sftctl.compiler.gemm_table` chooses between it and the measured tables
(as XLA keeps ``gpu_performance_model`` beside ``matmul_interpolator``). numpy is imported inside
the functions.
"""

from __future__ import annotations

import json
from pathlib import Path

from sftctl.compiler.minimize import nelder_mead

PARAMS = ("eff", "floor_s", "wave_s", "tile_penalty", "hbm_frac")
_START = (0.8, 4.5e-6, 1.5e-6, 0.1, 0.7)
SPLITS = (1, 2, 4, 8, 16)
#: bytes per element of each dtype the model prices (a measured table's dtype combination or a
#: compiler dtype)
NBYTES = {"bf16xbf16->bf16": 2, "f16xf16->f16": 2, "f32xf32->f32": 4,
          "bfloat16": 2, "float16": 2, "float32": 4, "tfloat32": 4, "float8": 1}
#: the catalog's peak key of each table dtype
PEAK_KEY = {"bf16xbf16->bf16": "bfloat16", "f16xf16->f16": "float16", "f32xf32->f32": "float32"}

#: Maximum achievable matmul FLOPS (MAMF) as a fraction of the dense matrix peak, per catalog
#: accelerator and input dtype, from calibrations/mamf.json (its "source": Stas Bekman's "Maximum
#: Achievable Matmul FLOPS comparison table", torch.matmul at the best of a brute-force shape search;
#: e.g. A100 SXM 86.9 % and H100 SXM 80.3 % of the bf16 peak). A data file, as every table keyed by
#: accelerator is: no compiler module names one.
MAMF: dict[str, dict[str, float]] = json.loads(
    (Path(__file__).resolve().parent / "calibrations" / "mamf.json").read_text())["fraction_of_dense_peak"]


def facts(hw, dtype: str) -> tuple[int, float, float]:
    """(SMs, dense peak FLOP/s, HBM bytes/s) of accelerator ``hw`` for ``dtype`` (a table's
    combination such as ``bf16xbf16->bf16``, or ``bfloat16``/``float16``/``float32``/
    ``tfloat32``/``float8``). fp32 is the TF32 / matrix-core fp32 rate (``tfloat32`` where the
    catalog has it). Raises KeyError when ``hw`` has no matrix peak for it."""
    key = PEAK_KEY.get(dtype, dtype)
    if key in ("float32", "tfloat32"):
        peak = hw.matrix_flops_per_s.get("tfloat32") or hw.matrix_peak("float32")
    else:
        peak = hw.matrix_flops_per_s.get(key) or hw.matrix_peak(key)
    return hw.sm_count, peak, hw.hbm_bytes_per_s


def mamf_fraction(hw, dtype: str) -> float | None:
    """The measured maximum achievable fraction of ``hw``'s dense matrix peak for ``dtype`` GEMMs
    (:data:`MAMF`; ``dtype`` a compiler dtype or a table combination such as ``bf16xbf16->bf16``;
    float16 as bfloat16), or None where none is published (fp32/TF32, accelerators not listed)."""
    key = PEAK_KEY.get(dtype, dtype)
    key = "bfloat16" if key == "float16" else key
    return MAMF.get(getattr(hw, "name", ""), {}).get(key)


def mamf_time_s(b: int, m: int, n: int, k: int, hw, dtype: str) -> float:
    """The least GPU seconds of ``lhs[b,m,k] @ rhs[b,k,n]`` on ``hw``: its ``2 b m n k`` FLOPs at
    the measured maximum achievable matmul rate (:func:`mamf_fraction` x the dense peak of
    :func:`facts`); 0.0 where no MAMF is published for ``hw`` and ``dtype``."""
    frac = mamf_fraction(hw, dtype)
    if frac is None:
        return 0.0
    return 2.0 * b * m * n * k / (frac * facts(hw, dtype)[1])


def transfer(params, hw, reference, dtype: str) -> list[float]:
    """Coefficients fitted on ``reference``'s measured table, carried to accelerator ``hw``: the
    efficiency ``eff`` scaled by ``mamf(hw) / mamf(reference)`` (:func:`mamf_fraction`), the
    other coefficients as fitted; unchanged where either lacks a MAMF figure for ``dtype``."""
    out = [float(v) for v in params]
    mine, ref = mamf_fraction(hw, dtype), mamf_fraction(reference, dtype)
    if mine is not None and ref is not None and getattr(hw, "name", None) != getattr(reference, "name", None):
        out[0] = min(1.0, out[0] * mine / ref)
    return out


def predict(shapes, params, sms: int, peak: float, hbm: float, nbytes: int, tiles):
    """GPU seconds of each GEMM: ``shapes`` an (N, 4) float array of b, m, n, k -> (N,) array,
    the best of ``tiles`` ((BM, BN), ...) x split-K factors (see the module docstring)."""
    import numpy as np

    eff, floor, wave, pen, hfrac = params
    b, m, n, k = (shapes[:, i] for i in range(4))
    bw = hfrac * hbm
    memory = nbytes * b * (m * k + k * n + m * n) / bw
    best = np.full(len(shapes), np.inf)
    for bm, bn in tiles:
        e = eff / (1.0 + pen * (128.0 / bm + 128.0 / bn - 2.0))
        blocks = b * np.ceil(m / bm) * np.ceil(n / bn)
        for s in SPLITS:
            waves = np.ceil(blocks * s / sms)
            t = waves * (2.0 * bm * bn * np.ceil(k / s) / (e * peak / sms) + wave)
            if s > 1:
                t = t + (s + 1) * 4.0 * b * m * n / bw
            best = np.minimum(best, t)
    return floor + np.maximum(best, memory)


def time_s(b: int, m: int, n: int, k: int, hw, dtype: str, params) -> float:
    """The model's GPU seconds for ``lhs[b,m,k] @ rhs[b,k,n]`` on ``hw`` in ``dtype`` with
    coefficients ``params`` (:data:`PARAMS` order) and ``hw``'s library tiles."""
    import numpy as np

    sms, peak, hbm = facts(hw, dtype)
    return float(predict(np.array([[b, m, n, k]], float), params, sms, peak, hbm, NBYTES[dtype], hw.gemm_tiles)[0])


def fit(rows, hw, dtype: str) -> list[float]:
    """Coefficients (:data:`PARAMS`) minimizing the squared log error of the model on ``rows``
    (``[b, m, n, k, seconds]`` measured on ``hw``): Nelder-Mead on the log of each coefficient
    (numpy only)."""
    import numpy as np

    a = np.asarray(rows, float)
    shapes, logt = a[:, :4], np.log(a[:, 4])
    sms, peak, hbm = facts(hw, dtype)

    def loss(x):
        p = np.exp(x)
        if p[0] > 1.0 or p[4] > 1.0:
            return 1e9
        return float(np.mean((np.log(predict(shapes, p, sms, peak, hbm, NBYTES[dtype], hw.gemm_tiles)) - logt) ** 2))

    x, _ = nelder_mead(loss, np.log(np.array(_START)), step=0.3, iters=600)
    return [float(v) for v in np.exp(x)]
