"""GEMM / batched GEMM launcher: the search's schedule (a config dict) runs as a Triton kernel.

:func:`gemm` computes, for 2-D or 3-D (batched) operands with arbitrary strides::

    out[b] = act(alpha * (A[b] @ B[b]) + bias) + residual[b]      (fp32 accumulation)

* **Schedule.** ``config`` is a dict as the search returns it (``GemmChoice.config``; keys of
  ``search.gemm.SPACE``): ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K`` (powers of two, >= 16: the
  smallest ``tl.dot`` tile), ``GROUP_M`` (grouped tile order, Triton tutorial 03), ``split_k``,
  ``num_warps``, ``num_stages``, ``layout`` (``costmodel.LAYOUTS``: ``as_is``, ``copy_a``,
  ``copy_b``, ``copy_ab``). Tile sizes, GROUP_M and split_k are ``tl.constexpr`` of the kernel;
  warps and stages are Triton launch options. Missing keys take :data:`DEFAULT_CONFIG`'s value.
* **Prologue.** Operands are read through their strides, so ``a.t()``, ``b.t()``, expanded
  (stride-0) batch dims and sliced views need no copy (``layout`` ``copy_a``/``copy_b`` asks for
  a K-contiguous copy first, which is what the cost model charges for it). Each loaded tile is
  cast to the MMA dtype (``compute_dtype``; default the operands' common dtype), e.g. fp32
  activations times bf16 weights with ``compute_dtype=torch.bfloat16``.
* **Epilogue.** ``alpha`` scaling, ``bias`` per output column (shape ``(N,)``), activation
  (:data:`ACTIVATIONS`), ``residual`` add (any tensor broadcastable to the output), cast to
  ``out_dtype`` (default: the operands' dtype), all on the fp32 accumulator before one store.
* **Split-K** (``split_k > 1``): two passes, the cost model's form (costmodel.py, "Split-K"):
  each of the ``split_k`` K-slices writes an fp32 partial tile into a workspace
  ``[split_k, batch, M, N]``; ``splitk_reduce_kernel`` sums them in a fixed order
  (deterministic, unlike fp32 atomics) and runs the epilogue. Slices are BLOCK_K-aligned; a
  slice past K writes zeros.
* **Modes.** On CUDA/ROCm tensors the kernel is compiled by Triton; on CPU tensors, or with
  ``TRITON_INTERPRET=1``, Triton's interpreter runs it (bit-faithful tiling, slow).

dtypes: fp32 (MMA in TF32 unless ``allow_tf32=False``), fp16, bf16 operands; any float output.
Limits: batch <= 65535 and split_k <= 65535 (CUDA grid y/z). Batch and K-slice offsets are
64-bit; in-tile offsets (row * row stride + col * col stride within one operand matrix) are
32-bit, as in Triton's tutorial kernels, so each 2-D operand/output must span < 2**31 elements
(32-bit offsets keep the contiguity information that vectorized and async-copy loads need).
"""

from __future__ import annotations

import dataclasses
import math

from sftctl.compiler.codegen import _runtime as rt

__all__ = ["ACTIVATIONS", "DEFAULT_CONFIG", "GemmLaunch", "gemm", "gemm_constexprs", "launch_for",
           "normalize_config", "problem_for_kernel"]

#: Activation name -> the kernel's ``ACTIVATION`` constexpr. ``gelu`` is the erf form
#: (``torch.nn.functional.gelu``'s default), ``gelu_tanh`` its ``approximate="tanh"`` form.
ACTIVATIONS = {"none": 0, "relu": 1, "gelu_tanh": 2, "gelu": 3, "gelu_erf": 3, "silu": 4}

#: Schedule used for keys missing from ``config`` (and when ``config`` is None).
DEFAULT_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "split_k": 1,
                  "num_warps": 4, "num_stages": 3, "layout": "as_is"}

_LAYOUTS = ("as_is", "copy_a", "copy_b", "copy_ab")  # == costmodel.LAYOUTS (kept import-free)
_DOT_DTYPES = ("float32", "float16", "bfloat16")


