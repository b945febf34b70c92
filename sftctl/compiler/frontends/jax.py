"""JAX frontend: trace one whole training step (value_and_grad + AdamW) into the IR.

``trace_step(loss_fn, params, batch)`` builds

    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params', m', v' = AdamW(params, grads, m, v, step)          # written in jax.numpy

takes its jaxpr with ``jax.make_jaxpr`` on abstract values (``jax.ShapeDtypeStruct``: no memory is
allocated; ``params`` / ``batch`` may hold arrays or ShapeDtypeStructs) and lowers the jaxpr
equation by equation to the IR (:mod:`sftctl.compiler.ir`). Call-like primitives (``jit`` /
``pjit``, ``closed_call``, ``remat``, ``custom_jvp_call``, ``custom_vjp_call``) are inlined. A
primitive without a lowering raises ``NotImplementedError`` naming it.

The graph's inputs: role ``param`` (the leaves of ``params`` in ``jax.tree_util`` order, named by
their key paths joined with ``.``), ``opt_state`` (``<name>.exp_avg`` for each, then
``<name>.exp_avg_sq``), ``buffer`` (a flax.nnx module's non-parameter state, see below),
``step`` (a scalar, the 1-based number of this step; float64 when the parameters are float64,
else float32), ``batch`` (the leaves of ``batch``). Outputs: ``loss``, ``param:<name>`` ...,
``opt_state:<name>.exp_avg`` ..., ``opt_state:<name>.exp_avg_sq`` ..., then ``buffer:<name>``
for each buffer the step changes. AdamW is ``torch.optim.AdamW``'s (and optax.adamw's
with ``eps_root=0``): decoupled weight decay ``lr * wd * p``, bias-corrected moments, ``eps``
added after the square root.

Models: ``params`` is any pytree of arrays (plain JAX, or a flax.linen ``variables`` dict with
``loss_fn(variables, batch)`` calling ``module.apply``), or a **flax.nnx** ``Module``: it is split
with ``nnx.split(model, nnx.Param, ...)``, its ``nnx.Param`` leaves are the parameters (named by
their state paths, e.g. ``blocks.0.attn.qkv.kernel``), other state except RNG state (batch statistics) is step input
of role ``buffer`` whose updates come out as ``buffer:<name>``, RNG state is closed over (a
model that draws random numbers while traced is refused), and ``loss_fn(model, batch)`` receives
the module merged back from the traced state.

Mixed precision (``compute_dtype`` / ``trace_entrypoint(dtype=...)``), the same scheme as the
torch frontend: parameters, gradients and AdamW state stay float32 (master weights) and the
loss function sees the parameters and the floating batch leaves cast to ``compute_dtype``
(bfloat16/float16), so its matmuls run in that dtype; the gradients flow back through the casts
to float32, the loss is returned as float32. This is ``jmp``'s ``params=float32,
compute=bfloat16, output=float32`` policy, and what flax modules built with
``param_dtype=float32, dtype=bfloat16`` do. JAX has no autocast: ops a model does not upcast
itself (flax's LayerNorm and softmax compute their statistics in float32) run in
``compute_dtype`` too, where torch's autocast keeps its float32 list in float32.

Attention: ``jax.nn.dot_product_attention`` is not one primitive when traced: its ``xla``
implementation (also what ``implementation=None`` selects) is an einsum, a masked softmax and an
einsum, and lowers as that (materialized scores, as XLA runs it); its ``cudnn`` implementation
(the fused flash-attention kernel on GPU) needs cuDNN even to trace. So while tracing, a call
with ``implementation="cudnn"`` is routed (:func:`_attention_patch`) to two primitives of this
frontend, ``sftctl_attention`` (O and the log-sum-exp) and its ``custom_vjp`` backward
``sftctl_attention_bwd`` (dQ, dK, dV), which lower to the IR's ``attention`` /
``attention_lse`` / ``attention_grad`` ops, exactly as PyTorch's SDPA does: ``mask`` (bool) or
``bias`` (additive, without gradient), ``is_causal``, ``scale`` and grouped K/V heads; a call with
``query_seq_lengths``, ``key_value_seq_lengths`` or ``local_window_size`` keeps the XLA path.
flax's ``dot_product_attention`` is written out (einsums) and stays materialized.

``conv_general_dilated`` (any dimension numbers) becomes an IR ``conv`` between transposes to the
IR's NCHW/OIHW layout; ``rev`` an IR ``reverse``.

``gather`` / ``scatter-add`` are lowered for the two forms ``jax.numpy`` emits for the usual
training code: a *take* (``x[idx]`` / ``jnp.take`` along one axis: IR ``gather`` /
``scatter_add`` plus a transpose) and a *point gather* (all slice sizes 1, e.g.
``jnp.take_along_axis``: an IR ``gather`` on the flattened operand at a computed linear index).
Out-of-bounds indices are assumed not to occur (jax would clamp or fill).

jax is imported lazily, inside the functions of this module.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
import warnings
from typing import Any, Callable

import numpy as np

from sftctl.compiler.ir import FLOAT_DTYPES, Graph, GraphBuilder, row_major_strides
from sftctl.errors import SftctlWarning

_DTYPES = {"float64", "float32", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8", "uint32", "bool"}


_PRNG_REFUSAL = ("jax frontend: the step draws random numbers from a PRNG key (flax dropout in train mode, "
                 "or jax.random in the loss); random ops are not lowered: trace with deterministic=True "
                 "(model.eval() in flax.nnx) or set the dropout rate to 0")
#: primitives that only make, split or hash PRNG keys: lowered to no value (flax's lifted transforms
#: split keys nobody draws from); ``random_bits`` draws from the IR's random stream instead, and any
#: other use of a key's value refuses with _PRNG_REFUSAL
_KEY_OPS = frozenset({"random_seed", "random_split", "random_fold_in", "random_wrap", "random_clone",
                      "random_unwrap", "threefry2x32"})


def ir_dtype(dtype) -> str:
    """The IR dtype of a jax dtype. Raises NotImplementedError for one the IR lacks, and for a
    typed PRNG key (``key<fry>``: flax dropout in train mode, ``jax.random`` in the step) with
    what to do instead."""
    try:
        name = np.dtype(dtype).name
    except TypeError:  # an extended dtype numpy does not know
        name = str(dtype)
    if name.startswith("key<"):
        raise NotImplementedError(_PRNG_REFUSAL)
    if name not in _DTYPES:
        raise NotImplementedError(f"jax frontend: dtype {name} has no IR dtype")
    return name


def _user_line(eqn) -> str | None:
    """``file:line (function)`` of the user's code that emitted a jaxpr equation (the innermost
    frame outside jax, flax, optax and sftctl), or None."""
    try:
        from jax._src import source_info_util
    except ImportError:  # pragma: no cover - jax moved it
        return None
    skip = ("/jax/", "/jaxlib/", "/flax/", "/optax/", "/sftctl/compiler/")
    found = None
    try:
        frames = source_info_util.user_frames(eqn.source_info.traceback) if eqn.source_info.traceback else []
    except Exception:  # noqa: BLE001 - a traceback jax cannot read: no line to name
        return None
    for frame in frames:
        if not any(s in frame.file_name for s in skip):
            found = found or f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
    return found


@contextlib.contextmanager
def _linen_mutable_watch(seen: set):
    """Record the collections a flax.linen ``Module.apply(..., mutable=...)`` inside the traced
    loss asks to mutate (their updates cannot leave a loss function)."""
    try:
        from flax import linen
    except ImportError:
        yield
        return
    original = linen.Module.apply

    def apply(self, variables, *args, mutable=False, **kwargs):
        if mutable is True:
            seen.add("every collection")
        elif isinstance(mutable, str):
            seen.add(mutable)
        elif isinstance(mutable, (list, tuple, set)):
            seen.update(str(m) for m in mutable)
        elif mutable:
            seen.add(str(mutable))
        return original(self, variables, *args, mutable=mutable, **kwargs)

    linen.Module.apply = apply
    try:
        yield
    finally:
        linen.Module.apply = original


def _leaf_names(tree, prefix: str) -> list[str]:
    import jax

    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        try:
            s = jax.tree_util.keystr(path, simple=True, separator=".")
        except TypeError:  # older jax
            s = jax.tree_util.keystr(path)
        names.append(f"{prefix}{s}" if s else prefix.rstrip("."))
    return names


def adamw_update(params, grads, m, v, step, *, lr, betas, eps, weight_decay):
    """One functional AdamW update in jax.numpy; returns ``(params', m', v')``."""
    import jax
    import jax.numpy as jnp

    b1, b2 = betas
    bias1 = 1 - jnp.power(b1, step)
    bias2_sqrt = jnp.sqrt(1 - jnp.power(b2, step))
    step_size = lr / bias1
    new_m = jax.tree_util.tree_map(lambda m_, g: m_ + (g - m_) * (1 - b1), m, grads)
    new_v = jax.tree_util.tree_map(lambda v_, g: v_ * b2 + g * g * (1 - b2), v, grads)

    def upd(p, m_, v_):
        p2 = p * (1 - lr * weight_decay) if weight_decay else p
        denom = jnp.sqrt(v_) / bias2_sqrt.astype(v_.dtype) + eps
        return p2 - step_size.astype(p.dtype) * (m_ / denom)

    return jax.tree_util.tree_map(upd, params, new_m, new_v), new_m, new_v


def make_step(loss_fn: Callable, *, lr: float, betas, eps: float, weight_decay: float) -> Callable:
    """The traced function: ``step(params, m, v, step, batch) -> (loss, params', m', v')``."""
    import jax

    def step(params, m, v, count, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        new_p, new_m, new_v = adamw_update(params, grads, m, v, count, lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay)
        return loss, new_p, new_m, new_v

    return step


def _make_step_with_buffers(loss_fn: Callable, *, lr: float, betas, eps: float, weight_decay: float) -> Callable:
    """``step(params, m, v, buffers, step, batch) -> (loss, params', m', v', buffers')`` for a
    ``loss_fn(params, buffers, batch) -> (loss, buffers')`` (buffers: non-trainable state such as
    batch-norm statistics, threaded through and returned updated)."""
    import jax

    def step(params, m, v, buffers, count, batch):
        (loss, new_b), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, buffers, batch)
        new_p, new_m, new_v = adamw_update(params, grads, m, v, count, lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay)
        return loss, new_p, new_m, new_v, new_b

    return step


def trace_step(
    loss_fn: Callable[[Any, Any], Any],
    params: Any,
    batch: Any,
    *,
    optimizer: str = "adamw",
    lr: float = 3e-4,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    compute_dtype: str | None = None,
) -> tuple[Graph, dict[str, Any]]:
    """Trace ``loss_fn(params, batch) -> scalar`` plus an AdamW update into an IR graph.

    ``params`` may be a flax.nnx ``Module`` (then ``loss_fn(model, batch)``; see the module
    docstring). ``compute_dtype`` (``bfloat16``/``float16``): the loss function sees the
    parameters and floating batch leaves cast to it (float32 master weights and AdamW state).

    A flax.nnx module's non-parameter state (``nnx.BatchStats`` and other variables, not its RNG
    state) becomes inputs of role ``buffer`` (after the optimizer state, as in the torch
    frontend) and, where the step changes it (batch norm in train mode), outputs
    ``buffer:<name>`` after the optimizer state.

    Returns:
        ``(graph, meta)``: ``meta`` has ``params`` / ``opt_state`` / ``buffers`` (name -> input
        node id), ``step`` (id), ``batch`` (ids in leaf order), ``batch_names``, ``param_names``,
        ``outputs`` (role -> index into ``graph.outputs``), ``n_params``, ``hyper``,
        ``jaxpr_eqns``, ``trace_s``, ``lower_s``.

    Raises:
        NotImplementedError: a primitive, dtype or gather form the lowering does not support; a
        flax.nnx module that draws random numbers (dropout in train mode).
    """
    import jax
    import jax.numpy as jnp

    if optimizer != "adamw":
        raise ValueError(f"optimizer must be 'adamw', got {optimizer!r}")
    loss_fn, params, buffers = _nnx_split(loss_fn, params)
    if compute_dtype not in (None, "float32"):
        loss_fn = _with_compute_dtype(loss_fn, jnp.dtype(compute_dtype))

    def abstract(x):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)

    p_abs = jax.tree_util.tree_map(abstract, params)
    buf_abs = jax.tree_util.tree_map(abstract, buffers)
    b_abs = jax.tree_util.tree_map(abstract, batch)
    # the step count's dtype sets the precision of AdamW's scalar math (jax literals take the dtype
    # of the array they meet): float64 when the parameters are float64, else float32
    wide = any(np.dtype(x.dtype) == np.float64 for x in jax.tree_util.tree_leaves(params))
    step_abs = jax.ShapeDtypeStruct((), jnp.float64 if wide else jnp.float32)
    fn = _make_step_with_buffers(loss_fn, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    t0 = time.perf_counter()
    mutated: set[str] = set()
    try:
        with _attention_patch(), _linen_mutable_watch(mutated):
            closed = jax.make_jaxpr(fn)(p_abs, p_abs, p_abs, buf_abs, step_abs, b_abs)
    except Exception as e:
        if type(e).__name__ == "TraceContextError":  # flax: RNG state mutated inside the trace
            raise NotImplementedError(
                "jax frontend: the flax.nnx model draws random numbers while traced (dropout in train "
                f"mode; random ops are not supported): call model.eval() or set the dropout rate to 0 ({e})"
            ) from None
        raise
    t1 = time.perf_counter()
    pnames = _leaf_names(params, "")
    bufnames = _leaf_names(buffers, "")
    bnames = _leaf_names(batch, "batch.")
    n, nb = len(pnames), len(bufnames)
    roles = ([("param", nm) for nm in pnames] + [("opt_state", nm + ".exp_avg") for nm in pnames]
             + [("opt_state", nm + ".exp_avg_sq") for nm in pnames] + [("buffer", nm) for nm in bufnames]
             + [("step", "step")] + [("batch", nm) for nm in bnames])
    out_roles = (["loss"] + [f"param:{nm}" for nm in pnames] + [f"opt_state:{nm}.exp_avg" for nm in pnames]
                 + [f"opt_state:{nm}.exp_avg_sq" for nm in pnames] + [f"buffer:{nm}" for nm in bufnames])
    graph, ids = _Lowering().run(closed, roles, out_roles)
    # a buffer the step leaves as it was is no output
    keep = [k for k, r in enumerate(out_roles)
            if not (r.startswith("buffer:") and graph.outputs[k] == ids[3 * n + bufnames.index(r[7:])])]
    graph.outputs = [graph.outputs[k] for k in keep]
    graph.output_roles = out_roles = [out_roles[k] for k in keep]
    if mutated:
        # the loss function returns only the loss: what apply(mutable=...) updated is dropped
        note = (f"flax.linen apply(mutable={sorted(mutated)}) in the loss: the updated "
                f"{', '.join(sorted(mutated))} (batch norm's running statistics) are not part of the "
                "traced step, which is priced without their update (a few elementwise ops per layer); "
                "flax.nnx BatchNorm is traced with it")
        graph.nodes[graph.outputs[0]].attrs["note"] = note
        warnings.warn(SftctlWarning(note), stacklevel=2)
    t2 = time.perf_counter()
    meta = {
        "params": {nm: ids[i] for i, nm in enumerate(pnames)},
        "opt_state": {**{nm + ".exp_avg": ids[n + i] for i, nm in enumerate(pnames)},
                      **{nm + ".exp_avg_sq": ids[2 * n + i] for i, nm in enumerate(pnames)}},
        "buffers": {nm: ids[3 * n + i] for i, nm in enumerate(bufnames)},
        "step": ids[3 * n + nb],
        "batch": ids[3 * n + nb + 1:],
        "batch_names": bnames,
        "param_names": pnames,
        "outputs": {r: i for i, r in enumerate(out_roles)},
        "n_params": int(sum(math.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(params))),
        "hyper": {"optimizer": optimizer, "lr": lr, "betas": tuple(betas), "eps": eps,
                  "weight_decay": weight_decay, "compute_dtype": compute_dtype},
        "jaxpr_eqns": len(closed.jaxpr.eqns),
        "trace_s": t1 - t0,
        "lower_s": t2 - t1,
    }
    return graph, meta


def _with_compute_dtype(loss_fn: Callable, dtype) -> Callable:
    """``loss_fn`` on parameters and floating batch leaves cast to ``dtype``; float32 loss."""
    import jax
    import jax.numpy as jnp

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    def wrapped(params, buffers, batch):
        loss, new_b = loss_fn(jax.tree_util.tree_map(cast, params), buffers, jax.tree_util.tree_map(cast, batch))
        new_b = jax.tree_util.tree_map(lambda new, old: new.astype(old.dtype), new_b, buffers)
        return loss.astype(jnp.float32), new_b

    return wrapped


def _nnx_split(loss_fn: Callable, params: Any) -> tuple[Callable, Any, Any]:
    """``(loss(params, buffers, batch) -> (loss, buffers'), params, buffers)``.

    For a flax.nnx Module: its ``nnx.Param`` state and its other state except RNG state, both as
    nested dicts; the loss merges the module back from them (RNG state closed over) and returns
    its state after the call. Anything else: ``params`` unchanged, no buffers."""
    import jax

    def plain(p, bufs, batch):
        return loss_fn(p, batch), bufs

    try:
        from flax import nnx
    except ImportError:  # flax not installed: not an nnx module
        return plain, params, {}
    if not isinstance(params, nnx.Module):
        return plain, params, {}
    graphdef, pstate, rngs, bstate = nnx.split(params, nnx.Param, nnx.RngState, ...)

    def fill(state, pure):
        st = jax.tree_util.tree_map(lambda x: x, state)  # a copy to fill
        nnx.replace_by_pure_dict(st, pure)
        return st

    def loss_of(p, bufs, batch):
        model = nnx.merge(graphdef, fill(pstate, p), rngs, fill(bstate, bufs))
        loss = loss_fn(model, batch)
        return loss, nnx.to_pure_dict(nnx.split(model, nnx.Param, nnx.RngState, ...)[3])

    return loss_of, nnx.to_pure_dict(pstate), nnx.to_pure_dict(bstate)


# ------------------------------------------------------------------------------------------------
# lowering: jaxpr -> IR
# ------------------------------------------------------------------------------------------------


_ATTN: dict[str, Any] = {}


def _attention_prims():
    """The ``sftctl_attention`` / ``sftctl_attention_bwd`` primitives (abstract evaluation only:
    they are traced, never executed) and the ``custom_vjp`` function that uses them."""
    if _ATTN:
        return _ATTN["fn"]
    import jax
    import jax.numpy as jnp

    core = _jcore()
    fwd_p = core.Primitive("sftctl_attention")
    fwd_p.multiple_results = True
    bwd_p = core.Primitive("sftctl_attention_bwd")
    bwd_p.multiple_results = True

    def fwd_abstract(q, k, v, *mask, causal, scale):
        return [jax.core.ShapedArray(q.shape[:-1] + (v.shape[-1],), q.dtype),
                jax.core.ShapedArray(q.shape[:-1], jnp.float32)]

    def bwd_abstract(q, k, v, o, do, lse, *mask, causal, scale):
        return [jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray(k.shape, k.dtype),
                jax.core.ShapedArray(v.shape, v.dtype)]

    fwd_p.def_abstract_eval(fwd_abstract)
    bwd_p.def_abstract_eval(bwd_abstract)

    import functools

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
    def attention(q, k, v, mask, causal, scale):
        return fwd_p.bind(q, k, v, *([] if mask is None else [mask]), causal=causal, scale=scale)[0]

    def attention_fwd(q, k, v, mask, causal, scale):
        o, lse = fwd_p.bind(q, k, v, *([] if mask is None else [mask]), causal=causal, scale=scale)
        return o, (q, k, v, mask, o, lse)

    def attention_bwd(causal, scale, res, do):
        q, k, v, mask, o, lse = res
        dq, dk, dv = bwd_p.bind(q, k, v, o, do, lse, *([] if mask is None else [mask]), causal=causal, scale=scale)
        if mask is None:
            return dq, dk, dv, None
        if mask.dtype == jnp.bool_:
            return dq, dk, dv, np.zeros(mask.shape, dtype=jax.dtypes.float0)
        return dq, dk, dv, jnp.zeros_like(mask)  # a bias enters without gradient

    attention.defvjp(attention_fwd, attention_bwd)
    _ATTN["fn"] = attention
    return attention


class _attention_patch:
    """While tracing: ``jax.nn.dot_product_attention(..., implementation="cudnn")`` -> the
    attention primitives, in the IR's [B, heads, L, D] layout (JAX's is [B, L, heads, D])."""

    def __enter__(self):
        import jax
        import jax.numpy as jnp

        self.orig = jax.nn.dot_product_attention
        orig, fn = self.orig, _attention_prims()

        def patched(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                    implementation=None, **kw):
            if (implementation != "cudnn" or query_seq_lengths is not None or key_value_seq_lengths is not None
                    or local_window_size is not None or kw or query.ndim != 4):
                return orig(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                            local_window_size=local_window_size,
                            implementation=None if implementation == "cudnn" else implementation, **kw)
            q, k, v = (jnp.transpose(x, (0, 2, 1, 3)) for x in (query, key, value))
            m = None
            if mask is not None:
                m = jnp.asarray(mask, bool)
            if bias is not None:
                b = jax.lax.stop_gradient(jnp.asarray(bias))
                m = b if m is None else jnp.where(m, b, -jnp.inf)
            if m is not None:
                m = m.reshape((1,) * (4 - m.ndim) + m.shape)
            sc = float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1])
            out = fn(q, k, v, m, bool(is_causal), sc)
            return jnp.transpose(out, (0, 2, 1, 3))

        jax.nn.dot_product_attention = patched
        return self

    def __exit__(self, *exc):
        import jax

        jax.nn.dot_product_attention = self.orig
        return False


