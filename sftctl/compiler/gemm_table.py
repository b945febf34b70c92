"""Library GEMM GPU time (cuBLAS, hipBLASLt): the one place that chooses between XLA's measured
tables (:mod:`sftctl.compiler.matmul_interpolator`) and the fitted analytical model
(:mod:`sftctl.compiler.matmul_model`), as XLA chooses between its ``matmul_interpolator`` and
``gpu_performance_model``.

Which table prices an accelerator is its catalog record's (``accelerators.yaml``):

* its die's measured ``gemm_table`` (H100 and H200 ``sm_90``, B200 ``sm_100_B200``, MI355X
  ``gfx950``), where it has the dtype: the prediction is the model times the table's
  interpolated correction (:class:`~sftctl.compiler.matmul_interpolator.Interpolator`; on the
  H200 its own cuBLAS peers join the table's points, ``calibrations/data/h200/peers.jsonl``:
  the H200's cuBLAS 4096^3 measured 175.4 us against the H100 table's 176.2 us);
* otherwise (no table of its die: A100, L4, MI300X, ...; a dtype its table lacks: fp8; an
  accelerator that is not the catalog's: a what-if copy): the model alone, with the
  coefficients of its ``gemm_model`` table (its vendor's reference, ``sm_90`` or ``gfx950``)
  on the accelerator's own SMs, peaks, bandwidth and library tiles;
* neither (the CPU): None.

Cross-validated by shape (:func:`cross_validate`: k-fold over (m, n, k), the fold's shapes at
every b held out, the coefficients refitted without them; the results are shipped in the table
file under ``cross_validation``). ``python -m sftctl.compiler.gemm_table MATMUL_JSONL`` rebuilds
the shipped tables from XLA's measured GEMMs.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from sftctl.compiler.matmul_interpolator import (  # the public names callers use
    SHIPPED,
    SOURCE,
    TABLE_PATH,
    Interpolator,
    document,
    measured_on,
    peer_rows,
    tables,
)
from sftctl.compiler.matmul_model import NBYTES, PARAMS, facts, mamf_time_s, predict, transfer  # re-exported
from sftctl.compiler.matmul_model import fit as fit_on
from sftctl.compiler.matmul_model import time_s as model_time_on

#: compiler dtype -> the table's dtype combinations, in order of preference (fp16 runs at bf16's
#: rate where the table has no f16 rows)
_DTYPES = {"bfloat16": ("bf16xbf16->bf16",), "float16": ("f16xf16->f16", "bf16xbf16->bf16"),
           "tfloat32": ("f32xf32->f32",), "float32": ("f32xf32->f32",)}


def model_time_s(b: int, m: int, n: int, k: int, arch: str, dtype: str, params=None, hw=None) -> float:
    """The analytical model's GPU seconds for ``lhs[b,m,k] @ rhs[b,k,n]`` with the coefficients
    fitted on table ``arch`` for table dtype ``dtype`` (unless ``params`` given), on ``hw``
    (default: the accelerator the table was measured on)."""
    params = params if params is not None else tables()[arch][dtype]["params"]
    return model_time_on(b, m, n, k, hw if hw is not None else measured_on(arch), dtype, params)


def fit(rows, arch: str, dtype: str) -> list[float]:
    """The model's coefficients fitted on ``rows`` (``[b, m, n, k, seconds]``) of table ``arch``
    (on the accelerator it was measured on; :func:`sftctl.compiler.matmul_model.fit`)."""
    return fit_on(rows, measured_on(arch), dtype)


def _interpolator(rows, hw, dtype: str, params) -> Interpolator:
    sms, peak, hbm = facts(hw, dtype)
    nbytes, tiles = NBYTES[dtype], hw.gemm_tiles
    return Interpolator(rows, lambda shapes: predict(shapes, params, sms, peak, hbm, nbytes, tiles))


@functools.lru_cache(maxsize=None)
def _interp(accelerator: str, arch: str, dtype: str) -> Interpolator:
    from sftctl.compiler.hardware import get_accelerator

    t = tables()[arch][dtype]
    rows = t["rows"] + (peer_rows(accelerator) if dtype == "bf16xbf16->bf16" else [])
    return _interpolator(rows, get_accelerator(accelerator), dtype, t["params"])


def table_for(accelerator: str, dtype: str) -> tuple[str, str] | None:
    """(arch, table dtype) of the measured table that prices ``dtype`` GEMMs on ``accelerator``
    (a catalog name): its entry's ``gemm_table``; None where none applies."""
    from sftctl.compiler.hardware import find_accelerator

    acc = find_accelerator(accelerator)
    arch = acc.gemm_table if acc is not None else None
    if arch is None or arch not in tables():
        return None
    for d in _DTYPES.get(dtype, ()):
        if d in tables()[arch]:
            return arch, d
    return None


