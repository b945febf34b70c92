"""The search compiler: a traced training step in, a plan (kernels, schedules, times) out.

Knows nothing of clouds, state or the CLI. Import is light; torch, jax and numpy are imported by
the modules that use them.

The ``sftensor`` torch.compile backend (:mod:`sftctl.compiler.backend`) is registered with Dynamo
through the ``torch_dynamo_backends`` entry point, and here too when torch is already imported
(so ``torch.compile(model, backend="sftensor")`` works from a checkout that is not installed).
"""

import sys as _sys


def _register_torch_backend() -> None:
    if "torch" not in _sys.modules:  # never import torch from here
        return
    try:
        from sftctl.compiler.backend import register

        register()
    except Exception:  # noqa: BLE001 - a registry change in torch must not break this import
        pass


_register_torch_backend()