def _jcore():
    try:
        from jax.extend import core  # jax >= 0.4.30
    except ImportError:  # pragma: no cover
        from jax import core  # type: ignore[no-redef]
    return core




_UNARY = {"neg": "neg", "exp": "exp", "log": "log", "log1p": "log1p", "expm1": "expm1", "tanh": "tanh",
          "logistic": "sigmoid", "rsqrt": "rsqrt", "sqrt": "sqrt", "abs": "abs", "sign": "sign",
          "sin": "sin", "cos": "cos", "erf": "erf", "floor": "floor", "ceil": "ceil",
          "atan": "atan"}
_BINARY = {"add": "add", "add_any": "add", "sub": "sub", "mul": "mul", "div": "div", "pow": "pow",
           "max": "maximum", "min": "minimum"}
_COMPARE = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
_IDENTITY = {"stop_gradient", "copy", "copy_p", "sharding_constraint", "mesh_cast", "optimization_barrier",
             "device_put", "reduce_precision_noop"}
_CALLS = {"jit", "pjit", "closed_call", "core_call", "remat", "checkpoint", "remat2", "custom_jvp_call",
          "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin"}


#: jaxpr primitive name -> lowering ``rule(lowering, args, params, shape, dtype) -> [IR ids]`` (``args``:
#: the equation's operands as IR ids; ``shape``/``dtype``: its first output's). The one op table of
#: this frontend, as ``frontends/torch/lowering.py``'s ``OPS`` is the torch frontend's; call-like
#: primitives (inlined) and the attention primitives are handled by ``_Lowering.lower_eqn`` itself.
_PRIMS: dict[str, Callable] = {}