def normalize_config(config: dict | None) -> dict:
    """``config`` completed with :data:`DEFAULT_CONFIG` and checked.

    Raises:
        ValueError: a block size that is not a power of two >= 16, a non-positive count, an
            unknown layout or an unknown key.
    """
    cfg = rt.with_overrides(DEFAULT_CONFIG, config, "gemm config")
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = cfg[key]
        if not (isinstance(v, int) and rt.is_power_of_2(v) and v >= 16):
            raise ValueError(f"gemm config: {key} must be a power of two >= 16, got {v!r}")
    for key in ("GROUP_M", "split_k", "num_warps", "num_stages"):
        v = cfg[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"gemm config: {key} must be a positive int, got {v!r}")
    if not rt.is_power_of_2(cfg["num_warps"]):
        raise ValueError(f"gemm config: num_warps must be a power of two, got {cfg['num_warps']}")
    layout = cfg["layout"]
    if isinstance(layout, int) and 0 <= layout < len(_LAYOUTS):
        cfg["layout"] = _LAYOUTS[layout]
    elif layout not in _LAYOUTS:
        raise ValueError(f"gemm config: layout must be one of {_LAYOUTS}, got {layout!r}")
    return cfg


def gemm_constexprs(config: dict, *, dot_dtype: str = "bfloat16", even_k: bool = False,
                    activation: str = "none", has_bias: bool = False, has_residual: bool = False,
                    has_alpha: bool = False, allow_tf32: bool = True, interpret: bool = False) -> dict:
    """The ``gemm_kernel`` constexprs for a schedule and epilogue (also used by ``targets``)."""

    cfg = normalize_config(config)
    dot_dtype = rt.dtype_name(dot_dtype)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return {
        "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
        "GROUP_M": cfg["GROUP_M"], "SPLIT_K": cfg["split_k"],
        "DOT_DTYPE": rt.tl_dtype(dot_dtype),
        "INPUT_PRECISION": "tf32" if (dot_dtype == "float32" and allow_tf32) else "ieee",
        "UPCAST_DOT": bool(interpret and dot_dtype != "float32"),
        "EVEN_K": bool(even_k),
        "HAS_ALPHA": bool(has_alpha), "HAS_BIAS": bool(has_bias),
        "ACTIVATION": ACTIVATIONS[activation], "HAS_RESIDUAL": bool(has_residual),
    }


def _as_batched(x, name: str):
    if x.dim() == 2:
        return x.unsqueeze(0), False
    if x.dim() == 3:
        return x, True
    raise ValueError(f"gemm: {name} must be 2-D (M x K) or 3-D (batch x M x K), got shape {tuple(x.shape)}")


def _strides3(x, batch: int):
    """(batch, row, col) strides with stride 0 for a broadcast batch."""
    sb = 0 if x.shape[0] == 1 and batch != 1 else x.stride(0)
    return sb, x.stride(1), x.stride(2)


