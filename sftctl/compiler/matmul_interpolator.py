"""XLA's measured GEMM tables and the interpolation between their points (XLA's
``matmul_interpolator``).

Data: ``calibrations/data/xla/matmul.json``, extracted from XLA's ``matmul.jsonl`` by
:func:`sftctl.compiler.gemm_table.build_tables` (source: openxla/xla via the ROCm/xla mirror at
commit 183fa00cb5, ``xla/service/gpu/model/default_matmul_perf_table.txtpb``). Each row is
``[b, m, n, k, seconds]`` of ``lhs[b,m,k] @ rhs[b,k,n]``: the median CUPTI kernel time of XLA's
autotuned best kernel, GPU time only (no host launch). Grids: b in {1, 2, 4}, m, n, k powers of
two 256-4096 (H100 lacks k = 1024). ``f32xf32->f32`` runs on TF32 tensor cores (H100: 403
TFLOP/s at 4096^3), so it prices ``float32`` only under ``matmul_precision`` high / medium,
never IEEE fp32. fp8 rows are not shipped (the README: some exceed the dense FP8 peak). Each
table is keyed by XLA's arch (``sm_90``), carries the analytical model's coefficients fitted to
it (:mod:`sftctl.compiler.matmul_model`) and names the catalog accelerator it was measured on
(``measured_on``). Which accelerator a table prices is the catalog's ``gemm_table`` field.

:class:`Interpolator`: the log residual ``r = log(measured / model)`` is inverse-distance
interpolated (in log2 of b, m, n, k) over the table's points within one octave of the query
(clamped into the grid), and faded to 0 over one octave beyond the grid: at a grid point the
prediction is the measurement, between points it follows the model's wave/split-K shape scaled
to the neighbours, far beyond it is the model alone.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

TABLE_PATH = Path(__file__).resolve().parent / "calibrations" / "data" / "xla" / "matmul.json"
SOURCE = ("openxla/xla measured GEMM table (ROCm/xla mirror @183fa00cb5d82384463a1a7aed1ab06bc9026974, "
          "xla/service/gpu/model/default_matmul_perf_table.txtpb; generator xla/tools/matmul_perf_table_gen.cc): "
          "median CUPTI kernel time of XLA's autotuned best (cuBLAS/hipBLASLt or Triton), via data/provenance/xla/matmul.jsonl")
#: the table dtype combinations shipped
SHIPPED = ("bf16xbf16->bf16", "f16xf16->f16", "f32xf32->f32")


@functools.lru_cache(maxsize=1)
def document() -> dict:
    """The shipped document (:data:`TABLE_PATH`), read once."""
    return json.loads(TABLE_PATH.read_text())


def tables() -> dict:
    """arch -> table dtype -> ``{"params": [...], "rows": [[b, m, n, k, s], ...]}`` (shipped)."""
    return document()["tables"]


def measured_on(arch: str):
    """The catalog ``Accelerator`` table ``arch`` was measured on (its SMs, peaks and bandwidth
    fit the model). Raises KeyError for a table that names none, or a name the catalog lacks."""
    from sftctl.compiler.hardware import get_accelerator

    name = document().get("measured_on", {}).get(arch)
    if name is None:
        raise KeyError(f"{TABLE_PATH.name}: table {arch!r} names no measured_on accelerator")
    return get_accelerator(name)


class Interpolator:
    """Inverse-distance interpolation of the log residual of ``model`` over one table's points
    (see the module docstring). ``model(shapes) -> seconds``: an (N, 4) array of b, m, n, k."""

    def __init__(self, rows, model):
        import numpy as np

        a = np.asarray(rows, float)
        self.model = model
        self.x = np.log2(a[:, :4])
        self.lo, self.hi = self.x.min(axis=0), self.x.max(axis=0)
        self.r = np.log(a[:, 4] / model(a[:, :4]))

    def __call__(self, shapes):
        import numpy as np

        shapes = np.asarray(shapes, float)
        model = self.model(shapes)
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


def peer_rows(accelerator: str) -> list:
    """bf16 cuBLAS rows measured on ``accelerator`` itself (``calibrations/data/<name>/peers.jsonl``:
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
