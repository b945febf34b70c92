"""Analytical cost model: predicted seconds of GEMMs, memory-bound kernels, reductions.

Everything here is arithmetic on numbers from :class:`~sftctl.compiler.hardware.Accelerator` and a
small set of efficiency :class:`Coefficients` (what the hardware achieves in practice, as a
fraction of its datasheet peak). No measurement happens here; the coefficients are the knobs
``calibration.py`` fits to measured kernels (``calibrations/<accelerator>.json``, overlaid on
:meth:`Coefficients.uncalibrated` by :func:`sftctl.compiler.target.load_target`). Every function
takes its ``coeffs``: none derives them (this module imports nothing of the calibration).

GEMM model (:func:`gemm_time_s`)
--------------------------------
A candidate schedule is a Triton-style tiled GEMM: a grid of ``ceil(M/BLOCK_M) * ceil(N/BLOCK_N)``
output tiles per batch entry, times ``split_k`` slices of the K loop; each program (CUDA block)
streams ``BLOCK_M x BLOCK_K`` tiles of A and ``BLOCK_K x BLOCK_N`` tiles of B through a
``num_stages``-deep shared-memory ring into ``num_warps`` warps of tensor-core MMAs; programs are
issued in ``GROUP_M``-grouped order (Triton tutorial 03, "L2 cache optimizations"). The predicted
time is::

    launch + copies + split-K reduce + roofline(T_sm, T_hbm, T_l2)
    roofline = (1 - s) * max(T_sm, T_hbm, T_l2) + s * (T_sm + T_hbm + T_l2)   (s = overlap_slack)
    T_sm  = waves * t_fix + max(wa * t_mma, wa * t_smem, waves * t_latency) + wa * t_epilogue

with ``waves = ceil(programs / (SMs * blocks_per_SM))`` and ``wa = waves * a`` where ``a`` is the
number of programs co-resident on the busiest SM in a wave. Each term and its source:

* **Tile quantization** (NVIDIA "Matrix Multiplication Background User's Guide", section "Tile
  quantization"): the MMA work of a program is ``2 * BLOCK_M * BLOCK_N * K_s`` with ``K_s`` the
  split's K rounded up to BLOCK_K; programs on the ragged edge of M/N do the full tile.
* **Wave quantization** (same guide, "Wave quantization"): programs run in waves of
  ``SMs * blocks_per_SM``; a partial last wave costs a full one.
* **Occupancy** (CUDA C++ Programming Guide, "Occupancy calculator"; CUTLASS "Efficient GEMM in
  CUDA"): ``blocks_per_SM = min(max_blocks_per_sm, max_warps_per_sm // num_warps,
  regs_per_sm // (regs_per_thread * threads), smem_bytes_per_sm // smem_per_block)``; registers are
  allocated in units of 8 per thread (256 per warp). Registers per thread are estimated as fp32
  accumulators ``BLOCK_M * BLOCK_N / threads`` + double-buffered MMA operand fragments + (without
  asynchronous copies) one register-staged K tile + a fixed ``reg_base``. Shared memory is
  ``num_stages * (BLOCK_M + BLOCK_N) * BLOCK_K * bytes`` (Triton's pipeliner allocates one buffer
  per stage; Inductor's ``get_shared_memory_estimation`` uses the same product) plus the block's
  reserved 1 KiB (CUDA Programming Guide, "Shared memory", compute capability 8.x/9.x).
  A candidate that needs more shared memory per block or more threads per block than the
  hardware allows, or fits zero blocks per SM, is **infeasible** (``inf``). One that needs more
  registers than a thread may have **spills**: it runs, slowly (H200 measurements: 5-15x slower
  than the best config, ``calibrations/data/h200``).
* **Register spills** (ptxas ``bytes spill stores``, from ``codegen/targets.py`` where the
  kernel was compiled; else ``spill_estimate_factor`` bytes per register over the limit): each K
  iteration a thread stores and reloads its spilled bytes through local memory (L1/L2) at
  ``spill_bytes_per_clk`` per SM, serial with its MMAs.
* **MMA issue efficiency** (CUTLASS docs "Efficient GEMM in CUDA", warp-level tiling; "Dissecting
  the NVIDIA Hopper architecture through microbenchmarking", Luo et al. 2024, for wgmma): the work
  is split over MMA units (a warp for ``mma.sync``; a 4-warp warpgroup for Hopper ``wgmma`` when
  ``num_warps % 4 == 0`` and BLOCK_M >= 64). A unit's tile of ``t`` outputs runs at
  ``t / (t + warp_tile_overhead_elems * unit_warps)`` of the unit's peak (per-instruction
  address/fragment overhead dominates tiny tiles). Warps beyond what the tile can feed
  (``(BLOCK_M/mma_m) * (BLOCK_N/mma_n)`` units) replicate work, as Triton's layouts wrap
  (``replication = units / useful_units`` multiplies MMA and shared-memory work). A program with
  fewer than ``mma_subpartitions`` (4) warps resident per SM leaves tensor cores idle:
  throughput ``* min(1, a * num_warps / 4)``.
* **Shared-memory bandwidth** (CUTLASS "Efficient GEMM", 32 banks x 4 B/clk): each K step a unit
  reads its A rows and B columns from shared memory and the stage fill writes the tile once:
  ``t_smem = K_s * (rep * (wn*BLOCK_M + wm*BLOCK_N) + BLOCK_M + BLOCK_N) * bytes / smem_bw`` with
  the units arranged ``wm x wn`` (the arrangement that minimises the traffic).
* **Pipeline depth vs latency** (Little 1961; NVIDIA "CUDA C++ Best Practices", memory-latency
  hiding; Triton docs ``num_stages``): ``num_stages`` buffers form a ring; a stage's load can be
  issued only when the MMA that read its buffer ``num_stages`` iterations earlier is done, and
  arrives ``L = latency + stage bytes / sm_load_bytes_per_clk`` later, so a K iteration takes at
  least ``(t_mma + L) / num_stages`` (``num_stages == 1``: load, then compute). H200 measured:
  2 stages 1.84-1.94x, 3 stages 1.15x, 4 stages 1.0x of the best 4096^3 tile.
  Each wave also pays the fill (first load) and the final store latency and
  ``tile_overhead_cycles`` (index math, prologue, epilogue, barriers).
* **HBM roofline with tile reuse and L2** (NVIDIA guide, "Math and memory bounds"; Triton tutorial
  03 on grouped ordering): A is read ``f_A`` times and B ``f_B`` times from DRAM. Under grouped
  order, the ``min(GROUP_M, tiles_m)`` A row-panels of a group are reused by every column of the
  group if they fit in the usable L2 (``f_A = 1``), otherwise only by the columns that run
  concurrently (``f_A = ceil(tiles_n / cols_in_flight)``); a B column-panel is read once per group
  of rows (or once if all of B plus the group's A panels fit in L2). Output written once in the
  output dtype plus the fused epilogue's extra bytes per element.
* **L2 bandwidth** (Jia et al., "Dissecting the NVIDIA Volta/Ampere GPU architecture via
  microbenchmarking"; Luo et al. 2024 for Hopper): every program reads its panels through L2;
  L2 bandwidth is ``l2_bytes_per_clk_per_sm * sm_count * clock_hz``.
* **Split-K** (CUTLASS "split-K" GEMM; NVIDIA guide, "Dimension quantization effects"): split_k
  slices multiply the programs (parallelism for small M*N), each writes an fp32 partial tile;
  a second, memory-bound kernel reads ``split_k`` fp32 partials and writes the output.
* **Operand layout**: an MN-major operand (A stored M-contiguous, or B stored N-contiguous, the
  usual ``x @ W`` with W row-major) costs ``mn_major_efficiency_*`` of MMA throughput (16-bit has
  ``ldmatrix.trans`` / wgmma transpose support: 1.0 on NVIDIA; tf32 and fp8 need a register
  shuffle). The schedule may instead transpose-copy the operand first (a memory-bound kernel that
  reads and writes it once).
* **K-loop overhead**: ``k_loop_overhead_cycles`` per iteration (wait, barrier, address
  increments; CUTLASS "Efficient GEMM", software pipelining) is added to the MMA time, so
  BLOCK_K = 16 loops pay for their many iterations.
* **Launch overhead**: ``hw.launch_overhead_s`` per kernel (GEMM, copies, reduce).

* **Imperfect overlap** (``overlap_slack``, our assumption, to be calibrated): a pure roofline
  max assumes compute, DRAM and L2 traffic overlap perfectly; ``s`` of the non-dominant terms
  stays exposed.

Every per-candidate time is non-decreasing in M, N, K and batch (mathematically; in floating
point up to ~1e-15 relative, where co-residency terms equal in exact arithmetic round
differently), and non-increasing in HBM bandwidth, matrix FLOP/s and L2 size (exactly);
tests/test_costmodel.py checks both elementwise over the whole space. The search
(``search/gemm.py``) relies on :func:`gemm_group_bound`, a lower bound computed through the same
expression tree with best-case leaves, so it is <= every member's time in floating point too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sftctl.compiler.coefficients import Coefficients  # re-exported (__all__)
from sftctl.compiler.hardware import Accelerator
from sftctl.compiler.problem import GemmProblem, dtype_bytes  # re-exported (__all__)

__all__ = [
    "Coefficients", "GemmProblem", "LAYOUTS", "dtype_bytes", "gemm_time_s", "gemm_breakdown",
    "gemm_group_bound", "memory_bound_time_s", "reduction_time_s",
    "row_kernel_time_s", "elementwise_time_s", "STREAM_KERNELS",
]

#: Operand layout choices of a GEMM schedule (the ``layout`` candidate key, an index here).
LAYOUTS = ("as_is", "copy_a", "copy_b", "copy_ab")

MAX_THREADS_PER_BLOCK = 1024  # CUDA and HIP alike


def _peak_key(dtype: str) -> str:
    return "float8" if dtype.startswith("float8") else ("float32" if dtype == "tf32" else dtype)


# --------------------------------------------------------------------------------------------
# Generic kernels


def memory_bound_time_s(bytes_moved, hw: Accelerator, coeffs: Coefficients,
                        n_kernels=1):
    """Seconds for ``n_kernels`` memory-bound kernels moving ``bytes_moved`` bytes in all.

    ``n_kernels * (launch + fill_latencies * latency) + bytes / (hbm_efficiency * peak BW)``.
    Works elementwise on numpy arrays.
    """
    c = coeffs
    lat = hw.memory_latency_s * c.latency_multiplier
    per_kernel = hw.launch_overhead_s * c.launch_multiplier + c.fill_latencies * lat
    return n_kernels * per_kernel + bytes_moved / (hw.hbm_bytes_per_s * c.hbm_efficiency)


def reduction_time_s(rows, cols, dtype: str, hw: Accelerator, coeffs: Coefficients,
                     out_dtype: str | None = None, flops_per_elem: float = 1.0, n_kernels: int = 1):
    """Seconds for a row reduction of a ``rows x cols`` tensor (sum, max, softmax statistics ...).

    Roofline of reading the input once and writing one value per row, against
    ``flops_per_elem`` vector FLOPs per input element. Assumes Inductor-style split reductions
    keep every SM busy when rows are few, so no wave term. Elementwise on arrays.
    """
    c = coeffs
    in_b = dtype_bytes(dtype)
    out_b = dtype_bytes(out_dtype) if out_dtype else in_b
    bytes_moved = rows * cols * in_b + rows * out_b
    mem = memory_bound_time_s(bytes_moved, hw, c, n_kernels)
    compute = rows * cols * flops_per_elem / (hw.vector_peak("float32") * c.vector_efficiency)
    lat = hw.memory_latency_s * c.latency_multiplier
    fixed = n_kernels * (hw.launch_overhead_s * c.launch_multiplier + c.fill_latencies * lat)
    return np.maximum(mem, fixed + compute)


#: Per-element work of the streaming kernels :func:`row_kernel_time_s` and
#: :func:`elementwise_time_s` model, counted from their Triton source (``calibrations/data/h200/
#: kernels.py``; SASS instructions per element, approximate): ``instr`` per element per thread,
#: ``thread_instr`` per thread and step whatever its element count (index, mask and address
#: arithmetic; 0 where not counted), ``reductions`` block-wide reductions per row,
#: ``regs_per_elem`` fp32 registers each element a thread holds needs (from ptxas register counts
#: of those kernels on sm_90), ``params`` per-column parameter vectors read per program (weight,
#: bias: from L2). ``bias_gelu``'s two counts are its compiled SASS (Triton 3.9, sm_90, nvdisasm):
#: 215, 400, 772 and 3077 instructions per thread at 8, 16, 32 and 128 elements per thread, a
#: least-squares line of 24 per element + 24 (``tests/test_costmodel_stream.py`` recounts them).
STREAM_KERNELS = {
    "layernorm": dict(instr=14.0, reductions=2.0, regs_per_elem=3.3, params=2.0),
    "softmax": dict(instr=10.0, reductions=2.0, regs_per_elem=1.5, params=0.0),
    "rmsnorm": dict(instr=10.0, reductions=1.0, regs_per_elem=2.5, params=1.0),
    "bias_gelu": dict(instr=24.0, reductions=0.0, regs_per_elem=1.3, params=1.0, thread_instr=24.0),
    "elementwise": dict(instr=8.0, reductions=0.0, regs_per_elem=1.0, params=0.0),
}

_STREAM_REG_BASE = 16.0

#: Per vendor: (bytes of the instruction cache nearest the scheduler, bytes per instruction).
#: NVIDIA: the L0 instruction cache of one SM sub-partition, 12 KiB on Volta (Jia et al.,
#: "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", arXiv:1804.06826, 2018);
#: NVIDIA publishes no size for Ampere or Hopper, so Volta's is carried over; instructions are
#: 128-bit since Volta (same paper). AMD CDNA3: 64 KB instruction cache per two CUs, 32 KiB each (AMD
#: CDNA 3 architecture white paper), instructions 4 or 8 bytes (8 taken). On the H200 records
#: the held-out fit passes at 8 and 12 KiB and not at 16 (bias_gelu 8192x768 Spearman 0.77).
ICACHE = {"nvidia": (12 * 1024, 16.0), "amd": (32 * 1024, 8.0)}


def _stream_time(kind, programs, work_per_program, rows_per_program, elems_per_thread, warps,
                 bytes_moved, hw: Accelerator, c: Coefficients, registers=None, spill_bytes=None,
                 terms: bool = False, instr: float | None = None):
    """The streaming-kernel model shared by row and elementwise kernels (numpy, elementwise).

    A program (block of ``warps`` warps) handles ``rows_per_program`` dependent steps, each a
    load of its data, ``elems_per_thread`` elements of work per thread and (rows) block-wide
    reductions, then a store. Limits, combined by a smooth maximum ``(sum t^p)^(1/p)``:

    * DRAM: ``bytes / (hbm_efficiency * peak)`` (HBM roofline), plus the wave tail
      ``stream_wave_tail * min(DRAM, issue) / rounds`` (two-stage pipeline fill and drain);
    * latency, Little's law: each resident program has one step's loads in flight, so an SM with
      ``a`` resident programs finishes ``a`` steps per step latency; programs run in
      ``ceil(per_sm / a)`` rounds (wave quantization over the busiest SM);
    * block rate: an SM launches one block per ``block_launch_cycles``;
    * issue: ``instr`` per element (+ ``thread_instr / elems_per_thread``) over the SM's issue
      rate ``min(4, a*warps*warp_ipc)``/clock (4 schedulers; CUDA C++ Programming Guide,
      "Hardware Multithreading");
    * instruction fetch: code past the instruction cache (:data:`ICACHE`) fetched at
      ``icache_fetch_bytes_per_clk``.
    Occupancy (blocks per SM) from warps, blocks and registers per SM as the CUDA Occupancy
    Calculator computes it; registers from ptxas when given, else estimated.
    """
    k = dict(STREAM_KERNELS[kind])
    if instr is not None:
        k["instr"] = float(instr)
    clock = hw.clock_hz
    W = _f(warps)
    threads = W * hw.warp_size
    e = _f(elems_per_thread)
    regs_est = _STREAM_REG_BASE + k["regs_per_elem"] * e
    regs = regs_est if registers is None else np.where(np.isnan(_f(registers)), regs_est, _f(registers))
    spill = np.maximum(regs - hw.regs_per_thread_max, 0.0) * c.spill_estimate_factor
    if spill_bytes is not None:
        spill = np.where(np.isnan(_f(spill_bytes)), spill, _f(spill_bytes))
    regs = _round_regs(np.minimum(regs, hw.regs_per_thread_max))
    occ = np.minimum(np.minimum(float(hw.max_blocks_per_sm), np.floor(hw.max_warps_per_sm / W)),
                     np.floor(hw.regs_per_sm / (regs * threads)))
    feasible = (threads <= MAX_THREADS_PER_BLOCK) & (occ >= 1.0)
    occ = np.maximum(occ, 1.0)
    P = _f(programs)
    per_sm = np.ceil(P / hw.sm_count)
    a = np.minimum(occ, per_sm)
    rounds = np.ceil(per_sm / a)
    lat = hw.memory_latency_s * c.stream_latency_multiplier
    issue = np.minimum(float(c.mma_subpartitions), a * W * c.warp_ipc)
    red = k["reductions"] * c.row_reduce_cycles * (1.0 + np.log2(W)) / clock
    spill_t = 2.0 * spill * threads / (c.spill_bytes_per_clk * clock)  # store + reload per step
    # a thread's elements are independent (instruction-level parallelism): one element's
    # dependent chain costs ``instr / warp_ipc`` cycles, each further element's instructions
    # issue behind it at up to one per cycle (one warp, one scheduler)
    ti = k.get("thread_instr", 0.0)
    step = lat + red + ((k["instr"] + ti) / c.warp_ipc + (e - 1.0) * k["instr"]) / clock + spill_t
    t_lat = rounds * _f(rows_per_program) * step
    t_dram = _f(bytes_moved) / (hw.hbm_bytes_per_s * c.hbm_efficiency)
    t_blk = per_sm * c.block_launch_cycles / clock
    t_iss = per_sm * _f(work_per_program) * (k["instr"] + ti / e) / (hw.warp_size * issue * clock)
    # Wave tail (pipeline fill and drain): programs of one round load, compute and store in
    # step, so a round's memory phase (DRAM) and compute phase (issue) overlap only with other
    # rounds'. ``rounds`` rounds through that two-stage pipeline take ``max + min / rounds`` of the
    # two stages' times: the shorter stage stays exposed once per round's share
    # (one round: load everything, compute everything, store everything). ``stream_wave_tail``
    # is the share of that ideal lockstep exposure left after programs drift out of step.
    t_hbm = t_dram + c.stream_wave_tail * np.minimum(t_dram, t_iss) / rounds
    # Instruction fetch: a thread's step is straight-line code (the elements unrolled); once it
    # outgrows the instruction cache nearest the scheduler, the share ``1 - cache / code`` of
    # every warp's fetches comes from the next level at ``icache_fetch_bytes_per_clk`` per SM
    # (the slowdown of 64 to 256 elements per thread on H200: 1.2-1.6x at 65536x1024)
    cache_bytes, instr_bytes = ICACHE.get(hw.vendor, (math.inf, 0.0))
    code = (k["instr"] * e + ti) * instr_bytes
    miss = np.maximum(0.0, 1.0 - cache_bytes / np.maximum(code, 1.0))
    warp_steps = per_sm * _f(work_per_program) / (e * hw.warp_size)
    t_fetch = warp_steps * code * miss / (c.icache_fetch_bytes_per_clk * clock)
    p = c.stream_combine_p
    body = (t_hbm ** p + t_lat ** p + t_blk ** p + t_iss ** p + t_fetch ** p) ** (1.0 / p)
    fixed = hw.launch_overhead_s * c.launch_multiplier
    total = np.where(feasible, fixed + body, np.inf)
    if not terms:
        return total
    return dict(total=total, fixed=np.broadcast_to(fixed, np.shape(total)), t_hbm=t_hbm, t_dram=t_dram, t_latency=t_lat,
                t_blocks=t_blk, t_issue=t_iss, t_fetch=t_fetch, occupancy=occ, registers=regs,
                spill_bytes=spill, feasible=feasible)


def row_kernel_time_s(kind: str, rows, cols, config: dict, hw: Accelerator,
                      coeffs: Coefficients, dtype: str = "bfloat16",
                      registers=None, spill_bytes=None, terms: bool = False):
    """Predicted seconds of a row kernel over a ``rows x cols`` tensor (``kind``: ``layernorm``,
    ``softmax``, ``rmsnorm``), each program normalizing ``ROWS`` consecutive rows one after the
    other with a ``BLOCK_N``-wide block of ``num_warps`` warps (``config``; a row longer than
    BLOCK_N is walked in ``ceil(cols / BLOCK_N)`` dependent chunks, as the codegen kernels do), as ``layernorm_fwd`` / ``softmax_fwd`` in
    ``calibrations/data/h200/kernels.py``: grid ``ceil(rows / ROWS)``; reads ``x`` and writes
    ``y`` (``dtype``) once, parameters per program from L2.

    ``config`` values may be numpy arrays (broadcast). ``registers`` / ``spill_bytes``: ptxas
    figures of the compiled kernel (NaN: estimate). ``inf`` where the block cannot run (more
    than 1024 threads). Raises KeyError for an unknown ``kind``.
    """
    c = coeffs
    if kind not in STREAM_KERNELS or STREAM_KERNELS[kind]["reductions"] == 0:
        raise KeyError(f"unknown row kernel {kind!r}")
    R = _f(config.get("ROWS", 1))
    BN = _f(config["BLOCK_N"])
    W = _f(config["num_warps"])
    e = np.maximum(BN / (W * hw.warp_size), 1.0)
    chunks = np.ceil(_f(cols) / BN)  # a row longer than BLOCK_N: dependent chunks (codegen kernels)
    b = dtype_bytes(dtype)
    moved = 2.0 * _f(rows) * _f(cols) * b
    return _stream_time(kind, np.ceil(_f(rows) / R), R * BN * chunks, R * chunks, e, W, moved, hw, c,
                        registers, spill_bytes, terms)


def elementwise_time_s(n_elements, config: dict, hw: Accelerator, coeffs: Coefficients,
                       kind: str = "bias_gelu", bytes_per_element: float = 4.0,
                       registers=None, spill_bytes=None, terms: bool = False,
                       instr_per_element: float | None = None):
    """Predicted seconds of a 1-D elementwise kernel over ``n_elements`` (``bias_gelu`` of
    ``calibrations/data/h200/kernels.py``: grid ``ceil(n / BLOCK)``, ``BLOCK`` elements per
    program over ``num_warps`` warps; ``bytes_per_element`` read + written from DRAM: 4 for a
    bf16 input and output). ``config`` values may be arrays. Registers and spills as in
    :func:`row_kernel_time_s`; ``instr_per_element`` overrides the kind's instruction count
    (generated chains: more ops, more instructions)."""
    c = coeffs
    B = _f(config["BLOCK"])
    W = _f(config["num_warps"])
    e = np.maximum(B / (W * hw.warp_size), 1.0)
    n = _f(n_elements)
    return _stream_time(kind, np.ceil(n / B), B, 1.0, e, W, n * bytes_per_element, hw, c, registers,
                        spill_bytes, terms, instr_per_element)


# --------------------------------------------------------------------------------------------
# GEMM


@dataclass(frozen=True)
class _Ctx:
    """Scalars of one (problem, hw, coeffs) triple, precomputed once per evaluation."""

    batch: float
    M: float
    N: float
    K: float
    in_b: float
    out_b: float
    epi_bytes: float
    pro_flops: float
    epi_flops: float
    sms: float
    p_sm: float
    smem_bw: float
    hbm: float
    l2bw: float
    l2bw_sm: float
    l2u: float
    lat: float
    vec_sm: float
    launch: float
    spill_bw: float
    t_fix: float
    t_iter: float
    warp: float
    max_warps: float
    max_blocks: float
    regs_sm: float
    regs_max: float
    smem_sm: float
    smem_block: float
    eff_a: float  # MMA multiplier when A is MN-major and not copied
    eff_b: float
    a_bytes: float  # DRAM bytes of A, B (real sizes)
    b_bytes: float
    c: Coefficients


def _ctx(problem: GemmProblem, hw: Accelerator, c: Coefficients) -> _Ctx:
    in_b = problem.in_bytes
    lat = hw.memory_latency_s * c.latency_multiplier
    batch, M, N, K = (float(problem.batch), float(problem.m), float(problem.n), float(problem.k))
    mn_eff = c.mn_major_efficiency(in_b)
    return _Ctx(
        batch=batch, M=M, N=N, K=K, in_b=float(in_b), out_b=float(problem.out_bytes),
        epi_bytes=float(problem.epilogue_bytes_per_elem),
        pro_flops=float(problem.prologue_flops_per_elem),
        epi_flops=float(c.epilogue_flops_per_elem + problem.epilogue_flops_per_elem),
        sms=float(hw.sm_count),
        p_sm=hw.matrix_peak(_peak_key(problem.dtype)) * c.mma_efficiency / hw.sm_count,
        smem_bw=c.smem_bytes_per_clk * hw.clock_hz,
        hbm=hw.hbm_bytes_per_s * c.hbm_efficiency,
        l2bw=c.l2_bytes_per_clk_per_sm * hw.sm_count * hw.clock_hz,
        l2bw_sm=c.sm_load_bytes_per_clk * hw.clock_hz,
        l2u=hw.l2_bytes * c.l2_usable_fraction,
        lat=lat,
        vec_sm=hw.vector_peak("float32") * c.vector_efficiency / hw.sm_count,
        launch=float(hw.launch_overhead_s) * c.launch_multiplier,
        spill_bw=c.spill_bytes_per_clk * hw.clock_hz,
        t_fix=c.tile_overhead_cycles / hw.clock_hz + c.fill_latencies * lat,
        t_iter=c.k_loop_overhead_cycles / hw.clock_hz,
        warp=float(hw.warp_size), max_warps=float(hw.max_warps_per_sm),
        max_blocks=float(hw.max_blocks_per_sm), regs_sm=float(hw.regs_per_sm),
        regs_max=float(hw.regs_per_thread_max), smem_sm=float(hw.smem_bytes_per_sm),
        smem_block=float(hw.smem_bytes_per_block),
        eff_a=mn_eff if problem.a_transposed else 1.0,
        eff_b=1.0 if problem.b_transposed else mn_eff,
        a_bytes=batch * M * K * in_b, b_bytes=batch * N * K * in_b,
        c=c,
    )


def _f(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _geometry_unit(ctx: _Ctx, BM, BN, W, unit_warps: float, unit_m: float, frag: bool):
    """MMA units (warps or warpgroups) of a BM x BN tile with W warps.

    Returns (useful units, replication, smem elements read per k per program, unit efficiency,
    registers per thread of accumulators + fragments).
    """
    c = ctx.c
    units = np.maximum(np.floor(W / unit_warps), 1.0)
    max_units = np.maximum(np.floor(BM / unit_m) * np.floor(BN / c.mma_n), 1.0)
    uu = np.minimum(units, max_units)
    rep = units / uu
    best = None
    wm = 1.0
    while wm <= 64.0:
        wn = uu / wm
        ok = (np.floor(wn) == wn) & (wm * unit_m <= BM) & (wn * c.mma_n <= BN)
        cost = np.where(ok, wn * BM + wm * BN, np.inf)
        best = cost if best is None else np.minimum(best, cost)
        wm *= 2.0
    best = np.where(np.isfinite(best), best, uu * BM + BN)  # fallback: all units along N
    wt = BM * BN / uu
    e_w = wt / (wt + c.warp_tile_overhead_elems * unit_warps)
    acc = BM * BN / (uu * unit_warps * ctx.warp)
    regs = acc
    if frag:  # double-buffered k16 operand fragments in registers (mma.sync)
        regs = acc + 2.0 * (best / uu) * 16.0 * ctx.in_b / (4.0 * ctx.warp)
    return uu, rep, best, e_w, regs


def _geometry(ctx: _Ctx, BM, BN, W):
    """Per-(BM, BN, W) MMA geometry, choosing wgmma where the model's coefficients allow it."""
    g1 = _geometry_unit(ctx, BM, BN, W, 1.0, float(ctx.c.mma_m), True)
    if not ctx.c.warpgroup_mma:
        return g1
    g4 = _geometry_unit(ctx, BM, BN, W, 4.0, 64.0, False)
    use4 = (np.remainder(W, 4.0) == 0.0) & (BM >= 64.0)
    return tuple(np.where(use4, b, a) for a, b in zip(g1, g4))


