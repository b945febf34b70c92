"""Library GEMM GPU time (cuBLAS, hipBLASLt): measured tables where they exist, the analytical
model where they do not.

Data: XLA's measured GEMM tables (``calibrations/data/xla/matmul.json``, extracted from
``../shared/xla/matmul.jsonl`` by :func:`build_tables`; source: openxla/xla via the ROCm/xla
mirror at commit 183fa00cb5, ``xla/service/gpu/model/default_matmul_perf_table.txtpb``). Each
row is ``[b, m, n, k, seconds]`` of ``lhs[b,m,k] @ rhs[b,k,n]``: the median CUPTI kernel time of
XLA's autotuned best kernel, GPU time only (no host launch). Grids: b in {1, 2, 4}, m, n, k
powers of two 256-4096 (H100 lacks k = 1024). ``f32xf32->f32`` runs on TF32 tensor cores
(H100: 403 TFLOP/s at 4096^3), so it prices ``float32`` only under ``matmul_precision`` high /
medium, never IEEE fp32. fp8 rows are not shipped (the README: some exceed the dense FP8 peak).

The analytical model (:func:`model_time_s`), per (arch, dtype), the library's best of
tile shapes x split-K factors::

    t = floor + max(waves * (2 BM BN ceil(k/s) / (eff(BM, BN) * peak / SMs) + wave_s)
                    + reduce(s), bytes / (hbm_frac * HBM))
    waves = ceil(b ceil(m/BM) ceil(n/BN) s / SMs); eff(BM, BN) = eff / (1 + tile_penalty (128/BM + 128/BN - 2))
    reduce(s) = (s > 1) * (s + 1) * 4 b m n / (hbm_frac * HBM)   (fp32 partials written, read)

``floor`` is the fixed GPU time of one kernel (about 5 us on H100 and B200 for the smallest
GEMMs), ``wave_s`` the per-wave prologue/epilogue. The five coefficients
(``eff, floor_s, wave_s, tile_penalty, hbm_frac``) are fitted per table (least squares on log
time, :func:`fit`) and shipped in the same file; peaks, SM counts and HBM bandwidth come from the
catalog (:mod:`sftctl.catalog.accelerators`, each number sourced there; gfx950 from AMD's MI355X
datasheet, :data:`_AMD_GFX950`).

The prediction (:func:`gemm_gpu_time_s`) is the model times a measured correction:
``exp(r)`` where ``r = log(measured / model)`` is inverse-distance interpolated (in log2 of
b, m, n, k) over the table's points within one octave of the query (clamped into the grid), and
faded to 0 over one octave beyond the grid: at a grid point it returns the measurement, between
points it follows the model's wave/split-K shape scaled to the neighbours, far beyond it is
the model alone. Cross-validated by shape (:func:`cross_validate`: k-fold over (m, n, k), the
fold's shapes at every b held out, the coefficients refitted without them; the results are
shipped in the same file under ``cross_validation``).

Accelerators: H100 -> ``sm_90``; H200 -> ``sm_90`` (the same GH100 die and clocks; the H200's
cuBLAS 4096^3 measured 175.4 us against the H100 table's 176.2 us, ``../shared/h200/peers.jsonl``;
its HBM bandwidth is its own); B200 -> ``sm_100_B200``; MI355X -> ``gfx950``.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

TABLE_PATH = Path(__file__).resolve().parent / "calibrations" / "data" / "xla" / "matmul.json"
SOURCE = ("openxla/xla measured GEMM table (ROCm/xla mirror @183fa00cb5d82384463a1a7aed1ab06bc9026974, "
          "xla/service/gpu/model/default_matmul_perf_table.txtpb; generator xla/tools/matmul_perf_table_gen.cc): "
          "median CUPTI kernel time of XLA's autotuned best (cuBLAS/hipBLASLt or Triton), via ../shared/xla/matmul.jsonl")

#: catalog accelerator -> XLA arch of its table
ARCH_OF = {"H100": "sm_90", "H200": "sm_90", "B200": "sm_100_B200", "MI355X": "gfx950"}
#: compiler dtype -> the table's dtype combination, per vendor (NVIDIA fp16 runs at bf16's rate)
_DTYPES = {"bfloat16": ("bf16xbf16->bf16",), "float16": ("f16xf16->f16", "bf16xbf16->bf16"),
           "tfloat32": ("f32xf32->f32",), "float32": ("f32xf32->f32",)}
SHIPPED = ("bf16xbf16->bf16", "f16xf16->f16", "f32xf32->f32")
_BYTES = {"bf16xbf16->bf16": 2, "f16xf16->f16": 2, "f32xf32->f32": 4}
_PEAK_KEY = {"bf16xbf16->bf16": "bfloat16", "f16xf16->f16": "float16", "f32xf32->f32": "float32"}
#: (arch -> catalog accelerator whose peaks the model uses). gfx950 is not in the catalog: its
#: facts are AMD Instinct MI355X datasheet (2025): 256 CUs, 8 TB/s HBM3E, dense FP16/BF16
#: 2.5 PFLOPS, TF32/"FP32 matrix" 157.3 TFLOPS.
_HW_OF_ARCH = {"sm_90": "H100", "sm_100_B200": "B200"}
_AMD_GFX950 = {"sms": 256, "hbm": 8.0e12, "peak": {"bfloat16": 2.5e15, "float16": 2.5e15, "float32": 1.573e14}}

_TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
#: per arch, where the library's tiles differ: hipBLASLt's tuned gfx942/gfx950 kernels include
#: 256x256 macro tiles (MT256x256x64 in its library logic). Held out by size bucket on XLA's
#: gfx950 table, adding it takes the share within 0.8-1.25 from 76.5 % to 81.6 % (median 1.054
#: -> 1.048); on sm_90 / sm_100 it does not help (98.7 -> 98.3 %, 99.5 -> 98.7 %), so they keep
#: the common set.
_TILES_OF = {"gfx950": ((256, 256),) + _TILES}


def tiles_for(arch: str | None) -> tuple[tuple[int, int], ...]:
    """The (BM, BN) tile shapes the model searches for ``arch``."""
    return _TILES_OF.get(arch or "", _TILES)
_SPLITS = (1, 2, 4, 8, 16)
PARAMS = ("eff", "floor_s", "wave_s", "tile_penalty", "hbm_frac")
_START = (0.8, 4.5e-6, 1.5e-6, 0.1, 0.7)


def _hw_facts(arch: str, dtype: str, hw=None) -> tuple[int, float, float]:
    """(SMs, peak FLOP/s for the dtype, HBM bytes/s) of ``arch`` (``hw`` overrides: an
    accelerator of the same die with its own memory)."""
    key = _PEAK_KEY[dtype]
    if hw is None and arch in _HW_OF_ARCH:
        from sftctl.compiler.hardware import get_accelerator

        hw = get_accelerator(_HW_OF_ARCH[arch])
    if hw is not None:
        peak = hw.matrix_flops_per_s.get("tfloat32" if key == "float32" else key) or hw.matrix_peak(key)
        return hw.sm_count, peak, hw.hbm_bytes_per_s
    return _AMD_GFX950["sms"], _AMD_GFX950["peak"][key], _AMD_GFX950["hbm"]


def _model(shapes, params, sms: int, peak: float, hbm: float, nbytes: int, tiles=_TILES):
    """Vectorized :func:`model_time_s`: ``shapes`` an (N, 4) float array of b, m, n, k -> (N,) s,
    the best of ``tiles`` (:func:`tiles_for`) x split-K factors."""
    import numpy as np

    eff, floor, wave, pen, hfrac = params
    b, m, n, k = (shapes[:, i] for i in range(4))
    bw = hfrac * hbm
    memory = nbytes * b * (m * k + k * n + m * n) / bw
    best = np.full(len(shapes), np.inf)
    for bm, bn in tiles:
        e = eff / (1.0 + pen * (128.0 / bm + 128.0 / bn - 2.0))
        tiles = b * np.ceil(m / bm) * np.ceil(n / bn)
        for s in _SPLITS:
            waves = np.ceil(tiles * s / sms)
            t = waves * (2.0 * bm * bn * np.ceil(k / s) / (e * peak / sms) + wave)
            if s > 1:
                t = t + (s + 1) * 4.0 * b * m * n / bw
            best = np.minimum(best, t)
    return floor + np.maximum(best, memory)


def model_time_s(b: int, m: int, n: int, k: int, arch: str, dtype: str, params=None, hw=None) -> float:
    """The analytical model's GPU seconds for ``lhs[b,m,k] @ rhs[b,k,n]`` (see the module
    docstring), with the shipped coefficients of (``arch``, ``dtype``) unless ``params`` given."""
    import numpy as np

    params = params if params is not None else tables()[arch][dtype]["params"]
    sms, peak, hbm = _hw_facts(arch, dtype, hw)
    return float(_model(np.array([[b, m, n, k]], float), params, sms, peak, hbm, _BYTES[dtype], tiles_for(arch))[0])


def fit(rows, arch: str, dtype: str) -> list[float]:
    """Coefficients (:data:`PARAMS`) minimizing the squared log error of the model on ``rows``
    (``[b, m, n, k, seconds]``): Nelder-Mead on the log of each coefficient (numpy only)."""
    import numpy as np

    a = np.asarray(rows, float)
    shapes, logt = a[:, :4], np.log(a[:, 4])
    sms, peak, hbm = _hw_facts(arch, dtype)

    def loss(x):
        p = np.exp(x)
        if p[0] > 1.0 or p[4] > 1.0:
            return 1e9
        return float(np.mean((np.log(_model(shapes, p, sms, peak, hbm, _BYTES[dtype], tiles_for(arch))) - logt) ** 2))

    x = _nelder_mead(loss, np.log(np.array(_START)))
    return [float(v) for v in np.exp(x)]


def _nelder_mead(f, x0, iters: int = 600, step: float = 0.3):
    import numpy as np

    n = len(x0)
    pts = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        c = np.mean(pts[:-1], axis=0)
        xr = c + (c - pts[-1])
        fr = f(xr)
        if fr < vals[0]:
            xe = c + 2 * (c - pts[-1])
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = c + 0.5 * (pts[-1] - c)
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    return pts[int(np.argmin(vals))]


def build_tables(src: str | Path) -> dict:
    """The shipped document from XLA's ``matmul.jsonl``: per arch and shipped dtype its rows and
    fitted coefficients. ``python -m sftctl.compiler.gemm_table SRC`` writes it to :data:`TABLE_PATH`."""
    rows: dict = {}
    for line in Path(src).read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r["dtype"] in SHIPPED:
            rows.setdefault(r["arch"], {}).setdefault(r["dtype"], []).append(
                [r["b"], r["m"], r["n"], r["k"], float(f"{r['time_s']:.6g}")])
    doc = {"source": SOURCE, "row": "[b, m, n, k, seconds]", "params": list(PARAMS), "tables": {}}
    for arch, by_dtype in sorted(rows.items()):
        for dtype, rs in sorted(by_dtype.items()):
            doc["tables"].setdefault(arch, {})[dtype] = {
                "params": [float(f"{v:.5g}") for v in fit(rs, arch, dtype)], "rows": sorted(rs)}
    return doc


@functools.lru_cache(maxsize=1)
def tables() -> dict:
    """arch -> table dtype -> ``{"params": [...], "rows": [[b, m, n, k, s], ...]}`` (shipped)."""
    return json.loads(TABLE_PATH.read_text())["tables"]


class _Interp:
    """Inverse-distance interpolation of the log residual over one table's points (see the
    module docstring)."""

    def __init__(self, rows, arch: str, dtype: str, params, hw=None):
        import numpy as np

        a = np.asarray(rows, float)
        self.arch, self.dtype, self.params, self.hw = arch, dtype, params, hw
        self.sms, self.peak, self.hbm = _hw_facts(arch, dtype, hw)
        self.x = np.log2(a[:, :4])
        self.lo, self.hi = self.x.min(axis=0), self.x.max(axis=0)
        model = _model(a[:, :4], params, self.sms, self.peak, self.hbm, _BYTES[dtype], tiles_for(arch))
        self.r = np.log(a[:, 4] / model)

    def __call__(self, shapes):
        import numpy as np

        shapes = np.asarray(shapes, float)
        model = _model(shapes, self.params, self.sms, self.peak, self.hbm, _BYTES[self.dtype], tiles_for(self.arch))
        q = np.log2(shapes)
        qc = np.clip(q, self.lo, self.hi)
        outside = np.abs(q - qc).max(axis=1)
        fade = np.clip(1.0 - outside, 0.0, 1.0)
        out = np.empty(len(shapes))
        for i, p in enumerate(qc):
            d = np.abs(self.x - p)
            near = d.max(axis=1) <= 1.0 + 1e-9
            if not near.any():
                out[i] = model[i]
                continue
            dist = np.sqrt((d[near] ** 2).sum(axis=1))
            if dist.min() < 1e-9:
                r = float(self.r[near][np.argmin(dist)])
            else:
                w = 1.0 / dist ** 2
                r = float((w * self.r[near]).sum() / w.sum())
            out[i] = model[i] * math.exp(fade[i] * r)
        return out


def _peer_rows(accelerator: str) -> list:
    """bf16 cuBLAS rows measured on ``accelerator`` itself (its calibration's ``peers.jsonl``:
    ``torch.mm`` timings), as ``[1, M, N, K, seconds]``; [] when none are shipped."""
    from sftctl.compiler.calibrated import DATA_DIR

    path = DATA_DIR / accelerator.lower() / "peers.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if r.get("kernel") == "gemm" and r.get("dtype") == "bfloat16" and r.get("measured_s"):
            out.append([1, r["M"], r["N"], r["K"], r["measured_s"]])
    return out


@functools.lru_cache(maxsize=None)
def _interp(accelerator: str, arch: str, dtype: str) -> _Interp:
    from sftctl.compiler.hardware import get_accelerator

    t = tables()[arch][dtype]
    rows = t["rows"] + (_peer_rows(accelerator) if dtype == "bf16xbf16->bf16" else [])
    hw = get_accelerator(accelerator) if accelerator in _HW_OF_ARCH.values() or accelerator == "H200" else None
    return _Interp(rows, arch, dtype, t["params"], hw)


def table_for(accelerator: str, dtype: str) -> tuple[str, str] | None:
    """(arch, table dtype) that prices ``dtype`` GEMMs on ``accelerator`` (a catalog name), or
    None where no measured table applies."""
    arch = ARCH_OF.get(accelerator)
    if arch is None or arch not in tables():
        return None
    for d in _DTYPES.get(dtype, ()):
        if d in tables()[arch]:
            return arch, d
    return None


#: vendor -> the arch whose fitted coefficients price an accelerator without a table of its own
REFERENCE_ARCH = {"nvidia": "sm_90", "amd": "gfx950"}


def gemm_gpu_time_s(b: int, m: int, n: int, k: int, hw, dtype: str) -> float | None:
    """GPU seconds (no host launch) of the library's ``lhs[b,m,k] @ rhs[b,k,n]`` on accelerator
    ``hw`` (a catalog ``Accelerator``) in ``dtype`` (``bfloat16``, ``float16``, ``float32``
    meaning TF32 / matrix-core fp32, ``float8``). Where a measured table covers (accelerator,
    dtype): the model corrected by the table (and, on the H200, by its own cuBLAS peers); else
    the analytical model on ``hw``'s own peaks with the coefficients fitted on its vendor's
    reference table (:data:`REFERENCE_ARCH`; float8 uses the bf16 coefficients at the fp8 peak).
    None when the vendor has no reference (CPU).

    Raises:
        ValueError: a non-positive size.
    """
    import numpy as np

    if min(b, m, n, k) <= 0:
        raise ValueError(f"GEMM sizes must be positive, got b={b} m={m} n={n} k={k}")
    found = table_for(hw.name, dtype)
    if found is not None and get_accelerator_or_none(hw.name) == hw:
        return float(_interp(hw.name, *found)([[b, m, n, k]])[0])
    arch = REFERENCE_ARCH.get(hw.vendor)
    if arch is None or arch not in tables():
        return None
    tdtype = "f32xf32->f32" if dtype in ("float32", "tfloat32") else "bf16xbf16->bf16"
    params = tables()[arch][tdtype]["params"]
    key = {"float32": "tfloat32", "tfloat32": "tfloat32", "float16": "float16", "float8": "float8"}.get(dtype, "bfloat16")
    peak = hw.matrix_flops_per_s.get(key) or hw.matrix_peak("float32" if key == "tfloat32" else key)
    nbytes = {"float32": 4, "tfloat32": 4, "float8": 1}.get(dtype, 2)
    return float(_model(np.array([[b, m, n, k]], float), params, hw.sm_count, peak, hw.hbm_bytes_per_s, nbytes,
                        tiles_for(arch))[0])


def get_accelerator_or_none(name: str):
    from sftctl.compiler.hardware import get_accelerator

    try:
        return get_accelerator(name)
    except KeyError:
        return None


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
    t = gemm_gpu_time_s(*sizes, hw, dtype)
    if t is None:
        raise ValueError(f"no GEMM model for {hw.name} ({hw.vendor})")
    return t


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
        interp = _Interp(train, arch, dtype, params)
        t = np.asarray(test, float)
        ratios += list(interp(t[:, :4]) / t[:, 4])
        model_ratios += list(_model(t[:, :4], params, interp.sms, interp.peak, interp.hbm, _BYTES[dtype],
                                    tiles_for(arch)) / t[:, 4])

    def summary(rs):
        rs = np.asarray(rs)
        return float(np.median(rs)), float(np.mean((rs >= 0.8) & (rs <= 1.25)))

    med, within = summary(ratios)
    mmed, mwithin = summary(model_ratios)
    return {"n": len(ratios), "shapes": len(shapes), "median": med, "within_0.8_1.25": within, "model_median": mmed,
            "model_within": mwithin, "ratios": [float(r) for r in ratios]}


def main() -> None:
    """``python -m sftctl.compiler.gemm_table ../shared/xla/matmul.jsonl``: rebuild the shipped
    tables from XLA's measured GEMMs and record each table's cross-validation."""
    import sys

    doc = build_tables(sys.argv[1])
    TABLE_PATH.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    tables.cache_clear()
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