def _prim(*names: str):
    def register(fn: Callable) -> Callable:
        for name in names:
            _PRIMS[name] = fn
        return fn
    return register


def _install_elementwise() -> None:
    for name, op in _UNARY.items():
        _PRIMS[name] = lambda self, args, p, shape, dtype, _op=op: [
            self.add(_op, [self.cast(args[0], dtype)], shape, dtype)]
    for name, op in _BINARY.items():
        _PRIMS[name] = lambda self, args, p, shape, dtype, _op=op: [
            self.add(_op, [self.cast(a, dtype) for a in args], shape, dtype)]
    for name, op in _COMPARE.items():
        _PRIMS[name] = lambda self, args, p, shape, dtype, _op=op: [self.add(_op, args, shape, "bool")]
    for name in _IDENTITY:
        _PRIMS[name] = lambda self, args, p, shape, dtype: list(args)


_install_elementwise()


def _logical_rule(name: str) -> Callable:
    def rule(self, args, p, shape, dtype):
        if any(self.dtype(a) != "bool" for a in args):
            if name in ("and", "or", "xor"):  # bitwise on integers (jax.random's bit tricks)
                return [self.add("bitwise_" + name, [self.cast(a, dtype) for a in args], shape, dtype)]
            raise NotImplementedError(f"jax frontend: primitive {name} on integers")
        if name == "not":
            return [self.add("logical_not", args, shape, "bool")]
        if name == "xor":
            return [self.add("ne", args, shape, "bool")]
        return [self.add("logical_" + name, args, shape, "bool")]
    return rule


