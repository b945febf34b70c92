"""Library GEMM times from XLA's measured tables (sftctl.compiler.gemm_table) and their predict records."""

import dataclasses
import io
import json
import sys

import pytest

from sftctl.compiler import gemm_table, predict
from sftctl.compiler.hardware import get_accelerator

XLA = "ROCm/xla"


def _rows(arch, dtype):
    return gemm_table.tables()[arch][dtype]["rows"]


def test_shipped_tables_name_their_source_and_cover_h100_b200():
    doc = json.loads(gemm_table.TABLE_PATH.read_text())
    assert XLA in doc["source"] and "183fa00cb5" in doc["source"]
    assert len(_rows("sm_90", "bf16xbf16->bf16")) == 300
    assert len(_rows("sm_100_B200", "bf16xbf16->bf16")) == 375
    assert gemm_table.table_for("H100", "bfloat16") == ("sm_90", "bf16xbf16->bf16")
    assert gemm_table.table_for("B200", "float32") == ("sm_100_B200", "f32xf32->f32")
    assert gemm_table.table_for("A100-80GB", "bfloat16") is None


def test_grid_points_are_reproduced_and_floor_and_split_k_are_measured():
    h100, b200 = get_accelerator("H100"), get_accelerator("B200")
    for b, m, n, k, t in _rows("sm_90", "bf16xbf16->bf16")[::37]:
        assert gemm_table.gemm_gpu_time_s(b, m, n, k, h100, "bfloat16") == pytest.approx(t, rel=1e-6)
    # the smallest GEMM: a ~5 us GPU floor on both (XLA README), not the roofline's nanoseconds
    assert gemm_table.gemm_gpu_time_s(1, 256, 256, 256, h100, "bfloat16") == pytest.approx(4.99e-6, rel=0.01)
    assert gemm_table.gemm_gpu_time_s(1, 256, 256, 256, b200, "bfloat16") == pytest.approx(4.96e-6, rel=0.01)
    # split-K: 256x256x4096 measures 5.9 us (the issue: the old model said 26.9 us); the
    # analytical model alone (a copy of the H100 that matches no table) must find it too
    what_if = dataclasses.replace(h100, launch_overhead_s=h100.launch_overhead_s * 2)
    alone = gemm_table.gemm_gpu_time_s(1, 256, 256, 4096, what_if, "bfloat16")
    assert 4e-6 < alone < 9e-6


def test_between_grid_points_follows_the_neighbours():
    """A shape between grid points lands between its measured neighbours (monotone in K)."""
    h100 = get_accelerator("H100")
    lo = gemm_table.gemm_gpu_time_s(1, 2048, 2048, 2048, h100, "bfloat16")
    hi = gemm_table.gemm_gpu_time_s(1, 2048, 2048, 4096, h100, "bfloat16")
    mid = gemm_table.gemm_gpu_time_s(1, 2048, 2048, 3072, h100, "bfloat16")
    assert lo < mid < hi
    # far beyond the grid it is the model: GPT-2's LM head on H100 runs near the fitted peak
    t = gemm_table.gemm_gpu_time_s(1, 8192, 50257, 768, h100, "bfloat16")
    assert 0.55 < 2 * 8192 * 50257 * 768 / t / h100.matrix_peak("bfloat16") < 0.85


def test_held_out_h100_shapes_meet_the_issue_targets():
    """k-fold by (m, n, k) shape, every b of a held-out shape out, coefficients refitted:
    issue 20's targets: median predicted/measured in 0.9-1.1, >= 80 % within 0.8-1.25."""
    cv = gemm_table.cross_validate("sm_90", "bf16xbf16->bf16", folds=5)
    assert cv["n"] == 300
    assert 0.9 <= cv["median"] <= 1.1
    assert cv["within_0.8_1.25"] >= 0.8


def test_h200_uses_the_h100_die_table_and_its_own_cublas_peers():
    h200 = get_accelerator("H200")
    assert gemm_table.gemm_gpu_time_s(1, 4096, 4096, 4096, h200, "bfloat16") == pytest.approx(175.36e-6, rel=0.01)
    assert gemm_table.gemm_gpu_time_s(1, 8192, 2304, 768, h200, "bfloat16") == pytest.approx(47.68e-6, rel=0.01)


def _fraction(b, m, n, k, hw, dtype="bfloat16"):
    t = gemm_table.gemm_gpu_time_s(b, m, n, k, hw, dtype)
    peak = hw.matrix_peak("float8" if dtype == "float8" else "bfloat16")
    return 2 * b * m * n * k / t / peak


