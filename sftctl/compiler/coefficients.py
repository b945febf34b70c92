"""The cost model's efficiency coefficients: what the hardware achieves in practice, as a fraction
of its datasheet peak (:class:`Coefficients`). Plain numbers, per vendor and per accelerator;
``calibration.py`` fits them to measured kernels and :func:`sftctl.compiler.target.load_target`
overlays the fitted ones on :meth:`Coefficients.uncalibrated`. :mod:`sftctl.compiler.costmodel`
computes seconds from them (and re-exports the class)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from sftctl.compiler.hardware import Accelerator

__all__ = ["Coefficients"]


@dataclass(frozen=True)
class Coefficients:
    """Tunable efficiency coefficients of the model (all plain numbers: hashable, comparable).

    Defaults are NVIDIA datacenter-GPU values; :meth:`for_vendor` / :meth:`uncalibrated` give
    per-vendor / per-model sets. Change one with ``dataclasses.replace(c, hbm_efficiency=0.85)``.

    Attributes:
        mma_efficiency: achievable fraction of the dense matrix peak by a large, well-tiled GEMM
            (cuBLAS/CUTLASS reach ~0.8-0.9 on A100/H100 at large sizes; "Dissecting Hopper",
            Luo et al. 2024; NVIDIA guide figures). MI300X hipBLASLt reaches ~0.6.
        hbm_efficiency: achievable fraction of peak DRAM bandwidth (STREAM-like copy reaches
            ~0.9 on A100/H100, ~0.8 on MI300X).
        l2_bytes_per_clk_per_sm: achievable L2-to-SM bandwidth per SM per clock (A100: 5120
            B/clk peak over 108 SMs, ~5 TB/s measured, Jia et al. microbenchmarks -> ~33;
            H100 ~10 TB/s, Luo et al. 2024 -> ~41). Per SM and clock rather than a multiple of
            DRAM bandwidth, so GDDR parts (L4, A10G, T4) with big, fast L2s come out right.
        l2_usable_fraction: share of L2 that holds reusable GEMM panels (H100/A100 L2 is two
            partitions; streaming traffic evicts the rest).
        smem_bytes_per_clk: shared-memory (LDS) bandwidth per SM per clock (32 banks x 4 B).
        warp_tile_overhead_elems: per-warp MMA issue overhead, in output elements; a unit with
            a tile of t outputs runs at t / (t + this * unit_warps).
        mma_subpartitions: tensor-core sub-partitions per SM (4 on Volta..Hopper, 4 SIMDs/CU).
        mma_m, mma_n: smallest per-warp MMA tile (mma.sync m16n8; MFMA 16x16).
        warpgroup_mma: Hopper wgmma: 4-warp units with a 64-row tile, operands read from smem.
        async_copy: cp.async/TMA (no register staging of loads when num_stages >= 2).
        reg_base: registers per thread besides accumulators and fragments (addresses, masks).
        smem_reserved_per_block: bytes the runtime reserves per block (1 KiB on sm80/sm90).
        tile_overhead_cycles: fixed cycles per wave of programs (index math, prologue, epilogue).
        k_loop_overhead_cycles: cycles per K-loop iteration the tensor cores idle (wait for the
            stage's copy, barrier, address increments); makes tiny BLOCK_K slow.
        fill_latencies: memory latencies paid per wave outside the pipelined loop (first load,
            final store).
        latency_multiplier: scales ``hw.memory_latency_s`` (loaded vs idle latency).
        epilogue_flops_per_elem: vector FLOPs per output element of the plain epilogue
            (scale, convert, store address math).
        vector_efficiency: achievable fraction of the vector (CUDA core) peak.
        mn_major_efficiency_16bit: MMA throughput multiplier per MN-major 16-bit operand.
        mn_major_efficiency_other: the same for 8- and 32-bit operands (tf32/fp8 have no
            transposed MMA operand load).
        splitk_partial_bytes: bytes per partial-sum element of split-K (fp32).
        conv_efficiency: a convolution is priced as its implicit GEMM (``fusion``: M = output
            positions, N = output channels, K = input channels x taps) and the time divided by
            this: what implicit-GEMM convolution (cuDNN, CUTLASS) achieves relative to a plain
            GEMM of the same size (im2col address math, halo loads). 1.0 until calibrated
            against measured convolutions (none yet in ``calibrations/data/h200``).
        overlap_slack: share of the non-dominant roofline terms that is not hidden: the time is
            ``(1 - s) * max(T_sm, T_hbm, T_l2) + s * (T_sm + T_hbm + T_l2)`` (0 = perfect
            overlap, the pure roofline). Also makes a memory-bound kernel prefer the schedule
            that wastes least compute, instead of a tie.
        sm_load_bytes_per_clk: bytes per clock one SM's pipeline stages fill at from L2 (the
            SM's share of L2 bandwidth; ~41 on Hopper, Luo et al. 2024): a stage of
            ``(BLOCK_M + BLOCK_N) * BLOCK_K`` elements arrives ``latency + bytes / this`` after its
            request, ``num_stages - 1`` of them in flight.
        sm_overlap_slack: like ``overlap_slack``, inside an SM: the share of the non-dominant
            MMA / shared-memory / load-latency terms that is not hidden.
        spill_bytes_per_clk: local-memory bandwidth per SM per clock that register-spill traffic
            gets (spill stores and reloads go through L1/L2): a GEMM that spills ``s`` bytes per
            thread pays ``2 * s * threads`` bytes of that traffic per K iteration, serial with its
            MMAs. Spilling configs are slow (measured 5-15x on H200), not impossible.
        spill_estimate_factor: spilled bytes per thread per register over the limit, used when no
            compiled kernel's ptxas spill count is given (Triton 3.9 sm_90 GEMMs spill ~8x the
            4 bytes of the registers the model's estimate exceeds; our compile of the H200
            calibration configs, ``calibrations/data/h200/resources_sm90.json``).
        launch_multiplier: scales ``hw.launch_overhead_s`` (the fixed time of one kernel as
            back-to-back launches see it).
        block_launch_cycles: cycles an SM spends launching and retiring one block (CTA); caps
            the block rate of kernels made of many short programs (row and elementwise kernels).
        stream_latency_multiplier: scales ``hw.memory_latency_s`` for streaming (row and
            elementwise) kernels: the loaded DRAM latency a program waits per dependent load.
        row_reduce_cycles: cycles of one block-wide reduction step (shared memory + barrier);
            a row reduction over ``w`` warps takes ``1 + log2(w)`` of them.
        warp_ipc: instructions per cycle one warp issues on its own (dependent instruction
            latency); an SM issues ``min(4, resident_warps * warp_ipc)`` per cycle.
        stream_wave_tail: share of a streaming kernel's pipeline fill and drain left exposed
            (wave quantization of load/compute/store phases): the DRAM term becomes
            ``t_dram + stream_wave_tail * min(t_dram, t_issue) / rounds``.
        icache_fetch_bytes_per_clk: instruction bytes per clock an SM fetches past its nearest
            instruction cache (:data:`ICACHE`) when a streaming kernel's code outgrows it.
        stream_combine_p: exponent of the smooth maximum ``(sum t_i^p)^(1/p)`` that combines the
            DRAM, latency (Little's law), block-rate, issue and instruction-fetch limits of a streaming kernel.
    """

    mma_efficiency: float = 0.88
    hbm_efficiency: float = 0.90
    l2_bytes_per_clk_per_sm: float = 33.0
    l2_usable_fraction: float = 0.5
    smem_bytes_per_clk: float = 128.0
    warp_tile_overhead_elems: float = 256.0
    mma_subpartitions: int = 4
    mma_m: int = 16
    mma_n: int = 8
    warpgroup_mma: bool = False
    async_copy: bool = True
    reg_base: int = 32
    smem_reserved_per_block: int = 1024
    tile_overhead_cycles: float = 1000.0
    k_loop_overhead_cycles: float = 32.0
    fill_latencies: float = 2.0
    latency_multiplier: float = 1.0
    epilogue_flops_per_elem: float = 2.0
    vector_efficiency: float = 0.7
    mn_major_efficiency_16bit: float = 1.0
    mn_major_efficiency_other: float = 0.85
    splitk_partial_bytes: int = 4
    overlap_slack: float = 0.05
    conv_efficiency: float = 1.0
    spill_bytes_per_clk: float = 64.0
    sm_load_bytes_per_clk: float = 41.0
    sm_overlap_slack: float = 0.0
    spill_estimate_factor: float = 8.0
    launch_multiplier: float = 1.0
    block_launch_cycles: float = 150.0
    stream_latency_multiplier: float = 1.5
    row_reduce_cycles: float = 100.0
    warp_ipc: float = 0.5
    stream_combine_p: float = 4.0
    stream_wave_tail: float = 0.0
    icache_fetch_bytes_per_clk: float = 32.0

    #: Per-vendor overrides of the defaults (``for_vendor``).
    VENDOR: ClassVar[dict] = {
        "nvidia": {},
        "amd": dict(mma_efficiency=0.65, hbm_efficiency=0.80, l2_bytes_per_clk_per_sm=20.0,
                    mma_n=16, async_copy=False, smem_reserved_per_block=0,
                    mn_major_efficiency_16bit=0.9),
        "cpu": dict(mma_efficiency=0.5, hbm_efficiency=0.6),
    }
    #: Per-accelerator-name overrides, applied after the vendor's (calibration goes here).
    ACCELERATOR: ClassVar[dict] = {}

    @classmethod
    def for_vendor(cls, vendor: str) -> "Coefficients":
        return cls(**cls.VENDOR.get(vendor, {}))

    @classmethod
    def uncalibrated(cls, hw: Accelerator) -> "Coefficients":
        """Vendor defaults, Hopper wgmma where it applies, then ``ACCELERATOR[hw.name]``: the
        coefficients before any calibration (:func:`sftctl.compiler.target.load_target` overlays
        the shipped fit; the calibration tool fits from these)."""
        c = cls.for_vendor(hw.vendor)
        if hw.vendor == "nvidia" and isinstance(hw.triton_arch, int) and hw.triton_arch >= 90:
            # Hopper: wgmma (warpgroup MMA, operands from smem) and a faster L2 (~10 TB/s on
            # H100; Luo et al. 2024).
            c = dataclasses.replace(c, warpgroup_mma=True, l2_bytes_per_clk_per_sm=41.0)
        return dataclasses.replace(c, **cls.ACCELERATOR.get(hw.name, {}))

    def mn_major_efficiency(self, nbytes: int) -> float:
        return self.mn_major_efficiency_16bit if nbytes == 2 else self.mn_major_efficiency_other