def _round_regs(x):
    return np.ceil(x / 8.0) * 8.0


def _k_tiling(ctx: _Ctx, BK, SK):
    kspl = np.ceil(ctx.K / SK)
    k_iters = np.maximum(np.ceil(kspl / BK), 1.0)
    return k_iters, k_iters * BK


def _flops_block(BM, BN, Ks, rep):
    return 2.0 * BM * BN * Ks * rep


def _out_bytes(ctx: _Ctx, SK):
    """DRAM bytes the GEMM kernel writes: the output (+ epilogue) or fp32 split-K partials."""
    mn = ctx.batch * ctx.M * ctx.N
    return np.where(SK > 1.0, mn * ctx.c.splitk_partial_bytes * SK, mn * (ctx.out_b + ctx.epi_bytes))


def _extra_kernels(ctx: _Ctx, hw: Accelerator, SK, L):
    """Launch of the GEMM + split-K reduce kernel + transpose copies (seconds)."""
    mn = ctx.batch * ctx.M * ctx.N
    red_bytes = mn * (ctx.c.splitk_partial_bytes * SK + ctx.out_b + ctx.epi_bytes)
    reduce = np.where(SK > 1.0, memory_bound_time_s(red_bytes, hw, ctx.c), 0.0)
    Li = np.asarray(L).astype(np.int64)
    copy_a = np.where((Li & 1) != 0, memory_bound_time_s(2.0 * ctx.a_bytes, hw, ctx.c), 0.0)
    copy_b = np.where((Li & 2) != 0, memory_bound_time_s(2.0 * ctx.b_bytes, hw, ctx.c), 0.0)
    return ctx.launch + reduce + (copy_a + copy_b)


