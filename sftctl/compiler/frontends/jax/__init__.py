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

The package: :mod:`.capture` (``make_jaxpr`` over the step: :func:`trace_step`,
:func:`trace_entrypoint`, :func:`make_step`), :mod:`.lowering` (the driver: :class:`_Lowering`,
the primitive table ``_PRIMS`` and ``@_prim``), :mod:`.attention` (the cuDNN attention route) and
:mod:`.lowerings` (the rules by kind, one module each).

jax is imported lazily, inside the functions of these modules.
"""

from sftctl.compiler.frontends.jax import lowerings  # noqa: F401  (registers every rule in _PRIMS)
from sftctl.compiler.frontends.jax.attention import _attention_patch, _attention_prims  # noqa: F401
from sftctl.compiler.frontends.jax.capture import (  # noqa: F401
    _leaf_names,
    _linen_mutable_watch,
    _make_step_with_buffers,
    _nnx_split,
    _with_compute_dtype,
    adamw_update,
    make_step,
    trace_entrypoint,
    trace_step,
)
from sftctl.compiler.frontends.jax.lowering import (  # noqa: F401
    _CALLS,
    _DTYPES,
    _KEY_OPS,
    _PRIMS,
    _PRNG_REFUSAL,
    _Lowering,
    _jcore,
    _prim,
    _user_line,
    ir_dtype,
)
