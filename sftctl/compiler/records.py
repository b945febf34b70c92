"""Measured kernel records and their predictions: the record format of the H200 calibration set
(``calibrations/data/h200/README.md``, the team's measurements, copied verbatim), checked and completed
(:func:`normalize`), their ptxas resources (:func:`resources_for`), and the cost model's seconds
for each (:func:`predict_records`). The tools ``python -m sftctl.compiler.predict`` (records in,
``predicted_s`` out) and ``python -m sftctl.compiler.calibration`` (the fit) both price through
here. Kernels, as written in ``calibrations/data/h200/kernels.py``:

* ``gemm``: ``mm_kernel``, bf16/fp16/fp32 A (M x K row-major) @ B (K x N row-major), config
  ``BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages`` and ``GROUP_M`` (default 1);
* ``layernorm`` / ``softmax``: ``layernorm_fwd`` / ``softmax_fwd`` over ``M x N``, config
  ``ROWS`` (default 1), ``BLOCK_N`` (default ``next_power_of_2(N)``), ``num_warps``;
* ``bias_gelu``: over ``M x N`` elements, config ``BLOCK``, ``num_warps``.

Registers and spills come from ptxas: the shipped table of the calibration configs
(``calibrations/data/h200/resources_sm90.json``), else an offline Triton compile of the reference
kernel for the accelerator's target (disk-cached; needs ``triton``), else the model's estimate.
"""

from __future__ import annotations

import functools
import json
import math

from sftctl.compiler.calibrated import DATA_DIR
from sftctl.compiler.target import Target

KERNELS = ("gemm", "layernorm", "softmax", "bias_gelu")
_GEMM_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
_DTYPES = ("bfloat16", "float16", "float32")


class RecordError(ValueError):
    """A record that can not be predicted; the message names the field and a fix."""


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _pos_int(rec: dict, key: str, where: str = "") -> int:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RecordError(f"{where}{key} must be a positive integer, got {v!r}")
    return v


def normalize(rec) -> dict:
    """The record's kernel, sizes and full config (defaults filled in); RecordError if bad."""
    if not isinstance(rec, dict):
        raise RecordError("a record must be a JSON object")
    kernel = rec.get("kernel")
    if kernel not in KERNELS:
        raise RecordError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    dtype = rec.get("dtype", "bfloat16")
    if dtype not in _DTYPES:
        raise RecordError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    cfg = rec.get("config")
    if not isinstance(cfg, dict):
        raise RecordError("config must be an object (see calibrations/data/h200/README.md)")
    M, N = _pos_int(rec, "M"), _pos_int(rec, "N")
    out = {"kernel": kernel, "dtype": dtype, "M": M, "N": N}
    if kernel == "gemm":
        out["K"] = _pos_int(rec, "K")
        c = {k: _pos_int(cfg, k, "config.") for k in _GEMM_KEYS}
        c["GROUP_M"] = _pos_int(dict(GROUP_M=cfg.get("GROUP_M", 1)), "GROUP_M", "config.")
    elif kernel == "bias_gelu":
        c = {k: _pos_int(cfg, k, "config.") for k in ("BLOCK", "num_warps")}
    else:
        c = {"ROWS": _pos_int(dict(ROWS=cfg.get("ROWS", 1)), "ROWS", "config."),
             "BLOCK_N": _pos_int(dict(BLOCK_N=cfg.get("BLOCK_N", _next_pow2(N))), "BLOCK_N", "config."),
             "num_warps": _pos_int(cfg, "num_warps", "config.")}
        if c["BLOCK_N"] < N:
            raise RecordError(f"config.BLOCK_N ({c['BLOCK_N']}) must cover the row (N={N}): "
                              "the kernel loads a whole row at once")
    for k in ("num_warps", "BLOCK", "BLOCK_N", "BLOCK_M", "BLOCK_K"):
        if k in c and c[k] & (c[k] - 1):
            raise RecordError(f"config.{k} must be a power of two, got {c[k]}")
    out["config"] = c
    return out


def config_key(kernel: str, config: dict) -> str:
    """Key of a config in ``resources_sm90.json``."""
    keys = {"gemm": _GEMM_KEYS, "bias_gelu": ("BLOCK", "num_warps")}.get(kernel, ("ROWS", "BLOCK_N", "num_warps"))
    return ",".join(f"{k}={config[k]}" for k in keys)


@functools.lru_cache(maxsize=None)
def shipped_resources(target: str) -> dict:
    """kernel -> config key -> ptxas resources, of the shipped table for ``target`` ({} if none)."""
    path = DATA_DIR / "h200" / f"resources_{target.replace('_', '')}.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())["kernels"]


_SIGS = {
    "gemm": ({"a_ptr": "*{t}", "b_ptr": "*{t}", "c_ptr": "*{t}", "M": "i32", "N": "i32", "K": "i32",
              "sam": "i32", "sak": "constexpr", "sbk": "i32", "sbn": "constexpr", "scm": "i32",
              "scn": "constexpr", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr",
              "GROUP_M": "constexpr"}, "mm_kernel"),
    "layernorm": ({"x_ptr": "*{t}", "w_ptr": "*{t}", "b_ptr": "*{t}", "y_ptr": "*{t}", "M": "i32", "N": "i32",
                   "eps": "fp32", "ROWS": "constexpr", "BLOCK_N": "constexpr"}, "layernorm_fwd"),
    "softmax": ({"x_ptr": "*{t}", "y_ptr": "*{t}", "M": "i32", "N": "i32", "ROWS": "constexpr",
                 "BLOCK_N": "constexpr"}, "softmax_fwd"),
    "bias_gelu": ({"x_ptr": "*{t}", "b_ptr": "*{t}", "y_ptr": "*{t}", "n_elem": "i32", "N": "i32",
                   "BLOCK": "constexpr"}, "bias_gelu"),
}