for _name in ("and", "or", "not", "xor"):
    _PRIMS[_name] = _logical_rule(_name)


@_prim("integer_pow")
def _integer_pow(self, args, p, shape, dtype):
    y = int(p["y"])
    if y == 2:
        return [self.add("mul", [args[0], args[0]], shape, dtype)]
    return [self.add("pow", [args[0], self.const(y, (), dtype)], shape, dtype)]


@_prim("square")
def _square(self, args, p, shape, dtype):
    return [self.add("mul", [args[0], args[0]], shape, dtype)]


@_prim("erfc")
def _erfc(self, args, p, shape, dtype):
    e = self.add("erf", [self.cast(args[0], dtype)], shape, dtype)
    return [self.add("sub", [self.const(1.0, (), dtype), e], shape, dtype)]


@_prim("is_finite")
def _is_finite(self, args, p, shape, dtype):  # |x| < inf is false for inf and nan
    x = args[0]
    ax = self.add("abs", [x], self.shape(x), self.dtype(x))
    return [self.add("lt", [ax, self.const(float("inf"), (), self.dtype(x))], shape, "bool")]


@_prim("exp2")
def _exp2(self, args, p, shape, dtype):
    return [self.add("pow", [self.const(2.0, (), dtype), args[0]], shape, dtype)]


@_prim("select_n")
def _select_n(self, args, p, shape, dtype):
    pred, cases = args[0], args[1:]
    out = self.cast(cases[0], dtype)
    for k, case in enumerate(cases[1:], start=1):
        cond = pred if len(cases) == 2 and self.dtype(pred) == "bool" else self.binary(
            "eq", pred, self.const(k, (), self.dtype(pred)), "bool")
        out = self.add("where", [cond, self.cast(case, dtype), out], shape, dtype)
    return [out]


@_prim("clamp")
def _clamp(self, args, p, shape, dtype):
    lo, x, hi = args
    y = self.add("maximum", [x, self.cast(lo, dtype)], shape, dtype)
    return [self.add("minimum", [y, self.cast(hi, dtype)], shape, dtype)]


@_prim("convert_element_type")
def _convert(self, args, p, shape, dtype):
    return [self.cast(args[0], dtype)]


_REDUCE = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_or": "max", "reduce_and": "min",
           "reduce_prod": "prod"}


def _reduce_rule(op: str) -> Callable:
    def rule(self, args, p, shape, dtype):
        axes = tuple(sorted(int(a) for a in p["axes"]))
        if not axes:
            return [self.cast(args[0], dtype)]
        return [self.add(op, [self.cast(args[0], dtype)], shape, dtype, axes=axes, keepdim=False)]
    return rule


for _name, _op in _REDUCE.items():
    _PRIMS[_name] = _reduce_rule(_op)


@_prim("broadcast_in_dim")
def _broadcast_in_dim(self, args, p, shape, dtype):
    x = args[0]
    if self.shape(x) == shape:
        return [x]
    n = self.g.nodes[x]
    if n.op == "constant":
        return [self.const(n.attrs["value"], shape, dtype)]
    return [self.add("broadcast_in_dim", [x], shape, dtype, shape=shape,
                     dims=tuple(int(d) for d in p["broadcast_dimensions"]))]


@_prim("reshape")
def _reshape(self, args, p, shape, dtype):
    x = args[0]
    if p.get("dimensions") not in (None, ()):  # lax.reshape's transpose-first form
        x = self.transpose(x, tuple(int(d) for d in p["dimensions"]))
    return [self.reshape(x, shape)]


@_prim("squeeze", "expand_dims")
def _squeeze(self, args, p, shape, dtype):
    return [self.reshape(args[0], shape)]


@_prim("transpose")
def _transpose(self, args, p, shape, dtype):
    return [self.transpose(args[0], p["permutation"])]


@_prim("dot_general")
def _dot_general(self, args, p, shape, dtype):
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    return [self.add("dot_general", args[:2], shape, dtype, lhs_batch=tuple(int(d) for d in lb),
                     rhs_batch=tuple(int(d) for d in rb), lhs_contract=tuple(int(d) for d in lc),
                     rhs_contract=tuple(int(d) for d in rc))]


@_prim("conv_general_dilated")
def _conv_general_dilated(self, args, p, shape, dtype):
    return [self.conv(args[0], args[1], p, shape, dtype)]


@_prim("rev")
def _rev(self, args, p, shape, dtype):
    return [self.add("reverse", [args[0]], shape, dtype, axes=tuple(int(d) for d in p["dimensions"]))]


@_prim("iota")
def _iota(self, args, p, shape, dtype):
    return [self.add("iota", [], shape, dtype, axis=int(p["dimension"]))]


@_prim("concatenate")
def _concatenate(self, args, p, shape, dtype):
    return [self.add("concatenate", [self.cast(a, dtype) for a in args], shape, dtype, axis=int(p["dimension"]))]


def _pad_general(self, x: int, cfg, value, dtype: str) -> int:
    """``lax.pad``: per dim (low, high, interior); interior zeros between elements (the
    transpose of a strided window sum) by a reshape to [.., n, 1 + interior], a pad and a crop;
    negative low/high crop."""
    shape = list(self.shape(x))
    for d, (_, _, interior) in enumerate(cfg):
        interior = int(interior)
        if not interior or shape[d] == 0:
            continue
        n = shape[d]
        wide = shape[:d + 1] + [1] + shape[d + 1:]
        x = self.add("reshape", [x], wide, dtype, shape=tuple(wide))
        grown = list(wide)
        grown[d + 1] = 1 + interior
        hi = [0] * len(wide)
        hi[d + 1] = interior
        x = self.add("pad", [x], grown, dtype, low=(0,) * len(wide), high=tuple(hi), value=value)
        flat = shape[:d] + [n * (1 + interior)] + shape[d + 1:]
        x = self.add("reshape", [x], flat, dtype, shape=tuple(flat))
        shape = shape[:d] + [n + (n - 1) * interior] + shape[d + 1:]
        x = self.add("slice", [x], shape, dtype, start=(0,) * len(shape), limit=tuple(shape), step=(1,) * len(shape))
    lows = [max(int(c[0]), 0) for c in cfg]
    highs = [max(int(c[1]), 0) for c in cfg]
    if any(lows) or any(highs):
        shape = [s + lo + hi for s, lo, hi in zip(shape, lows, highs)]
        x = self.add("pad", [x], shape, dtype, low=tuple(lows), high=tuple(highs), value=value)
    if any(int(c[0]) < 0 or int(c[1]) < 0 for c in cfg):
        start = [-min(int(c[0]), 0) for c in cfg]
        limit = [s + min(int(c[1]), 0) for s, c in zip(shape, cfg)]
        shape = [hi - lo for lo, hi in zip(start, limit)]
        x = self.add("slice", [x], shape, dtype, start=tuple(start), limit=tuple(limit), step=(1,) * len(shape))
    return x


@_prim("pad")
def _pad(self, args, p, shape, dtype):
    value = self.g.nodes[args[1]]
    if value.op != "constant":
        raise NotImplementedError("jax frontend: pad with a non-constant padding value")
    return [_pad_general(self, self.cast(args[0], dtype), p["padding_config"], value.attrs["value"], dtype)]


_WINDOW_INIT = {"reduce_window_sum": 0.0, "reduce_window_max": float("-inf"), "reduce_window_min": float("inf")}
_WINDOW_OP = {"reduce_window_sum": "add", "reduce_window_max": "maximum", "reduce_window_min": "minimum"}


def _window_taps(self, x: int, p, out_shape, dtype: str, fill):
    """(tap, strided view of the padded ``x`` [out_shape]) for every window position of a
    ``reduce_window``-style primitive (``window_dimensions``, ``window_strides``, ``padding``,
    ``window_dilation``; a ``base_dilation`` other than 1 is unsupported)."""
    import itertools

    dims = [int(w) for w in p["window_dimensions"]]
    strides = [int(s) for s in p["window_strides"]]
    wdil = [int(d) for d in (p.get("window_dilation") or (1,) * len(dims))]
    if any(int(b) != 1 for b in (p.get("base_dilation") or ())):
        raise NotImplementedError("jax frontend: reduce_window with base dilation")
    xp = _pad_general(self, x, [(lo, hi, 0) for lo, hi in p["padding"]], fill, dtype)
    for tap in itertools.product(*(range(w) for w in dims)):
        start = [t * d for t, d in zip(tap, wdil)]
        limit = [st + s * (o - 1) + 1 for st, s, o in zip(start, strides, out_shape)]
        yield tap, self.add("slice", [xp], tuple(out_shape), dtype, start=tuple(start), limit=tuple(limit),
                            step=tuple(strides))


