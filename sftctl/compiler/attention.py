"""Attention kernel speed from published benchmark tables (``calibrations/attention.json``).

A flash-attention kernel (fusion kind ``attention``, one per call and direction) is priced as::

    t = launch + fill latency + FLOPs / (fraction * matrix peak of the target),   >= its bytes at HBM rate

where ``fraction`` is what the backend torch's SDPA dispatches on that accelerator reaches, as a
share of the dense matrix peak of the GPU it was measured on, interpolated in log2(sequence
length) and log2(head dim) over the published points (clamped at their ends: below 512 tokens the
512 value, above 16k the 16k value). FLOPs are those :func:`sftctl.compiler.fusion.attention_flops`
counts (forward ``4 L S D`` per head x the kept fraction; backward 2.5x), the same convention as
the FlashAttention benchmarks, so their TFLOP/s divide straight into them.

Which table each accelerator uses, and why (the backend torch dispatches in the eager and
``default`` modes; ``sftensor`` generates no attention kernel of its own and runs SDPA too), is
the ``accelerators`` map of the data file; each table names its source and quotes it. Tables
marked ``scale_of`` reuse another's shape scaled to a published plateau; ``flat_fraction`` tables
are stated assumptions (no published figures found).
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from pathlib import Path

DATA = Path(__file__).resolve().parent / "calibrations" / "attention.json"
DIRECTIONS = ("forward", "backward")


@functools.lru_cache(maxsize=1)
def _doc() -> dict:
    return json.loads(DATA.read_text())


def table_for(accelerator: str) -> tuple[str, dict]:
    """(table name, table) of ``accelerator``; the FlashAttention-2 A100 table when the catalog
    names a GPU the data file does not."""
    d = _doc()
    name = d["accelerators"].get(accelerator, {}).get("table", "fa2-a100")
    return name, d["tables"][name]


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear in log2(x), clamped to the end values."""
    lx = [math.log2(v) for v in xs]
    t = math.log2(max(x, 1.0))
    if t <= lx[0]:
        return ys[0]
    if t >= lx[-1]:
        return ys[-1]
    i = bisect.bisect_right(lx, t)
    w = (t - lx[i - 1]) / (lx[i] - lx[i - 1])
    return ys[i - 1] + w * (ys[i] - ys[i - 1])


def _series_fraction(table: dict, direction: str, causal: bool, head_dim: int, seq_len: int) -> float:
    """Fraction of the measured-on GPU's peak, from the table's series (see module docstring)."""
    peak = table["peak_flops_per_s"]
    rows = [s for s in table["series"] if s["direction"] == direction and s["causal"] == causal]
    if not rows and direction == "backward" and causal:
        # derived: non-causal backward x (causal / non-causal forward)
        return (_series_fraction(table, "backward", False, head_dim, seq_len)
                * _series_fraction(table, "forward", True, head_dim, seq_len)
                / _series_fraction(table, "forward", False, head_dim, seq_len))
    if not rows:
        raise ValueError(f"attention table has no {direction} series (causal={causal})")
    rows = sorted(rows, key=lambda s: s["head_dim"])
    per_dim = [(s["head_dim"], _interp(s["seq_len"], [v * 1e12 / peak for v in s["tflops"]], seq_len))
               for s in rows]
    dims, fr = [d for d, _ in per_dim], [f for _, f in per_dim]
    return _interp(dims, fr, head_dim) if len(dims) > 1 else fr[0]


def efficiency(accelerator: str, direction: str, causal: bool, head_dim: int, seq_len: int) -> float:
    """Fraction of the dense matrix peak the SDPA backend reaches on ``accelerator`` for one
    attention kernel (``direction``: ``forward`` | ``backward``; ``seq_len``: the longer of the
    query and key lengths, tokens; ``head_dim``: elements).

    Raises:
        ValueError: an unknown direction.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be forward or backward, got {direction!r}")
    _, table = table_for(accelerator)
    if "flat_fraction" in table:
        return float(table["flat_fraction"][direction])
    if "scale_of" in table:
        base = _doc()["tables"][table["scale_of"]]
        plateau = _series_fraction(base, direction, False, 128, 16384)
        return (_series_fraction(base, direction, causal, head_dim, seq_len)
                * table["plateau_fraction"][direction] / plateau)
    return _series_fraction(table, direction, causal, head_dim, seq_len)


def source(accelerator: str) -> dict:
    """Where ``accelerator``'s attention speed comes from: ``{table, backend, source, why}``."""
    name, table = table_for(accelerator)
    why = _doc()["accelerators"].get(accelerator, {}).get("why", "not in attention.json: FlashAttention-2 (A100) assumed")
    return {"table": name, "backend": table["backend"], "source": table["source"], "why": why}


