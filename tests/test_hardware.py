"""The accelerator table (catalog/accelerators.yaml) and the offerings' new bandwidth columns."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import yaml

from sftctl.catalog import Offering, accelerator_names, cloud_offerings, local_offering
from sftctl.catalog.accelerators import ACCELERATORS_YAML, TABLE_FIELDS, _number
from sftctl.compiler.hardware import (
    Accelerator,
    find_accelerator,
    get_accelerator,
    load_accelerators,
)

REQUIRED = {"H100", "H200", "B200", "A100-40GB", "A100-80GB", "L4", "A10G", "T4", "V100", "MI300X", "MI355X", "cpu"}
NUMERIC = [f.name for f in dataclasses.fields(Accelerator)
           if f.name not in ("name", "vendor", "triton_backend", "triton_arch", "sources") + TABLE_FIELDS]


def raw_entries() -> dict[str, dict]:
    with ACCELERATORS_YAML.open() as f:
        return {e["name"]: e for e in yaml.safe_load(f)["accelerators"]}


def test_every_required_accelerator_loads():
    table = load_accelerators()
    assert REQUIRED <= set(table)
    assert load_accelerators() is table  # cached


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_fields_positive_and_sourced(name):
    acc = load_accelerators()[name]
    for field in NUMERIC:
        value = getattr(acc, field)
        if isinstance(value, dict):
            assert value and all(v > 0 and math.isfinite(v) for v in value.values()), (name, field)
        else:
            assert value > 0 and math.isfinite(value), (name, field, value)
        assert acc.sources.get(field, "").strip(), f"{name}.{field} has no source"
    assert acc.vendor in ("nvidia", "amd", "cpu")
    assert acc.smem_bytes_per_block <= acc.smem_bytes_per_sm
    assert acc.warp_size in ((8,) if name == "cpu" else (32, 64))
    if name != "cpu":
        assert acc.triton_backend in ("cuda", "hip") and acc.triton_arch is not None
        assert acc.sources.get("triton_arch")
        # each matrix peak beats or equals the vector FP32 rate; bf16 matmul is at least fp32 speed
        assert acc.matrix_peak("bfloat16") >= acc.matrix_peak("float32") >= acc.vector_peak("float32") * 0.99


@pytest.mark.parametrize("name", sorted(REQUIRED - {"cpu"}))
def test_peaks_equal_sms_times_clock_times_per_sm_rate(name):
    """Every peak is SMs x clock x FLOP/clk/SM within 2%: catches a 2:4-sparsity figure copied in."""
    acc = load_accelerators()[name]
    deriv = raw_entries()[name]["derivation"]
    mat, vec = deriv["matrix_flops_per_clk_per_sm"], deriv["vector_flops_per_clk_per_sm"]
    assert set(acc.matrix_flops_per_s) == set(mat), f"{name}: every matrix peak needs a per-SM rate"
    assert set(acc.vector_flops_per_s) == set(vec), f"{name}: every vector peak needs a per-SM rate"
    for dtype, rate in mat.items():
        expect = acc.sm_count * acc.clock_hz * rate
        assert acc.matrix_flops_per_s[dtype] == pytest.approx(expect, rel=0.02), (name, dtype)
    vclock = float(deriv.get("vector_clock_hz", acc.clock_hz))
    for dtype, rate in vec.items():
        assert acc.vector_flops_per_s[dtype] == pytest.approx(acc.sm_count * vclock * rate, rel=0.02), (name, dtype)


# Dense tensor-core peaks from the datasheets (sparse figures halved), TFLOP/s, for the fastest
# 16-bit input each part has. A doubled (2:4 sparsity) figure fails these.
DENSE_16BIT_TFLOPS = {
    "H100": ("bfloat16", 989.4), "H200": ("bfloat16", 989.4), "B200": ("bfloat16", 2250.0), "A100-40GB": ("bfloat16", 312.0),
    "A100-80GB": ("bfloat16", 312.0), "L4": ("bfloat16", 121.0), "A10G": ("bfloat16", 70.0),
    "T4": ("float16", 65.0), "V100": ("float16", 125.0), "MI300X": ("bfloat16", 1307.4),
    "MI355X": ("bfloat16", 2500.0),
}


@pytest.mark.parametrize("name", sorted(DENSE_16BIT_TFLOPS))
def test_dense_not_sparse(name):
    dtype, tflops = DENSE_16BIT_TFLOPS[name]
    assert load_accelerators()[name].matrix_peak(dtype) == pytest.approx(tflops * 1e12, rel=0.01)


def test_hopper_and_cdna3_headline_numbers():
    t = load_accelerators()
    h100, h200, mi = t["H100"], t["H200"], t["MI300X"]
    assert h100.matrix_peak("bfloat16") < 1.1e15  # the datasheet's 1979 is 2:4 sparse
    assert h100.matrix_peak("bfloat16") < 1.2e15
    assert h100.matrix_peak("float32") == pytest.approx(494.7e12, rel=0.01)  # TF32 dense
    assert h200.matrix_flops_per_s == h100.matrix_flops_per_s  # same GH100, only HBM differs
    assert h200.vector_flops_per_s == h100.vector_flops_per_s
    assert h200.hbm_bytes_per_s > h100.hbm_bytes_per_s and h200.memory_bytes > h100.memory_bytes
    assert mi.matrix_peak("bfloat16") == pytest.approx(1.307e15, rel=0.005)
    assert mi.warp_size == 64 and mi.triton_backend == "hip" and mi.triton_arch == "gfx942"
    # our own measurement is on record and below the peak
    assert "784" in h200.sources["matrix_flops_per_s"] and "our measurement" in h200.sources["matrix_flops_per_s"]
    assert 784e12 < h200.matrix_peak("bfloat16")


def test_no_bf16_tensor_cores_before_ampere():
    t = load_accelerators()
    for name in ("T4", "V100"):
        acc = t[name]
        assert acc.matrix_peak("bfloat16") == acc.vector_peak("float32")
        assert acc.matrix_peak("float16") > 5 * acc.matrix_peak("bfloat16")


def test_cpu_is_this_machine():
    cpu = get_accelerator("cpu")
    cores = os.cpu_count() or 1
    assert cpu.sm_count == cores and cpu.vendor == "cpu"
    assert cpu.triton_backend is None and cpu.triton_arch is None
    per_clk = raw_entries()["cpu"]["derivation"]["matrix_flops_per_clk_per_sm"]["float32"]
    assert cpu.matrix_peak("float32") == pytest.approx(cores * cpu.clock_hz * per_clk)
    assert cpu.matrix_peak("bfloat16") == cpu.matrix_peak("float32")
    assert cpu.matrix_peak("float32") < 1e14  # conservative: far below any GPU
    assert "os.cpu_count()" in cpu.sources["sm_count"]
    assert "ASSUMPTION" in cpu.sources["clock_hz"] and "ASSUMPTION" in cpu.sources["hbm_bytes_per_s"]


def test_get_accelerator_is_case_insensitive():
    for spelling in ("h100", "H100", " h100 ", "a100-80gb", "Mi300X", "CPU", "a10g"):
        assert get_accelerator(spelling).name.lower() == spelling.strip().lower()
    assert find_accelerator("nope") is None


def test_get_accelerator_unknown_says_did_you_mean():
    with pytest.raises(KeyError, match="did you mean 'H100'"):
        get_accelerator("H10")
    with pytest.raises(KeyError, match="did you mean 'A100-40GB' or 'A100-80GB'"):
        get_accelerator("a100")
    with pytest.raises(KeyError, match="did you mean 'MI300X'"):
        get_accelerator("mi300")
    with pytest.raises(KeyError, match="unknown accelerator 'tpu-v5'"):
        get_accelerator("tpu-v5")


def test_yaml_numbers_with_unsigned_exponents_are_read():
    assert _number("1.83e9", "x") == 1.83e9  # PyYAML leaves this a string
    assert _number("65_536", "x", int) == 65536
    with pytest.raises(ValueError):
        _number("fast", "x")
    with pytest.raises(ValueError):
        _number(1.5, "x", int)


def test_every_offering_accelerator_is_in_the_hardware_table():
    for o in cloud_offerings() + [local_offering(2)]:
        assert get_accelerator(o.accelerator).name == o.accelerator, o
    for name in accelerator_names():
        assert find_accelerator(name) is not None, name


def test_offering_bandwidths_and_dates():
    offerings = cloud_offerings()
    assert any(o.accelerator == "H200" for o in offerings)
    for o in offerings:
        assert o.as_of and o.as_of[:4].isdigit(), o
        assert o.source and o.bandwidth_source, o
        for bw in (o.intra_node_bytes_per_s, o.inter_node_bytes_per_s):
            assert bw is None or bw > 0, o
        if o.count > 1:  # multi-accelerator nodes say how fast their accelerators talk
            assert o.intra_node_bytes_per_s is not None, o
            # no interconnect is faster than the accelerator's own memory
            assert o.intra_node_bytes_per_s < get_accelerator(o.accelerator).hbm_bytes_per_s
        assert o.inter_node_bytes_per_s is not None, o
        assert o.inter_node_bytes_per_s <= 1e12  # per node: 8 Tbps would be a units mistake
        if o.spot_usd_per_hour is not None:
            assert 0 < o.spot_usd_per_hour < o.usd_per_hour, o
    p5 = next(o for o in offerings if o.instance_type == "p5.48xlarge")
    assert p5.inter_node_bytes_per_s == 3200e9 / 8 and p5.intra_node_bytes_per_s == 450e9


def test_local_offering_and_old_offering_dicts_still_work():
    local = local_offering(3)
    assert local.accelerator == "cpu" and local.count == 3 and local.usd_per_hour == 0.0
    assert local.intra_node_bytes_per_s and local.inter_node_bytes_per_s is None and local.as_of
    # a plan stored before the new fields existed (controller.py rebuilds Offering(**dict))
    old = {"provider": "aws", "instance_type": "g5.xlarge", "accelerator": "A10G", "count": 1,
           "region": "us-east-1", "usd_per_hour": 1.006, "spot_usd_per_hour": None, "vcpus": 4,
           "memory_gib": 16.0, "source": "x"}
    o = Offering(**old)
    assert o.intra_node_bytes_per_s is None and o.as_of == ""
    assert Offering(**o.to_dict()) == o


def test_one_owner_of_the_facts_and_no_cycle():
    """The catalog owns the hardware facts (sftctl.catalog.accelerators) and imports no compiler
    code; the compiler's hardware module is that same table; neither imports numpy or torch."""
    import subprocess
    import sys

    import sftctl.catalog.accelerators as owner
    import sftctl.compiler.hardware as hardware

    assert hardware.Accelerator is owner.Accelerator
    assert hardware.load_accelerators() is owner.load_accelerators()
    assert hardware.get_accelerator("h200") is owner.get_accelerator("H200")
    code = ("import sys, sftctl.catalog as c; names = c.accelerator_names(); "
            "bad = sorted(m for m in sys.modules if m.startswith('sftctl.compiler') or m in ('numpy', 'torch')); "
            "assert not bad and 'H200' in names, bad; "
            "import sftctl.compiler.hardware as h; h.get_accelerator('H100'); "
            "bad = sorted(m for m in sys.modules if m in ('numpy', 'torch')); assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_every_entry_names_its_measured_tables_and_they_exist(name):
    """The record names the data that price it (issue 39): each named table exists in its data
    file, and each one set has a source."""
    from sftctl.compiler import collectives, gemm_table
    from sftctl.compiler.accuracy import ACCURACY_DIR
    from sftctl.compiler.calibrated import CALIBRATION_DIR

    acc = load_accelerators()[name]
    raw = raw_entries()[name]
    assert set(TABLE_FIELDS) <= set(raw), f"{name}: every entry writes {TABLE_FIELDS}"
    for f in TABLE_FIELDS:
        if raw[f] is not None:
            assert acc.sources.get(f, "").strip(), f"{name}.{f} has no source"
    for f in ("gemm_table", "gemm_model"):
        assert getattr(acc, f) is None or (getattr(acc, f) in gemm_table.tables() and acc.gemm_tiles), (name, f)
    assert (acc.gemm_model is None) == (name == "cpu")
    for f in ("collective_link", "pcie_link"):
        collectives.link(getattr(acc, f))  # KeyError when the link is not in collectives.json
    for f in ("calibration", "peers"):
        assert getattr(acc, f) is None or (CALIBRATION_DIR / getattr(acc, f)).exists()
    assert acc.accuracy and (ACCURACY_DIR / acc.accuracy).exists()


def test_an_entry_without_a_table_field_or_its_source_is_refused(tmp_path, monkeypatch):
    from sftctl.catalog import accelerators

    text = ACCELERATORS_YAML.read_text()
    for broken, match in ((text.replace("    gemm_tiles: hipblaslt\n", "", 1), r"missing keys \['gemm_tiles'\]"),
                          (text.replace("    gemm_tiles: hipblaslt\n", "    gemm_tiles: rocblas\n", 1),
                           "unknown tile set 'rocblas'"),
                          (text.replace('      die: "ROCm', '      nodie: "ROCm', 1), "MI300X.die: no source")):
        path = tmp_path / "accelerators.yaml"
        path.write_text(broken)
        monkeypatch.setattr(accelerators, "ACCELERATORS_YAML", path)
        accelerators._document.cache_clear()
        accelerators.load_accelerators.cache_clear()
        with pytest.raises(ValueError, match=match):
            accelerators.load_accelerators()
    monkeypatch.undo()
    accelerators._document.cache_clear()
    accelerators.load_accelerators.cache_clear()