def _reduce_window(kind: str) -> Callable:
    def rule(self, args, p, shape, dtype):
        """``lax.reduce_window`` sum / max / min (flax's ``avg_pool`` / ``max_pool``): one
        strided slice of the padded operand per window tap, combined elementwise."""
        x = self.cast(args[0], dtype)
        fill = _WINDOW_INIT[kind] if dtype in FLOAT_DTYPES else {"reduce_window_sum": 0}.get(kind)
        if fill is None:
            raise NotImplementedError(f"jax frontend: {kind} of {dtype}")
        out = None
        for _, v in _window_taps(self, x, p, shape, dtype, fill):
            out = v if out is None else self.add(_WINDOW_OP[kind], [out, v], shape, dtype)
        return [out]
    return rule


for _name in _WINDOW_OP:
    _PRIMS[_name] = _reduce_window(_name)


@_prim("select_and_scatter_add")
def _select_and_scatter_add(self, args, p, shape, dtype):
    """The gradient of ``reduce_window_max`` (``select_prim`` ge) / ``_min`` (le): each window's
    cotangent added at the first element of the window the select keeps (XLA's
    SelectAndScatter), as the torch lowering of max pooling's backward: the winning tap per
    output, then each tap's share placed back by an interior pad."""
    source, operand = args[0], self.cast(args[1], dtype)
    select = str(p["select_prim"])
    fill = float("-inf") if "ge" in select else float("inf")
    cmp = "gt" if "ge" in select else "lt"
    out_shape = self.shape(source)
    best = win = None
    taps = []
    for k, (tap, v) in enumerate(_window_taps(self, operand, p, out_shape, dtype, fill)):
        taps.append(tap)
        if best is None:
            best, win = v, self.const(0, out_shape, "int64")
            continue
        better = self.add(cmp, [v, best], out_shape, "bool")
        win = self.add("where", [better, self.const(k, out_shape, "int64"), win], out_shape, "int64")
        best = self.add("maximum" if cmp == "gt" else "minimum", [best, v], out_shape, dtype)
    strides = [int(s) for s in p["window_strides"]]
    wdil = [int(d) for d in (p.get("window_dilation") or (1,) * len(strides))]
    pads = [(int(lo), int(hi)) for lo, hi in p["padding"]]
    padded = [s + lo + hi for s, (lo, hi) in zip(shape, pads)]
    src = self.cast(source, dtype)
    total = None
    for k, tap in enumerate(taps):
        part = self.add("where", [self.add("eq", [win, self.const(k, out_shape, "int64")], out_shape, "bool"), src,
                                  self.const(0.0, out_shape, dtype)], out_shape, dtype)
        cfg = []
        for d, o in enumerate(out_shape):
            lo = tap[d] * wdil[d]
            span = (o - 1) * strides[d] + 1 if o else 0
            cfg.append((lo, padded[d] - lo - span, strides[d] - 1))
        placed = _pad_general(self, part, cfg, 0.0, dtype)
        total = placed if total is None else self.add("add", [total, placed], tuple(padded), dtype)
    crop = [(-lo, -hi, 0) for lo, hi in pads]
    return [_pad_general(self, total, crop, 0.0, dtype)]


@_prim("slice")
def _slice(self, args, p, shape, dtype):
    xs = self.shape(args[0])
    strides = p.get("strides") or (1,) * len(xs)
    return [self.add("slice", [args[0]], shape, dtype, start=tuple(int(s) for s in p["start_indices"]),
                     limit=tuple(int(s) for s in p["limit_indices"]), step=tuple(int(s) for s in strides))]


@_prim("split")
def _split(self, args, p, shape, dtype):
    axis = int(p["axis"])
    xs = self.shape(args[0])
    res, start = [], 0
    for size in p["sizes"]:
        st, lim = [0] * len(xs), list(xs)
        st[axis], lim[axis] = start, start + int(size)
        out = list(xs)
        out[axis] = int(size)
        res.append(self.add("slice", [args[0]], out, dtype, start=tuple(st), limit=tuple(lim), step=(1,) * len(xs)))
        start += int(size)
    return res


@_prim("gather")
def _gather(self, args, p, shape, dtype):
    return [self.gather(args[0], args[1], p, shape, dtype)]


@_prim("scatter")
def _scatter(self, args, p, shape, dtype):
    if not tuple(p["dimension_numbers"].scatter_dims_to_operand_dims) and self.shape(args[2]) == shape:
        return [self.cast(args[2], dtype)]  # x.at[...].set(v) over the whole array: v
    raise NotImplementedError("jax frontend: primitive scatter has no IR lowering")


@_prim("round")
def _round(self, args, p, shape, dtype):
    """``lax.round``: to nearest even (IR ``round``, what ``jnp.round`` asks for) or, by default,
    half away from zero: ``sign(x) * floor(|x| + 0.5)``."""
    x = self.cast(args[0], dtype)
    if int(p.get("rounding_method", 0)) == 1:
        return [self.add("round", [x], shape, dtype)]
    up = self.add("floor", [self.binary("add", self.add("abs", [x], shape, dtype), self.const(0.5, (), dtype))],
                  shape, dtype)
    return [self.add("mul", [self.add("sign", [x], shape, dtype), up], shape, dtype)]


@_prim("rem")
def _rem(self, args, p, shape, dtype):
    """``lax.rem`` (C's fmod, the sign of the dividend): ``x - trunc(x / y) * y``."""
    x, y = (self.cast(a, dtype) for a in args)
    q = self.add("div", [x, y], shape, dtype)
    if dtype in FLOAT_DTYPES:
        q = self.add("trunc", [q], shape, dtype)
    return [self.add("sub", [x, self.binary("mul", q, y)], shape, dtype)]


def _arg_rule(largest: bool) -> Callable:
    def rule(self, args, p, shape, dtype):
        """``argmax`` / ``argmin`` along one axis: the first index of the extreme, as XLA's."""
        x = args[0]
        xs = self.shape(x)
        d = int(p["axes"][0])
        kshape = tuple(1 if i == d else s_ for i, s_ in enumerate(xs))
        m = self.add("max" if largest else "min", [x], kshape, self.dtype(x), axes=(d,), keepdim=True)
        mb = self.add("broadcast_in_dim", [m], xs, self.dtype(x), shape=xs, dims=tuple(range(len(xs))))
        hit = self.add("eq", [x, mb], xs, "bool")
        cand = self.add("where", [hit, self.add("iota", [], xs, dtype, axis=d), self.const(xs[d], (), dtype)], xs, dtype)
        return [self.reshape(self.add("min", [cand], kshape, dtype, axes=(d,), keepdim=True), shape)]
    return rule


_PRIMS["argmax"], _PRIMS["argmin"] = _arg_rule(True), _arg_rule(False)


@_prim("scatter-add", "scatter_add")
def _scatter_add(self, args, p, shape, dtype):
    return [self.scatter_add(args[0], args[1], args[2], p, shape, dtype)]


