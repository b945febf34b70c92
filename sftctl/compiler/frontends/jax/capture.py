"""The JAX frontend's capture: the whole training step (``value_and_grad`` + AdamW, a flax.nnx
module split into parameters and buffers, mixed precision) taken with ``jax.make_jaxpr`` on
abstract values and handed to the lowering (:mod:`.lowering`); see the package's docstring."""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Any, Callable

import numpy as np

from sftctl.compiler.frontends.jax.attention import _attention_patch
from sftctl.compiler.frontends.jax.lowering import _Lowering
from sftctl.compiler.frontends import user_prints_to_stderr
from sftctl.compiler.ir import Graph
from sftctl.errors import SftctlWarning


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


@user_prints_to_stderr
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
