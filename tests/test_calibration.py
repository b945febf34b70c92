"""The shipped H200 calibration: loaded by default, reproducible, and its quality as stated."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from sftctl.compiler import calibrated
from sftctl.compiler import calibration as C
from sftctl.compiler.costmodel import Coefficients
from sftctl.compiler.hardware import get_accelerator
from sftctl.compiler.target import calibrated_coefficients, load_target

H200, H100, A100 = (get_accelerator(n) for n in ("H200", "H100", "A100-80GB"))


@pytest.fixture(scope="module")
def doc():
    return json.loads(C.calibration_path("H200").read_text())


def test_calibration_file_states_source_date_and_quality(doc):
    assert doc["accelerator"] == "H200" and doc["kind"] == "sftctl cost-model calibration"
    assert doc["date"] and doc["data"]["train_sha256"] == C._sha256(C.DATA_DIR / "h200" / "train.jsonl")
    assert doc["data"]["records"] == 408
    loso = doc["fit"]["leave_one_shape_out"]
    assert len(loso) == 8 and all(-1 <= q["spearman"] <= 1 for q in loso.values())
    assert "H100" in doc["carries_over"]


def test_used_by_default_for_h200_and_h100_not_a100(doc):
    c = load_target("H200").coeffs
    for k, v in doc["coefficients"].items():
        assert getattr(c, k) == v
    raw = Coefficients.uncalibrated(H200)
    assert raw != c
    # same GH100 die: H100 gets the same coefficients (its HBM bandwidth comes from its catalog)
    assert load_target("H100").coeffs == c
    assert load_target("A100-80GB").coeffs == Coefficients.uncalibrated(A100)
    # explicit overrides still win
    try:
        Coefficients.ACCELERATOR["H200"] = {"mma_efficiency": 0.5}
        assert calibrated_coefficients(H200).mma_efficiency == 0.5
    finally:
        Coefficients.ACCELERATOR.pop("H200")


def test_refit_reproduces_the_stated_fit(doc):
    """Refit from the shipped records: the coefficients and the leave-one-shape-out quality
    are the ones the file states (deterministic fit)."""
    m = doc["method"]
    new = C.run_fit("H200", C.DATA_DIR / "h200", loso=True, iters=m["iters"], restarts=m["restarts"])
    # deterministic here; loose enough for another numpy's last-ulp differences in log/exp/pow
    for k, v in doc["coefficients"].items():
        assert new["coefficients"][k] == pytest.approx(v, rel=0.05, abs=0.01), k
    for table in ("leave_one_shape_out", "leave_shape_out_all_kernels"):
        for name, q in doc["fit"][table].items():
            got = new["fit"][table][name]
            assert got["spearman"] == pytest.approx(q["spearman"], abs=0.02), (table, name)
            assert got["pick_over_best"] == pytest.approx(q["pick_over_best"], abs=0.03), (table, name)
    # the stated quality, held out one (kernel, shape) at a time: GEMMs reach the aim
    loso = doc["fit"]["leave_one_shape_out"]
    for name in ("gemm:4096x4096x4096", "gemm:8192x2304x768"):
        assert loso[name]["spearman"] >= 0.9 and loso[name]["pick_over_best"] <= 1.10, loso[name]
    # issue 20's done-when, by the model alone: every (kernel, shape) held out ranks its configs
    # with Spearman >= 0.9 and picks one within 1.10x of the best measured, in both tables
    # (bias_gelu 8192x768 picked 1.125x before the instruction-fetch term and the per-thread
    # instruction count; its Spearman was 0.8775 before the pipeline wave tail)
    for table in ("leave_one_shape_out", "leave_shape_out_all_kernels"):
        for name, q in doc["fit"][table].items():
            assert q["spearman"] >= 0.9 and q["pick_over_best"] <= 1.10, (table, name, q)


def test_spearman_and_ranks_against_hand_values():
    assert C.rankdata([10, 30, 20, 20]).tolist() == [1.0, 4.0, 2.5, 2.5]
    assert C.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert C.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # rho = 1 - 6 sum d^2 / (n (n^2 - 1)) without ties: d = (0, 1, -1, 0, 0) -> 1 - 12/120
    assert C.spearman([1, 2, 3, 4, 5], [1, 3, 2, 4, 5]) == pytest.approx(0.9)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=50), rng.normal(size=50)
    rx, ry = C.rankdata(x), C.rankdata(y)
    assert C.spearman(x, y) == pytest.approx(np.corrcoef(rx, ry)[0, 1], abs=1e-12)


def test_peer_efficiency_cublas_and_eager_rows():
    p = calibrated.peer_efficiency("H200")
    # peers.jsonl: torch.mm 4096^3 bf16 in 175.36 us = 783.8 TFLOP/s
    assert p.cublas_bf16_flops_per_s["square4096"] == pytest.approx(2 * 4096**3 / 175.35999417304994e-6, rel=1e-3)
    assert 0.7 < p.cublas_bf16_fraction_of_peak["square4096"] < 0.85
    assert p.copy_bytes_per_s == pytest.approx(4.241e12, rel=1e-3)
    ln = p.eager_row_bytes_per_s["layernorm"]["65536x1024"]
    assert ln == pytest.approx(2 * 65536 * 1024 * 2 / 155.55199980735778e-6, rel=1e-3)
    h100 = calibrated.peer_efficiency("H100")
    assert h100.cublas_bf16_fraction_of_peak == p.cublas_bf16_fraction_of_peak
    assert h100.copy_bytes_per_s == pytest.approx(p.copy_bytes_per_s * 3.35 / 4.8, rel=1e-3)
    # no calibration of its own; its entry's peers are the H200's, as fractions of its own peaks
    a100 = calibrated.peer_efficiency("A100-80GB")
    assert calibrated.calibration_for("A100-80GB") is None and a100.measured_on == "H200"
    assert a100.cublas_bf16_fraction_of_peak == p.cublas_bf16_fraction_of_peak
    assert a100.copy_bytes_per_s == pytest.approx(p.copy_bytes_per_s * 2.039 / 4.8, rel=1e-2)


def test_fit_recovers_known_coefficients_from_synthetic_records():
    """Records generated by the model with known streaming coefficients: the fit finds
    coefficients that predict them (log error tiny), starting from the defaults."""
    from sftctl.compiler.records import normalize, predict_records

    truth = dataclasses.replace(Coefficients.uncalibrated(H200), launch_multiplier=0.6,
                                block_launch_cycles=300.0, stream_latency_multiplier=2.5)
    recs = []
    for M, N in ((8192, 768), (32768, 2048)):
        for rows in (1, 4, 16):
            for w in (1, 4, 16):
                recs.append({"kernel": "softmax", "M": M, "N": N, "dtype": "bfloat16",
                             "config": {"ROWS": rows, "num_warps": w}})
    t = predict_records([normalize(r) for r in recs], load_target(H200).with_coeffs(truth))
    for r, s in zip(recs, t):
        r["measured_s"] = s
    groups = C.prepare(recs, H200)
    base = Coefficients.uncalibrated(H200)
    fitted = C.fit(groups, H200, base, iters=300, restarts=1)
    for g in groups:
        q = C.quality(g, C.predict_group(g, H200, fitted))
        assert q["rms_log_error"] < 0.05 and q["spearman"] > 0.9, q
    assert math.isclose(fitted.hbm_efficiency, base.hbm_efficiency)  # not a fitted parameter


def _measured(kernel, M):
    recs = C.load_records(C.DATA_DIR / "h200" / "train.jsonl")
    return [r for r in recs if r["kernel"] == kernel and r["M"] == M]


@pytest.mark.parametrize("kernel, M", [("layernorm", 8192), ("layernorm", 65536), ("softmax", 8192),
                                       ("softmax", 65536)])
def test_codegen_row_config_search_picks_a_fast_measured_config(kernel, M):
    """row_config(rows=...) searches num_warps with the calibrated model; on H200 the pick
    measured within 1.10x of the best one-row-per-program config (the fixed rule's 4 warps
    measured up to 1.1x, 8 warps 1.5x slower)."""
    from sftctl.compiler.codegen.reduction import row_config

    recs = [r for r in _measured(kernel, M) if r["config"]["ROWS"] == 1]
    N = recs[0]["N"]
    cfg = row_config(N, rows=M, kind=kernel, target=load_target(H200), dtype="bfloat16")
    assert cfg["BLOCK_N"] == 1024
    by_warps = {r["config"]["num_warps"]: r["measured_s"] for r in recs}
    assert by_warps[cfg["num_warps"]] <= 1.10 * min(by_warps.values())
    # an explicit num_warps is kept; no rows: the fixed rule
    assert row_config(N, {"num_warps": 16}, rows=M, target=load_target(H200))["num_warps"] == 16
    assert row_config(N)["num_warps"] == 4


@pytest.mark.parametrize("M", [8192, 65536])
def test_elementwise_search_on_the_bias_gelu_records(M):
    """The elementwise search space scored by the calibrated model: its pick for bias + GELU
    measured within 1.15x of the best measured config (1.125x at 8192x768, whose 29 configs
    span 11-27 us with ~5 us of launch; 1.0x at 65536x1024)."""
    from sftctl.compiler.costmodel import elementwise_time_s
    from sftctl.compiler.search.stream import ELEMENTWISE_BLOCKS, ELEMENTWISE_WARPS

    recs = _measured("bias_gelu", M)
    meas = {(r["config"]["BLOCK"], r["config"]["num_warps"]): r["measured_s"] for r in recs}
    space = [(b, w) for b in ELEMENTWISE_BLOCKS for w in ELEMENTWISE_WARPS if (b, w) in meas]
    t = elementwise_time_s(M * recs[0]["N"], {"BLOCK": np.array([b for b, _ in space]),
                                              "num_warps": np.array([w for _, w in space])}, H200,
                          load_target(H200).coeffs)
    pick = space[int(np.argmin(t))]
    assert meas[pick] <= 1.15 * min(meas.values()), (pick, meas[pick], min(meas.values()))


@pytest.mark.parametrize("name", ["H200", "H100", "A100-80GB", "MI300X"])
def test_no_prediction_beats_the_roofline(name):
    """Random configs and shapes (inside and far outside the measured ones): every prediction is
    finite or inf (never NaN or <= 0), GEMMs never exceed the dense matrix peak, streaming
    kernels never move bytes faster than the datasheet HBM peak."""
    from sftctl.compiler.costmodel import GemmProblem, elementwise_time_s, gemm_time_s, row_kernel_time_s

    hw, c = get_accelerator(name), load_target(name).coeffs
    rng = np.random.default_rng(1)
    for _ in range(6):
        M, N, K = (int(v) for v in 2 ** rng.integers(5, 14, size=3))
        p = GemmProblem(1, M, N, K)
        n = 400
        cands = {"BLOCK_M": 2 ** rng.integers(4, 9, n), "BLOCK_N": 2 ** rng.integers(4, 9, n),
                 "BLOCK_K": 2 ** rng.integers(4, 9, n), "num_warps": 2 ** rng.integers(0, 5, n),
                 "num_stages": rng.integers(1, 8, n), "GROUP_M": 2 ** rng.integers(0, 6, n)}
        t = gemm_time_s(p, hw, cands, c)
        assert not np.any(np.isnan(t)) and np.all(t > 0)
        ok = np.isfinite(t)
        assert ok.any()
        assert np.all(p.flops / t[ok] <= hw.matrix_peak("bfloat16"))
        rows, cols = int(2 ** rng.integers(4, 18)), int(2 ** rng.integers(4, 14))
        cfg = {"ROWS": 2 ** rng.integers(0, 5, n), "BLOCK_N": np.full(n, max(16, 1 << (cols - 1).bit_length())),
               "num_warps": 2 ** rng.integers(0, 6, n)}
        for kind in ("layernorm", "softmax"):
            r = row_kernel_time_s(kind, rows, cols, cfg, hw, c)
            assert not np.any(np.isnan(r)) and np.all(r > 0)
            assert np.all(2 * rows * cols * 2 / r[np.isfinite(r)] <= hw.hbm_bytes_per_s)
        e = elementwise_time_s(rows * cols, {"BLOCK": 2 ** rng.integers(6, 14, n), "num_warps": 2 ** rng.integers(0, 5, n)}, hw, c)
        assert not np.any(np.isnan(e)) and np.all(e > 0)
        assert np.all(rows * cols * 4 / e[np.isfinite(e)] <= hw.hbm_bytes_per_s)