class _Lowering(GraphBuilder):
    def __init__(self) -> None:
        super().__init__()
        self.core = _jcore()

    # --- driver -------------------------------------------------------------------------------
    def run(self, closed, roles, out_roles) -> tuple[Graph, list[int]]:
        jaxpr = closed.jaxpr
        if len(jaxpr.invars) != len(roles):
            raise RuntimeError(f"jaxpr has {len(jaxpr.invars)} inputs, expected {len(roles)}")
        env: dict[Any, int] = {}
        ids = []
        for var, (role, name) in zip(jaxpr.invars, roles):
            i = self.add("input", [], var.aval.shape, ir_dtype(var.aval.dtype), role=role, name=name)
            env[var] = i
            ids.append(i)
        for var, value in zip(jaxpr.constvars, closed.consts):
            env[var] = self.array_const(value, str(var))
        outs = self.lower_jaxpr(jaxpr, env)
        if len(outs) != len(out_roles):
            raise RuntimeError(f"jaxpr has {len(outs)} outputs, expected {len(out_roles)}")
        self.g.outputs = outs
        self.g.output_roles = list(out_roles)
        return self.g.compact(ids)

    def array_const(self, value, name: str) -> int:
        arr = np.asarray(value)
        dtype = ir_dtype(arr.dtype)
        flat = arr.reshape(-1)
        if flat.size == 0 or bool(np.all(flat == flat[0])):
            return self.const(flat[0].item() if flat.size else 0, arr.shape, dtype)
        return self.add("input", [], arr.shape, dtype, role="constant", name=name,
                        value=arr.astype(np.float64) if dtype in FLOAT_DTYPES else arr)

    def read(self, env, atom) -> int:
        if isinstance(atom, self.core.Literal):
            val = np.asarray(atom.val)
            return self.array_const(val, "literal") if val.ndim else self.const(
                val.item(), tuple(atom.aval.shape), ir_dtype(atom.aval.dtype))
        return env[atom]

    def lower_jaxpr(self, jaxpr, env) -> list[int]:
        for eqn in jaxpr.eqns:
            args = [self.read(env, a) for a in eqn.invars]
            try:
                outs = self.lower_eqn(eqn, args)
            except NotImplementedError as e:
                where = _user_line(eqn)
                if where and " at " not in str(e).rsplit(")", 1)[-1] and "(at " not in str(e):
                    raise NotImplementedError(f"{e} (at {where})") from None
                raise
            for var, i in zip(eqn.outvars, outs):
                if not isinstance(var, self.core.DropVar):
                    env[var] = i
        return [self.read(env, a) for a in jaxpr.outvars]

    def inline(self, sub, args) -> list[int]:
        if isinstance(sub, self.core.ClosedJaxpr):
            env = {v: self.array_const(c, str(v)) for v, c in zip(sub.jaxpr.constvars, sub.consts)}
            sub = sub.jaxpr
        else:
            env = {}
            if sub.constvars:
                raise NotImplementedError("jax frontend: open sub-jaxpr with constvars")
        env.update(zip(sub.invars, args))
        return self.lower_jaxpr(sub, env)

    def lower_eqn(self, eqn, args: list[int]) -> list[int]:
        name = eqn.primitive.name
        p = eqn.params
        outs = eqn.outvars
        if name in _KEY_OPS:
            return [None] * len(outs)  # a PRNG key: no IR value (see _KEY_OPS)
        if any(a is None for a in args) and name not in ("scan", "cond", "random_bits") and not (
                name in _CALLS or name.endswith("_call")):
            if all(str(v.aval.dtype).startswith("key<") for v in outs):
                return [None] * len(outs)  # a slice or reshape of keys is keys
            raise NotImplementedError(_PRNG_REFUSAL + f" (primitive {name})")
        if name in ("sftctl_attention", "sftctl_attention_bwd"):
            attrs = dict(causal=bool(p["causal"]), scale=float(p["scale"]), dropout_p=0.0, rng=0)
            types = [(tuple(v.aval.shape), ir_dtype(v.aval.dtype)) for v in outs]
            if name == "sftctl_attention":
                return [self.add("attention", args, *types[0], **attrs), self.add("attention_lse", args, *types[1], **attrs)]
            return [self.add("attention_grad", args, *t, wrt=w, **attrs) for t, w in zip(types, "qkv")]
        if name in _CALLS or name.endswith("_call"):
            for key in ("call_jaxpr", "jaxpr", "fun_jaxpr"):
                sub = p.get(key)
                if isinstance(sub, (self.core.ClosedJaxpr, self.core.Jaxpr)):
                    return self.inline(sub, args[len(args) - len(getattr(sub, "jaxpr", sub).invars):])
            raise NotImplementedError(f"jax frontend: primitive {name} (no inlinable jaxpr)")
        if name == "scan":
            return self.scan(p, args)
        if name == "cond":
            return self.cond(p, args)
        aval = outs[0].aval
        shape, dtype = tuple(aval.shape), ir_dtype(aval.dtype)
        rule = _PRIMS.get(name)
        if rule is None:
            raise NotImplementedError(f"jax frontend: primitive {name} has no IR lowering")
        return rule(self, args, p, shape, dtype)

    # --- control flow ----------------------------------------------------------------------------
    def _spread(self, scalar: int, shape) -> int:
        """A 0-d value broadcast to ``shape``."""
        shape = tuple(shape)
        if not shape:
            return scalar
        return self.add("broadcast_in_dim", [scalar], shape, self.dtype(scalar), shape=shape, dims=())

    def scan(self, p, args) -> list[int]:
        """``lax.scan`` (flax ``nn.RNN`` / ``nn.scan``, a hand-written recurrence) unrolled over
        its static ``length``: the body inlined once per step, each step's slice of ``xs`` in, its
        ``ys`` stacked along a new leading axis (``reverse``: steps from the end)."""
        body = p["jaxpr"]
        n_consts, n_carry, length = int(p["num_consts"]), int(p["num_carry"]), int(p["length"])
        consts, carry, xs = args[:n_consts], list(args[n_consts:n_consts + n_carry]), args[n_consts + n_carry:]
        y_avals = [v.aval for v in body.jaxpr.outvars[n_carry:]]
        ys: list[list[int]] = [[None] * length for _ in y_avals]
        steps = range(length - 1, -1, -1) if p.get("reverse") else range(length)
        for i in steps:
            x_i = []
            for x in xs:
                xs_shape = self.shape(x)
                sl = self.add("slice", [x], (1,) + xs_shape[1:], self.dtype(x), start=(i,) + (0,) * (len(xs_shape) - 1),
                              limit=(i + 1,) + xs_shape[1:], step=(1,) * len(xs_shape))
                x_i.append(self.reshape(sl, xs_shape[1:]))
            out = self.inline(body, list(consts) + carry + x_i)
            carry = list(out[:n_carry])
            for k, y in enumerate(out[n_carry:]):
                ys[k][i] = y
        stacked = []
        for k, aval in enumerate(y_avals):
            full = (length,) + tuple(aval.shape)
            if str(aval.dtype).startswith("key<"):
                stacked.append(None)
                continue
            dt = ir_dtype(aval.dtype)
            if length == 0:
                stacked.append(self.const(0, full, dt))
                continue
            if any(y is None for y in ys[k]):  # a PRNG key per step: no value (see _KEY_OPS)
                stacked.append(None)
                continue
            parts = [self.reshape(self.cast(y, dt), (1,) + tuple(aval.shape)) for y in ys[k]]
            stacked.append(parts[0] if length == 1 else self.add("concatenate", parts, full, dt, axis=0))
        return carry + stacked

    def cond(self, p, args) -> list[int]:
        """``lax.cond`` / ``lax.switch`` on a traced index: every branch lowered and the outputs
        selected elementwise by the index (both branches are priced, as a GPU running
        ``jnp.where`` would run them; XLA runs one)."""
        index, ops = args[0], args[1:]
        branches = [self.inline(b, list(ops)) for b in p["branches"]]
        idx = self.cast(index, "int64")
        outs = list(branches[0])
        for k, br in enumerate(branches[1:], start=1):
            pick = self.add("eq", [idx, self.const(k, (), "int64")], (), "bool")
            outs = [self.add("where", [self._spread(pick, self.shape(a)), self.cast(b, self.dtype(a)), a],
                             self.shape(a), self.dtype(a)) for a, b in zip(outs, br)]
        return outs

    # --- convolution ---------------------------------------------------------------------------
    def conv(self, lhs: int, rhs: int, p, shape, dtype) -> int:
        """``lax.conv_general_dilated``: operands transposed to NCHW / OIHW, an IR ``conv``, the
        result transposed back from NCHW to the equation's output layout."""
        dn = p["dimension_numbers"]
        lspec, rspec, ospec = (tuple(int(d) for d in s_) for s_ in (dn.lhs_spec, dn.rhs_spec, dn.out_spec))
        x = self.transpose(self.cast(lhs, dtype), lspec)
        w = self.transpose(self.cast(rhs, dtype), rspec)
        nsp = len(lspec) - 2
        lhs_dil = tuple(int(d) for d in (p.get("lhs_dilation") or (1,) * nsp))
        rhs_dil = tuple(int(d) for d in (p.get("rhs_dilation") or (1,) * nsp))
        out_nchw = tuple(shape[d] for d in ospec)
        y = self.add("conv", [x, w], out_nchw, dtype, stride=tuple(int(s_) for s_ in p["window_strides"]),
                     padding=tuple((int(lo), int(hi)) for lo, hi in p["padding"]), lhs_dilation=lhs_dil,
                     rhs_dilation=rhs_dil, feature_group_count=int(p["feature_group_count"]),
                     batch_group_count=int(p["batch_group_count"]))
        inv = [0] * len(ospec)
        for i, d in enumerate(ospec):
            inv[d] = i
        return self.transpose(y, inv)

    # --- gather / scatter ---------------------------------------------------------------------
    def _take_form(self, dn, operand_shape, slice_sizes, index_shape):
        """The axis of a *take* gather/scatter (one indexed axis, full slices), else None."""
        smap = tuple(dn.start_index_map if hasattr(dn, "start_index_map") else dn.scatter_dims_to_operand_dims)
        collapsed = tuple(dn.collapsed_slice_dims if hasattr(dn, "collapsed_slice_dims") else dn.inserted_window_dims)
        batching = tuple(getattr(dn, "operand_batching_dims", ()))
        if len(smap) != 1 or collapsed != smap or batching or index_shape[-1] != 1:
            return None
        a = smap[0]
        if slice_sizes is not None and any(s != (1 if d == a else operand_shape[d])
                                           for d, s in enumerate(slice_sizes)):
            return None
        return a

    def _point_index(self, dn, operand_shape, idx: int) -> int:
        """Linear index into the flattened operand for a point gather/scatter (all slices size 1)."""
        smap = tuple(dn.start_index_map if hasattr(dn, "start_index_map") else dn.scatter_dims_to_operand_dims)
        obatch = tuple(getattr(dn, "operand_batching_dims", ()))
        ibatch = tuple(getattr(dn, "start_indices_batching_dims", ()) or getattr(dn, "scatter_indices_batching_dims", ()))
        ishape = self.shape(idx)
        bshape = ishape[:-1]
        strides = row_major_strides(operand_shape)
        flat = None
        idx64 = self.cast(idx, "int64")
        for j, d in enumerate(smap):
            col = self.reshape(self._slice_last(idx64, j), bshape)
            term = col if strides[d] == 1 else self.binary("mul", col, self.const(strides[d], (), "int64"))
            flat = term if flat is None else self.binary("add", flat, term)
        for od, idim in zip(obatch, ibatch):
            term = self.add("iota", [], bshape, "int64", axis=int(idim))
            if strides[od] != 1:
                term = self.binary("mul", term, self.const(strides[od], (), "int64"))
            flat = term if flat is None else self.binary("add", flat, term)
        if flat is None:
            flat = self.const(0, bshape, "int64")
        if self.shape(flat) != bshape:
            flat = self.add("broadcast_in_dim", [flat], bshape, "int64", shape=bshape,
                            dims=tuple(range(len(bshape) - len(self.shape(flat)), len(bshape))))
        return flat

    def _slice_last(self, idx: int, j: int) -> int:
        s = self.shape(idx)
        if s[-1] == 1:
            return idx
        return self.add("slice", [idx], s[:-1] + (1,), self.dtype(idx), start=(0,) * (len(s) - 1) + (j,),
                        limit=s[:-1] + (j + 1,), step=(1,) * len(s))

    def gather(self, x: int, idx: int, p, shape, dtype) -> int:
        dn = p["dimension_numbers"]
        xs, ishape = self.shape(x), self.shape(idx)
        a = self._take_form(dn, xs, tuple(p["slice_sizes"]), ishape)
        if a is not None:
            i = self.reshape(idx, ishape[:-1])
            nb = len(ishape) - 1
            take_shape = xs[:a] + ishape[:-1] + xs[a + 1:]
            t = self.add("gather", [x, i], take_shape, dtype, axis=a)
            offset = tuple(int(d) for d in dn.offset_dims)
            perm, j = [], 0
            for pos in range(len(shape)):
                if pos in offset:
                    k = offset.index(pos)
                    perm.append(k if k < a else k + nb)
                else:
                    perm.append(a + j)
                    j += 1
            return self.transpose(t, perm)
        if not tuple(dn.offset_dims) and all(int(s) == 1 for s in p["slice_sizes"]):
            flat = self._point_index(dn, xs, idx)
            return self.add("gather", [self.reshape(x, (math.prod(xs),)), flat], shape, dtype, axis=0)
        raise NotImplementedError(f"jax frontend: primitive gather with dimension numbers {dn}")

    def scatter_add(self, x: int, idx: int, upd: int, p, shape, dtype) -> int:
        dn = p["dimension_numbers"]
        xs, ishape, us = self.shape(x), self.shape(idx), self.shape(upd)
        upd = self.cast(upd, dtype)
        a = self._take_form(dn, xs, None, ishape)
        if a is not None and len(us) == len(xs) - 1 + len(ishape) - 1:
            nb = len(ishape) - 1
            window = tuple(int(d) for d in dn.update_window_dims)
            # updates -> take order: operand dims < a, scatter (batch) dims, operand dims > a
            scatter_pos = [d for d in range(len(us)) if d not in window]
            perm = list(window[:a]) + scatter_pos + list(window[a:])
            u = self.transpose(upd, perm)
            i = self.reshape(idx, ishape[:-1])
            full = all(us[wd] == xs[k if k < a else k + 1] for k, wd in enumerate(window))
            if len(scatter_pos) != nb or not full:
                raise NotImplementedError(f"jax frontend: primitive scatter-add with dimension numbers {dn}")
            sc = self.add("scatter_add", [u, i], xs, dtype, axis=a, size=xs[a])
        elif not tuple(dn.update_window_dims):
            flat = self._point_index(dn, xs, idx)
            total = (math.prod(xs),)
            sc = self.reshape(self.add("scatter_add", [upd, flat], total, dtype, axis=0, size=total[0]), xs)
        else:
            raise NotImplementedError(f"jax frontend: primitive scatter-add with dimension numbers {dn}")
        n = self.g.nodes[x]
        if n.op == "constant" and n.attrs["value"] == 0:
            return sc
        return self.add("add", [x, sc], shape, dtype)


