"""Kernels priced on the roofline: memory-bound and vector kernels, and flash attention.

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
    """A flash-attention kernel (fusion kind ``attention``) as a roofline: its matrix FLOPs at
    the matrix peak of its dtype times ``coeffs.mma_efficiency``, against its bytes at HBM
    bandwidth, plus launch and fill latency (:func:`roofline_time_s`). Seconds."""
    dtype = mma_dtype(k.attention["dtype"])
    return roofline_time_s(k, target, target.hw.matrix_peak(dtype) * target.coeffs.mma_efficiency)
