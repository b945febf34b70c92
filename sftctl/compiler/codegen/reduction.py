"""Row reductions and their fused forms as Triton kernels: launchers.

Every function reduces over the **last** dimension of its input, viewed as ``(rows, n)`` with
``rows`` the product of the leading dims (a view when the strides allow it, else one copy).
One program handles one row and loops over it in ``BLOCK_N`` chunks, so rows of any length work;
arithmetic is fp32 whatever the storage dtype (fp32, fp16, bf16); statistics (``mean``,
``rstd``, ``loss``) are fp32; other outputs take the input's dtype.

The schedule is ``config``: ``{"BLOCK_N": power of two, "num_warps": int}`` for row kernels
(default :func:`row_config`: the row rounded up to a power of two, capped at 4096 elements, 16
KiB fp32, so a row chunk lives in registers; ``num_warps`` searched with the cost model for the
launch's rows and the tensor's accelerator), and for :func:`column_sum` ``{"BLOCK_M",
"BLOCK_N", "split", "num_warps"}`` (``split`` row slices, summed by a second pass in a fixed
order: deterministic). ``BLOCK_*`` are ``tl.constexpr``.

On CPU tensors or with ``TRITON_INTERPRET=1`` the kernels run in Triton's interpreter.

Errors: ValueError for shapes that do not match, an empty last dimension or a bad config;
TypeError for unsupported dtypes.
"""

from __future__ import annotations

import math

from sftctl.compiler.codegen import _runtime as rt

__all__ = ["column_sum", "cross_entropy_fwd_bwd", "layer_norm_bwd", "layer_norm_fwd", "log_softmax",
           "rms_norm_bwd", "rms_norm_fwd", "row_config", "row_max", "row_sum", "softmax"]

_FLOATS = ("float32", "float16", "bfloat16")


def row_config(n: int, config: dict | None = None, *, rows: int | None = None, kind: str = "softmax",
               x=None, target=None, dtype: str | None = None) -> dict:
    """The row-kernel schedule for rows of ``n`` elements (``config`` overrides keys).

    With ``rows`` (the number of rows the launch covers), ``num_warps`` is searched with the
    cost model (``search.stream.search_row_config``: ``kind`` ``softmax``/``layernorm``/
    ``rmsnorm``) for ``target`` (a :class:`sftctl.compiler.target.Target`; default: the
    accelerator of tensor ``x``, ``search.stream.target_for_tensor``); without it, the fixed rule: 4 warps up to 1024
    elements, else 8. BLOCK_N is the row rounded up to a power of two, within [16, 4096].

    Raises:
        ValueError: BLOCK_N not a power of two, num_warps not a positive power of two, or a key
            of ``config`` the schedule lacks (:func:`_runtime.with_overrides`).
    """
    block = min(rt.next_power_of_2(max(n, 1)), 4096)
    cfg = {"BLOCK_N": max(block, 16), "num_warps": 4 if block <= 1024 else 8}
    if rows is not None and not (config and "num_warps" in config):
        from sftctl.compiler.search import stream

        target = target if target is not None else stream.target_for_tensor(x)
        if dtype is None:
            dtype = rt.dtype_name(x.dtype) if x is not None else "bfloat16"
        best, _ = stream.search_row_config(kind, rows, n, target.hw, target.coeffs, dtype=dtype if dtype in
                                           ("float32", "float16", "bfloat16") else "float32")
        cfg["num_warps"] = best["num_warps"]
    cfg = rt.with_overrides(cfg, config, "row config")
    if not rt.is_power_of_2(cfg["BLOCK_N"]):
        raise ValueError(f"row config: BLOCK_N must be a power of two, got {cfg['BLOCK_N']!r}")
    if not rt.is_power_of_2(cfg["num_warps"]):
        raise ValueError(f"row config: num_warps must be a power of two, got {cfg['num_warps']!r}")
    return cfg


def _rows(x, name: str = "x"):
    """``x`` as a 2-D ``(rows, n)`` tensor (a view when possible)."""
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    if rt.dtype_name(x.dtype) not in _FLOATS:
        raise TypeError(f"{name}: dtype must be one of {_FLOATS}, got {x.dtype}")
    n = x.shape[-1]
    if n == 0:
        raise ValueError(f"{name}: the reduced (last) dimension is empty")
    return x.reshape(-1, n)


def _rows_contig(x, name: str = "x"):
    x2 = _rows(x, name)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _mod(*tensors):
    return rt.builtin_kernels("reduction", rt.use_interpreter(*tensors))


