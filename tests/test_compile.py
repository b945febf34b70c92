"""The compiler end to end: trace the quickstart's model, compile, predict, plan, CLI output."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import REPO, sftctl
from sftctl.compiler.driver import compile_for, trace_model
from sftctl.compiler.hardware import get_accelerator
from sftctl.compiler.step import compile_graph, predict
from sftctl.compiler.target import load_target


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    import os

    os.environ["SFTCTL_HOME"] = str(tmp_path_factory.mktemp("home"))
    return trace_model("torch", "examples/gpt/model.py:build", str(REPO), 4, "float32")


def test_compile_and_cache(graph):
    c = compile_for(graph, load_target("H100"), matmul_precision="high")  # TF32: tensor-core schedules searched
    assert c.kernels and c.compute_time_s > 0
    assert sum(k.time_s for k in c.kernels) == pytest.approx(c.compute_time_s)
    assert c.candidates >= 100_000 * len([k for k in c.kernels if k.kind == "gemm"]) // 10
    n_params = sum(n.type.numel for n in graph.inputs_with_role("param"))
    assert c.peak_memory["params_bytes"] == 4 * n_params
    assert c.peak_memory["opt_state_bytes"] == 2 * 4 * n_params  # AdamW: exp_avg and exp_avg_sq
    assert c.grad_bytes == 4 * n_params
    gemms = [k for k in c.kernels if k.kind == "gemm"]
    assert all(k.config and k.config["BLOCK_M"] in (16, 32, 64, 128, 256) for k in gemms)
    again = compile_for(graph, load_target("H100"), matmul_precision="high")  # from the disk cache
    assert again.to_dict() == c.to_dict()


def test_more_bandwidth_or_flops_never_slower(graph):
    hw = get_accelerator("A100-80GB")
    base = compile_graph(graph, load_target(hw)).compute_time_s
    faster_mem = dataclasses.replace(hw, hbm_bytes_per_s=hw.hbm_bytes_per_s * 2)
    faster_mma = dataclasses.replace(hw, matrix_flops_per_s={k: v * 2 for k, v in hw.matrix_flops_per_s.items()})
    assert compile_graph(graph, load_target(faster_mem)).compute_time_s <= base
    assert compile_graph(graph, load_target(faster_mma)).compute_time_s <= base


def test_data_parallel_adds_allreduce(graph):
    hw = load_target("H100")
    c = compile_for(graph, hw, matmul_precision="highest")
    one = predict(c, hw, 1, 1, None, None)
    assert one.allreduce_time_s == 0 and one.step_time_s == c.compute_time_s
    eight = predict(c, hw, 8, 2, 450e9, 400e9)
    assert eight.world_size == 16 and eight.step_time_s >= c.compute_time_s
    slow_net = predict(c, hw, 8, 2, 450e9, 1e9)
    assert slow_net.allreduce_time_s > eight.allreduce_time_s


def test_cli_plan_compile_catalog(tmp_path, home):
    proc = sftctl("plan", "examples/quickstart.yaml", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    chosen = doc["chosen"]
    assert chosen["offering"]["provider"] == "local" and chosen["step_time_s"] > 0
    assert doc["candidates"][0]["total_usd"] == 0.0 and "candidates" not in chosen
    assert set(doc) == {"job", "objective", "steps", "chosen", "reason", "candidates", "catalog"}
    out = tmp_path / "c"
    proc = sftctl("compile", "examples/quickstart.yaml", "--target", "h100", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert plan["accelerator"] == "H100" and plan["kernels"]
    assert "| # | kernel |" in (out / "report.md").read_text()
    assert "ms/step in eager mode" in " ".join(proc.stdout.split())
    bad = sftctl("compile", "examples/quickstart.yaml", "--target", "h1000")
    assert bad.returncode == 2 and "did you mean" in bad.stderr and "Traceback" not in bad.stderr
    cat = json.loads(sftctl("catalog", "--accelerator", "h100", "--json", check=True).stdout)["offerings"]
    assert cat and {o["accelerator"] for o in cat} == {"H100"}
    assert all(o["source"] for o in cat)


def test_jax_spec_plans_and_runs(home):
    pytest.importorskip("jax")
    doc = json.loads(sftctl("plan", "examples/jax-mlp.yaml", "--json", check=True).stdout)
    assert doc["chosen"]["step_time_s"] > 0
    proc = sftctl("run", "examples/jax-mlp.yaml", "--set", "train.steps=60", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = json.loads(proc.stdout)
    assert run["status"] == "SUCCEEDED"
    (rank,) = run["ranks"]
    assert rank["step"] == 60 and rank["loss"] < rank["first_loss"]
