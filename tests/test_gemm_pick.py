"""Picking our own GEMM kernels' configs: the model's top k, ties broken by physics, the device's
timing at first compile (here an injected timer: no GPU in CI) cached per (kernel, shape, device)."""

import dataclasses
import math

import numpy as np
import pytest

from sftctl.compiler import backend as be
from sftctl.compiler.costmodel import gemm_time_s
from sftctl.compiler.problem import GemmProblem
from sftctl.compiler.search.gemm import ORDER, schedule_space, search_gemm, tie_break_costs, top_k_gemm
from sftctl.compiler.target import load_target

SMALL = {"BLOCK_M": (64, 128, 256), "BLOCK_N": (64, 128, 256), "split_k": (1, 2), "num_warps": (4, 8),
         "BLOCK_K": (32, 64), "num_stages": (3, 4), "GROUP_M": (1, 8), "layout": (0,)}


def test_top_k_are_the_k_smallest_model_times():
    t = load_target("H200")
    p = GemmProblem(1, 2048, 768, 3072, "bfloat16")
    top = top_k_gemm(p, t.hw, t.coeffs, k=10, space=SMALL)
    every = np.sort(np.asarray(gemm_time_s(p, t.hw, schedule_space(p, t.hw, SMALL), t.coeffs)).reshape(-1))
    assert [c.time_s for c in top] == pytest.approx(list(every[:10]), rel=1e-12)
    assert top[0].time_s == pytest.approx(search_gemm(p, t.hw, t.coeffs, space=SMALL).time_s, rel=1e-12)
    with pytest.raises(ValueError):
        top_k_gemm(p, t.hw, t.coeffs, k=0)


def test_model_ties_are_broken_by_row_segments_then_traffic_not_by_order():
    """4096^3 on the H200: 128x256 and 256x128 tiles, at several GROUP_M, tie in model time;
    the tied set is ordered by the physical second costs. The H200 set measured 128x256x32
    (8 warps, 4 stages) at 1.025x the best and 256x128x32 at 1.056x: a row-major A tile of
    BLOCK_M rows costs 256x128 twice the A row segments, and the key says so."""
    t = load_target("H200")
    p = GemmProblem(1, 4096, 4096, 4096, "bfloat16")
    top = top_k_gemm(p, t.hw, t.coeffs, k=6)
    tied = [c for c in top if f"{c.time_s:.9g}" == f"{top[0].time_s:.9g}"]
    assert len(tied) >= 2
    keys = [(c.segments, c.traffic_s, c.footprint_bytes) for c in tied]
    assert keys == sorted(keys)
    cfg = {"BLOCK_K": 32, "num_warps": 8, "num_stages": 4, "GROUP_M": 8, "split_k": 1, "layout": "as_is"}
    wide, tall = dict(cfg, BLOCK_M=128, BLOCK_N=256), dict(cfg, BLOCK_M=256, BLOCK_N=128)
    seg, _, _ = tie_break_costs(p, t.hw, t.coeffs, [wide, tall])
    assert seg[0] < seg[1]
    # stored N x K (nn.Linear's weight), B's rows are BLOCK_N long in K: the wide tile pays
    seg_t, _, _ = tie_break_costs(dataclasses.replace(p, b_transposed=True), t.hw, t.coeffs, [wide, tall])
    assert seg_t[0] > seg[0]


def _cands():
    return [({"BLOCK_M": 128, "BLOCK_N": n, "split_k": 1, "num_warps": 8, "BLOCK_K": 64, "num_stages": 4,
              "GROUP_M": 8, "layout": "as_is"}, 1e-4 + n * 1e-9) for n in (64, 128, 256)]


@pytest.mark.cold_cache
def test_measured_pick_is_the_fastest_and_cached_per_device():
    p = GemmProblem(1, 1024, 1024, 1024, "bfloat16")
    cands = _cands()
    seen = []

    def timer(cfg):
        seen.append(cfg["BLOCK_N"])
        return {64: 3e-5, 128: 2e-5, 256: 1e-5}[cfg["BLOCK_N"]]

    assert be.pick_measured("gemm", p, "NVIDIA H200", cands, timer) == cands[2]
    assert seen == [64, 128, 256]

    def no_timing(cfg):
        raise AssertionError("the cached winner must not be timed again")

    assert be.pick_measured("gemm", p, "NVIDIA H200", cands, no_timing) == cands[2]
    # another device, or another shape, is timed afresh
    seen.clear()
    assert be.pick_measured("gemm", p, "NVIDIA H100 80GB HBM3", cands, lambda c: {64: 1e-6}.get(c["BLOCK_N"], 1.0)) \
        == cands[0]


@pytest.mark.cold_cache
def test_failed_timings_lose_and_all_failing_keeps_the_model_pick():
    p = GemmProblem(1, 512, 512, 512, "bfloat16")
    cands = _cands()

    def one_fails(cfg):
        if cfg["BLOCK_N"] == 256:
            raise RuntimeError("out of resources")
        return {64: 5e-5, 128: 4e-5}[cfg["BLOCK_N"]]

    assert be.pick_measured("gemm", p, "dev-a", cands, one_fails) == cands[1]

    def nan(cfg):
        return math.nan

    assert be.pick_measured("gemm", p, "dev-b", cands, nan) == cands[0]
    # nothing was cached for dev-b: a working timer is consulted next time
    assert be.pick_measured("gemm", p, "dev-b", cands, lambda c: 1e-5 if c["BLOCK_N"] == 128 else 1e-4) == cands[1]


@pytest.mark.cold_cache
def test_search_cached_times_the_models_top_k_only_with_a_timer():
    t = load_target("H200")
    p = GemmProblem(1, 4096, 768, 768, "bfloat16")
    model_cfg, model_s = be.search_cached(p, t)
    top = top_k_gemm(p, t.hw, t.coeffs, k=be.TOP_K)
    assert model_cfg == top[0].config and model_s == pytest.approx(top[0].time_s)
    timed = []

    def timer(cfg):  # the device disagrees with the model: the last candidate is fastest
        timed.append(cfg)
        return 1e-6 if cfg == top[-1].config else 1e-3

    cfg, s = be.search_cached(p, t, timer=timer, device_name="NVIDIA H200")
    assert cfg == top[-1].config and s == pytest.approx(top[-1].time_s)
    assert len(timed) == be.TOP_K and all(set(c) == set(ORDER) for c in timed)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (the device timer)")
@pytest.mark.cold_cache
def test_device_timer_times_the_top_k_on_the_gpu():
    import torch

    from sftctl.compiler.target import Target

    t = Target.for_device(torch.device("cuda"))
    p = GemmProblem(1, 2048, 2048, 2048, "bfloat16")
    timer = be.device_gemm_timer(p, torch.device("cuda"))
    secs = [timer(c.config) for c in top_k_gemm(p, t.hw, t.coeffs, k=3)]
    assert all(1e-6 < s < 1e-1 for s in secs)
    cfg, _ = be.search_cached(p, t, timer=timer, device_name=torch.cuda.get_device_name())
    assert cfg is not None
