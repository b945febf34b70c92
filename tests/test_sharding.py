"""DDP vs FSDP (with and without activation checkpointing) in the planner: the memory and time
arithmetic of sftctl.compiler.sharding on a real traced step, and the planner's choice."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from sftctl.compiler import collectives, sharding, step  # noqa: E402
from sftctl.compiler.hardware import get_accelerator  # noqa: E402
from sftctl.compiler.step import compile_graph  # noqa: E402
from sftctl.compiler.target import load_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpt():
    """The example GPT (4 blocks) traced at batch 4 in bf16 mixed precision, compiled for the L4."""
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    try:
        import model as gpt_model
    finally:
        sys.path.pop(0)
    from sftctl.compiler.frontends import torch as torch_frontend

    with torch.device("meta"):
        m, batch, loss_fn = gpt_model.build(batch_size=4)
    graph, _ = torch_frontend.trace_step(m, batch, loss_fn, autocast_dtype="bfloat16")
    units: dict[str, int] = {}
    for name, p in m.named_parameters():  # what prepare() wraps: each of blocks.N, and the root
        key = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else ""
        units[key] = units.get(key, 0) + p.numel()
    return m, compile_graph(graph, load_target("L4")), units


def test_param_units_group_blocks_and_root(gpt):
    m, compiled, units = gpt
    assert compiled.param_units == units
    assert len(units) == len(m.blocks) + 1
    assert step.param_units([("model.layers.12.mlp.up.weight", 6), ("model.layers.12.norm.weight", 2),
                                 ("lm_head.weight", 5)]) == {"model.layers.12": 8, "": 5}


def test_fsdp_memory_is_the_sharded_state_plus_gathered_units(gpt):
    m, compiled, units = gpt
    n_params = sum(p.numel() for p in m.parameters())
    hw = get_accelerator("L4")
    preds = sharding.predict_strategies(compiled, load_target(hw), 4, 1, 25e9, 5e9, mode="eager", param_dtype_bytes=2)
    by = {(p.parallelism, p.activation_checkpointing): p for p in preds}
    ddp, fsdp, fsdp_ck = by["ddp", False], by["fsdp", False], by["fsdp", True]
    pm = compiled.modes["eager"]["peak_memory"]
    # DDP is the compiled step's liveness peak as it is
    assert ddp.memory_bytes == pm["params_bytes"] + pm["opt_state_bytes"] + pm["batch_bytes"] \
        + pm["transient_peak_bytes"] + pm["reserve_bytes"]
    assert pm["params_bytes"] == 4 * n_params and pm["opt_state_bytes"] == 8 * n_params  # fp32 master, AdamW m+v
    # FSDP: 16 bytes a parameter over 4 devices, the largest unit gathered twice in bf16 plus
    # its fp32 gradient, the same activations
    acts = pm["transient_peak_bytes"] - 4 * n_params
    largest = max(units.values())
    expected = (4 * n_params) // 4 * 2 + (8 * n_params) // 4 + acts + 2 * largest * 2 + 4 * largest \
        + pm["batch_bytes"] + pm["reserve_bytes"]
    assert fsdp.memory_bytes == expected
    assert fsdp.breakdown["activations"] == acts > 0
    # checkpointing keeps 2/L of the activations (L = 4 blocks) and recomputes the forward
    assert fsdp_ck.breakdown["activations"] == int(acts * 2 / 4)
    # each device's AdamW step updates its quarter of the parameters: FSDP pays 1/4 of the
    # optimizer's time, DDP all of it; checkpointing adds the forward (a third of the compute)
    opt = compiled.modes["eager"]["by_phase"]["optimizer"]
    assert opt > 0
    assert fsdp.compute_time_s == pytest.approx(ddp.compute_time_s - opt * 3 / 4)
    assert fsdp_ck.compute_time_s == pytest.approx(fsdp.compute_time_s + ddp.compute_time_s / 3)
    # communication: per unit, an all-gather in bf16 and a reduce-scatter in fp32 on L4's PCIe
    # link (measured alpha + bytes / beta, each unit paying the latency), overlapped
    link = collectives.host_link("L4", 25e9)
    assert link.name == "pcie-gen4"
    ag = sum(link.time_s("all-gather", 4, 2 * u) for u in units.values())
    rs = sum(link.time_s("reduce-scatter", 4, 4 * u) for u in units.values())
    fit = link.fit_for("all-gather", 4)
    assert ag == pytest.approx(len(units) * fit.alpha_s + 3 / 4 * 2 * n_params / fit.bus_bytes_per_s)
    n = len(units)
    f = ddp.compute_time_s / 3
    # plus the contention: while the collectives overlap compute, NCCL's 24 SMs are lost to it
    # (the step's GEMMs run in waves over the SMs left, as DDP's overlapped all-reduce pays it)
    slow = step.overlap_slowdown(compiled.kernels, hw.sm_count)
    assert slow > 1.0
    contention = (min(ag * (1 - 1 / n), f) + min(ag + rs * (1 - 1 / n), 2 * f)) * (slow - 1)
    assert contention > 0
    assert fsdp.comm_time_s == pytest.approx(ag / n + max(0, ag * (1 - 1 / n) - f) + rs / n
                                             + max(0, ag + rs * (1 - 1 / n) - 2 * f) + contention)
    # one device: no communication at all
    solo = sharding.predict_strategies(compiled, load_target(hw), 1, 1, None, None, mode="eager", param_dtype_bytes=2)
    assert all(p.comm_time_s == 0 for p in solo)


def test_bf16_reduce_dtype_halves_the_reduce_scatter_bytes(gpt):
    """A job reducing gradients in bf16 (torch's MixedPrecision reduce_dtype=bfloat16, as
    fms-fsdp's bfSixteen policy runs) reduce-scatters half the bytes of a float32 one: its
    collectives, their time and the unit's gradient buffer before the reduce-scatter halve."""
    m, compiled, units = gpt
    ag4, rs4 = sharding.fsdp_collective_bytes(units, 2, 4)
    ag2, rs2 = sharding.fsdp_collective_bytes(units, 2, 2)
    assert ag2 == ag4 == [2 * u for u in units.values()]
    assert rs4 == [4 * u for u in units.values()]
    assert rs2 == [2 * u for u in units.values()] == [b // 2 for b in rs4]
    with pytest.raises(ValueError, match="reduce_dtype_bytes"):
        sharding.fsdp_collective_bytes(units, 2, 3)
    # priced: 8 x A100 over 2 nodes, so the reduce-scatters are long; the default is float32
    target = load_target("A100-80GB")
    args = (compiled, target, 8, 2, 300e9, 50e9)
    kw = dict(mode="eager", param_dtype_bytes=2, parallelisms=("fsdp",), checkpointing=(False,))
    f32 = sharding.predict_strategies(*args, **kw)[0]
    assert sharding.predict_strategies(*args, **kw, reduce_dtype_bytes=4)[0] == f32
    b16 = sharding.predict_strategies(*args, **kw, reduce_dtype_bytes=2)[0]
    largest = max(units.values())
    assert f32.breakdown["gather"] - b16.breakdown["gather"] == 2 * largest
    rs = [collectives.time_s("reduce-scatter", b, "A100-80GB", 8, 2, 300e9, 50e9) for b in rs4]
    rs_half = [collectives.time_s("reduce-scatter", b, "A100-80GB", 8, 2, 300e9, 50e9) for b in rs2]
    assert sum(rs_half) < sum(rs)
    ag = sum(collectives.time_s("all-gather", b, "A100-80GB", 8, 2, 300e9, 50e9) for b in ag2)
    fwd = step.predict(compiled, target, 8, 2, 300e9, 50e9, mode="eager").compute_time_s / 3
    slow = step.overlap_slowdown(compiled.kernels, target.hw.sm_count)
    n = len(units)

    def comm(rs_s: float) -> float:
        return (ag / n + max(0, ag * (1 - 1 / n) - fwd) + rs_s / n + max(0, ag + rs_s * (1 - 1 / n) - 2 * fwd)
                + sharding.fsdp_contention_s(ag, rs_s, n, fwd, 2 * fwd, slow))
    assert f32.comm_time_s == pytest.approx(comm(sum(rs)))
    assert b16.comm_time_s == pytest.approx(comm(sum(rs_half)))
    assert b16.comm_time_s < f32.comm_time_s
    assert b16.compute_time_s == f32.compute_time_s


def test_fsdp_contention_is_the_overlapped_collectives_times_the_lost_share():
    # 10 units: forward overlaps 9/10 of the all-gathers (0.9 s of 1 s, under 2 s of forward);
    # backward the all-gathers and 9/10 of the reduce-scatters (1 + 1.8 = 2.8 s, capped at 2.5 s)
    assert sharding.fsdp_contention_s(1.0, 2.0, 10, 2.0, 2.5, 1.2) == pytest.approx((0.9 + 2.5) * 0.2)
    # short compute caps both: forward 0.5 s, backward 1 s
    assert sharding.fsdp_contention_s(1.0, 2.0, 10, 0.5, 1.0, 1.5) == pytest.approx(1.5 * 0.5)
    # nothing lost when the collectives take no SMs, or there are none
    assert sharding.fsdp_contention_s(1.0, 2.0, 10, 2.0, 2.5, 1.0) == 0.0
    assert sharding.fsdp_contention_s(0.0, 0.0, 10, 2.0, 2.5, 1.3) == 0.0


def test_choose_takes_fsdp_when_only_it_fits(gpt):
    m, compiled, units = gpt
    hw = get_accelerator("L4")
    preds = sharding.predict_strategies(compiled, load_target(hw), 4, 1, 25e9, 5e9, mode="eager", param_dtype_bytes=2)
    by = {(p.parallelism, p.activation_checkpointing): p for p in preds}
    ddp, fsdp = by["ddp", False], by["fsdp", False]
    assert fsdp.memory_bytes < by["ddp", True].memory_bytes < ddp.memory_bytes
    # a device between the two: FSDP without checkpointing is the only plain choice that fits
    small = dataclasses.replace(hw, memory_bytes=(fsdp.memory_bytes + min(ddp.memory_bytes, by["ddp", True].memory_bytes)) // 2)
    preds = sharding.predict_strategies(compiled, load_target(small), 4, 1, 25e9, 5e9, mode="eager", param_dtype_bytes=2)
    best, why = sharding.choose(preds)
    assert (best.parallelism, best.fits) == ("fsdp", True)
    assert "ddp would need" in why and "GiB" in why
    # a device nothing fits: the least memory, said so
    tiny = dataclasses.replace(hw, memory_bytes=1000)
    best, why = sharding.choose(sharding.predict_strategies(compiled, load_target(tiny), 4, 1, 25e9, 5e9, mode="eager"))
    assert not best.fits and why.startswith("nothing fits: fsdp + activation checkpointing needs")


def test_choose_keeps_ddp_unless_another_strategy_is_clearly_faster(gpt):
    """The quickstart on local CPUs priced FSDP at 227.7 ms against DDP's 229.5 (0.8 % apart)
    and took FSDP: sharded checkpoints and a resume on one node that could not read them, for a
    gain inside the model's error. DDP stays unless the other is faster by more than the margin."""
    m, compiled, units = gpt
    preds = sharding.predict_strategies(compiled, load_target(get_accelerator("L4")), 4, 1, 25e9, 5e9,
                                        mode="eager", param_dtype_bytes=2)
    ddp = next(p for p in preds if (p.parallelism, p.activation_checkpointing) == ("ddp", False))
    assert ddp.fits
    for gain, expected in ((0.008, "ddp"), (sharding.SWITCH_MARGIN * 0.9, "ddp"), (sharding.SWITCH_MARGIN * 1.5, "fsdp")):
        faster = [dataclasses.replace(p, step_time_s=ddp.step_time_s * (1 - gain)) if p.parallelism == "fsdp"
                  and not p.activation_checkpointing else p for p in preds]
        faster = [dataclasses.replace(p, step_time_s=ddp.step_time_s * 2) if p.activation_checkpointing else p
                  for p in faster]
        best, why = sharding.choose(faster)
        assert (best.parallelism, best.activation_checkpointing) == (expected, False), (gain, why)
    assert why.startswith("fsdp") and "vs ddp's" in why


def test_planner_names_the_strategy_and_spec_can_fix_it(tmp_path, monkeypatch):
    """The real Predictor on the example GPT: an L4 shrunk so that only FSDP fits; with
    train.parallelism: ddp the offering is rejected with the arithmetic."""
    import sftctl.compiler.target as target_mod
    from conftest import write_spec
    from sftctl.errors import InfeasibleError
    from sftctl.planner import plan
    from sftctl.spec import load_spec

    def write(par: str):
        return load_spec(write_spec(tmp_path / f"{par}.yaml", (
            f"name: job\nworkdir: {ROOT}\nmodel: {{entrypoint: examples/gpt/model.py:build, batch_size: 16, dtype: bfloat16}}\n"
            f"train: {{steps: 100, parallelism: {par}, activation_checkpointing: false}}\n"
            "resources: {accelerators: [L4:4], clouds: [aws]}\nrun: echo\n")))

    real = target_mod.load_target
    l4 = real("L4")
    # first the true L4: everything fits, DDP is as fast as anything here and wins ties
    p = plan(write("auto"), {"aws": None})
    assert p.chosen.parallelism in ("ddp", "fsdp") and p.chosen.activation_checkpointing is False
    strategies = {s["parallelism"]: s for s in p.chosen.strategies}
    cap = (strategies["fsdp"]["memory_bytes"] + strategies["ddp"]["memory_bytes"]) // 2
    small = dataclasses.replace(l4, hw=dataclasses.replace(l4.hw, memory_bytes=cap))  # the planner's one Target
    monkeypatch.setattr(target_mod, "load_target", lambda name: small if name.lower() == "l4" else real(name))
    p = plan(write("auto"), {"aws": None})
    d = p.to_dict()
    assert d["parallelism"] == "fsdp" and d["activation_checkpointing"] is False
    assert d["candidates"][0]["parallelism"] == "fsdp" and "ddp would need" in p.reason
    from sftctl.ui import plan_table

    table = plan_table(p.candidates, 100)
    col = [c.name for c in table.cols].index("STRATEGY")
    # every offering the planner compiled for names its strategy; the snapshot's GCP g2-standard-48
    # rows (L4:4) are listed as excluded by clouds: [aws], never compiled: no strategy ("-")
    strategy = {(c.offering.provider, c.offering.region): row[col] for c, row in zip(p.candidates, table.rows)}
    assert {v for (cloud, _), v in strategy.items() if cloud == "aws"} == {"fsdp"}
    assert {v for (cloud, _), v in strategy.items() if cloud != "aws"} <= {"-"}
    assert all(c.rejected.code.name == "EXCLUDED" for c in p.candidates if c.offering.provider != "aws")
    with pytest.raises(InfeasibleError) as e:
        plan(write("ddp"), {"aws": None})
    assert "nothing fits: ddp needs" in e.value.message and "train.parallelism ddp" in str(e.value.candidates[0].rejected)
