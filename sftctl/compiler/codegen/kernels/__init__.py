"""Triton kernel sources of the codegen package.

Do not import these modules directly: :func:`sftctl.compiler.codegen._runtime.builtin_kernels`
loads each file once per execution mode (compiled or CPU interpreter), because ``@triton.jit``
fixes the mode when it decorates. They are a package only so that packaging ships them.
"""
