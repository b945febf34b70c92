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
        kernels = accuracy_cv.combine([p["gemm"]["factor"], p["step_composition"]["factor"]])
        assert e["factor"] == pytest.approx(max(kernels, p["published_steps"]["factor"]), abs=1e-3), name
        assert p["published_steps"] == accuracy_cv.published_part(doc_name(name)), name
        assert e["collectives_factor"] == p["collectives"]["factor"] and "shape buckets" in p["gemm"]["method"]
        assert accuracy.accuracy(name)["error"] == e["factor"]


def doc_name(file_stem: str) -> str:
    return json.loads((accuracy.ACCURACY_DIR / f"{file_stem}.json").read_text())["accelerator"]


def test_published_part_is_the_own_records_quantile_or_the_pooled_one():
    """An accelerator with MIN_OWN_RECORDS published steps takes the 90 % quantile of its own
    |ln(pred/meas)|; one with fewer takes its die's (A100-40GB: A100-80GB's, H200: H100's), else
    every record's."""
    own = [1.0] * 7 + [1.1, 1 / 1.3, 1.5]  # 10 records: 90 % quantile of |ln r| between ln 1.3 and ln 1.5
    ratios = {"H100": own, "H200": [2.0, 2.0], "A100-80GB": [1.05] * 8}
    h100 = accuracy_cv.published_part("H100", ratios)
    assert (h100["n"], h100["own"]) == (10, 10) and h100["factor"] == pytest.approx(accuracy_cv.factor(own), abs=1e-4)
    assert math.log(1.3) < math.log(h100["factor"]) < math.log(1.5)
    # leaving each out: the two widest (1 / 1.3 and 1.5) fall outside the others' factor, the rest inside
    assert h100["covered_leave_one_out"] == pytest.approx(0.8)
    b200 = accuracy_cv.published_part("B200", ratios)  # none of its own, no other B200 die
    assert (b200["n"], b200["own"]) == (20, 0) and "pooled" in b200["method"]
    assert b200["factor"] == pytest.approx(accuracy_cv.factor(own + [2.0, 2.0] + [1.05] * 8), abs=1e-4)
    h200 = accuracy_cv.published_part("H200", ratios)  # two of its own: H100's, the same die
    assert (h200["n"], h200["own"], h200["factor"]) == (10, 10, h100["factor"])
    a40 = accuracy_cv.published_part("A100-40GB", ratios)
    assert (a40["n"], a40["own"], a40["factor"]) == (8, 8, pytest.approx(1.05, abs=1e-4))
    assert "carried over to A100-40GB" in a40["method"]
    # no tables and no steps of its own: no factor from this tool
    with pytest.raises(KeyError):
        accuracy_cv.accelerator_error("L4", ratios=ratios)
    a80 = accuracy_cv.accelerator_error("A100-80GB", ratios=ratios)
    assert a80["factor"] == pytest.approx(1.05, abs=1e-3) and "collectives_factor" not in a80


def test_the_published_steps_factor_covers_what_the_records_say():
    """The shipped A100-80GB and H100 factors hold at least 80 % of their own published steps
    (benchmarks/results/published_steps.json) within [predicted / f, predicted x f]."""
    ratios = accuracy_cv.published_ratios()
    for name in ("A100-80GB", "H100"):
        f = accuracy.factor(name)
        inside = [1 / f <= r <= f for r in ratios[name]]
        assert len(inside) >= accuracy_cv.MIN_OWN_RECORDS and sum(inside) / len(inside) >= 0.8, (name, f)
        assert accuracy.accuracy(name)["calibrated"], name


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