def _layout_eff(ctx: _Ctx, L):
    Li = np.asarray(L).astype(np.int64)
    ea = np.where((Li & 1) != 0, 1.0, ctx.eff_a)
    eb = np.where((Li & 2) != 0, 1.0, ctx.eff_b)
    return ea * eb


def _combine(ctx, fixed, waves, wa, t_fix, xc, xs, xl, xe, t_hbm, t_l2):
    """The one expression tree shared by the model and its lower bound."""
    q = ctx.c.sm_overlap_slack
    a, b, c = wa * xc, wa * xs, waves * xl
    t_sm = waves * t_fix + ((1.0 - q) * np.maximum(np.maximum(a, b), c) + q * ((a + b) + c)) + wa * xe
    s = ctx.c.overlap_slack
    roof = (1.0 - s) * np.maximum(np.maximum(t_sm, t_hbm), t_l2) + s * ((t_sm + t_hbm) + t_l2)
    return fixed + roof, t_sm


_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "split_k", "GROUP_M", "layout",
         "regs_per_thread", "smem_bytes", "spill_bytes")


def _spills(ctx: _Ctx, regs):
    """(registers allocated, estimated spill bytes per thread) of an estimated register need:
    what exceeds the per-thread limit spills, ``spill_estimate_factor`` bytes per register."""
    excess = np.maximum(regs - ctx.regs_max, 0.0)
    return np.minimum(regs, ctx.regs_max), excess * ctx.c.spill_estimate_factor


