"""Compile the codegen kernels for sm_90, sm_80, sm_89, sm_75 and gfx942 without a GPU, check the
resources they report, and that measured resources drive the search's feasibility/occupancy."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from sftctl.compiler.codegen import targets as T
from sftctl.compiler.codegen.elementwise import Chain
from sftctl.compiler.costmodel import GemmProblem
from sftctl.compiler.hardware import get_accelerator
from sftctl.compiler.search.gemm import evaluate_configs, search_gemm
from sftctl.compiler.target import calibrated_coefficients as _coeffs

GEMM_CONFIGS = [
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4, split_k=4, GROUP_M=4),
]
#: Does not fit a T4 SM: one fp32 stage of A and B tiles is (64 + 128) * 128 * 4 B = 96 KiB > 64 KiB.
HUGE = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=7)


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SFTCTL_CODEGEN_CACHE", str(tmp_path_factory.mktemp("codegen")))
    mp.delenv("TRITON_INTERPRET", raising=False)
    yield
    mp.undo()


def _max_regs(target):
    return 512 if target == "gfx942" else 255


@pytest.mark.parametrize("target", sorted(T.TARGETS))
def test_compile_all_kernel_families(target):
    table = []
    for cfg in GEMM_CONFIGS:
        r = T.gemm_resources(cfg, target, "bfloat16")
        table.append(r)
        assert r.target == target and r.num_warps == cfg["num_warps"]
        assert 0 < r.registers <= _max_regs(target)
        assert r.warp_size == (64 if target == "gfx942" else 32)
        stage = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
        if target == "sm_75":
            # no cp.async before sm_80: Triton stages one tile through shared memory
            assert 0.5 * stage <= r.shared_bytes <= 1.5 * max(1, cfg["num_stages"] - 1) * stage
        else:
            # Triton's pipeliner keeps num_stages - 1 tiles in flight (one buffer each)
            expected = max(1, cfg["num_stages"] - 1) * stage
            assert 0.5 * expected <= r.shared_bytes <= 1.5 * expected, (r, expected)
    chain = Chain(("x", "b"), (("h", "add", "x", "b"), ("y", "gelu_tanh", "h")), ("y",))
    ew = T.elementwise_resources(chain, target)
    assert 0 < ew.registers <= 64 and ew.spill_bytes == 0 and ew.shared_bytes == 0
    ln = T.layer_norm_resources(target, n=4096)
    assert 0 < ln.registers <= _max_regs(target) and ln.spill_bytes == 0
    assert ln.shared_bytes < 64 * 1024  # cross-warp reduction scratch only
    # the disk cache answers the second time
    again = T.gemm_resources(GEMM_CONFIGS[0], target, "bfloat16")
    assert again.cached and again.registers == table[0].registers
    for r in table + [ew, ln]:
        print(f"{target:7s} {r.kernel:16s} regs {r.registers:4d} spill {r.spill_bytes:6d} "
              f"smem {r.shared_bytes:7d} warps {r.num_warps} {r.compile_s:.2f}s")


def test_occupancy_arithmetic():
    h100 = get_accelerator("H100")
    r = T.KernelResources("sm_90", registers=128, spill_bytes=0, shared_bytes=64 * 1024, num_warps=4,
                          compile_s=0.0)
    # regs: 65536 / (128 * 32) = 16 warps -> 4 blocks; smem: 228 KiB // (64 KiB + 1 KiB) = 3
    assert T.occupancy(r, h100) == 3 and T.fits(r, h100)
    mi300 = get_accelerator("MI300X")
    r = T.KernelResources("gfx942", registers=128, spill_bytes=0, shared_bytes=0, num_warps=4,
                          compile_s=0.0, warp_size=64)
    # 131072 / (128 * 64) = 16 waves per CU (4 SIMDs x 4) -> 4 blocks of 4 waves
    assert T.occupancy(r, mi300) == 4
    t4 = get_accelerator("T4")
    r = T.KernelResources("sm_75", registers=64, spill_bytes=0, shared_bytes=65 * 1024, num_warps=4,
                          compile_s=0.0)
    assert not T.fits(r, t4) and T.occupancy(r, t4) == 0
    assert T.target_for(h100) == "sm_90" and T.target_for(mi300) == "gfx942"
    with pytest.raises(ValueError):
        T.target_for(get_accelerator("cpu"))


def test_huge_config_rejected_on_t4():
    t4 = get_accelerator("T4")
    r = T.gemm_resources(HUGE, "sm_75", "float32")
    assert r.shared_bytes > t4.smem_bytes_per_block, r
    assert not T.fits(r, t4) and T.occupancy(r, t4) == 0
    problem = GemmProblem(batch=1, m=1024, n=1024, k=1024, dtype="float32")
    assert math.isinf(evaluate_configs(problem, t4, [HUGE], _coeffs(t4), resources=[r])[0])
    # only the huge config in the space: nothing feasible
    space = {k: [v] for k, v in HUGE.items()}
    space.update(split_k=[1], GROUP_M=[8], layout=[0])
    choice = search_gemm(problem, t4, _coeffs(t4), space=space, measured={_key(HUGE): r})
    assert choice.config is None and math.isinf(choice.time_s)
    # with a small alternative, the search measures, rejects the huge one, returns a fitting one
    space2 = dict(space, BLOCK_K=[32, 128], num_stages=[2, 7])
    measured = {}

    def measure(cfg):
        res = T.gemm_measurer(problem, t4)(cfg)
        measured[_key(cfg)] = res
        return res

    choice = search_gemm(problem, t4, _coeffs(t4), space=space2, measure=measure, measured={_key(HUGE): r})
    assert choice.config is not None and choice.config["BLOCK_K"] == 32
    assert T.fits(measured[_key(choice.config)], t4)


def _key(cfg):
    from sftctl.compiler.search.gemm import config_key

    return config_key(dict(dict(split_k=1, GROUP_M=8, layout=0), **cfg))


def test_measured_search_is_exact_and_uses_measurements():
    h100 = get_accelerator("H100")
    problem = GemmProblem(batch=1, m=512, n=768, k=1024, dtype="bfloat16")
    space = dict(BLOCK_M=[64, 128], BLOCK_N=[64, 128], BLOCK_K=[32, 64], num_warps=[4, 8],
                 num_stages=[3, 4], split_k=[1], GROUP_M=[8], layout=[0])
    measure = T.gemm_measurer(problem, h100)
    a = search_gemm(problem, h100, _coeffs(h100), space=space, measure=measure)
    assert a.config is not None
    res = measure(a.config)
    assert T.fits(res, h100)
    assert a.time_s == pytest.approx(evaluate_configs(problem, h100, [a.config], _coeffs(h100), resources=[res])[0])
    # exact: branch-and-bound and exhaustive agree with the same measurements
    measured = {_key(a.config): res}
    b = search_gemm(problem, h100, _coeffs(h100), space=space, measured=measured)
    c = search_gemm(problem, h100, _coeffs(h100), space=space, measured=measured, prune=False)
    assert b.config == c.config and b.time_s == c.time_s
    # a measurement that does not fit removes the model's favourite
    plain = search_gemm(problem, h100, _coeffs(h100), space=space)
    bad = T.KernelResources("sm_90", registers=255, spill_bytes=0, shared_bytes=300 * 1024,
                            num_warps=plain.config["num_warps"], compile_s=0.0)
    d = search_gemm(problem, h100, _coeffs(h100), space=space, measured={_key(plain.config): bad})
    assert d.config != plain.config and d.time_s >= plain.time_s
