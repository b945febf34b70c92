"""Issue 35.5: what an NCCL all-reduce costs the backward kernels it overlaps. Its thread blocks
hold SMs, so a compute-bound GEMM runs in more waves (the published 2x of a 132-tile GEMM beside
24 NCCL blocks on an H100) and every other kernel loses the SMs' share."""

from __future__ import annotations

import pytest

from sftctl.compiler import step
from sftctl.compiler.step import KernelPlan, overlap_slowdown


def _k(label: str, t: float, kind: str = "gemm", bound: str = "compute", config: dict | None = None) -> KernelPlan:
    return KernelPlan(index=0, kind=kind, label=label, n_ops=1, time_s=t, flops=1.0, bytes=1,
                      arithmetic_intensity=1.0, bound=bound, roofline_fraction=1.0, config=config)


def test_a_one_wave_gemm_takes_two_waves_beside_nccl():
    """132 output tiles of 128 x 128 on 132 SMs: one wave alone, two when NCCL holds 24 SMs
    (the forum's 'nearly 2x')."""
    gemm = _k("gemm 1536x1408x4096 float16", 1e-3)  # 12 x 11 = 132 tiles
    assert overlap_slowdown([gemm], 132) == pytest.approx(2.0)


def test_many_waves_approach_the_sm_share_and_the_schedule_sets_the_tiles():
    big = _k("gemm 16384x16384x4096 bfloat16", 1e-3)  # 16384 tiles: 125 waves, then 152
    assert overlap_slowdown([big], 132) == pytest.approx(152 / 125)
    assert 132 / 108 - 0.01 < overlap_slowdown([big], 132) < 132 / 108 + 0.02
    # a 256 x 128 schedule with split-K 2: 64 x 128 x 2 = 16384 tiles too
    tiled = _k("gemm 16384x16384x4096 bfloat16 +1 fused", 1e-3, config={"BLOCK_M": 256, "BLOCK_N": 128, "split_k": 2})
    assert overlap_slowdown([tiled], 132) == pytest.approx(152 / 125)
    # batched: 8 x (4 x 4) tiles = 128 on 108 SMs: 2 waves for 1
    assert overlap_slowdown([_k("gemm 8x512x512x64 float16", 1e-3)], 132) == pytest.approx(2.0)


def test_other_kernels_lose_the_sm_share_weighted_by_time():
    mem = _k("pointwise add+mul [4096, 1024]", 3e-3, kind="pointwise", bound="memory")
    gemm = _k("gemm 1536x1408x4096 float16", 1e-3)
    share = 1 + step.NCCL_OVERLAP_SMS / 132
    assert overlap_slowdown([mem], 132) == pytest.approx(share)
    assert overlap_slowdown([mem, gemm], 132) == pytest.approx((3 * share + 2.0) / 4)
    assert overlap_slowdown([], 132) == pytest.approx(share)


def test_the_exposed_time_charges_the_overlap_at_the_slowdown():
    """60 MB reduced while 100 ms of backward runs: the last bucket is ready only when backward
    ends, so its all-reduce is exposed whole; the others ran during backward and cost
    ``(slowdown - 1)`` x the time they ran."""
    from sftctl.compiler.collectives import time_s as collective_s

    grads = 60 * 2**20
    times = [collective_s("all-reduce", b, "H100", 8) for b in step.ddp_buckets(grads)]
    last, overlapped = times[-1], sum(times[:-1])
    for slowdown in (1.0, 1.25, 2.0):
        got = step.ddp_allreduce_exposed_s(grads, 0.1, "H100", 132, 8, slowdown=slowdown)
        assert got == pytest.approx(last + overlapped * (slowdown - 1.0), rel=1e-6)
    default = step.ddp_allreduce_exposed_s(grads, 0.1, "H100", 132, 8)
    assert default == pytest.approx(last + overlapped * step.NCCL_OVERLAP_SMS / 132, rel=1e-6)
