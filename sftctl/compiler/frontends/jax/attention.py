"""``jax.nn.dot_product_attention(..., implementation="cudnn")`` while tracing: routed to this
frontend's ``sftctl_attention`` / ``sftctl_attention_bwd`` primitives (see the package's
docstring), which :meth:`~sftctl.compiler.frontends.jax.lowering._Lowering.lower_eqn` lowers to
the IR's ``attention`` ops."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from sftctl.compiler.frontends.jax.lowering import _jcore


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