def test_no_gemm_beats_the_published_max_achievable_matmul_flops():
    """Stas Bekman's MAMF table: H100 SXM 80.3 % of the bf16 peak (H200 the same), 70.9 % in fp8;
    A100 SXM 86.9 %. Large GEMMs, where the H100 table's model reached 0.83-0.85, stop there."""
    from sftctl.compiler import matmul_model

    h100, h200, a100 = (get_accelerator(n) for n in ("H100", "H200", "A100-80GB"))
    for hw in (h100, h200):
        assert _fraction(1, 16384, 16384, 16384, hw) == pytest.approx(0.803, rel=1e-6)
        assert _fraction(1, 8192, 28672, 8192, hw) == pytest.approx(0.803, rel=1e-6)
    assert _fraction(1, 16384, 16384, 16384, h100, "float8") == pytest.approx(0.709, rel=1e-6)
    assert _fraction(1, 16384, 16384, 16384, a100) == pytest.approx(0.869, rel=1e-6)
    # the cap is the floor of the time: 2 b m n k at the MAMF rate
    assert matmul_model.mamf_time_s(1, 4096, 4096, 4096, h100, "bfloat16") == pytest.approx(
        2 * 4096**3 / (0.803 * h100.matrix_peak("bfloat16")))
    assert matmul_model.mamf_time_s(1, 4096, 4096, 4096, get_accelerator("L4"), "bfloat16") == 0.0
    # smaller GEMMs stay under the ceiling: the measured table point (4096^3 in 176 us) is kept
    assert gemm_table.gemm_gpu_time_s(1, 4096, 4096, 4096, h100, "bfloat16") == pytest.approx(176.2e-6, rel=0.01)


def test_the_a100_carries_the_h100_fit_at_its_own_max_achievable_share():
    """The A100 has no measured table: the H100's fitted efficiency scaled by 0.869 / 0.803, so a
    Llama-7B MLP GEMM reaches 0.85-0.87 of the A100's peak (0.82 before, the H100's share)."""
    from sftctl.compiler import matmul_model

    a100, h100 = get_accelerator("A100-80GB"), get_accelerator("H100")
    params = gemm_table.tables()["sm_90"]["bf16xbf16->bf16"]["params"]
    moved = matmul_model.transfer(params, a100, h100, "bfloat16")
    assert moved[0] == pytest.approx(params[0] * 0.869 / 0.803)
    assert moved[1:] == pytest.approx(params[1:])
    assert matmul_model.transfer(params, h100, h100, "bfloat16") == pytest.approx(params)
    assert matmul_model.transfer(params, get_accelerator("L4"), h100, "bfloat16") == pytest.approx(params)
    assert 0.85 <= _fraction(1, 8192, 11008, 4096, a100) <= 0.869
    # the H100 itself on the same GEMM: its own table, under its 0.803
    assert 0.78 <= _fraction(1, 8192, 11008, 4096, h100) <= 0.803 + 1e-9


def _predict(monkeypatch, capsys, lines, target):
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    rc = predict.main(["--target", target, "--no-compile"])
    out = capsys.readouterr()
    return rc, [json.loads(x) for x in out.out.splitlines()], out.err


def test_predict_reads_xla_matmul_records_in_order(monkeypatch, capsys):
    recs = [{"arch": "sm_90", "b": 1, "m": 256, "n": 256, "k": 256, "dtype": "bf16xbf16->bf16"},
            {"b": 2, "m": 4096, "n": 4096, "k": 4096, "dtype": "bf16xbf16->bf16"},
            {"b": 1, "m": 8192, "n": 11008, "k": 4096, "dtype": "f32xf32->f32"},
            {"b": 1, "m": 1024, "n": 1024, "k": 1024, "dtype": "f8e4m3fnxf8e4m3fn->bf16"}]
    rc, out, err = _predict(monkeypatch, capsys, [json.dumps(r) for r in recs], "h100")
    assert rc == 0, err
    assert [{k: v for k, v in o.items() if k != "predicted_s"} for o in out] == recs
    t = [o["predicted_s"] for o in out]
    assert t[0] == pytest.approx(4.99e-6, rel=0.01)
    assert t[1] == pytest.approx(2 * 176.16e-6, rel=0.1)
    assert t[2] > t[1] and t[3] < t[0] * 4
    rc, out, _ = _predict(monkeypatch, capsys, [json.dumps(recs[1])], "b200")
    assert rc == 0 and out[0]["predicted_s"] < t[1] * 0.7


def test_predict_refuses_a_bad_matmul_record(monkeypatch, capsys):
    good = json.dumps({"b": 1, "m": 256, "n": 256, "k": 256, "dtype": "bf16xbf16->bf16"})
    bad = json.dumps({"b": 1, "m": 0, "n": 256, "k": 256, "dtype": "bf16xbf16->bf16"})
    rc, out, err = _predict(monkeypatch, capsys, [good, bad], "h100")
    assert rc == 2 and out == [] and "line 2" in err and "'m'" in err
    rc, out, err = _predict(monkeypatch, capsys, [json.dumps({"m": 1, "n": 1, "k": 1, "dtype": "s8xs8->s32"})], "h100")
    assert rc == 2 and "'dtype'" in err and "bf16xbf16->bf16" in err
