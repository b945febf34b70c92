"""The second held-out set of issue 35 runs on V100 (16 and 32 GB) and T4: the catalog sells them
(AWS P3, P3dn, G4dn; GCP N1 with V100 / T4 attached), with their peaks cited from NVIDIA's
datasheets, and a GPT-2 small plan prices a step on each."""

from __future__ import annotations

import pytest

from sftctl.catalog import cloud_offerings
from sftctl.catalog.accelerators import get_accelerator


def _sold() -> set[tuple[str, str, str, int]]:
    return {(o.provider, o.instance_type, o.accelerator, o.count) for o in cloud_offerings()
            if o.accelerator in ("V100", "V100-32GB", "T4")}


def test_v100_16_and_32_gb_and_t4_are_sold_on_aws_and_gcp():
    sold = _sold()
    for row in [("aws", "p3.2xlarge", "V100", 1), ("aws", "p3.16xlarge", "V100", 8),
                ("aws", "p3dn.24xlarge", "V100-32GB", 8), ("aws", "g4dn.xlarge", "T4", 1),
                ("gcp", "n1-standard-8+V100", "V100", 1), ("gcp", "n1-standard-4+T4", "T4", 1)]:
        assert row in sold, row
    p3dn = next(o for o in cloud_offerings() if o.instance_type == "p3dn.24xlarge")
    assert p3dn.usd_per_hour == pytest.approx(31.212) and p3dn.inter_node_bytes_per_s == pytest.approx(100e9 / 8)


def test_their_peaks_are_the_datasheets():
    v16, v32, t4 = get_accelerator("V100"), get_accelerator("V100-32GB"), get_accelerator("T4")
    assert (v16.memory_bytes, v32.memory_bytes, t4.memory_bytes) == (16 * 2**30, 32 * 2**30, 16 * 2**30)
    for v in (v16, v32):  # V100 SXM2: 125 TFLOPS fp16 tensor, 15.7 FP32; no bf16 tensor cores
        assert v.matrix_flops_per_s == {"float32": 15.7e12, "bfloat16": 15.7e12, "float16": 125e12}
        assert v.hbm_bytes_per_s == 900e9 and v.triton_arch == 70
        assert "V100 datasheet" in v.sources["matrix_flops_per_s"]
    assert t4.matrix_flops_per_s == {"float32": 8.1e12, "bfloat16": 8.1e12, "float16": 65e12}
    assert "T4 Tensor Core GPU datasheet" in t4.sources["matrix_flops_per_s"]
    assert "32 GB HBM2" in v32.sources["memory_bytes"]


def test_a_32_gb_v100_is_told_from_a_16_gb_one():
    from sftctl.catalog.identity import from_node_labels, identify

    assert identify(name="Tesla V100-SXM2-32GB", memory_bytes=32 * 2**30).name == "V100-32GB"
    assert identify(name="Tesla V100-SXM2-16GB", memory_bytes=16 * 2**30).name == "V100"
    assert identify(name="Tesla V100-SXM2-16GB").name == "V100"
    key = "nvidia.com/gpu.product"
    assert from_node_labels({key: "Tesla-V100-SXM2-32GB"}, (key,))[0] == "V100-32GB"
    assert from_node_labels({key: "Tesla-V100-SXM2-16GB"}, (key,))[0] == "V100"


def test_attention_and_accuracy_on_a_32_gb_v100_are_the_v100s():
    from sftctl.compiler import accuracy
    from sftctl.compiler.attention import source

    assert source("V100-32GB")["implementation"] == "efficient"
    assert source("V100-32GB")["table"] == source("V100")["table"] == "mem-efficient-assumed"
    assert accuracy.accuracy("V100-32GB")["error"] == accuracy.accuracy("V100")["error"]


def test_a_gpt2_small_plan_prices_a_step_on_t4_and_both_v100s(tmp_path):
    """examples/gpt2-small.yaml in float16 (sm70 / sm75: fp16 tensor cores, no bf16): every
    offering gets a step time, the 124M model fits 16 GB at 8 x 1024 tokens, and bfloat16 is
    predicted slower there (its matmuls on the CUDA cores) with a note saying so."""
    from pathlib import Path

    from sftctl.planner import plan
    from sftctl.spec import load_spec

    root = Path(__file__).resolve().parents[1]
    text = (root / "examples" / "gpt2-small.yaml").read_text()
    steps = {}
    for dtype in ("float16", "bfloat16"):
        spec_text = (text.replace("workdir: ..", f"workdir: {root}").replace("dtype: bfloat16", f"dtype: {dtype}")
                     .replace("[H100:8, H200:8, A100-80GB:8, A100-40GB:8, L4:1, A10G:1, T4:1, V100:1]",
                              "[T4:1, V100:1, V100-32GB:8]\n  clouds: [aws]"))
        (tmp_path / f"{dtype}.yaml").write_text(spec_text)
        p = plan(load_spec(tmp_path / f"{dtype}.yaml"), usable={"aws": None})
        for c in p.candidates:
            if c.offering.provider != "aws":
                continue  # resources.clouds: [aws]
            assert c.rejected is None, (c.offering.instance_type, str(c.rejected))
            assert c.step_time_s and c.step_time_s > 0
            assert c.peak_memory_bytes < 12 * 2**30
            steps[dtype, c.offering.accelerator] = c.step_time_s
            if dtype == "bfloat16":
                assert "has no bfloat16 tensor cores" in (c.note or "")
    for acc in ("T4", "V100", "V100-32GB"):
        assert steps["bfloat16", acc] > 2 * steps["float16", acc], acc
    assert steps["float16", "T4"] > 1.5 * steps["float16", "V100"]  # 65 vs 125 TFLOPS, 320 vs 900 GB/s