def gemm_gpu_time_s(b: int, m: int, n: int, k: int, hw, dtype: str) -> float | None:
    """GPU seconds (no host launch) of the library's ``lhs[b,m,k] @ rhs[b,k,n]`` on accelerator
    ``hw`` (a catalog ``Accelerator``) in ``dtype`` (``bfloat16``, ``float16``, ``float32``
    meaning TF32 / matrix-core fp32, ``float8``; anything else is priced as ``bfloat16``). Where
    ``hw``'s measured ``gemm_table`` covers the dtype and ``hw`` is the catalog's: the model
    corrected by the table; else the model on ``hw``'s own peaks with the coefficients of its
    ``gemm_model`` table (float8 uses the bf16 coefficients at the fp8 peak), its efficiency
    carried over by the two accelerators' measured MAMF ratio
    (:func:`sftctl.compiler.matmul_model.transfer`). Either way never faster than ``hw``'s
    published maximum achievable matmul FLOPS (:func:`sftctl.compiler.matmul_model.mamf_time_s`).
    None when ``hw`` names neither (the CPU).

    Raises:
        ValueError: a non-positive size.
    """
    from sftctl.compiler.hardware import find_accelerator

    if min(b, m, n, k) <= 0:
        raise ValueError(f"GEMM sizes must be positive, got b={b} m={m} n={n} k={k}")
    found = table_for(hw.name, dtype)
    d = dtype if dtype in ("float32", "tfloat32", "float16", "float8") else "bfloat16"
    if found is not None and find_accelerator(hw.name) == hw:
        return max(float(_interp(hw.name, *found)([[b, m, n, k]])[0]), mamf_time_s(b, m, n, k, hw, d))
    arch = hw.gemm_model
    if arch is None or arch not in tables():
        return None
    tdtype = "f32xf32->f32" if dtype in ("float32", "tfloat32") else "bf16xbf16->bf16"
    params = transfer(tables()[arch][tdtype]["params"], hw, measured_on(arch), d)
    return max(model_time_on(b, m, n, k, hw, d, params), mamf_time_s(b, m, n, k, hw, d))


def predict_record(rec: dict, hw) -> float:
    """GPU seconds of one record of XLA's ``matmul.jsonl`` as written (``b, m, n, k, dtype``,
    e.g. ``bf16xbf16->bf16``; ``time_s`` / ``flops_per_s`` are not read) on ``hw``.

    Raises:
        ValueError: a missing or non-positive size, or an unknown dtype combination.
    """
    sizes = []
    for f in ("b", "m", "n", "k"):
        v = rec.get(f, 1 if f == "b" else None)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"GEMM record field {f!r} must be a positive integer, got {v!r}")
        sizes.append(v)
    combo = str(rec.get("dtype", ""))
    lhs = combo.split("x", 1)[0]
    dtype = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}.get(lhs)
    if dtype is None and lhs.startswith("f8"):
        dtype = "float8"
    if dtype is None:
        raise ValueError(f"GEMM record field 'dtype' {combo!r} is not one of bf16/f16/f32/f8 x ...; "
                         "write it as XLA's matmul.jsonl does, e.g. 'bf16xbf16->bf16'")
    b, m, n, k = sizes
    t = gemm_gpu_time_s(b, m, n, k, hw, dtype)
    if t is None:
        raise ValueError(f"no GEMM model for {hw.name} ({hw.vendor}): its catalog entry names no gemm_model")
    return t