def _row_reduce(x, op: int, config, out):
    import torch

    x2 = _rows(x)
    cfg = row_config(x2.shape[1], config, rows=x2.shape[0], kind="softmax", x=x2)
    lead = tuple(x.shape[:-1])
    if out is None:
        out = torch.empty(lead, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != lead or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape {lead}")
    if x2.shape[0]:
        _mod(x).row_reduce_kernel[(x2.shape[0],)](
            x2, out, x2.shape[1], x2.stride(0), x2.stride(1), OP=op, BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg["num_warps"])
    return out


def row_sum(x, *, config: dict | None = None, out=None):
    """``x.sum(-1)`` accumulated in fp32, stored in ``x.dtype``: shape ``x.shape[:-1]``."""
    return _row_reduce(x, 0, config, out)


def row_max(x, *, config: dict | None = None, out=None):
    """``x.amax(-1)``: shape ``x.shape[:-1]``, ``x.dtype``."""
    return _row_reduce(x, 1, config, out)


def _softmax(x, log: bool, config, out):
    import torch

    x2 = _rows(x)
    cfg = row_config(x2.shape[1], config, rows=x2.shape[0], kind="softmax", x=x2)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"out must have shape {tuple(x.shape)}")
    y2 = out.view(-1, x2.shape[1]) if out.is_contiguous() else None
    if y2 is None:
        raise ValueError("out must be contiguous")
    if x2.shape[0]:
        _mod(x).softmax_kernel[(x2.shape[0],)](
            x2, y2, x2.shape[1], x2.stride(0), x2.stride(1), y2.stride(0), y2.stride(1),
            LOG=log, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    return out


def softmax(x, *, config: dict | None = None, out=None):
    """``softmax(x, dim=-1)``; same shape and dtype as ``x``. Online max/sum in one pass, then
    one pass writing ``exp(x - max) / sum``. Rows of all ``-inf`` give NaN (as torch)."""
    return _softmax(x, False, config, out)


def log_softmax(x, *, config: dict | None = None, out=None):
    """``log_softmax(x, dim=-1)``: ``x - max - log(sum(exp(x - max)))``; shape/dtype of ``x``."""
    return _softmax(x, True, config, out)


def cross_entropy_fwd_bwd(logits, target, *, ignore_index: int = -100, grad_scale=1.0,
                          config: dict | None = None, dlogits=None, check_targets: bool = False):
    """Fused log-softmax + negative log-likelihood and its gradient, in two passes over a row.

    Args:
        logits: ``(..., V)`` float logits.
        target: integer class indices of shape ``logits.shape[:-1]``; ``ignore_index`` rows give
            loss 0 and gradient 0. Other indices must lie in ``[0, V)`` (unchecked on the device
            unless ``check_targets``, which costs a host sync).
        grad_scale: multiplies the gradient: a float, or a 1-element tensor read on the device
            (e.g. ``grad_output / n_valid`` of a mean reduction, without a host sync).
        dlogits: optional preallocated gradient output (contiguous, shape of ``logits``).

    Returns:
        ``(loss, dlogits)``: ``loss`` fp32 of shape ``logits.shape[:-1]`` (per row, unreduced:
        ``logsumexp(x) - x[target]``), ``dlogits`` = ``(softmax(x) - onehot(target)) *
        grad_scale`` in ``logits.dtype``.

    Raises:
        ValueError: shapes disagree, or ``check_targets`` finds an index out of range.
        TypeError: non-integer targets.
    """
    import torch

    x2 = _rows(logits, "logits")
    rows, V = x2.shape
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target must have shape {tuple(logits.shape[:-1])}, got {tuple(target.shape)}")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices, got {target.dtype}")
    rt.check_device(logits, target)
    t1 = target.reshape(-1)
    if check_targets and rows:
        bad = (t1 != ignore_index) & ((t1 < 0) | (t1 >= V))
        if bool(bad.any()):
            raise ValueError(f"target index out of range [0, {V})")
    cfg = row_config(V, config, rows=rows, kind="softmax", x=x2)
    loss = torch.empty(tuple(logits.shape[:-1]), dtype=torch.float32, device=logits.device)
    if dlogits is None:
        dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if tuple(dlogits.shape) != tuple(logits.shape) or not dlogits.is_contiguous():
        raise ValueError(f"dlogits must be contiguous with shape {tuple(logits.shape)}")
    d2 = dlogits.view(-1, V)
    if isinstance(grad_scale, torch.Tensor):
        if grad_scale.numel() != 1:
            raise ValueError("grad_scale tensor must have one element")
        scale_ptr, has_ptr, scale = grad_scale.reshape(1), True, 1.0
    else:
        scale_ptr, has_ptr, scale = loss, False, float(grad_scale)
    if rows:
        _mod(logits).cross_entropy_kernel[(rows,)](
            x2, t1, loss.view(-1), d2, scale_ptr, V, x2.stride(0), x2.stride(1), d2.stride(0),
            d2.stride(1), t1.stride(0), int(ignore_index), scale,
            HAS_SCALE_PTR=has_ptr, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    return loss, dlogits


def _check_param(p, n: int, name: str):
    if p is not None and tuple(p.shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {tuple(p.shape)}")
    return p if p is None or p.is_contiguous() else p.contiguous()


def _norm_fwd(x, weight, bias, eps: float, rms: bool, config):
    import torch

    x2 = _rows_contig(x)
    rows, n = x2.shape
    weight = _check_param(weight, n, "weight")
    bias = _check_param(bias, n, "bias")
    rt.check_device(x, weight, bias)
    cfg = row_config(n, config, rows=rows, kind="rmsnorm" if rms else "layernorm", x=x2)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    lead = tuple(x.shape[:-1])
    mean = None if rms else torch.empty(lead, dtype=torch.float32, device=x.device)
    rstd = torch.empty(lead, dtype=torch.float32, device=x.device)
    if rows:
        dummy = rstd
        _mod(x).norm_fwd_kernel[(rows,)](
            x2, weight if weight is not None else dummy, bias if bias is not None else dummy,
            y.view(rows, n), mean if mean is not None else dummy, rstd, n, x2.stride(0), n, float(eps),
            IS_RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg["num_warps"])
    return y, mean, rstd


def layer_norm_fwd(x, weight=None, bias=None, eps: float = 1e-5, *, config: dict | None = None):
    """Layer norm over the last dim: ``y = (x - mean) / sqrt(var + eps) * weight + bias``.

    Args:
        x: ``(..., n)`` fp32/fp16/bf16. weight, bias: ``(n,)`` or None.

    Returns:
        ``(y, mean, rstd)``: ``y`` like ``x``; ``mean`` and ``rstd`` fp32 of shape
        ``x.shape[:-1]`` (biased variance, as ``torch.nn.functional.layer_norm``).
    """
    return _norm_fwd(x, weight, bias, eps, False, config)


def rms_norm_fwd(x, weight=None, eps: float = 1e-6, *, config: dict | None = None):
    """RMS norm over the last dim: ``y = x / sqrt(mean(x^2) + eps) * weight``.

    Returns:
        ``(y, rstd)``: ``y`` like ``x``, ``rstd`` fp32 of shape ``x.shape[:-1]``.
    """
    y, _, rstd = _norm_fwd(x, weight, None, eps, True, config)
    return y, rstd


def _norm_bwd(dy, x, weight, mean, rstd, rms: bool, config, colsum_config, need_bias: bool):
    import torch

    x2 = _rows_contig(x)
    rows, n = x2.shape
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"dy must have the shape of x {tuple(x.shape)}, got {tuple(dy.shape)}")
    dy2 = _rows_contig(dy, "dy")
    weight = _check_param(weight, n, "weight")
    lead = tuple(x.shape[:-1])
    for name, s in (("mean", mean), ("rstd", rstd)):
        if s is not None and tuple(s.shape) != lead:
            raise ValueError(f"{name} must have shape {lead}, got {tuple(s.shape)}")
    rt.check_device(dy, x, weight, mean, rstd)
    rstd1 = rstd.reshape(-1).float().contiguous()
    mean1 = None if mean is None else mean.reshape(-1).float().contiguous()
    cfg = row_config(n, config, rows=rows, kind="rmsnorm" if rms else "layernorm", x=x2)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mod = _mod(x)
    if rows:
        mod.norm_bwd_dx_kernel[(rows,)](
            dy2, x2, weight if weight is not None else rstd1, mean1 if mean1 is not None else rstd1,
            rstd1, dx.view(rows, n), n, dy2.stride(0), x2.stride(0), n,
            IS_RMS=rms, HAS_W=weight is not None, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    dw = db = None
    if weight is not None or need_bias:
        mode = 2 if rms else 1
        dw, db = _column_sums(dy2, x2, mean1, rstd1, mode, colsum_config,
                              out_dtype=(weight.dtype if weight is not None else x.dtype))
    return dx, dw, db


def layer_norm_bwd(dy, x, weight, mean, rstd, *, has_bias: bool = True, config: dict | None = None,
                   colsum_config: dict | None = None):
    """Gradients of :func:`layer_norm_fwd`.

    Args:
        dy: ``(..., n)``, the gradient of ``y``. x: the forward input. weight: ``(n,)`` or None.
        mean, rstd: fp32 ``x.shape[:-1]`` from the forward.
        has_bias: also return the bias gradient.

    Returns:
        ``(dx, dweight, dbias)``: ``dx`` like ``x``; ``dweight = sum_rows(dy * xhat)`` and
        ``dbias = sum_rows(dy)`` of shape ``(n,)`` in the weight's dtype (None where not asked:
        no weight, or ``has_bias=False``), reduced by :func:`column_sum`'s kernel.
    """
    dx, dw, db = _norm_bwd(dy, x, weight, mean, rstd, False, config, colsum_config, has_bias)
    return dx, (dw if weight is not None else None), (db if has_bias else None)


def rms_norm_bwd(dy, x, weight, rstd, *, config: dict | None = None, colsum_config: dict | None = None):
    """Gradients of :func:`rms_norm_fwd`: ``(dx, dweight)`` (``dweight`` None without weight)."""
    dx, dw, _ = _norm_bwd(dy, x, weight, None, rstd, True, config, colsum_config, False)
    return dx, dw


def colsum_config(rows: int, n: int, config: dict | None = None) -> dict:
    """The column-sum schedule (``config`` overrides keys): BLOCK_M x BLOCK_N tiles, and
    ``split`` row slices so that at least ~128 programs run when rows are many."""
    block_n = min(max(rt.next_power_of_2(n), 16), 64)
    tiles_n = math.ceil(n / block_n)
    split = max(1, min(math.ceil(rows / 64), math.ceil(128 / tiles_n), 256))
    cfg = rt.with_overrides({"BLOCK_M": 32, "BLOCK_N": block_n, "split": split, "num_warps": 4}, config,
                            "column-sum config")
    for key in ("BLOCK_M", "BLOCK_N", "num_warps"):
        if not rt.is_power_of_2(cfg[key]):
            raise ValueError(f"column-sum config: {key} must be a power of two, got {cfg[key]!r}")
    if not isinstance(cfg["split"], int) or cfg["split"] < 1:
        raise ValueError(f"column-sum config: split must be a positive int, got {cfg['split']!r}")
    return cfg


def _column_sums(a2, x2, mean1, rstd1, mode: int, config, out_dtype):
    """(out_a, out_b) column sums of mode ``mode`` (see ``column_sum_kernel``)."""
    import torch

    rows, n = a2.shape
    cfg = colsum_config(rows, n, config)
    split = min(cfg["split"], max(rows, 1))
    rows_per_split = max(1, math.ceil(rows / split))
    split = max(1, math.ceil(rows / rows_per_split)) if rows else 1
    dev = a2.device
    mod = _mod(a2)
    grid = (math.ceil(n / cfg["BLOCK_N"]), split)
    final = split == 1
    pdt = out_dtype if final else torch.float32
    part_a = torch.empty((split, n), dtype=pdt, device=dev)
    part_b = torch.empty((split, n), dtype=pdt, device=dev) if mode == 1 else part_a
    dummy = part_a
    mod.column_sum_kernel[grid](
        a2, x2 if x2 is not None else dummy, mean1 if mean1 is not None else dummy,
        rstd1 if rstd1 is not None else dummy, part_a, part_b, rows, n, rows_per_split,
        a2.stride(0), a2.stride(1), x2.stride(0) if x2 is not None else 0,
        x2.stride(1) if x2 is not None else 0, n,
        MODE=mode, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    if final:
        return part_a[0], (part_b[0] if mode == 1 else None)
    outs = []
    for part in ((part_a, part_b) if mode == 1 else (part_a,)):
        o = torch.empty((1, n), dtype=out_dtype, device=dev)
        mod.column_sum_kernel[(math.ceil(n / cfg["BLOCK_N"]), 1)](
            part, part, part, part, o, o, split, n, split, part.stride(0), part.stride(1), 0, 0, n,
            MODE=0, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
        outs.append(o[0])
    return outs[0], (outs[1] if mode == 1 else None)


def column_sum(x, *, config: dict | None = None, out_dtype=None):
    """``x.sum(dim=tuple(range(x.dim() - 1)))``: sums over every dim but the last, e.g. a bias
    gradient from ``dy`` of shape ``(..., n)``. fp32 accumulation, result ``(n,)`` in
    ``out_dtype`` (default ``x.dtype``). Deterministic (fixed split order)."""
    x2 = _rows(x)
    odt = rt.torch_dtype(out_dtype) if out_dtype is not None else x.dtype
    out, _ = _column_sums(x2, None, None, None, 0, config, odt)
    return out
