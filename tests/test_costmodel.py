"""Cost model and GEMM schedule search: exactness of the pruned search, monotonicity,
infeasibility, sanity against rooflines, all-reduce formula."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftctl.compiler.costmodel import (
    Coefficients, GemmProblem, gemm_breakdown, gemm_group_bound, gemm_time_s,
    memory_bound_time_s, reduction_time_s,
)
from sftctl.compiler.hardware import Accelerator
from sftctl.compiler.search.gemm import (
    ORDER, PREFIX, SPACE, SUFFIX, _axes, _normalize, evaluate_configs, exhaustive_gemm,
    inductor_mm_configs, inductor_scaled_configs, schedule_space, search_gemm,
)
from sftctl.compiler.target import calibrated_coefficients as _coeffs

KiB, MiB = 1024, 1024 * 1024

H100 = Accelerator(
    name="H100-like", vendor="nvidia", sm_count=132, clock_hz=1.83e9,
    matrix_flops_per_s={"bfloat16": 989e12, "float16": 989e12, "float32": 494e12, "float8": 1979e12},
    vector_flops_per_s={"float32": 67e12}, hbm_bytes_per_s=3.35e12, l2_bytes=50 * MiB,
    smem_bytes_per_sm=228 * KiB, smem_bytes_per_block=227 * KiB, regs_per_sm=65536,
    regs_per_thread_max=255, max_warps_per_sm=64, max_blocks_per_sm=32, warp_size=32,
    memory_bytes=80 * 10**9, memory_latency_s=600e-9, launch_overhead_s=4e-6,
    triton_backend="cuda", triton_arch=90)
A100 = dataclasses.replace(
    H100, name="A100-like", sm_count=108, clock_hz=1.41e9,
    matrix_flops_per_s={"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    vector_flops_per_s={"float32": 19.5e12}, hbm_bytes_per_s=2.039e12, l2_bytes=40 * MiB,
    smem_bytes_per_sm=164 * KiB, smem_bytes_per_block=163 * KiB, memory_latency_s=550e-9,
    triton_arch=80)
MI300 = dataclasses.replace(
    H100, name="MI300X-like", vendor="amd", sm_count=304, clock_hz=2.1e9,
    matrix_flops_per_s={"bfloat16": 1307e12, "float16": 1307e12, "float32": 163e12, "float8": 2615e12},
    vector_flops_per_s={"float32": 163e12}, hbm_bytes_per_s=5.3e12, l2_bytes=256 * MiB,
    smem_bytes_per_sm=64 * KiB, smem_bytes_per_block=64 * KiB, regs_per_sm=131072,
    regs_per_thread_max=512, max_warps_per_sm=32, max_blocks_per_sm=32, warp_size=64,
    triton_backend="hip", triton_arch="gfx942")

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
DTYPES = ("bfloat16", "float16", "float32", "float8")


@st.composite
def hardware(draw):
    base = draw(st.sampled_from([H100, A100, MI300]))
    f = lambda lo, hi: draw(st.floats(lo, hi))  # noqa: E731
    smem_sm = draw(st.sampled_from([48, 64, 100, 164, 228])) * KiB
    return dataclasses.replace(
        base, name=f"{base.name}-var", sm_count=draw(st.integers(8, 320)),
        clock_hz=base.clock_hz * f(0.5, 1.5),
        matrix_flops_per_s={k: v * f(0.1, 3.0) for k, v in base.matrix_flops_per_s.items()},
        hbm_bytes_per_s=base.hbm_bytes_per_s * f(0.1, 3.0),
        l2_bytes=draw(st.integers(1, 256)) * MiB,
        smem_bytes_per_sm=smem_sm, smem_bytes_per_block=smem_sm - draw(st.sampled_from([0, KiB])),
        regs_per_sm=draw(st.sampled_from([32768, 65536, 131072])),
        max_warps_per_sm=draw(st.sampled_from([32, 48, 64])),
        memory_latency_s=f(2e-7, 2e-6), launch_overhead_s=f(0.0, 1e-5))


dims = st.one_of(st.integers(1, 300), st.integers(1, 9000))


@st.composite
def problems(draw, max_batch=8):
    return GemmProblem(
        batch=draw(st.integers(1, max_batch)), m=draw(dims), n=draw(dims), k=draw(dims),
        dtype=draw(st.sampled_from(DTYPES)),
        out_dtype=draw(st.sampled_from(["same", "float32"])),
        a_transposed=draw(st.booleans()), b_transposed=draw(st.booleans()),
        epilogue_bytes_per_elem=draw(st.sampled_from([0.0, 2.0, 4.0])),
        epilogue_flops_per_elem=draw(st.sampled_from([0.0, 8.0])),
        prologue_flops_per_elem=draw(st.sampled_from([0.0, 0.0, 2.0])))


@st.composite
def spaces(draw):
    return {k: draw(st.lists(st.sampled_from(v), min_size=1, max_size=len(v), unique=True))
            for k, v in SPACE.items()}


def full_times(problem, hw, space=None, coeffs=None):
    """Times of the whole space, shape (n_groups, per_group), in enumeration order."""
    vals = _normalize(space)
    t = gemm_time_s(problem, hw, _axes(vals, ORDER), coeffs if coeffs is not None else _coeffs(hw))
    n_groups = math.prod(len(vals[k]) for k in PREFIX)
    return np.ascontiguousarray(t).reshape(n_groups, -1), vals


# ---------------------------------------------------------------- (a) exactness of the search

@settings(max_examples=60, **SETTINGS)
@given(problem=problems(), hw=hardware(), space=spaces())
def test_pruned_search_equals_exhaustive_on_random_spaces(problem, hw, space):
    e = exhaustive_gemm(problem, hw, _coeffs(hw), space=space, use_cache=False)
    s = search_gemm(problem, hw, _coeffs(hw), space=space, use_cache=False)
    assert s.time_s == e.time_s
    assert s.config == e.config
    assert s.n_candidates == e.n_candidates and s.n_scored <= e.n_candidates


@settings(max_examples=15, **SETTINGS)
@given(problem=problems(), hw=hardware())
def test_pruned_search_equals_exhaustive_on_full_space(problem, hw):
    e = exhaustive_gemm(problem, hw, _coeffs(hw), use_cache=False)
    s = search_gemm(problem, hw, _coeffs(hw), use_cache=False)
    assert (s.time_s, s.config) == (e.time_s, e.config)


@pytest.mark.parametrize("hw", [H100, A100, MI300], ids=lambda h: h.name)
@pytest.mark.parametrize("shape", [(1, 8192, 2304, 768), (1, 8192, 50257, 768), (1, 768, 3072, 8192),
                                   (96, 1024, 1024, 64), (96, 1024, 64, 1024), (1, 8, 8192, 8192),
                                   (1, 4096, 4096, 4096), (3, 1, 1, 1)])
def test_pruned_search_equals_exhaustive_gpt2_shapes(hw, shape):
    p = GemmProblem(*shape)
    e = exhaustive_gemm(p, hw, _coeffs(hw), use_cache=False)
    s = search_gemm(p, hw, _coeffs(hw), use_cache=False)
    assert (s.time_s, s.config) == (e.time_s, e.config)
    assert s.n_scored < e.n_scored / 10  # the bound prunes


@settings(max_examples=40, **SETTINGS)
@given(problem=problems(), hw=hardware(), space=spaces())
def test_group_bound_is_a_lower_bound_of_every_member(problem, hw, space):
    times, vals = full_times(problem, hw, space)
    bound = np.broadcast_to(gemm_group_bound(problem, hw, _axes(vals, PREFIX), {k: vals[k] for k in SUFFIX}, _coeffs(hw)),
                            tuple(len(vals[k]) for k in PREFIX)).reshape(-1)
    best = times.min(axis=1)
    assert np.all(bound <= best)  # inf <= inf for all-infeasible groups
    assert not np.any(np.isinf(bound) & np.isfinite(best))


# ---------------------------------------------------------------- (b) monotonicity

@settings(max_examples=25, **SETTINGS)
@given(problem=problems(), hw=hardware(), f_bw=st.floats(1.0, 10.0), f_fl=st.floats(1.0, 10.0),
       f_l2=st.floats(1.0, 8.0))
def test_more_bandwidth_flops_or_l2_never_predicts_slower(problem, hw, f_bw, f_fl, f_l2):
    c = _coeffs(hw)
    base, _ = full_times(problem, hw, coeffs=c)
    for faster in (dataclasses.replace(hw, hbm_bytes_per_s=hw.hbm_bytes_per_s * f_bw),
                   dataclasses.replace(hw, matrix_flops_per_s={k: v * f_fl for k, v in hw.matrix_flops_per_s.items()}),
                   dataclasses.replace(hw, l2_bytes=int(hw.l2_bytes * f_l2))):
        t, _ = full_times(problem, faster, coeffs=c)
        assert np.all(t <= base)
        assert np.array_equal(np.isinf(t), np.isinf(base))  # feasibility does not depend on these


@settings(max_examples=25, **SETTINGS)
@given(problem=problems(max_batch=4), hw=hardware(), which=st.sampled_from(["m", "n", "k", "batch"]),
       grow=st.integers(1, 5000))
def test_bigger_problem_never_predicts_faster(problem, hw, which, grow):
    bigger = dataclasses.replace(problem, **{which: getattr(problem, which) + grow})
    t0, _ = full_times(problem, hw)
    t1, _ = full_times(bigger, hw)
    # per candidate (up to rounding: a*W/4 co-residency terms equal in exact arithmetic may
    # round differently), and the best over the space
    assert np.all(t1 >= t0 * (1 - 1e-12))
    assert np.array_equal(np.isinf(t1), np.isinf(t0))
    assert search_gemm(bigger, hw, _coeffs(hw)).time_s >= search_gemm(problem, hw, _coeffs(hw)).time_s * (1 - 1e-12)


# ---------------------------------------------------------------- (c) infeasibility

def test_infeasible_configs_get_inf():
    p = GemmProblem(1, 4096, 4096, 4096)
    cands = {k: np.array(v) for k, v in {
        "BLOCK_M": [256, 128, 256, 64, 128], "BLOCK_N": [256, 128, 256, 64, 128],
        "BLOCK_K": [256, 64, 64, 64, 64], "num_warps": [8, 4, 4, 32, 4], "num_stages": [7, 3, 3, 2, 3],
    }.items()}
    t = gemm_time_s(p, H100, cands, _coeffs(H100))
    # 7 stages x (256+256) x 256 x 2 B = 1.8 MB of smem; 256x256 fp32 accumulators over 128
    # threads = 512 registers/thread; 32 warps = 1024 threads is allowed but 32*32 > 1024 is not
    # threads = 512 registers/thread: that spills (slow, finite; H200 runs such configs 5-15x
    # slower than the best, calibrations/data/h200 measurements), it is not infeasible
    assert np.isinf(t[0]) and np.isfinite(t[2])
    assert np.isfinite(t[1]) and np.isfinite(t[4])
    b = gemm_breakdown(p, H100, {k: int(v[1]) for k, v in cands.items()}, _coeffs(H100))
    assert b["feasible"] and b["smem_bytes"] <= H100.smem_bytes_per_block and b["regs_per_thread"] <= 255
    assert b["spill_bytes"] == 0
    s = gemm_breakdown(p, H100, {k: int(v[2]) for k, v in cands.items()}, _coeffs(H100))
    assert s["feasible"] and s["regs_per_thread"] == 255 and s["spill_bytes"] > 0


def test_spills_cost_time_not_feasibility():
    """The same config with measured spills is finite and slower than without them."""
    p = GemmProblem(1, 4096, 4096, 4096)
    cfg = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    cands = {k: np.array([v, v, v]) for k, v in cfg.items()}
    cands["regs_per_thread"] = np.array([255.0, 255.0, 255.0])
    cands["smem_bytes"] = np.array([147456.0] * 3)
    cands["spill_bytes"] = np.array([0.0, 512.0, 2080.0])  # ptxas "bytes spill stores"
    t = gemm_time_s(p, H100, cands, _coeffs(H100))
    assert np.all(np.isfinite(t))
    assert t[0] < t[1] < t[2]
    assert t[2] > 2.0 * t[0]


@settings(max_examples=30, **SETTINGS)
@given(problem=problems(), hw=hardware())
def test_chosen_config_is_feasible(problem, hw):
    s = search_gemm(problem, hw, _coeffs(hw))
    if s.config is None:
        assert s.time_s == math.inf
        return
    b = gemm_breakdown(problem, hw, s.config, _coeffs(hw))
    assert b["feasible"] and math.isfinite(s.time_s)
    assert b["smem_bytes"] <= hw.smem_bytes_per_block
    assert b["regs_per_thread"] <= hw.regs_per_thread_max
    assert s.config["num_warps"] * hw.warp_size <= 1024
    assert b["total"] == s.time_s


def test_everything_infeasible_returns_none():
    tiny = dataclasses.replace(H100, name="tiny-smem", smem_bytes_per_sm=1536, smem_bytes_per_block=1536)
    p = GemmProblem(1, 512, 512, 512)
    for choice in (search_gemm(p, tiny, _coeffs(tiny), use_cache=False), exhaustive_gemm(p, tiny, _coeffs(tiny), use_cache=False)):
        assert choice.config is None and choice.time_s == math.inf
        assert choice.n_infeasible == choice.n_scored


def test_small_smem_excludes_big_tiles():
    small = dataclasses.replace(A100, name="small-smem", smem_bytes_per_sm=48 * KiB, smem_bytes_per_block=48 * KiB)
    p = GemmProblem(1, 4096, 4096, 4096)
    cfg = search_gemm(p, small, _coeffs(small)).config
    stages = max(cfg["num_stages"], 1)
    assert stages * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2 + 1024 <= 48 * KiB
    t = evaluate_configs(p, small, [dict(cfg, BLOCK_M=256, BLOCK_N=256, BLOCK_K=64, num_stages=3)], _coeffs(small))
    assert np.isinf(t[0])


# ---------------------------------------------------------------- (d) sanity

def test_square_gemm_on_h100_is_compute_bound_near_roofline():
    p = GemmProblem(1, 4096, 4096, 4096, "bfloat16", b_transposed=True)
    s = search_gemm(p, H100, _coeffs(H100))
    ideal = 2 * 4096**3 / (0.8 * 989e12)
    assert 0.5 * ideal <= s.time_s <= 1.3 * ideal
    assert gemm_breakdown(p, H100, s.config, _coeffs(H100))["bound"] == "compute"


def test_skinny_gemm_is_memory_bound():
    p = GemmProblem(1, 8, 8192, 8192, "bfloat16", b_transposed=True)
    s = search_gemm(p, H100, _coeffs(H100))
    assert gemm_breakdown(p, H100, s.config, _coeffs(H100))["bound"] == "memory"
    weights = 8192 * 8192 * 2
    assert s.time_s >= weights / H100.hbm_bytes_per_s
    assert s.time_s <= 1.5 * (weights / (0.9 * H100.hbm_bytes_per_s) + H100.launch_overhead_s)


def test_split_k_helps_small_mn_large_k():
    p = GemmProblem(1, 256, 256, 65536)
    best = search_gemm(p, H100, _coeffs(H100))
    no_split = search_gemm(p, H100, _coeffs(H100), space={"split_k": [1]})
    assert best.config["split_k"] > 1 and best.time_s < no_split.time_s


def test_mn_major_fp32_operand_prefers_a_transpose_copy_or_pays():
    # tf32 MN-major A costs mn_major_efficiency_other of MMA throughput; copying A costs a
    # memory-bound kernel. Either way it is never faster than the K-major problem.
    kmaj = GemmProblem(1, 4096, 4096, 4096, "float32", b_transposed=True)
    mnmaj = dataclasses.replace(kmaj, a_transposed=True)
    assert search_gemm(mnmaj, A100, _coeffs(A100)).time_s > search_gemm(kmaj, A100, _coeffs(A100)).time_s


def test_memory_bound_and_reduction_formulas():
    c = _coeffs(H100)
    t = memory_bound_time_s(1e9, H100, c, n_kernels=2)
    expect = 2 * (4e-6 + c.fill_latencies * 600e-9) + 1e9 / (3.35e12 * c.hbm_efficiency)
    assert t == pytest.approx(expect)
    r = reduction_time_s(8192, 50257, "float32", H100, c)
    assert r == pytest.approx(memory_bound_time_s(8192 * 50257 * 4 + 8192 * 4, H100, c))
    assert np.all(np.diff(memory_bound_time_s(np.array([1e6, 1e7, 1e8]), H100, c)) > 0)


def test_schedule_space_is_full_cartesian_product_in_order():
    sp = schedule_space(GemmProblem(1, 64, 64, 64), H100)
    n = math.prod(len(v) for v in SPACE.values())
    assert n >= 10**5 and all(len(v) == n for v in sp.values())
    rows = np.stack([sp[k] for k in ORDER], axis=1)
    assert len(np.unique(rows, axis=0)) == n
    assert np.all(np.lexsort(rows.T[::-1]) == np.arange(n))  # lexicographic = enumeration order


def test_gemm_time_flat_and_broadcast_agree():
    p = GemmProblem(2, 1000, 3000, 700, b_transposed=True)
    small = {"BLOCK_M": [64, 128], "BLOCK_N": [64, 256], "split_k": [1, 4], "num_warps": [4, 8],
             "BLOCK_K": [32, 64], "num_stages": [1, 3], "GROUP_M": [1, 8], "layout": [0, 2]}
    flat = schedule_space(p, H100, small)
    t_flat = gemm_time_s(p, H100, flat, _coeffs(H100))
    t_grid, _ = full_times(p, H100, small)
    assert np.array_equal(t_flat, t_grid.reshape(-1))


def test_memoization_and_cache_keys():
    p = GemmProblem(1, 1024, 1024, 1024)
    a = search_gemm(p, H100, _coeffs(H100))
    b = search_gemm(p, H100, _coeffs(H100))
    assert b.cached and b.config == a.config and b.time_s == a.time_s
    b.config["BLOCK_M"] = -1  # callers get copies
    assert search_gemm(p, H100, _coeffs(H100)).config == a.config
    faster = dataclasses.replace(H100, hbm_bytes_per_s=2 * H100.hbm_bytes_per_s)  # same name
    assert not search_gemm(p, faster, _coeffs(faster)).cached
    c2 = dataclasses.replace(_coeffs(H100), mma_efficiency=0.5)
    other = search_gemm(p, H100, coeffs=c2)
    assert not other.cached and other.time_s > a.time_s


def test_coefficients_vendor_and_override():
    nv, amd = Coefficients.for_vendor("nvidia"), Coefficients.for_vendor("amd")
    assert nv != amd and hash(nv) != hash(amd)
    assert _coeffs(H100).warpgroup_mma and not _coeffs(A100).warpgroup_mma
    try:
        Coefficients.ACCELERATOR["H100-like"] = {"hbm_efficiency": 0.5}
        assert _coeffs(H100).hbm_efficiency == 0.5
    finally:
        Coefficients.ACCELERATOR.pop("H100-like", None)


def test_problem_validation():
    with pytest.raises(ValueError):
        GemmProblem(1, 0, 8, 8)
    with pytest.raises(ValueError):
        GemmProblem(1, 8, 8, 8, dtype="complex64")


def test_inductor_configs_match_installed_torch_and_are_in_our_space():
    fallback = inductor_mm_configs("fallback")
    assert len(fallback) >= 20
    try:
        from_torch = inductor_mm_configs("torch")
    except ImportError:
        pytest.skip("torch._inductor not importable")
    assert from_torch == fallback  # update the hard-coded copy when torch moves
    p = GemmProblem(1, 100, 5000, 40)
    for cfg in inductor_scaled_configs(p):
        for k in ORDER:
            if k != "layout":
                assert cfg[k] in SPACE[k]
    ours = search_gemm(p, H100, _coeffs(H100)).time_s
    assert ours <= evaluate_configs(p, H100, inductor_scaled_configs(p), _coeffs(H100)).min()
