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