def _evaluate(problem: GemmProblem, hw: Accelerator, cands: dict, coeffs: Coefficients,
              terms: bool = False):
    c = coeffs
    ctx = _ctx(problem, hw, c)
    BM, BN, BK = _f(cands["BLOCK_M"]), _f(cands["BLOCK_N"]), _f(cands["BLOCK_K"])
    W, S = _f(cands["num_warps"]), _f(cands["num_stages"])
    SK = _f(cands.get("split_k", 1))
    G = _f(cands.get("GROUP_M", 8))
    L = np.asarray(cands.get("layout", 0))
    if L.dtype.kind in "UO":  # layout names
        L = np.vectorize(LAYOUTS.index, otypes=[np.int64])(L)
    L = L.astype(np.float64)

    # --- resources and occupancy
    uu, rep, smem_rd, e_w, regs_mma = _geometry(ctx, BM, BN, W)
    threads = W * ctx.warp
    stage_regs = (BM + BN) * BK * ctx.in_b / (4.0 * threads)
    if c.async_copy:
        stage_regs = np.where(S <= 1.0, stage_regs, 0.0)
    regs_raw, spill = _spills(ctx, _round_regs(c.reg_base + regs_mma + stage_regs))
    smem = np.maximum(S, 1.0) * (BM + BN) * BK * ctx.in_b + c.smem_reserved_per_block
    # Measured resources (codegen/targets.py: the compiled kernel's registers per thread, spill
    # bytes and shared bytes per block) replace the estimates where given; NaN keeps the estimate.
    if "regs_per_thread" in cands:
        measured = _f(cands["regs_per_thread"])
        regs_raw = np.where(np.isnan(measured), regs_raw, measured)
        spill = np.where(np.isnan(measured), spill, 0.0)
    if "spill_bytes" in cands:
        measured = _f(cands["spill_bytes"])
        spill = np.where(np.isnan(measured), spill, measured)
    regs = _round_regs(regs_raw)  # allocation granularity 8 per thread (256 per warp)
    if "smem_bytes" in cands:
        measured = _f(cands["smem_bytes"])
        smem = np.where(np.isnan(measured), smem, measured + c.smem_reserved_per_block)
    occ = np.minimum(np.minimum(ctx.max_blocks, np.floor(ctx.max_warps / W)),
                     np.minimum(np.floor(ctx.regs_sm / (regs * threads)), np.floor(ctx.smem_sm / smem)))
    feasible = ((threads <= MAX_THREADS_PER_BLOCK) & (W <= ctx.max_warps) & (regs_raw <= ctx.regs_max)
                & (spill >= 0.0) & (smem <= ctx.smem_block) & (occ >= 1.0) & (S >= 1.0) & (SK >= 1.0) & (G >= 1.0))
    occ = np.maximum(occ, 1.0)

    # --- grid, waves
    tm, tn = np.ceil(ctx.M / BM), np.ceil(ctx.N / BN)
    k_iters, Ks = _k_tiling(ctx, BK, SK)
    blocks = ctx.batch * tm * tn * SK
    slots = ctx.sms * occ
    waves = np.ceil(blocks / slots)
    per_sm = np.ceil(blocks / ctx.sms)
    a = np.minimum(occ, per_sm)
    wa = waves * a

    # --- per-program times
    e_l = _layout_eff(ctx, L)
    F = _flops_block(BM, BN, Ks, rep)
    share = np.minimum(1.0, a * W / c.mma_subpartitions)
    xc = (F / (ctx.p_sm * e_w * e_l * share) + BM * Ks * ctx.pro_flops / ctx.vec_sm + k_iters * ctx.t_iter
          + k_iters * 2.0 * spill * threads / ctx.spill_bw)
    xs = Ks * ((rep * smem_rd + (BM + BN)) * ctx.in_b) / ctx.smem_bw
    # Ring of S stage buffers: a stage arrives L = latency + its transfer at the SM's fill rate
    # (``a`` co-resident programs share it) after its request, and the request can only go out
    # once the MMA reading that buffer S iterations earlier is done, so one iteration takes at
    # least (t_mma + L) / S (S = 1: load then compute, serially). Matches the H200 num_stages
    # sweeps: 2 stages 1.84-1.94x, 3 stages 1.15x, 4 stages 1.0x of the best 4096^3 config.
    stage_bytes = (BM + BN) * BK * ctx.in_b
    # (t_mma: the program's MMAs at its own warps' tensor-core share, min(1, warps / 4))
    share1 = np.minimum(1.0, W / c.mma_subpartitions)
    xc1 = (F / (ctx.p_sm * e_w * e_l * share1) + BM * Ks * ctx.pro_flops / ctx.vec_sm + k_iters * ctx.t_iter
           + k_iters * 2.0 * spill * threads / ctx.spill_bw)
    xl = (xc1 + k_iters * (ctx.lat + (a * stage_bytes) / ctx.l2bw_sm)) / np.maximum(S, 1.0)
    xe = BM * BN * ctx.epi_flops / ctx.vec_sm

    # --- DRAM traffic with grouped-order L2 reuse
    g_eff = np.minimum(G, tm)
    panel_a = g_eff * BM * Ks * ctx.in_b
    conc = np.minimum(slots, tm * tn)
    cols = np.minimum(tn, np.ceil(conc / g_eff))
    fa = np.where(panel_a <= ctx.l2u, 1.0, np.ceil(tn / cols))
    rows = np.minimum(tm, np.maximum(g_eff, np.floor(conc / tn)))
    fits_b = tn * BN * Ks * ctx.in_b + panel_a <= ctx.l2u
    fb = np.where(fits_b, 1.0, np.ceil(tm / rows))
    out_bytes = _out_bytes(ctx, SK)
    t_hbm = (ctx.a_bytes * fa + ctx.b_bytes * fb + out_bytes) / ctx.hbm
    t_l2 = (ctx.batch * ctx.K * ctx.in_b * (ctx.M * tn + ctx.N * tm) + out_bytes) / ctx.l2bw

    fixed = _extra_kernels(ctx, hw, SK, L)
    total, t_sm = _combine(ctx, fixed, waves, wa, ctx.t_fix, xc, xs, xl, xe, t_hbm, t_l2)
    total = np.where(feasible, total, np.inf)
    if not terms:
        return total
    return dict(total=total, feasible=feasible, t_sm=t_sm, t_hbm=t_hbm, t_l2=t_l2, fixed=fixed,
                mma=wa * xc, smem=wa * xs, latency=waves * xl, waves=waves, occupancy=occ,
                regs_per_thread=regs_raw, spill_bytes=spill, smem_bytes=smem, f_a=fa, f_b=fb, useful_units=uu,
                replication=rep, unit_efficiency=e_w, tiles=blocks)


