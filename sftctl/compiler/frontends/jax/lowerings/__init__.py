"""The JAX frontend's primitive lowerings, by kind; importing this package registers them all in
:data:`sftctl.compiler.frontends.jax.lowering._PRIMS` (``@_prim``)."""

from sftctl.compiler.frontends.jax.lowerings import (  # noqa: F401
    elementwise,
    reductions,
    layout,
    linalg,
    pooling,
    indexing,
    control_flow,
    random,
)
