"""The torch frontend's ATen lowerings, by kind; importing this package registers them all in
:data:`sftctl.compiler.frontends.torch.lowering.OPS`."""

from sftctl.compiler.frontends.torch.lowerings import (  # noqa: F401
    elementwise,
    sources,
    reductions,
    linalg,
    pooling,
    layout,
    select,
    moe,
    indexing,
    random,
    attention,
    ctc,
    complex,
)
