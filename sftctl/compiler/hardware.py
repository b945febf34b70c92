"""Accelerator hardware facts used by the cost model.

Every number carries its source in ``Accelerator.sources`` (datasheet, whitepaper, or our own
measurement file). Peak FLOP/s are *dense* (no 2:4 sparsity).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator model.

    Attributes:
        name: catalog name, e.g. ``H100``, ``A100-80GB``, ``MI300X``, ``cpu``.
        vendor: ``nvidia``, ``amd`` or ``cpu``.
        sm_count: streaming multiprocessors (NVIDIA) or compute units (AMD); cores for ``cpu``.
        clock_hz: boost clock the peak figures assume, Hz.
        matrix_flops_per_s: dense peak FLOP/s of the matrix units per input dtype
            (keys ``float32`` (TF32 where the hardware has no FP32 matrix path), ``bfloat16``,
            ``float16``; ``float8`` where supported).
        vector_flops_per_s: peak FLOP/s of the non-matrix (CUDA core / SIMD) units per dtype
            (keys ``float32``, ``bfloat16``/``float16`` where different).
        hbm_bytes_per_s: peak DRAM bandwidth, bytes/s.
        l2_bytes: last-level on-chip cache, bytes.
        smem_bytes_per_sm: shared memory (LDS) per SM/CU usable by resident blocks, bytes.
        smem_bytes_per_block: most shared memory one block may allocate, bytes.
        regs_per_sm: 32-bit registers per SM/CU.
        regs_per_thread_max: most registers one thread may use.
        max_warps_per_sm: most resident warps (wavefronts) per SM/CU.
        max_blocks_per_sm: most resident blocks per SM/CU.
        warp_size: threads per warp (32) or wavefront (64 on CDNA).
        memory_bytes: device memory capacity, bytes.
        memory_latency_s: DRAM load latency, seconds (for pipeline-depth modelling).
        launch_overhead_s: host-side cost of one kernel launch, seconds.
        triton_backend: ``cuda`` or ``hip`` (None for ``cpu``).
        triton_arch: compute capability as int (90) or gfx name (``gfx942``); None for ``cpu``.
        sources: field name -> where the number comes from.
    """

    name: str
    vendor: str
    sm_count: int
    clock_hz: float
    matrix_flops_per_s: dict[str, float]
    vector_flops_per_s: dict[str, float]
    hbm_bytes_per_s: float
    l2_bytes: int
    smem_bytes_per_sm: int
    smem_bytes_per_block: int
    regs_per_sm: int
    regs_per_thread_max: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    warp_size: int
    memory_bytes: int
    memory_latency_s: float
    launch_overhead_s: float
    triton_backend: str | None
    triton_arch: int | str | None
    sources: dict[str, str] = dataclasses.field(default_factory=dict, hash=False, compare=False)

    def matrix_peak(self, dtype: str) -> float:
        """Dense matrix-unit FLOP/s for ``dtype`` (float16 falls back to bfloat16 and back)."""
        table = self.matrix_flops_per_s
        for key in (dtype, {"float16": "bfloat16", "bfloat16": "float16"}.get(dtype, dtype), "float32"):
            if key in table:
                return table[key]
        raise KeyError(f"{self.name}: no matrix peak for {dtype}")

    def vector_peak(self, dtype: str) -> float:
        """Non-matrix FLOP/s for ``dtype`` (falls back to float32)."""
        return self.vector_flops_per_s.get(dtype, self.vector_flops_per_s["float32"])
