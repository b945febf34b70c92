"""Attention kernel speed from published benchmark tables (``calibrations/attention.json``).

Attention is priced by the implementation the job runs (:data:`IMPLEMENTATIONS`: FlashAttention 2
and 3, cuDNN, SDPA's memory-efficient and math paths, Triton, xformers, FlexAttention), each from
its own published figures (the ``implementations`` map of the data file). The implementation is
the attention nodes' ``impl`` attribute: stamped by the tracer from HF's ``attn_implementation``,
replaced by the spec's ``model.attention`` (:func:`with_implementation`), ``auto`` otherwise,
which :func:`resolve` turns into the kernel torch's SDPA dispatches on that GPU.

A flash-attention kernel (fusion kind ``attention``, one per call and direction) is priced as::

    t = launch + fill latency + FLOPs / (fraction * matrix peak of the target),   >= its bytes at HBM rate

where ``fraction`` is what that implementation reaches on that accelerator's GPU family, as a
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


def _accelerator_entry(accelerator: str) -> dict:
    """The data file's entry for ``accelerator``, or for its name without a memory suffix (a
    ``V100-32GB`` is a ``V100`` with more HBM2: the same die, the same kernels); {} without."""
    import re

    acc = _doc()["accelerators"]
    return acc.get(accelerator) or acc.get(re.sub(r"-\d+GB$", "", accelerator)) or {}


def table_for(accelerator: str) -> tuple[str, dict]:
    """(table name, table) of ``accelerator``; the FlashAttention-2 A100 table when the catalog
    names a GPU the data file does not."""
    d = _doc()
    name = _accelerator_entry(accelerator).get("table", "fa2-a100")
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


#: the implementations a spec may name (``model.attention``); ``auto`` is torch SDPA's dispatch
IMPLEMENTATIONS = ("auto", "flash2", "flash3", "cudnn", "efficient", "math", "triton", "xformers", "flex")
#: HF ``config._attn_implementation`` -> ours (``eager`` is attention written out by hand: it traces as
#: matmul + softmax + matmul and never reaches this module)
HF_IMPLEMENTATIONS = {"sdpa": "auto", "flash_attention_2": "flash2", "flash_attention_3": "flash3",
                      "flex_attention": "flex", "eager": "math"}
#: the implementation a GPU family's tables are transferred from (:func:`_rate`)
_FAMILY_BASE = {"ampere": "flash2", "volta-turing": "efficient", "rocm": "aotriton"}


def check_implementation(value: str, field: str = "model.attention") -> str:
    """``value`` if it names an implementation (:data:`IMPLEMENTATIONS`); raises ValueError with
    one line naming ``field`` and the choices otherwise."""
    if value not in IMPLEMENTATIONS:
        raise ValueError(f"{field}: unknown attention implementation {value!r}; use one of "
                         f"{', '.join(IMPLEMENTATIONS)}")
    return value


ATTENTION_OPS = ("attention", "attention_lse", "attention_grad")


def with_implementation(graph, implementation: str, torch_version: str | None = None):
    """``graph`` (an IR :class:`~sftctl.compiler.ir.Graph`) with every attention node's ``impl``
    attribute set to ``implementation`` (:data:`IMPLEMENTATIONS`), and its ``torch`` attribute to
    ``torch_version`` (``"2.3"``: the torch the job runs, which decides SDPA's choice; None: the
    installed one): a copy, the input untouched; ``graph`` itself when nothing changes. ``auto``
    keeps what the tracer stamped (HF's ``attn_implementation``). Raises ValueError for an
    unknown implementation or a torch version that is not ``major.minor``."""
    import dataclasses

    check_implementation(implementation)
    extra = {} if implementation == "auto" else {"impl": implementation}
    if torch_version is not None:
        _torch_tuple(torch_version)
        extra["torch"] = str(torch_version)
    if not extra or not any(n.op in ATTENTION_OPS for n in graph.nodes):
        return graph
    nodes = [dataclasses.replace(n, attrs={**n.attrs, **extra}) if n.op in ATTENTION_OPS else n for n in graph.nodes]
    return dataclasses.replace(graph, nodes=nodes)


def with_call_implementations(graph, impls: dict[int, tuple[str, bool]]):
    """``graph`` with the attention nodes of the calls in ``impls`` (the tracer's call number, the
    nodes' ``rng`` attribute -> (implementation, ALiBi or not)) stamped ``impl`` and ``alibi``:
    the model's own call (``flash_attn_func``, xformers, ``flex_attention``). A copy."""
    import dataclasses

    nodes = [dataclasses.replace(n, attrs={**n.attrs, "impl": impls[n.attrs["rng"]][0],
                                           "alibi": impls[n.attrs["rng"]][1]})
             if n.op in ATTENTION_OPS and n.attrs.get("rng") in impls else n for n in graph.nodes]
    return dataclasses.replace(graph, nodes=nodes)


#: the note when a boolean SDPA mask's values are unknown at trace time (:func:`with_padding`)
PADDING_UNKNOWN = ("attention mask: its values are unknown at trace time (the batch built on meta, the model too "
                   "large to build for real), so a padded batch cannot be told from an unpadded one: priced "
                   "unpadded (transformers drops the mask; causal, flash); a padded batch gives SDPA the mask, "
                   "whose memory-efficient kernel computes every tile")


def with_padding(graph, padding: dict[int, str]):
    """``graph`` with the attention nodes of the SDPA calls in ``padding`` (call number, the
    nodes' ``rng`` attribute -> ``"none"`` | ``"padded"`` | ``"unknown"``:
    :func:`sftctl.compiler.frontends.torch.attention.mask_padding`) stamped ``padding``. A
    ``padded`` call is priced as SDPA runs a call given a mask: the memory-efficient kernel over
    every tile (:func:`sftctl.compiler.fusion.attention_shape`: not causal, ``bias``). A copy."""
    import dataclasses

    nodes = [dataclasses.replace(n, attrs={**n.attrs, "padding": padding[n.attrs["rng"]]})
             if n.op in ATTENTION_OPS and n.attrs.get("rng") in padding else n for n in graph.nodes]
    return dataclasses.replace(graph, nodes=nodes)


def _torch_tuple(version: str) -> tuple[int, int]:
    """``"2.3"`` / ``"2.3.1+cu121"`` -> (2, 3); ValueError naming the value otherwise."""
    try:
        major, minor = str(version).split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        raise ValueError(f"torch version must be major.minor (2.3), got {version!r}") from None


@functools.lru_cache(maxsize=1)
def _installed_torch() -> tuple[int, int]:
    """(major, minor) of the installed torch, (99, 0) without one (assume a recent torch)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("torch").split("+")[0].split(".")[:2]
        return int(major), int(minor)
    except (PackageNotFoundError, ValueError):
        return 99, 0


def family(accelerator: str) -> str:
    """The GPU family whose tables price ``accelerator``: ``hopper`` (sm90+: H100, H200, B200),
    ``ampere`` (sm80-89: A100, A10G, L4), ``volta-turing`` (below sm80: V100, T4), ``rocm``
    (AMD). A name the catalog does not know is ``ampere`` (FlashAttention-2 on an A100)."""
    from sftctl.catalog.accelerators import get_accelerator

    try:
        hw = get_accelerator(accelerator)
    except (KeyError, ValueError):
        return "ampere"
    if hw.vendor == "amd":
        return "rocm"
    arch = hw.triton_arch if isinstance(hw.triton_arch, int) else 80
    return "hopper" if arch >= 90 else "ampere" if arch >= 80 else "volta-turing"


def resolve(implementation: str | None, accelerator: str, *, dtype: str = "bfloat16", head_dim: int = 64,
            bias: bool = False, torch_version: tuple[int, int] | None = None) -> str:
    """The kernel that runs: ``implementation`` (:data:`IMPLEMENTATIONS`; None, ``auto`` and
    ``sdpa`` mean torch SDPA's own choice) on ``accelerator``.

    SDPA's dispatch (torch ``sdp_utils``; the order flash/cuDNN, memory-efficient, math): on AMD
    AOTriton; below sm80 the memory-efficient kernel (flash needs sm80+); float32, a head dim
    above 256 or an additive float ``bias`` (ALiBi's or a relative-position bias through SDPA's
    ``attn_mask``) rule out flash and cuDNN, so the memory-efficient kernel (a boolean mask does
    not: HF drops an all-ones padding mask before SDPA, so an unpadded batch runs flash; a padded
    one reaches SDPA, which :func:`with_padding` marks as a ``bias`` where the traced batch pads,
    and the plan says so where its values are unknown); on sm90+ cuDNN from torch 2.11 (``torch_version``, (major, minor);
    None: the installed torch's; see ``accelerators`` in the data file), FlashAttention-2 before
    it and on sm80-89. A named kernel the GPU cannot run falls back as a user of it
    would: FlashAttention-3 and cuDNN off Hopper to FlashAttention-2, anything flash-like below
    sm80 to the memory-efficient kernel, on AMD to AOTriton (``math`` runs everywhere)."""
    fam = family(accelerator)
    impl = "auto" if implementation in (None, "sdpa") else implementation
    if impl == "auto":
        if fam == "rocm":
            return "aotriton"
        if fam == "volta-turing" or dtype in ("float32", "float64") or head_dim > 256 or bias:
            return "efficient"
        return "cudnn" if fam == "hopper" and (torch_version or _installed_torch()) >= (2, 11) else "flash2"
    if impl == "xformers" and fam == "volta-turing":
        return "efficient"
    if impl in ("math", "efficient", "xformers"):
        return impl
    if fam == "rocm":
        return "aotriton"
    if fam == "volta-turing":
        return "efficient"
    if impl in ("flash3", "cudnn") and fam != "hopper":
        return "flash2"
    return impl


def _rate(impl: str, fam: str, direction: str, causal: bool, head_dim: int, seq_len: int) -> float:
    """Fraction of the dense matrix peak ``impl`` reaches on GPU family ``fam``: its own table
    there, else its rate relative to another implementation (``relative``), else its Hopper
    table's ratio to the family's base implementation (:data:`_FAMILY_BASE`) times the base's
    rate on that family (a stated transfer)."""
    d = _doc()
    spec = d["implementations"].get(impl, {})
    name = spec.get("tables", {}).get(fam)
    if name:
        return _table_fraction(d["tables"][name], direction, causal, head_dim, seq_len)
    rel = spec.get("relative")
    if rel:
        return rel[direction] * _rate(rel["of"], fam, direction, causal, head_dim, seq_len)
    base = _FAMILY_BASE.get(fam)
    if base is None or base == impl or "hopper" not in spec.get("tables", {}):
        raise ValueError(f"attention.json prices no {impl} on {fam}")
    hopper_base = "flash2" if base == "aotriton" else base
    ratio = (_rate(impl, "hopper", direction, causal, head_dim, seq_len)
             / _rate(hopper_base, "hopper", direction, causal, head_dim, seq_len))
    return ratio * _rate(base, fam, direction, causal, head_dim, seq_len)


def _table_fraction(table: dict, direction: str, causal: bool, head_dim: int, seq_len: int) -> float:
    """One table's fraction of the peak (``flat_fraction``, ``scale_of``, ``backward_of`` or its series)."""
    if "flat_fraction" in table:
        return float(table["flat_fraction"][direction])
    if "scale_of" in table:
        base = _doc()["tables"][table["scale_of"]]
        plateau = _series_fraction(base, direction, False, 128, 16384)
        return (_series_fraction(base, direction, causal, head_dim, seq_len)
                * table["plateau_fraction"][direction] / plateau)
    if direction == "backward" and "backward_of" in table:
        b = table["backward_of"]
        return b["ratio"] * _table_fraction(_doc()["tables"][b["table"]], direction, causal, head_dim, seq_len)
    return _series_fraction(table, direction, causal, head_dim, seq_len)


def efficiency(accelerator: str, direction: str, causal: bool, head_dim: int, seq_len: int,
               implementation: str | None = None, *, dtype: str = "bfloat16", bias: bool = False,
               alibi: bool = False, torch_version: tuple[int, int] | None = None) -> float:
    """Fraction of the dense matrix peak one attention kernel reaches on ``accelerator``
    (``direction``: ``forward`` | ``backward``; ``seq_len``: the longer of the query and key
    lengths, tokens; ``head_dim``: elements), run by ``implementation`` (:func:`resolve`; None:
    torch SDPA's choice) from that implementation's published tables (interpolated in log2 of
    length and head dim, clamped at their ends). ``alibi``: the implementation's ALiBi factor
    (``implementations.alibi`` in the data file); ``dtype``, ``bias``, ``torch_version``:
    what SDPA's choice depends on (:func:`resolve`).

    Raises:
        ValueError: an unknown direction or implementation.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be forward or backward, got {direction!r}")
    if implementation is not None and implementation != "sdpa":
        check_implementation(implementation, "implementation")
    impl = resolve(implementation, accelerator, dtype=dtype, head_dim=head_dim, bias=bias,
                   torch_version=torch_version)
    fam = family(accelerator)
    rate = _rate(impl, fam, direction, causal, head_dim, seq_len)
    if alibi:
        rate *= _doc()["implementations"]["alibi"]["factor"].get(impl, 1.0)
    return rate


def source(accelerator: str, implementation: str | None = None, **shape) -> dict:
    """Where ``accelerator``'s attention speed comes from: ``{implementation, table, backend,
    source, why}`` for ``implementation`` (None: torch SDPA's choice) and ``shape``'s keywords
    (:func:`resolve`'s ``dtype``, ``head_dim``, ``bias``, ``torch_version``)."""
    d = _doc()
    impl = resolve(implementation, accelerator, **shape)
    fam = family(accelerator)
    spec = d["implementations"].get(impl, {})
    name = spec.get("tables", {}).get(fam)
    if name is None and spec.get("relative"):
        name = f"{spec['relative']['of']} x relative"
    elif name is None:
        name = f"{spec.get('tables', {}).get('hopper')} / {_FAMILY_BASE.get(fam)} transferred"
    table = d["tables"].get(name) or d["tables"].get(spec.get("tables", {}).get("hopper"), {})
    why = _accelerator_entry(accelerator).get("why", "not in attention.json: FlashAttention-2 (A100) assumed")
    return {"implementation": impl, "table": name, "backend": table.get("backend", spec.get("name", impl)),
            "source": table.get("source", spec.get("why", "")), "why": why}


def attention_time_s(shape: dict, target) -> float:
    """Seconds of one attention kernel of ``shape`` (:func:`sftctl.compiler.fusion.attention_shape`'s
    dict: direction, batch, q_heads, q_len, kv_len, head_dim, v_head_dim, dtype, kept_fraction,
    and optionally ``implementation`` and ``alibi``) on ``target`` (a
    :class:`~sftctl.compiler.target.Target`): launch + fill latency + FLOPs at the
    implementation's fraction of the matrix peak (:func:`efficiency`)."""
    from sftctl.compiler.costmodel import memory_bound_time_s
    from sftctl.compiler.fusion import attention_flops

    hw, coeffs = target.hw, target.coeffs
    dtype = "float32" if shape["dtype"] == "float64" else shape["dtype"]
    eff = efficiency(hw.name, shape["direction"], bool(shape.get("causal")),
                     int(shape["head_dim"]), int(max(shape["q_len"], shape["kv_len"])),
                     shape.get("implementation"), dtype=dtype, bias=bool(shape.get("bias")),
                     alibi=bool(shape.get("alibi")),
                     torch_version=_torch_tuple(shape["torch"]) if shape.get("torch") else None)
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