def gemm(a, b, *, bias=None, activation: str = "none", residual=None, alpha: float = 1.0,
         out_dtype=None, config: dict | None = None, out=None, compute_dtype=None,
         allow_tf32: bool = True):
    """``act(alpha * (a @ b) + bias) + residual`` with the Triton schedule ``config``.

    Args:
        a: ``(M, K)`` or ``(batch, M, K)``; any strides (``x.t()`` is read in place).
        b: ``(K, N)`` or ``(batch, K, N)``; a 2-D operand (or batch 1) broadcasts over batch.
        bias: ``(N,)``, added per output column (any float dtype; read as fp32).
        activation: one of :data:`ACTIVATIONS` (``none``, ``relu``, ``gelu``/``gelu_erf``,
            ``gelu_tanh``, ``silu``), applied after the bias.
        residual: broadcastable to the output shape; added after the activation.
        alpha: scales ``a @ b`` before the bias.
        out_dtype: output dtype (default ``a.dtype``).
        config: the schedule (see the module docstring); None: :data:`DEFAULT_CONFIG`.
        out: optional preallocated output of the output's shape (any strides); returned.
        compute_dtype: MMA input dtype; default the operands' dtype (required when they differ).
        allow_tf32: fp32 operands use TF32 tensor-core MMA (the cost model's ``float32`` path);
            False asks for IEEE fp32 (``tl.dot(input_precision="ieee")``).

    Returns:
        The output tensor, ``(M, N)`` if both operands are 2-D, else ``(batch, M, N)``.

    Raises:
        ValueError: mismatched shapes/batches/devices, bad config or activation, batch or split_k
            over 65535.
        TypeError: unsupported operand dtype, or mixed operand dtypes without ``compute_dtype``.
    """
    import torch

    cfg = normalize_config(config)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    rt.check_device(a, b, bias, residual, out)
    a3, a_batched = _as_batched(a, "a")
    b3, b_batched = _as_batched(b, "b")
    if a3.shape[2] != b3.shape[1]:
        raise ValueError(f"gemm: inner dimensions differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    ba, bb = a3.shape[0], b3.shape[0]
    if ba != bb and 1 not in (ba, bb):
        raise ValueError(f"gemm: batch sizes differ: {ba} vs {bb}")
    batch = max(ba, bb)
    M, K, N = a3.shape[1], a3.shape[2], b3.shape[2]
    da, db = rt.dtype_name(a.dtype), rt.dtype_name(b.dtype)
    if compute_dtype is None:
        if da != db:
            raise TypeError(f"gemm: operand dtypes differ ({da}, {db}); pass compute_dtype")
        compute_dtype = da
    dot = rt.dtype_name(compute_dtype)
    if dot not in _DOT_DTYPES:
        raise TypeError(f"gemm: compute dtype must be one of {_DOT_DTYPES}, got {dot}")
    odt = rt.torch_dtype(out_dtype) if out_dtype is not None else a.dtype
    out_shape = (batch, M, N) if (a_batched or b_batched) else (M, N)
    if batch > 65535 or cfg["split_k"] > 65535:
        raise ValueError("gemm: batch and split_k must be <= 65535 (grid limit)")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"gemm: bias must have shape ({N},), got {tuple(bias.shape)}")

    if cfg["layout"] in ("copy_a", "copy_ab") and a3.stride(2) != 1:
        a3 = a3.contiguous()  # K-contiguous A
    if cfg["layout"] in ("copy_b", "copy_ab") and b3.stride(1) != 1:
        b3 = b3.transpose(1, 2).contiguous().transpose(1, 2)  # K-contiguous B

    if out is None:
        out = torch.empty(out_shape, dtype=odt, device=a.device)
    elif tuple(out.shape) != out_shape:
        raise ValueError(f"gemm: out must have shape {out_shape}, got {tuple(out.shape)}")
    if M == 0 or N == 0 or batch == 0:
        return out
    c3 = out if out.dim() == 3 else out.unsqueeze(0)
    if K == 0:  # empty reduction: the epilogue of a zero accumulator
        acc = torch.zeros(out_shape, dtype=torch.float32, device=a.device)
        res = acc if bias is None else acc + bias.float()
        res = _torch_activation(res, activation)
        out.copy_(res if residual is None else res + residual.float())
        return out
    r3 = None
    if residual is not None:
        try:
            r = residual.expand(out_shape)
        except RuntimeError:
            raise ValueError(f"gemm: residual {tuple(residual.shape)} does not broadcast to {out_shape}") from None
        r3 = r if r.dim() == 3 else r.unsqueeze(0)

    interpret = rt.use_interpreter(a, b)
    mod = rt.builtin_kernels("gemm", interpret)
    split = cfg["split_k"]
    even_k = K % (cfg["BLOCK_K"] * split) == 0
    ce = gemm_constexprs(cfg, dot_dtype=dot, even_k=even_k, activation=activation,
                         has_bias=bias is not None, has_residual=r3 is not None,
                         has_alpha=float(alpha) != 1.0, allow_tf32=allow_tf32, interpret=interpret)
    dummy = c3
    bias_t = bias if bias is not None else dummy
    res_t = r3 if r3 is not None else dummy
    rs = (r3.stride(0), r3.stride(1), r3.stride(2)) if r3 is not None else (0, 0, 0)
    sab, sam, sak = _strides3(a3, batch)
    sbb, sbk, sbn = _strides3(b3, batch)
    tiles = math.ceil(M / cfg["BLOCK_M"]) * math.ceil(N / cfg["BLOCK_N"])
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split == 1:
        scb = c3.stride(0) if c3.shape[0] > 1 else 0
        mod.gemm_kernel[(tiles, batch, 1)](
            a3, b3, c3, bias_t, res_t, M, N, K,
            sab, sam, sak, sbb, sbk, sbn,
            0, scb, c3.stride(1), c3.stride(2),
            *rs, bias.stride(0) if bias is not None else 0, float(alpha),
            **ce, **opts)
        return out
    ws = _workspace((split, batch, M, N), a.device)
    mod.gemm_kernel[(tiles, batch, split)](
        a3, b3, ws, bias_t, res_t, M, N, K,
        sab, sam, sak, sbb, sbk, sbn,
        ws.stride(0), ws.stride(1), ws.stride(2), ws.stride(3),
        *rs, bias.stride(0) if bias is not None else 0, float(alpha),
        **dict(ce, HAS_BIAS=False, HAS_RESIDUAL=False, HAS_ALPHA=False, ACTIVATION=0), **opts)
    scb = c3.stride(0) if c3.shape[0] > 1 else 0
    mod.splitk_reduce_kernel[(tiles, batch)](
        ws, c3, bias_t, res_t, M, N,
        ws.stride(0), ws.stride(1), ws.stride(2), ws.stride(3),
        scb, c3.stride(1), c3.stride(2), *rs, bias.stride(0) if bias is not None else 0, float(alpha),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], SPLIT_K=split,
        HAS_ALPHA=ce["HAS_ALPHA"], HAS_BIAS=ce["HAS_BIAS"], ACTIVATION=ce["ACTIVATION"],
        HAS_RESIDUAL=ce["HAS_RESIDUAL"], num_warps=cfg["num_warps"])
    return out