def trace_entrypoint(entrypoint: str, workdir: str, batch_size: int, dtype: str = "float32", *,
                     mixed_precision: bool = True, **step_kwargs: Any) -> tuple[Graph, dict[str, Any]]:
    """Import ``file.py:function`` (relative to ``workdir``) and trace its JAX training step.

    ``function(batch_size=..., dtype=...)`` must return ``(params, example_batch, loss_fn)`` with
    ``loss_fn(params, batch) -> scalar`` (pytrees of arrays, or a flax.nnx Module as ``params``;
    see examples/jax_mlp/model.py). As in the torch frontend, with ``mixed_precision`` (the
    default) a ``dtype`` of bfloat16/float16 means float32 master weights and AdamW state (the
    function is called with ``dtype="float32"``) and compute in ``dtype`` (``compute_dtype``);
    ``mixed_precision=False`` builds and trains in ``dtype`` as is. ``step_kwargs`` go to
    :func:`trace_step`. Raises what the entrypoint raises, and NotImplementedError for a
    primitive the lowering does not support.
    """
    from sftctl.compiler.frontends import load_entrypoint

    amp = mixed_precision and dtype != "float32"
    params, batch, loss_fn = load_entrypoint(entrypoint, workdir)(batch_size=batch_size,
                                                                  dtype="float32" if amp else dtype)
    graph, meta = trace_step(loss_fn, params, batch, compute_dtype=dtype if amp else None, **step_kwargs)
    meta.update(entrypoint=entrypoint, dtype=dtype,
                precision=f"compute {dtype}, float32 master weights" if amp else dtype)
    return graph, meta


@_prim("empty", "empty2")
def _empty(self, args, p, shape, dtype):
    """An uninitialized array (JAX's transposes make them for outputs a branch does not write):
    zeros, what the interpreter can compare."""
    return [self.const(0, shape, dtype)]


def _shift_rule(op: str) -> Callable:
    def rule(self, args, p, shape, dtype):
        return [self.add(op, [self.cast(a, dtype) for a in args], shape, dtype)]
    return rule


_PRIMS["shift_right_logical"], _PRIMS["shift_left"] = _shift_rule("shift_right_logical"), _shift_rule("shift_left")