def gemm_time_s(problem: GemmProblem, hw: Accelerator, cands: dict, coeffs: Coefficients) -> np.ndarray:
    """Predicted seconds of each candidate schedule; ``np.inf`` where infeasible.

    ``cands`` maps ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages`` and
    optionally ``split_k`` (1), ``GROUP_M`` (8), ``layout`` (0, an index into :data:`LAYOUTS` or
    the names) to arrays; they broadcast against each other (flat arrays of equal length, or
    per-axis arrays shaped for broadcasting).

    Optional measured resources (``codegen.targets.KernelResources`` of the compiled kernel):
    ``regs_per_thread`` and ``smem_bytes`` (per block, without the runtime's reservation)
    replace the model's register and shared-memory estimates in the occupancy and feasibility
    terms; NaN entries keep the estimate. A candidate whose measured resources exceed the
    per-thread/per-block limits or fit zero blocks per SM is infeasible (``inf``).
    """
    out = _evaluate(problem, hw, cands, coeffs)
    shape = np.broadcast_shapes(*(np.shape(cands[k]) for k in _KEYS if k in cands))
    return np.broadcast_to(out, shape)


def gemm_breakdown(problem: GemmProblem, hw: Accelerator, config: dict,
                   coeffs: Coefficients) -> dict:
    """The model's terms for one schedule (``config`` as in ``GemmChoice.config``).

    ``bound`` is ``compute`` (the SM term: MMA, shared memory, latency, wave overheads),
    ``memory`` (HBM) or ``l2``, whichever the roofline max picks.
    """
    t = _evaluate(problem, hw, {k: np.asarray([v]) for k, v in config.items() if k in _KEYS},
                  coeffs, terms=True)
    out: dict[str, Any] = {k: float(np.asarray(v).reshape(-1)[0]) for k, v in t.items()}
    out["feasible"] = bool(out["feasible"])
    which = max((out["t_sm"], "compute"), (out["t_hbm"], "memory"), (out["t_l2"], "l2"))
    out["bound"] = which[1]
    sm = max((out["mma"], "mma"), (out["smem"], "smem"), (out["latency"], "latency"))
    out["sm_limiter"] = sm[1]
    return out