#: Tests set this to fill split-K workspaces with NaN, so a partial tile never written shows.
POISON_WORKSPACE = False


def _workspace(shape, device):
    import torch

    if POISON_WORKSPACE:
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)
    return torch.empty(shape, dtype=torch.float32, device=device)


def _torch_activation(x, activation: str):
    import torch.nn.functional as F

    code = ACTIVATIONS[activation]
    if code == 1:
        return F.relu(x)
    if code == 2:
        return F.gelu(x, approximate="tanh")
    if code == 3:
        return F.gelu(x)
    if code == 4:
        return F.silu(x)
    return x


# --------------------------------------------------------------------------------------------
# From the compiler's plan to a launch


@dataclasses.dataclass(frozen=True)
class GemmLaunch:
    """How one fused GEMM kernel of a plan is launched.

    Attributes:
        batch, m, n, k: the GEMM class (``fusion.Kernel.gemm``'s sizes).
        dtype: operand dtype name.
        a_transposed, b_transposed: operands read through transposed strides (``a.t()``/``b.t()``
            views are passed as is; no copy unless ``config['layout']`` asks for one).
        config: the schedule for :func:`gemm`'s ``config``.
    """

    batch: int
    m: int
    n: int
    k: int
    dtype: str
    a_transposed: bool
    b_transposed: bool
    config: dict

    def __call__(self, a, b, **epilogue):
        """``gemm(a, b, config=self.config, **epilogue)`` after checking the operands' shapes."""
        am, ak = a.shape[-2], a.shape[-1]
        bk, bn = b.shape[-2], b.shape[-1]
        if (am, ak, bk, bn) != (self.m, self.k, self.k, self.n):
            raise ValueError(f"GemmLaunch: expected ({self.m}x{self.k}) @ ({self.k}x{self.n}), "
                             f"got {tuple(a.shape)} @ {tuple(b.shape)}")
        return gemm(a, b, config=self.config, **epilogue)


def problem_for_kernel(kernel):
    """The :class:`~sftctl.compiler.problem.GemmProblem` of a ``fusion.Kernel`` of kind ``gemm``
    (its ``gemm``, as traced).

    Raises:
        ValueError: the kernel is not a GEMM.
    """
    if kernel.kind != "gemm" or kernel.gemm is None:
        raise ValueError(f"not a gemm kernel: {kernel.kind}")
    return kernel.gemm


def launch_for(kernel, choice) -> GemmLaunch:
    """A :class:`GemmLaunch` from a ``fusion.Kernel`` (kind ``gemm``) and its ``GemmChoice``.

    ``choice`` may also be a bare config dict. Raises ValueError when the kernel is not a GEMM
    or the choice has no feasible config.
    """
    config = choice if isinstance(choice, dict) else choice.config
    if config is None:
        raise ValueError("the search found no feasible schedule for this GEMM")
    p = problem_for_kernel(kernel)
    return GemmLaunch(batch=p.batch, m=p.m, n=p.n, k=p.k, dtype=p.dtype, a_transposed=p.a_transposed,
                      b_transposed=p.b_transposed, config=normalize_config(config))
