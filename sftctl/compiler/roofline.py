"""Kernels priced on the roofline: memory-bound and vector kernels, and flash attention (at the
published tables' efficiency, :mod:`sftctl.compiler.attention`).

Shared by the compiler's own costing (:func:`sftctl.compiler.step.cost_kernels`) and the
execution modes (:mod:`sftctl.compiler.modes`), so both price these kernels alike. Seconds, from
the kernel's FLOPs and bytes (:class:`sftctl.compiler.fusion.Kernel`) and the target's
accelerator facts and coefficients (:func:`sftctl.compiler.costmodel.memory_bound_time_s`:
launch + fill latency + bytes at ``hbm_efficiency`` of the HBM peak).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sftctl.compiler.costmodel import memory_bound_time_s

if TYPE_CHECKING:
    from sftctl.compiler.fusion import Kernel
    from sftctl.compiler.target import Target


def mma_dtype(dtype: str) -> str:
    """The matrix-unit input dtype of a contraction traced in ``dtype`` (float64 runs as fp32)."""
    return "float32" if dtype == "float64" else dtype


def roofline_time_s(k: Kernel, target: Target, flops_per_s: float) -> float:
    """Memory-bound and vector kernels: launch + fill latency + max(bytes / BW, FLOPs / rate)."""
    hw, coeffs = target.hw, target.coeffs
    mem = float(memory_bound_time_s(k.bytes_read + k.bytes_written, hw, coeffs))
    fixed = float(memory_bound_time_s(0, hw, coeffs))
    return max(mem, fixed + k.flops / flops_per_s)


def attention_time_s(k: Kernel, target: Target) -> float:
    """A flash-attention kernel (fusion kind ``attention``): its matrix FLOPs at the fraction of
    the matrix peak that the SDPA backend reaches on this accelerator, for its direction, causal
    mask, head dim and length, from published benchmark tables
    (:func:`sftctl.compiler.attention.attention_time_s`), never faster than its bytes at HBM
    bandwidth (:func:`roofline_time_s` with no FLOPs). Seconds."""
    from sftctl.compiler.attention import attention_time_s as table_time_s

    hw, coeffs = target.hw, target.coeffs
    mem = float(memory_bound_time_s(k.bytes_read + k.bytes_written, hw, coeffs))
    return max(mem, table_time_s(k.attention, target))
