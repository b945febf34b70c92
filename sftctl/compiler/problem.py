"""The GEMM problem: what fusion finds, the cost model prices, the search schedules and codegen launches.

A pure-Python module (no numpy): ``fusion.py`` builds one per GEMM kernel
(:attr:`~sftctl.compiler.fusion.Kernel.gemm`), ``step.py`` prices it (after mapping the traced
dtype to the matrix units' dtype), ``search/gemm.py`` memoizes schedules by it, ``backend.py``
builds one per rewritten FX site and ``codegen/gemm.py`` launches from it.
:mod:`sftctl.compiler.costmodel` re-exports :class:`GemmProblem` and :func:`dtype_bytes`.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

__all__ = ["DTYPE_BYTES", "GemmProblem", "dtype_bytes"]

#: Bytes per element of every dtype a GEMM may be traced in or priced as: the matrix units'
#: dtypes (``tf32`` and the ``float8`` variants included) and the IR's integer and bool dtypes
#: (``sftctl.compiler.ir.DTYPE_BYTES``). An integer contraction is priced at the float32
#: matrix peak (``Accelerator.matrix_peak`` falls back to it): no integer MMA path is modelled.
DTYPE_BYTES = {"float64": 8, "float32": 4, "tf32": 4, "bfloat16": 2, "float16": 2,
               "float8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
               "int64": 8, "int32": 4, "int16": 2, "uint8": 1, "uint32": 4, "bool": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype``. Raises ValueError for a dtype not in :data:`DTYPE_BYTES`."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class GemmProblem:
    """One GEMM class ``C[b] = A[b] @ B[b]``: A is ``m x k``, B is ``k x n``, ``batch`` entries.

    Frozen and hashable: equal problems are one class (the search memoizes by it; ``step.py``
    searches each class once). Positional order is the field order below.

    Attributes:
        batch: independent GEMMs of the same shape (a ``bmm``'s batch; 1 for ``mm``), >= 1.
        m, n, k: rows of A and C, columns of B and C, the contracted dimension; elements, >= 1.
            For a convolution, its implicit GEMM (``ir.conv_gemm_dims``: M = output positions,
            N = output channels, K = input channels x taps, per group).
        dtype: operand dtype (a :data:`DTYPE_BYTES` name): as traced on a ``fusion.Kernel``;
            the matrix units' input dtype when priced (``bfloat16``, ``float16``, ``float32``
            = tf32 MMA, ``float8*``; ``step.py`` maps float64 to float32).
        out_dtype: dtype of the output C the kernel stores (its epilogue's result), ``"same"``
            for ``dtype``.
        a_transposed: A is stored as a row-major ``k x m`` tensor (M-contiguous, "MN-major").
        b_transposed: B is stored as a row-major ``n x k`` tensor (K-contiguous, the
            ``x @ W.T`` of ``nn.Linear``); False means row-major ``k x n`` (N-contiguous).
        epilogue_bytes_per_elem: bytes per output element the kernel moves besides its operands
            and its main output: a fused epilogue's extra operands (bias, residual) and extra
            outputs (a saved pre-activation, an fp32 copy), >= 0.
        epilogue_flops_per_elem: vector FLOPs per output element of the fused epilogue
            (activation, bias add ...), >= 0.
        prologue_flops_per_elem: vector FLOPs per A element as it is loaded into a tile (a fused
            elementwise op on A, e.g. dequantization or an activation's backward), >= 0.

    Raises:
        ValueError: a size that is not a positive int, an unknown dtype, a negative per-element
            figure.
    """

    batch: int
    m: int
    n: int
    k: int
    dtype: str = "bfloat16"
    out_dtype: str = "same"
    a_transposed: bool = False
    b_transposed: bool = False
    epilogue_bytes_per_elem: float = 0.0
    epilogue_flops_per_elem: float = 0.0
    prologue_flops_per_elem: float = 0.0

    def __post_init__(self) -> None:
        for name in ("batch", "m", "n", "k"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GemmProblem.{name} must be a positive int, got {v!r}")
        dtype_bytes(self.dtype)
        if self.out_dtype != "same":
            dtype_bytes(self.out_dtype)
        for name in ("epilogue_bytes_per_elem", "epilogue_flops_per_elem", "prologue_flops_per_elem"):
            if getattr(self, name) < 0:
                raise ValueError(f"GemmProblem.{name} must be >= 0")

    @property
    def in_bytes(self) -> int:
        """Bytes per operand element."""
        return dtype_bytes(self.dtype)

    @property
    def out_bytes(self) -> int:
        """Bytes per output element."""
        return dtype_bytes(self.dtype if self.out_dtype == "same" else self.out_dtype)

    @property
    def flops(self) -> int:
        """Matrix FLOPs: ``2 * batch * m * n * k``."""
        return 2 * self.batch * self.m * self.n * self.k

    @property
    def outputs(self) -> int:
        """Output elements: ``batch * m * n``."""
        return self.batch * self.m * self.n

    def signature(self) -> tuple:
        return dataclasses.astuple(self)