def build_tables(src: str | Path) -> dict:
    """The shipped document from XLA's ``matmul.jsonl``: per arch and shipped dtype its rows and
    fitted coefficients, and the accelerator each arch was measured on (kept from the shipped
    document). ``python -m sftctl.compiler.gemm_table SRC`` writes it to :data:`TABLE_PATH`.
    Raises KeyError for an arch the shipped document names no ``measured_on`` accelerator for."""
    rows: dict = {}
    for line in Path(src).read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r["dtype"] in SHIPPED:
            rows.setdefault(r["arch"], {}).setdefault(r["dtype"], []).append(
                [r["b"], r["m"], r["n"], r["k"], float(f"{r['time_s']:.6g}")])
    old = document()
    doc = {"source": SOURCE, "row": "[b, m, n, k, seconds]", "params": list(PARAMS),
           "measured_on": {a: old["measured_on"][a] for a in sorted(rows)},
           "measured_on_source": old.get("measured_on_source", ""), "tables": {}}
    for arch, by_dtype in sorted(rows.items()):
        for dtype, rs in sorted(by_dtype.items()):
            doc["tables"].setdefault(arch, {})[dtype] = {
                "params": [float(f"{v:.5g}") for v in fit(rs, arch, dtype)], "rows": sorted(rs)}
    return doc


def size_buckets(shapes: list[tuple[int, int, int]], folds: int) -> dict[tuple[int, int, int], int]:
    """Shape -> bucket: the (m, n, k) shapes sorted by size (log2 of m n k, then m, n, k) and cut
    into ``folds`` contiguous buckets of (nearly) equal count, smallest first. Holding a bucket
    out asks the table's neighbours and the model for a size range none of the rest covers."""
    order = sorted(shapes, key=lambda s: (math.log2(s[0] * s[1] * s[2]), s))
    return {s: min(folds - 1, i * folds // len(order)) for i, s in enumerate(order)}


def cross_validate(arch: str, dtype: str, folds: int = 5, seed: int = 0, by: str = "shape") -> dict:
    """k-fold by shape: the (m, n, k) shapes of the table are split into ``folds`` groups (``by``
    ``shape``: at random; ``size``: :func:`size_buckets`, contiguous size ranges); each group (at
    every b) is predicted by coefficients refitted on, and residuals interpolated from, the
    others. Returns ``{"n", "shapes", "median", "within_0.8_1.25", "model_median",
    "model_within", "ratios"}`` (predicted / measured). Raises ValueError for another ``by``."""
    import numpy as np

    rows = tables()[arch][dtype]["rows"]
    hw = measured_on(arch)
    shapes = sorted({tuple(r[1:4]) for r in rows})
    if by == "size":
        fold_of = size_buckets(shapes, folds)
    elif by == "shape":
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(shapes))
        fold_of = {shapes[j]: i % folds for i, j in enumerate(order)}
    else:
        raise ValueError(f"by must be shape or size, got {by!r}")
    ratios, model_ratios = [], []
    for f in range(folds):
        train = [r for r in rows if fold_of[tuple(r[1:4])] != f]
        test = [r for r in rows if fold_of[tuple(r[1:4])] == f]
        params = fit(train, arch, dtype)
        interp = _interpolator(train, hw, dtype, params)
        t = np.asarray(test, float)
        ratios += list(interp(t[:, :4]) / t[:, 4])
        model_ratios += list(interp.model(t[:, :4]) / t[:, 4])

    def summary(rs):
        rs = np.asarray(rs)
        return float(np.median(rs)), float(np.mean((rs >= 0.8) & (rs <= 1.25)))

    med, within = summary(ratios)
    mmed, mwithin = summary(model_ratios)
    return {"n": len(ratios), "shapes": len(shapes), "median": med, "within_0.8_1.25": within, "model_median": mmed,
            "model_within": mwithin, "ratios": [float(r) for r in ratios]}


def main() -> None:
    """``python -m sftctl.compiler.gemm_table MATMUL_JSONL``: rebuild the shipped tables from XLA's
    measured GEMMs and record each table's cross-validation."""
    import sys

    doc = build_tables(sys.argv[1])
    TABLE_PATH.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    document.cache_clear()
    _interp.cache_clear()
    doc["cross_validation"] = {"method": "5-fold by (m, n, k) shape, every b of a held-out shape out, "
                                         "coefficients refitted; predicted / measured", "tables": {}}
    for arch, by in doc["tables"].items():
        for dtype, t in by.items():
            cv = cross_validate(arch, dtype)
            doc["cross_validation"]["tables"].setdefault(arch, {})[dtype] = {
                k: round(cv[k], 4) for k in ("median", "within_0.8_1.25", "model_median", "model_within")}
            print(arch, dtype, len(t["rows"]), t["params"], doc["cross_validation"]["tables"][arch][dtype])
    TABLE_PATH.write_text(json.dumps(doc, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
