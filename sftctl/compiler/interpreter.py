"""A numpy reference interpreter of the IR (:mod:`sftctl.compiler.ir`).

``run(graph, inputs, dtype="float64")`` evaluates every node in order and returns the graph's
outputs. It is the ground truth the frontends are checked against, not a fast executor.

Precision modes (``dtype``):

* ``"float64"`` (the cross-check mode, the default): every floating node is computed and stored in
  float64 whatever its IR dtype (``cast`` between float dtypes is then the identity); integer and
  bool nodes keep their dtypes.
* ``"float32"``: every floating node in float32.
* ``None``: each node's own dtype is honoured. float32, float16 and float64 are numpy's. bfloat16
  is emulated: such nodes are computed in float32 and their result is rounded to the nearest
  bfloat16 (round-half-to-even on the bit pattern; NaN/inf kept) and stored as float32, so
  rounding happens after every bfloat16 op as on hardware without fused accumulation (a bfloat16
  ``dot_general`` or ``sum`` accumulates in float32 and rounds once, as tensor cores and XLA do).

Semantics not fixed by the IR docstring, as implemented here: integer ``div`` truncates toward
zero (XLA); ``cast`` from float to int truncates toward zero and to bool tests ``!= 0``;
``sigmoid`` is the logistic function; ``relu`` is ``max(x, 0)``; ``pow`` is ``x ** y``; ``max`` /
``min`` reductions on bool are any / all. An ``input`` node whose id is missing from ``inputs`` but
which carries ``attrs["value"]`` (the frontends' ``constant`` role, for non-uniform tensor
constants found in a traced program) takes that value.

Random ops draw from ``numpy.random.default_rng([seed, stream, rng])`` (``run``'s ``seed``; stream
0 for ``rng_bernoulli``, 1 for attention dropout, 2 for ``rng_uniform``; ``rng`` the node's attribute), so a node's
values depend only on the seed and the node, never on evaluation order, and the forward and
backward of an attention with dropout see the same keep-mask. ``attention`` and its
``attention_lse`` / ``attention_grad`` nodes are evaluated exactly (the scores materialized, in the
compute dtype): softmax with the row maximum subtracted, fully masked rows giving 0.

Every result is checked against its node's shape, so a frontend's wrong shape inference is caught
at the node that has it (``ValueError`` naming the node).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from sftctl.compiler.ir import Graph, Node

FLOAT_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16"})
_NP = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": np.float32,
       "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8,
       "uint32": np.uint32, "bool": np.bool_}


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even); returns float32."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    out = rounded.view(np.float32)
    return np.where(np.isnan(x), x, out).astype(np.float32)


def _erf(x: np.ndarray) -> np.ndarray:
    try:  # scipy is optional; math.erf is exact but slow
        from scipy.special import erf

        return erf(x)
    except ImportError:  # pragma: no cover - depends on the environment
        return np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        e = np.exp(-np.abs(x))
        return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(np.result_type(a, b), np.integer):
        q = np.abs(a) // np.abs(b)
        return np.where((a < 0) != (b < 0), -q, q)
    return a / b


_UNARY = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "tanh": np.tanh,
    "rsqrt": lambda x: 1 / np.sqrt(x), "sqrt": np.sqrt, "abs": np.abs,
    "relu": lambda x: np.maximum(x, np.zeros((), x.dtype)), "sigmoid": _sigmoid, "erf": _erf,
    "reciprocal": lambda x: 1 / x, "sin": np.sin, "cos": np.cos,
    "logical_not": lambda x: np.logical_not(x.astype(bool)), "sign": np.sign,
    "log1p": np.log1p, "expm1": np.expm1, "floor": np.floor, "ceil": np.ceil,
    "round": np.rint, "trunc": np.trunc, "atan": np.arctan,  # round: half to even, as torch.round and lax.round_nearest_even
}
_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": _div, "pow": np.power,
    "maximum": np.maximum, "minimum": np.minimum, "eq": np.equal, "ne": np.not_equal,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor,
    "shift_left": np.left_shift, "shift_right_logical": np.right_shift,
    "logical_and": lambda a, b: np.logical_and(a.astype(bool), b.astype(bool)),
    "logical_or": lambda a, b: np.logical_or(a.astype(bool), b.astype(bool)),
}


def _dot_general(lhs: np.ndarray, rhs: np.ndarray, attrs: dict[str, Any], acc) -> np.ndarray:
    lb, rb = tuple(attrs["lhs_batch"]), tuple(attrs["rhs_batch"])
    lc, rc = tuple(attrs["lhs_contract"]), tuple(attrs["rhs_contract"])
    lf = [d for d in range(lhs.ndim) if d not in lb and d not in lc]
    rf = [d for d in range(rhs.ndim) if d not in rb and d not in rc]
    bshape = [lhs.shape[d] for d in lb]
    m = [lhs.shape[d] for d in lf]
    n = [rhs.shape[d] for d in rf]
    k = math.prod(lhs.shape[d] for d in lc)
    a = lhs.transpose(*lb, *lf, *lc).reshape(math.prod(bshape), math.prod(m), k).astype(acc, copy=False)
    b = rhs.transpose(*rb, *rc, *rf).reshape(math.prod(bshape), k, math.prod(n)).astype(acc, copy=False)
    return np.matmul(a, b).reshape(*bshape, *m, *n)


def _conv(lhs: np.ndarray, rhs: np.ndarray, attrs: dict[str, Any], shape: tuple[int, ...], acc) -> np.ndarray:
    """XLA's ``conv_general_dilated`` in the IR's layout (see :mod:`sftctl.compiler.ir`), one
    einsum per kernel tap, accumulated in ``acc``."""
    lhs = lhs.astype(acc, copy=False)
    rhs = rhs.astype(acc, copy=False)
    ld, rd, st = attrs["lhs_dilation"], attrs["rhs_dilation"], attrs["stride"]
    if any(d != 1 for d in ld):  # insert (d - 1) zeros between input elements
        dil = np.zeros(lhs.shape[:2] + tuple((s - 1) * d + 1 for s, d in zip(lhs.shape[2:], ld)), dtype=acc)
        dil[(slice(None), slice(None)) + tuple(slice(None, None, d) for d in ld)] = lhs
        lhs = dil
    pad = attrs["padding"]
    lhs = _pad(lhs, (0, 0) + tuple(p[0] for p in pad), (0, 0) + tuple(p[1] for p in pad), 0)
    fg, bg = int(attrs.get("feature_group_count", 1)), int(attrs.get("batch_group_count", 1))
    out_sp = shape[2:]
    out = np.zeros(shape, dtype=acc)
    n, c = lhs.shape[:2]
    o = rhs.shape[0]
    for tap in np.ndindex(*rhs.shape[2:]):
        win = lhs[(slice(None), slice(None)) + tuple(
            slice(t * d, t * d + s * (os - 1) + 1, s) for t, d, s, os in zip(tap, rd, st, out_sp))]
        w = rhs[(slice(None), slice(None)) + tap]  # [O, C / fg]
        if bg > 1:
            x = win.reshape((bg, n // bg, c) + out_sp)
            out += np.einsum("bnc...,boc->nbo...", x, w.reshape(bg, o // bg, c)).reshape(shape)
        else:
            x = win.reshape((n, fg, c // fg) + out_sp)
            out += np.einsum("ngc...,goc->ngo...", x, w.reshape(fg, o // fg, c // fg)).reshape(shape)
    return out


def _broadcast_in_dim(x: np.ndarray, shape: tuple[int, ...], dims: tuple[int, ...]) -> np.ndarray:
    expanded = [1] * len(shape)
    for i, d in enumerate(dims):
        expanded[d] = x.shape[i]
    return np.broadcast_to(x.reshape(expanded), shape)


def _pad(x: np.ndarray, low, high, value) -> np.ndarray:
    widths = [(max(lo, 0), max(hi, 0)) for lo, hi in zip(low, high)]
    out = np.pad(x, widths, constant_values=value)
    crop = tuple(slice(max(-lo, 0), out.shape[i] - max(-hi, 0)) for i, (lo, hi) in enumerate(zip(low, high)))
    return out[crop]


def _scatter_add(src: np.ndarray, idx: np.ndarray, shape: tuple[int, ...], axis: int, dt) -> np.ndarray:
    out = np.zeros(shape, dtype=dt)
    np.add.at(out, (slice(None),) * axis + (idx.astype(np.int64),), src.astype(dt, copy=False))
    return out


def _keep_mask(seed: int, stream: int, rng: int, shape, p_keep: float) -> np.ndarray:
    """Bernoulli(``p_keep``) bool array of ``shape`` from random stream (seed, stream, rng)."""
    gen = np.random.default_rng([int(seed), int(stream), int(rng)])
    return gen.random(shape) < p_keep


def _attention_probs(q, k, v, mask, attrs, acc, seed):
    """(scores-softmax P [B,Hq,L,S], dropped-and-scaled P, LSE [B,Hq,L], kv-group size)."""
    q, k, v = (x.astype(acc, copy=False) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    if group != 1:
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * acc(attrs["scale"])
    L, S = s.shape[-2], s.shape[-1]
    if attrs.get("causal"):
        s = np.where(np.arange(S)[None, :] <= np.arange(L)[:, None], s, -np.inf)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask.astype(acc, copy=False)
    with np.errstate(all="ignore"):
        m = np.max(s, axis=-1, keepdims=True)
        m_safe = np.where(np.isfinite(m), m, 0)
        e = np.exp(s - m_safe)
        denom = np.sum(e, axis=-1, keepdims=True)
        p = np.where(denom > 0, e / np.where(denom > 0, denom, 1), 0).astype(acc, copy=False)
        lse = np.where(denom[..., 0] > 0, np.log(np.where(denom[..., 0] > 0, denom[..., 0], 1)) + m_safe[..., 0], np.inf)
    dp = float(attrs.get("dropout_p", 0.0))
    pd = p
    if dp > 0:
        keep = _keep_mask(seed, 1, attrs["rng"], p.shape, 1.0 - dp)
        pd = np.where(keep, p / acc(1.0 - dp), 0).astype(acc, copy=False)
    return p, pd, lse, group, k, v, (None if dp <= 0 else keep)


def _attention(node: Node, args: list[np.ndarray], acc, seed: int) -> np.ndarray:
    a = node.attrs
    if node.op in ("attention", "attention_lse"):
        q, k, v = args[:3]
        mask = args[3] if len(args) > 3 else None
        _, pd, lse, _, _, vr, _ = _attention_probs(q, k, v, mask, a, acc, seed)
        return lse if node.op == "attention_lse" else np.matmul(pd, vr)
    q, k, v, o, do, _lse = args[:6]
    mask = args[6] if len(args) > 6 else None
    p, pd, _, group, kr, vr, keep = _attention_probs(q, k, v, mask, a, acc, seed)
    do = do.astype(acc, copy=False)
    wrt = a["wrt"]
    if wrt == "v":
        g = np.matmul(np.swapaxes(pd, -1, -2), do)
    else:
        dpd = np.matmul(do, np.swapaxes(vr, -1, -2))  # d(dropped P)
        dpp = dpd if keep is None else np.where(keep, dpd / acc(1.0 - float(a["dropout_p"])), 0)
        rowdot = np.sum(dpp * p, axis=-1, keepdims=True)  # = rowsum(dO * O)
        ds = p * (dpp - rowdot) * acc(a["scale"])
        g = np.matmul(ds, kr) if wrt == "q" else np.matmul(np.swapaxes(ds, -1, -2), q.astype(acc, copy=False))
    if wrt != "q" and group != 1:
        b, h, s_, d = g.shape
        g = g.reshape(b, h // group, group, s_, d).sum(axis=2)
    return g


def _eval(node: Node, args: list[np.ndarray], dt, acc, seed: int = 0) -> np.ndarray:
    op, a = node.op, node.attrs
    shape = node.type.shape
    if op in ("attention", "attention_lse", "attention_grad"):
        return _attention(node, args, acc, seed)
    if op == "rng_bernoulli":
        return _keep_mask(seed, 0, a["rng"], shape, float(a["p"]))
    if op == "rng_uniform":
        return np.random.default_rng([int(seed), 2, int(a["rng"])]).random(shape).astype(acc)
    if op == "constant":
        return np.full(shape, a["value"], dtype=dt)
    if op == "iota":
        axis = a["axis"]
        r = np.arange(shape[axis]).reshape([-1 if i == axis else 1 for i in range(len(shape))])
        return np.broadcast_to(r, shape).astype(dt)
    if op == "cast":
        x = args[0]
        if dt is np.bool_:
            return x != 0
        if np.issubdtype(np.dtype(dt), np.integer) and np.issubdtype(x.dtype, np.floating):
            return np.trunc(x).astype(dt)
        return x.astype(dt)
    if op == "bitcast":  # an integer's bits as the node's float dtype of the same width
        target = {"float32": np.float32, "float16": np.float16, "float64": np.float64}[node.type.dtype]
        width = {np.float32: np.uint32, np.float16: np.uint16, np.float64: np.uint64}[target]
        return args[0].astype(width).view(target).astype(dt)
    if op in _UNARY:
        with np.errstate(all="ignore"):
            return _UNARY[op](args[0].astype(acc, copy=False) if op not in ("logical_not",) else args[0])
    if op in _BINARY:
        x, y = args
        if op in ("add", "sub", "mul", "div", "pow", "maximum", "minimum"):
            x, y = x.astype(acc, copy=False), y.astype(acc, copy=False)
        with np.errstate(all="ignore"):
            return _BINARY[op](x, y)
    if op == "where":
        c, x, y = args
        return np.where(c.astype(bool), x.astype(acc, copy=False), y.astype(acc, copy=False))
    if op in ("sum", "max", "min", "prod"):
        x = args[0]
        axes = tuple(a["axes"])
        keep = bool(a.get("keepdim", False))
        if op in ("sum", "prod"):
            if x.dtype == np.bool_:
                x = x.astype(acc)
            return (np.sum if op == "sum" else np.prod)(x, axis=axes, keepdims=keep,
                                                         dtype=acc if acc is not np.bool_ else None)
        if x.size == 0:
            raise ValueError(f"node {node.id}: {op} of an empty tensor")
        return (np.max if op == "max" else np.min)(x, axis=axes, keepdims=keep)
    if op == "dot_general":
        return _dot_general(args[0], args[1], a, acc)
    if op == "conv":
        return _conv(args[0], args[1], a, shape, acc)
    if op == "reverse":
        return np.flip(args[0], axis=tuple(a["axes"]))
    if op == "cumsum":
        return np.cumsum(args[0], axis=a["axis"], dtype=acc)
    if op == "reshape":
        return args[0].reshape(tuple(a["shape"]))
    if op == "transpose":
        return np.transpose(args[0], tuple(a["perm"]))
    if op == "broadcast_in_dim":
        return _broadcast_in_dim(args[0], tuple(a["shape"]), tuple(a["dims"]))
    if op == "slice":
        return args[0][tuple(slice(s, e, st) for s, e, st in zip(a["start"], a["limit"], a["step"]))]
    if op == "concatenate":
        return np.concatenate([x.astype(dt, copy=False) for x in args], axis=a["axis"])
    if op == "pad":
        return _pad(args[0], a["low"], a["high"], a["value"])
    if op == "gather":
        return np.take(args[0], args[1].astype(np.int64), axis=a["axis"])
    if op == "scatter_add":
        return _scatter_add(args[0], args[1], shape, a["axis"], acc)
    raise NotImplementedError(f"interpreter: IR op {op!r} (node {node.id})")


def _mode_dtype(ir_dtype: str, mode: str | None):
    if ir_dtype in FLOAT_DTYPES and mode is not None:
        return _NP[mode]
    return _NP[ir_dtype]


def run(graph: Graph, inputs: dict[int, Any], dtype: str | None = "float64", seed: int = 0) -> list[np.ndarray]:
    """Evaluate ``graph``; ``inputs`` maps each ``input`` node's id to its value.

    Args:
        graph: the IR graph.
        inputs: array-likes keyed by input node id (an input with ``attrs["value"]`` may be
            omitted).
        dtype: ``"float64"`` (compute every floating node in float64), ``"float32"``, or ``None``
            (honour node dtypes; bfloat16 emulated, see the module docstring).
        seed: the step's random seed (random ops and attention dropout; see the module docstring).

    Returns:
        the values of ``graph.outputs``, in order (numpy arrays, 0-d for scalars).

    Raises:
        KeyError: an input node has no value. ValueError: a value's shape is not its node's.
    """
    if dtype not in (None, "float64", "float32"):
        raise ValueError(f"dtype must be 'float64', 'float32' or None, got {dtype!r}")
    users = graph.users()
    last_use = [max(u) if u else -1 for u in users]
    keep = set(graph.outputs)
    vals: dict[int, np.ndarray] = {}
    for node in graph.nodes:
        dt = _mode_dtype(node.type.dtype, dtype)
        bf16 = dtype is None and node.type.dtype == "bfloat16"
        # compute dtype: the node's (float32 for float16 / emulated bfloat16: fp32 accumulation)
        acc = np.float32 if dtype is None and node.type.dtype in ("bfloat16", "float16") else dt
        if node.op == "input":
            if node.id in inputs:
                v = np.asarray(inputs[node.id])
            elif "value" in node.attrs:
                v = np.asarray(node.attrs["value"])
            else:
                raise KeyError(f"no value for input node {node.id} ({node.attrs.get('role')} "
                               f"{node.attrs.get('name')!r})")
            out = v.astype(dt, copy=False)
        else:
            out = np.asarray(_eval(node, [vals[i] for i in node.inputs], dt, acc, seed))
            if out.dtype != np.dtype(dt):
                out = out.astype(dt)
        if bf16:
            out = round_to_bfloat16(out)
        if tuple(out.shape) != node.type.shape:
            raise ValueError(f"node {node.id} ({node.op}): computed shape {tuple(out.shape)}, "
                             f"IR says {node.type.shape}")
        vals[node.id] = out
        for i in set(node.inputs):  # free values no later node reads
            if last_use[i] == node.id and i not in keep:
                vals.pop(i, None)
    return [vals[i] for i in graph.outputs]