@functools.lru_cache(maxsize=1)
def _reference_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sftctl_h200_reference_kernels", DATA_DIR / "h200" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_reference(kernel: str, config: dict, target: str, dtype: str = "bfloat16") -> dict | None:
    """ptxas resources of the reference kernel for ``config`` on ``target`` (Triton offline
    compile through ``codegen.targets.compile_resources``, disk-cached); None when Triton is
    missing or refuses the config."""
    try:
        from sftctl.compiler.codegen import _runtime as rt
        from sftctl.compiler.codegen.targets import compile_resources

        mod = _reference_module()
        sig_t, name = _SIGS[kernel]
        t = rt.triton_type(dtype)
        sig = {k: v.format(t=t) for k, v in sig_t.items()}
        fn = getattr(mod, name)
        if kernel == "gemm":
            ce = {"sak": 1, "sbn": 1, "scn": 1, "BM": config["BLOCK_M"], "BN": config["BLOCK_N"],
                  "BK": config["BLOCK_K"], "GROUP_M": config["GROUP_M"]}
        elif kernel == "bias_gelu":
            ce = {"BLOCK": config["BLOCK"]}
        else:
            ce = {"ROWS": config["ROWS"], "BLOCK_N": config["BLOCK_N"]}
        names = list(fn.arg_names)
        attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
                 if v.startswith("*") or (v == "i32" and k not in ("eps",))}
        import warnings

        with warnings.catch_warnings():  # Triton's knob deprecation notices: not ours to print
            warnings.simplefilter("ignore")
            r = compile_resources(fn, sig, ce, target, num_warps=config["num_warps"],
                                  num_stages=config.get("num_stages", 3), attrs=attrs)
        return {"registers": r.registers, "spill_bytes": r.spill_bytes, "shared_bytes": r.shared_bytes}
    except Exception:  # noqa: BLE001 a schedule the compiler rejects has no resources
        return None


def resources_for(kernel: str, config: dict, hw, dtype: str = "bfloat16", compile: bool = True) -> dict | None:
    """Registers / spill bytes / shared bytes of one record's kernel on ``hw`` (None: unknown)."""
    from sftctl.compiler.codegen.targets import target_for

    try:
        target = target_for(hw)
    except ValueError:
        return None
    if dtype == "bfloat16":
        hit = shipped_resources(target).get(kernel, {}).get(config_key(kernel, config))
        if hit is not None and "error" not in hit:
            return hit
    return compile_reference(kernel, config, target, dtype) if compile else None


def predict_records(records: list[dict], target: Target, resources: list | None = None) -> list[float]:
    """Predicted seconds per normalized record on ``target`` (``inf`` where the model says it
    cannot run); the coefficients are ``target.coeffs`` (a fit under evaluation:
    ``target.with_coeffs(fitted)``).

    ``records``: outputs of :func:`normalize`; ``resources``: per record a dict from
    :func:`resources_for` or None. Records of one (kernel, shape) are evaluated together.
    """
    import numpy as np

    import sftctl.compiler.costmodel as cm

    hw, c = target.hw, target.coeffs
    resources = resources if resources is not None else [None] * len(records)
    out = [math.inf] * len(records)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault((r["kernel"], r["dtype"], r["M"], r["N"], r.get("K")), []).append(i)

    def res_arrays(idx):
        regs = np.array([resources[i]["registers"] if resources[i] else np.nan for i in idx], dtype=float)
        spill = np.array([resources[i]["spill_bytes"] if resources[i] else np.nan for i in idx], dtype=float)
        smem = np.array([resources[i]["shared_bytes"] if resources[i] else np.nan for i in idx], dtype=float)
        return regs, spill, smem

    for (kernel, dtype, M, N, K), idx in groups.items():
        cfg = {k: np.array([records[i]["config"][k] for i in idx]) for k in records[idx[0]]["config"]}
        regs, spill, smem = res_arrays(idx)
        if kernel == "gemm":
            prob = cm.GemmProblem(batch=1, m=M, n=N, k=K, dtype=dtype)
            cands = dict(cfg, split_k=np.ones(len(idx)), layout=np.zeros(len(idx)),
                         regs_per_thread=regs, spill_bytes=spill, smem_bytes=smem)
            t = cm.gemm_time_s(prob, hw, cands, c)
        elif kernel == "bias_gelu":
            t = cm.elementwise_time_s(M * N, cfg, hw, c, kind="bias_gelu",
                                      bytes_per_element=2.0 * cm.dtype_bytes(dtype), registers=regs,
                                      spill_bytes=spill)
        else:
            t = cm.row_kernel_time_s(kernel, M, N, cfg, hw, c, dtype=dtype, registers=regs, spill_bytes=spill)
        for j, i in enumerate(idx):
            out[i] = float(np.asarray(t).reshape(-1)[j])
    return out