@_prim("bitcast_convert_type")
def _bitcast(self, args, p, shape, dtype):
    """An integer's bits as a float of the same width (``jax.random.uniform`` builds floats in
    [1, 2) from random mantissa bits this way)."""
    if self.shape(args[0]) != tuple(shape) or dtype not in ("float32", "float16", "float64"):
        raise NotImplementedError(f"jax frontend: bitcast_convert_type to {dtype}")
    return [self.add("bitcast", [args[0]], shape, dtype)]


@_prim("random_bits")
def _random_bits(self, args, p, shape, dtype):
    """``jax.random.bits`` (under ``uniform``, ``bernoulli``, flax dropout): uniform random
    integers of the output's width from the IR's ``rng_uniform`` stream, as the torch frontend
    prices dropout (the distribution, not threefry's exact bits)."""
    width = int(p.get("bit_width", 32))
    if width > 32:
        raise NotImplementedError(f"jax frontend: random_bits of {width} bits")
    self._rng = getattr(self, "_rng", 1 << 21) + 1
    u = self.add("rng_uniform", [], shape, "float64", rng=self._rng)
    scaled = self.add("floor", [self.add("mul", [u, self.const(float(2 ** width), (), "float64")], shape, "float64")],
                      shape, "float64")
    return [self.cast(self.cast(scaled, "int64"), dtype)]


@_prim("cumsum")
def _cumsum(self, args, p, shape, dtype):
    """``lax.cumsum`` (``jnp.cumsum``): the IR's inclusive scan; ``reverse`` by flipping."""
    axis = int(p["axis"])
    x = self.cast(args[0], dtype)
    if p.get("reverse"):
        x = self.add("reverse", [x], shape, dtype, axes=(axis,))
    y = self.add("cumsum", [x], shape, dtype, axis=axis)
    return [self.add("reverse", [y], shape, dtype, axes=(axis,)) if p.get("reverse") else y]


def _clamped_starts(self, operand_shape, starts, sizes) -> list[int]:
    """int64 0-d start of each dim, clamped into [0, dim - size] as XLA clamps them."""
    out = []
    for d, (st, size) in enumerate(zip(starts, sizes)):
        s0 = self.add("maximum", [self.cast(st, "int64"), self.const(0, (), "int64")], (), "int64")
        out.append(self.add("minimum", [s0, self.const(int(operand_shape[d]) - int(size), (), "int64")], (), "int64"))
    return out


def _dynamic_window(self, operand_shape, starts, sizes) -> int:
    """int64 flat index over ``sizes`` into the flattened operand for a window at traced
    ``starts`` (clamped: :func:`_clamped_starts`)."""
    rm = row_major_strides(list(operand_shape))
    flat = None
    for d, s0 in enumerate(_clamped_starts(self, operand_shape, starts, sizes)):
        term = self.add("add", [self.add("iota", [], tuple(sizes), "int64", axis=d),
                                self.add("broadcast_in_dim", [s0], tuple(sizes), "int64", shape=tuple(sizes), dims=())],
                        tuple(sizes), "int64")
        if rm[d] != 1:
            term = self.add("mul", [term, self.const(rm[d], (), "int64")], tuple(sizes), "int64")
        flat = term if flat is None else self.add("add", [flat, term], tuple(sizes), "int64")
    return flat


@_prim("dynamic_slice")
def _dynamic_slice(self, args, p, shape, dtype):
    """``lax.dynamic_slice`` at traced start indices: one gather from the flattened operand."""
    x = self.cast(args[0], dtype)
    xs = self.shape(x)
    if not xs:
        return [x]
    flat = _dynamic_window(self, xs, args[1:1 + len(xs)], shape)
    n = 1
    for v in xs:
        n *= v
    return [self.add("gather", [self.add("reshape", [x], (n,), dtype, shape=(n,)), flat], shape, dtype, axis=0)]


@_prim("dynamic_update_slice")
def _dynamic_update_slice(self, args, p, shape, dtype):
    """``lax.dynamic_update_slice``: the update where the (clamped) window lies, the operand
    elsewhere: a compare of each position with the window and one gather of the update."""
    x, upd = self.cast(args[0], dtype), self.cast(args[1], dtype)
    us = self.shape(upd)
    if not shape:
        return [upd]
    starts = _clamped_starts(self, shape, args[2:2 + len(shape)], us)
    inside = None
    rel = None
    urm = row_major_strides(list(us))
    for d, s0 in enumerate(starts):
        pos = self.add("iota", [], shape, "int64", axis=d)
        off = self.add("sub", [pos, self.add("broadcast_in_dim", [s0], shape, "int64", shape=shape, dims=())], shape, "int64")
        ok = self.add("logical_and", [self.add("ge", [off, self.const(0, (), "int64")], shape, "bool"),
                                      self.add("lt", [off, self.const(us[d], (), "int64")], shape, "bool")], shape, "bool")
        inside = ok if inside is None else self.add("logical_and", [inside, ok], shape, "bool")
        off = self.add("minimum", [self.add("maximum", [off, self.const(0, (), "int64")], shape, "int64"),
                                   self.const(max(us[d] - 1, 0), (), "int64")], shape, "int64")
        term = off if urm[d] == 1 else self.add("mul", [off, self.const(urm[d], (), "int64")], shape, "int64")
        rel = term if rel is None else self.add("add", [rel, term], shape, "int64")
    n = 1
    for v in us:
        n *= v
    if n == 0:
        return [x]
    picked = self.add("gather", [self.add("reshape", [upd], (n,), dtype, shape=(n,)), rel], shape, dtype, axis=0)
    return [self.add("where", [inside, picked, x], shape, dtype)]


@_prim("sort")
def _sort(self, args, p, shape, dtype):
    """``lax.sort`` (``jnp.sort`` / ``argsort``: the operands sorted together by the first one,
    ascending, stable): each element's rank along ``dimension`` by comparisons (an [m, m] compare
    per row and a row sum, as the torch frontend sorts), then every operand scattered to its rank.
    More than one key operand is unsupported."""
    if int(p.get("num_keys", 1)) != 1:
        raise NotImplementedError("jax frontend: sort by more than one key")
    key = args[0]
    ks = self.shape(key)
    if not ks:
        return list(args)
    dim = int(p["dimension"]) % len(ks)
    perm = tuple(d for d in range(len(ks)) if d != dim) + (dim,)
    inv = tuple(perm.index(d) for d in range(len(ks)))
    kt = self.transpose(key, perm)
    ts = self.shape(kt)
    m = ts[-1]
    rows = math.prod(ts[:-1])
    k2 = self.reshape(kt, (rows, m))
    a = self.reshape(k2, (rows, m, 1))
    b = self.reshape(k2, (rows, 1, m))
    kd = self.dtype(k2)
    cube = (rows, m, m)
    bj = self.add("broadcast_in_dim", [b], cube, kd, shape=cube, dims=(0, 1, 2))  # element j
    ai = self.add("broadcast_in_dim", [a], cube, kd, shape=cube, dims=(0, 1, 2))  # element i
    before = self.add("lt", [bj, ai], cube, "bool")
    ties = self.add("eq", [bj, ai], cube, "bool")
    earlier = self.add("lt", [self.add("iota", [], (rows, m, m), "int64", axis=2),
                              self.add("iota", [], (rows, m, m), "int64", axis=1)], (rows, m, m), "bool")
    first = self.add("logical_or", [before, self.add("logical_and", [ties, earlier], (rows, m, m), "bool")],
                     (rows, m, m), "bool")
    rank = self.add("sum", [self.cast(first, "int64")], (rows, m), "int64", axes=(2,), keepdim=False)
    row_base = self.add("mul", [self.add("iota", [], (rows, m), "int64", axis=0), self.const(m, (), "int64")],
                        (rows, m), "int64")
    flat = self.reshape(self.add("add", [rank, row_base], (rows, m), "int64"), (rows * m,))
    outs = []
    for x in args:
        xd = self.dtype(x)
        xt = self.reshape(self.transpose(x, perm), (rows * m,))
        placed = self.add("scatter_add", [xt, flat], (rows * m,), xd, axis=0, size=rows * m)
        outs.append(self.transpose(self.reshape(placed, ts), inv))
    return outs


@_prim("cumprod")
def _cumprod(self, args, p, shape, dtype):
    """``lax.cumprod``: :meth:`GraphBuilder.cumprod`."""
    return [self.cumprod(self.cast(args[0], dtype), int(p["axis"]), bool(p.get("reverse")))]