def gemm_group_bound(problem: GemmProblem, hw: Accelerator, prefix: dict, suffix_values: dict,
                     coeffs: Coefficients) -> np.ndarray:
    """Lower bound of :func:`gemm_time_s` over every schedule of a group.

    A group fixes ``BLOCK_M``, ``BLOCK_N``, ``split_k``, ``num_warps`` (``prefix``: arrays that
    broadcast against each other) and lets ``BLOCK_K``, ``num_stages``, ``GROUP_M`` and
    ``layout`` range over ``suffix_values`` (sequences). Each leaf of the model's expression
    tree (:func:`_combine`) is replaced by its best case over the free parameters:

    * ``K_s``, ``k_iters``: their minimum over BLOCK_K; the latency term uses the deepest
      pipeline; occupancy is bounded by the registers without K staging and the smallest smem;
    * ``waves * a >= ceil(programs / SMs)``, ``waves >= ceil(programs / (SMs * occ_max))``,
      tensor-core share at the largest possible co-residency;
    * DRAM reads A and B once (``f_A = f_B = 1``); L2 traffic, the split-K reduce and the
      launch do not depend on the free parameters; layout: the minimum over the layouts, each
      with its exact copy time and MMA efficiency.

    IEEE rounding is monotone in each operand of ``+ * /`` (positive operands) and ``max``, so
    evaluating the same tree on leaves that are each <= the member's gives a bound that is <=
    every member's computed time, not just mathematically. Groups with no feasible member get
    ``inf`` (every member is ``inf`` too).
    """
    c = coeffs
    ctx = _ctx(problem, hw, c)
    BM, BN = _f(prefix["BLOCK_M"]), _f(prefix["BLOCK_N"])
    W, SK = _f(prefix["num_warps"]), _f(prefix["split_k"])
    bks = sorted(float(v) for v in suffix_values["BLOCK_K"])
    stages = [float(v) for v in suffix_values["num_stages"]]
    layouts = sorted({int(v) if not isinstance(v, str) else LAYOUTS.index(v) for v in suffix_values["layout"]})
    groups_m = [float(v) for v in suffix_values["GROUP_M"]]

    uu, rep, smem_rd, e_w, regs_mma = _geometry(ctx, BM, BN, W)
    threads = W * ctx.warp
    regs_lb, spill_lb = _spills(ctx, _round_regs(c.reg_base + regs_mma + 0.0))
    regs_lb = _round_regs(regs_lb)
    smem_lb = max(min(stages), 1.0) * (BM + BN) * bks[0] * ctx.in_b + c.smem_reserved_per_block
    occ_ub = np.minimum(np.minimum(ctx.max_blocks, np.floor(ctx.max_warps / W)),
                        np.minimum(np.floor(ctx.regs_sm / (regs_lb * threads)), np.floor(ctx.smem_sm / smem_lb)))
    any_feasible = ((threads <= MAX_THREADS_PER_BLOCK) & (W <= ctx.max_warps)
                    & (smem_lb <= ctx.smem_block) & (occ_ub >= 1.0) & (min(stages) >= 1.0) & (SK >= 1.0)
                    & (min(groups_m) >= 1.0))
    occ_ub = np.maximum(occ_ub, 1.0)

    tm, tn = np.ceil(ctx.M / BM), np.ceil(ctx.N / BN)
    k_iters_lb, Ks_lb = None, None
    for bk in bks:
        ki, ks = _k_tiling(ctx, bk, SK)
        k_iters_lb = ki if k_iters_lb is None else np.minimum(k_iters_lb, ki)
        Ks_lb = ks if Ks_lb is None else np.minimum(Ks_lb, ks)
    blocks = ctx.batch * tm * tn * SK
    waves_lb = np.ceil(blocks / (ctx.sms * occ_ub))
    per_sm = np.ceil(blocks / ctx.sms)
    a_ub = np.minimum(occ_ub, per_sm)
    wa_lb = per_sm

    F_lb = _flops_block(BM, BN, Ks_lb, rep)
    share_ub = np.minimum(1.0, a_ub * W / c.mma_subpartitions)
    xs = Ks_lb * ((rep * smem_rd + (BM + BN)) * ctx.in_b) / ctx.smem_bw
    stage_bytes_lb = (BM + BN) * bks[0] * ctx.in_b
    xe = BM * BN * ctx.epi_flops / ctx.vec_sm
    out_bytes = _out_bytes(ctx, SK)
    t_hbm = (ctx.a_bytes * 1.0 + ctx.b_bytes * 1.0 + out_bytes) / ctx.hbm
    t_l2 = (ctx.batch * ctx.K * ctx.in_b * (ctx.M * tn + ctx.N * tm) + out_bytes) / ctx.l2bw

    best = None
    for L in layouts:
        e_l = _layout_eff(ctx, float(L))
        xc = (F_lb / (ctx.p_sm * e_w * e_l * share_ub) + BM * Ks_lb * ctx.pro_flops / ctx.vec_sm
              + k_iters_lb * ctx.t_iter + k_iters_lb * 2.0 * spill_lb * threads / ctx.spill_bw)
        share1 = np.minimum(1.0, W / c.mma_subpartitions)
        xc1 = (F_lb / (ctx.p_sm * e_w * e_l * share1) + BM * Ks_lb * ctx.pro_flops / ctx.vec_sm
               + k_iters_lb * ctx.t_iter + k_iters_lb * 2.0 * spill_lb * threads / ctx.spill_bw)
        xl = (xc1 + k_iters_lb * (ctx.lat + (1.0 * stage_bytes_lb) / ctx.l2bw_sm)) / max(max(stages), 1.0)
        fixed = _extra_kernels(ctx, hw, SK, float(L))
        total, _ = _combine(ctx, fixed, waves_lb, wa_lb, ctx.t_fix, xc, xs, xl, xe, t_hbm, t_l2)
        best = total if best is None else np.minimum(best, total)
    return np.where(any_feasible, best, np.inf)