def attention_time_s(shape: dict, target) -> float:
    """Seconds of one attention kernel of ``shape`` (:func:`sftctl.compiler.fusion.attention_shape`'s
    dict: direction, batch, q_heads, q_len, kv_len, head_dim, v_head_dim, dtype, kept_fraction)
    on ``target`` (a :class:`~sftctl.compiler.target.Target`): launch + fill latency + FLOPs at the
    table's fraction of the matrix peak, never faster than its bytes at HBM rate."""
    from sftctl.compiler.costmodel import memory_bound_time_s
    from sftctl.compiler.fusion import attention_flops

    hw, coeffs = target.hw, target.coeffs
    dtype = "float32" if shape["dtype"] == "float64" else shape["dtype"]
    eff = efficiency(hw.name, shape["direction"], bool(shape.get("causal")),
                     int(shape["head_dim"]), int(max(shape["q_len"], shape["kv_len"])))
    flops = attention_flops(shape)
    fixed = float(memory_bound_time_s(0, hw, coeffs))
    return fixed + flops / (eff * hw.matrix_peak(dtype))


def attention_bytes(shape: dict) -> float:
    """Bytes an attention kernel moves: Q, K, V, O (and dO, dQ, dK, dV backward), no scores."""
    from sftctl.compiler.problem import dtype_bytes

    b = dtype_bytes(shape["dtype"])
    q = shape["batch"] * shape["q_heads"] * shape["q_len"] * shape["head_dim"]
    kv = shape["batch"] * shape["kv_heads"] * shape["kv_len"] * (shape["head_dim"] + shape["v_head_dim"])
    o = shape["batch"] * shape["q_heads"] * shape["q_len"] * shape["v_head_dim"]
    return float((q + kv + o) * b * (2 if shape["direction"] == "backward" else 1))


def record_shape(rec: dict) -> dict:
    """An ``attention`` record (``batch``, ``heads``, ``kv_heads`` (default ``heads``), ``q_len``,
    ``kv_len`` (default ``q_len``), ``head_dim``, ``causal`` (false), ``dtype`` (bfloat16),
    ``direction``: forward | backward) as :func:`attention_time_s` takes it. Raises ValueError
    naming the field."""
    from sftctl.compiler.fusion import causal_fraction

    def pos(key, default=None):
        v = rec.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key} must be a positive integer, got {v!r}")
        return v

    direction = rec.get("direction", "forward")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be forward or backward, got {direction!r}")
    dtype = rec.get("dtype", "bfloat16")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    causal = rec.get("causal", False)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be true or false, got {causal!r}")
    heads = pos("heads")
    kv_heads = pos("kv_heads", heads)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    q_len = pos("q_len")
    kv_len = pos("kv_len", q_len)
    d = pos("head_dim")
    return {"direction": direction, "batch": pos("batch"), "q_heads": heads, "kv_heads": kv_heads,
            "q_len": q_len, "kv_len": kv_len, "head_dim": d, "v_head_dim": d, "dtype": dtype,
            "causal": causal, "masked": False, "dropout_p": 0.0,
            "kept_fraction": causal_fraction(q_len, kv_len) if causal else 1.0}


def predict_record(rec: dict, target) -> float:
    """Seconds of one ``attention`` record (:func:`record_shape`) on ``target``: the table's FLOP
    rate, never faster than the kernel's bytes at the HBM rate."""
    from sftctl.compiler.costmodel import memory_bound_time_s

    shape = record_shape(rec)
    mem = float(memory_bound_time_s(attention_bytes(shape), target.hw, target.coeffs))
    return max(mem, attention_time_s(shape, target))
