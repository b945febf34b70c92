"""The cross-validated error factors (issue 20 item 2): shape buckets, quantile factors, their
combination, and the shipped accuracy files being what the CV code computes."""

from __future__ import annotations

import json
import math

import pytest

from sftctl.compiler import accuracy, accuracy_cv, gemm_table


def test_size_buckets_are_contiguous_disjoint_and_cover_every_shape():
    shapes = sorted({tuple(r[1:4]) for r in gemm_table.tables()["sm_90"]["bf16xbf16->bf16"]["rows"]})
    b = gemm_table.size_buckets(shapes, 5)
    assert set(b) == set(shapes) and set(b.values()) == set(range(5))
    counts = [sum(1 for v in b.values() if v == i) for i in range(5)]
    assert max(counts) - min(counts) <= 1
    vol = {i: [m * n * k for (m, n, k), v in b.items() if v == i] for i in range(5)}
    for i in range(4):  # a held-out bucket is a size range none of the others covers
        assert max(vol[i]) <= min(vol[i + 1])


def test_factor_is_the_quantile_of_log_errors_and_parts_add_in_quadrature():
    assert accuracy_cv.factor([1.1] * 10) == pytest.approx(1.1)
    assert accuracy_cv.factor([1 / 1.2] * 5 + [1.2] * 5) == pytest.approx(1.2)
    # 90 % of |ln r|: nine of ten within 1.05, one at 2: the factor stays near 1.05
    assert accuracy_cv.factor([1.05] * 9 + [2.0]) < 1.2
    assert accuracy_cv.combine([1.1, 1.1]) == pytest.approx(math.exp(math.sqrt(2) * math.log(1.1)))
    for bad in ([], [1.0, -1.0], [0.0]):
        with pytest.raises(ValueError):
            accuracy_cv.factor(bad)


def test_shipped_factors_are_what_the_cross_validation_computes():
    """B200's file: the GEMM part (5-fold over shape buckets of XLA's sm_100_B200 bf16 table) and
    the collectives part recomputed here; the factor is the GEMM and step parts in quadrature."""
    doc = json.loads((accuracy.ACCURACY_DIR / "b200.json").read_text())
    parts = doc["error"]["parts"]
    gemm = accuracy_cv.gemm_part("sm_100_B200")
    assert gemm["n"] == parts["gemm"]["n"] == 375 and gemm["factor"] == pytest.approx(parts["gemm"]["factor"], abs=1e-3)
    coll = accuracy_cv.collectives_part("sm_100_B200")
    assert coll["n"] == parts["collectives"]["n"] and coll["factor"] == pytest.approx(parts["collectives"]["factor"])
    for name in ("h100", "h200", "b200", "mi355x"):
        e = json.loads((accuracy.ACCURACY_DIR / f"{name}.json").read_text())["error"]
        p = e["parts"]
        assert e["factor"] == pytest.approx(accuracy_cv.combine([p["gemm"]["factor"], p["step_composition"]["factor"]]),
                                            abs=1e-3), name
        assert e["collectives_factor"] == p["collectives"]["factor"] and "shape buckets" in p["gemm"]["method"]
        assert accuracy.accuracy(name)["error"] == e["factor"]


def test_tool_refuses_an_accelerator_without_tables(capsys):
    assert accuracy_cv.main(["Z100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Z100" in err and "H100" in err


def test_held_out_report_is_the_recorded_one_and_meets_the_bands_it_claims():
    """Issue 20's done-when checks on the data we have (benchmarks/results/accuracy_cv.json,
    written by ``python -m sftctl.compiler.accuracy_cv --write``): recomputed here, equal to the
    record, and each ``ok`` is its band applied to its figures."""
    from pathlib import Path

    rep = accuracy_cv.held_out_report()
    recorded = json.loads((Path(accuracy_cv.__file__).resolve().parents[2] / "benchmarks" / "results"
                           / "accuracy_cv.json").read_text())
    for name, g in rep["gemm"].items():
        r = recorded["gemm"][name]
        assert (g["n"], g["ok"]) == (r["n"], r["ok"]) and g["median"] == pytest.approx(r["median"], abs=2e-3), name
        assert g["ok"] == (0.9 <= g["median"] <= 1.1 and g["within_0.8_1.25"] >= 0.8)
    # the criterion names H100: its library GEMMs, 300 held-out shapes, median 1.013, 98.7 % in 0.8-1.25
    assert rep["gemm"]["H100"]["ok"] and rep["gemm"]["H100"]["n"] == 300
    for name, c in rep["collectives"].items():
        assert set(c["held_out_sizes"]) == {"<1MiB", "1-64MiB", ">=64MiB"}, name
        for bucket, v in c["held_out_sizes"].items():
            assert v["median"] == pytest.approx(recorded["collectives"][name]["held_out_sizes"][bucket]["median"],
                                                abs=2e-3)
            assert v["ok"] == (0.8 <= v["median"] <= 1.25)
        assert c["ok"], name  # every 8-GPU host, every size bucket
    for kind, t in rep["triton_h200"].items():
        assert t["spearman"] == pytest.approx(recorded["triton_h200"][kind]["spearman"], abs=1e-3), kind
        assert t["ok"] == (t["spearman"] >= 0.9 and t["pick_over_best"] <= 1.10)
    assert {k for k, t in rep["triton_h200"].items() if t["ok"]} >= {"gemm", "layernorm", "softmax"}
    lines = accuracy_cv.format_report(rep)
    assert sum(line.endswith(("ok", "FAIL")) or " FAIL " in line or " ok " in line for line in lines) >= 10
