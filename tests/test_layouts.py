"""Parallel layouts (sftctl.compiler.layouts, issue 38 item 1): the search's choices, the bubble,
memory per rank, the sharded GEMM shapes and the collectives' links, asserted on values."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest

from sftctl.compiler.collectives import time_s as collective_s
from sftctl.compiler.gemm_table import gemm_gpu_time_s
from sftctl.compiler.layouts import (MEGATRON, TORCH_AMP, Layout, Links, TransformerShape, bubble_fraction, choose,
                                     memory_per_rank, price, search)
from sftctl.compiler.layouts.price import _block_compute_s, _Prices
from sftctl.compiler.memory import RUNTIME_RESERVE_BYTES
from sftctl.compiler.target import load_target

LLAMA_70B = TransformerShape(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256, seq_len=8192,
                             gated_mlp=True)
GPT_125M = TransformerShape(layers=12, hidden=768, ffn=3072, heads=12, kv_heads=12, vocab=50257, seq_len=1024)


@pytest.fixture(scope="module")
def h100():
    return load_target("H100")


def test_bubble_matches_a_float64_reference():
    for p in (1, 2, 4, 8, 12, 35):
        for m in (1, 3, 8, 32, 280):
            ref = np.float64(p - 1) / np.float64(m + p - 1)
            assert bubble_fraction(p, m) == pytest.approx(float(ref), rel=1e-15, abs=0)
            for v in (2, 4):
                idle = np.float64(p - 1) / np.float64(v)
                assert bubble_fraction(p, m, v) == pytest.approx(float(idle / (m + idle)), rel=1e-15, abs=0)
    assert bubble_fraction(8, 8) == pytest.approx(7 / 15)
    with pytest.raises(ValueError):
        bubble_fraction(0, 4)


def test_priced_bubble_is_the_formula_times_the_slot(h100):
    links = Links("H100", 8, 1)
    shape = TransformerShape(layers=8, hidden=1024, ffn=4096, heads=16, kv_heads=16, vocab=32000, seq_len=1024)
    one = price(shape, Layout(pp=8, micro_batches=8), h100, links)
    inter = price(shape, Layout(pp=8, micro_batches=8, schedule="interleaved", interleave=1), h100, links)
    assert one.bubble_time_s > 0
    # 1F1B's bubble: (p - 1) slots; interleave=1 is no interleaving
    assert inter.bubble_time_s == pytest.approx(one.bubble_time_s)
    shape16 = TransformerShape(layers=16, hidden=1024, ffn=4096, heads=16, kv_heads=16, vocab=32000, seq_len=1024)
    a = price(shape16, Layout(pp=8, micro_batches=8), h100, links)
    b = price(shape16, Layout(pp=8, micro_batches=8, schedule="interleaved", interleave=2), h100, links)
    assert b.bubble_time_s == pytest.approx(a.bubble_time_s / 2, rel=1e-9)  # the interleave factor divides it


def test_memory_per_rank_matches_a_hand_computation():
    shape = TransformerShape(layers=4, hidden=1024, ffn=4096, heads=8, kv_heads=8, vocab=32000, seq_len=2048)
    lay = Layout(tp=2, pp=2, dp=2, dp_sharding="zero1", micro_batch=2, micro_batches=4, sequence_parallel=False)
    got = memory_per_rank(shape, lay, attention="gemm", precision=MEGATRON)
    h, f, s, v = 1024, 4096, 2048, 32000
    layer = 4 * h * h + 2 * h * f + 2 * h  # qkv + out, two MLP matrices, two norms
    stage = 2 * layer + v * h  # two blocks and the embedding (first stage) of the heaviest stage
    per_rank = stage / 2  # tp2
    assert got["weights"] == int(per_rank * 2)
    assert got["grads"] == int(per_rank * 4)
    assert got["optimizer"] == int(per_rank / 2 * 12)  # ZeRO-1 over dp2
    amp = memory_per_rank(shape, lay, attention="gemm", precision=TORCH_AMP)  # sftctl.train: 4 + 4 + 8
    assert (amp["weights"], amp["grads"], amp["optimizer"]) == (int(per_rank * 4), int(per_rank * 4),
                                                                int(per_rank / 2 * 8))
    # Korthikanti et al. 2022: s b h (10 + 24/t + 5 a s / (h t)) per block, 2 blocks, min(m, p) = 2 in flight
    b, a, t = 2, 8, 2
    per_block = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    # the last stage: one micro-batch in flight (1F1B) and its logits, vocab / tp, 2 + 4 + 4 bytes each
    # (a vocabulary-parallel loss): heavier here than the first stage's two micro-batches
    logits = s * b * v / t * (2 + 4 + 4)
    assert 2 * per_block * 1 + logits > 2 * per_block * 2
    assert got["activations"] == int(2 * per_block * 1) and got["logits"] == int(logits)
    assert got["gather"] == 0 and got["reserve"] == RUNTIME_RESERVE_BYTES
    # a small vocabulary: the first stage is the heavier
    small = memory_per_rank(dataclasses.replace(shape, vocab=1000), lay, attention="gemm", precision=MEGATRON)
    assert small["activations"] == int(2 * per_block * 2) and small["logits"] == 0
    # checkpointing keeps each block's input (2 bytes x s b h) per micro-batch in flight + one block's activations
    ck = memory_per_rank(dataclasses.replace(shape, vocab=100),
                         Layout(tp=2, pp=2, dp=2, dp_sharding="zero1", micro_batch=2, micro_batches=4,
                                checkpointing=True, sequence_parallel=False), attention="gemm", precision=MEGATRON)
    assert ck["activations"] == int(2 * (2 * s * b * h) * 2 + per_block)


def test_sharded_gemms_are_priced_on_their_own_shapes(h100):
    """tp2's block forward is the GEMMs of the halved shapes, not half of tp1's."""
    shape = TransformerShape(layers=2, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000, seq_len=2048,
                             gated_mlp=True)
    prices = _Prices(h100, "bfloat16")
    tokens = 2 * 2048
    for t in (1, 2, 8):
        *_, gemm_fwd, _ = _block_compute_s(shape, Layout(tp=t, dp=8 // t, micro_batch=2), prices, "flash")
        want = sum(gemm_gpu_time_s(1, m, n, k, h100.hw, "bfloat16") for m, n, k in (
            (tokens, math.ceil(3 * 4096 / t), 4096), (tokens, 4096, 4096 // t),
            (tokens, math.ceil(2 * 11008 / t), 4096), (tokens, 4096, math.ceil(11008 / t))))
        assert gemm_fwd == pytest.approx(want, rel=1e-12)
    one = _block_compute_s(shape, Layout(micro_batch=2, dp=8), prices, "flash")[2]
    eight = _block_compute_s(shape, Layout(tp=8, micro_batch=2), prices, "flash")[2]
    assert eight > one / 8 * 1.05  # thinner GEMMs run below the full ones' efficiency


def test_tensor_parallel_collectives_run_on_the_host_link(h100):
    shape = TransformerShape(layers=4, hidden=4096, ffn=16384, heads=32, kv_heads=32, vocab=32000, seq_len=2048)
    links = Links("H100", 8, 2, None, 400e9, "aws")
    lay = Layout(tp=8, dp=2, micro_batch=1, micro_batches=2, sequence_parallel=False)
    got = price(shape, lay, h100, links, tp_comm_overlap=False)
    ar = collective_s("all-reduce", 2048 * 4096 * 2, "H100", 8, 1)  # inside the node
    assert got.comm["tp"] == pytest.approx(2 * 4 * 4 * ar, rel=1e-12)  # 2 micro-batches x 4 blocks x 4
    across = collective_s("all-reduce", 2048 * 4096 * 2, "H100", 8, 2, None, 400e9, "aws")
    assert across > ar


def test_a_125m_model_on_one_node_is_data_parallel_only(h100):
    best, why = choose(search(GPT_125M, h100, Links("H100", 8, 1, None, None, "aws"), 64))
    assert best.fits
    assert (best.layout.tp, best.layout.pp, best.layout.cp, best.layout.dp) == (1, 1, 1, 8), why


def test_a_70b_model_on_8x80gb_nodes_is_not_plain_ddp(h100):
    links = Links("H100", 8, 8, None, 400e9, "aws")
    results = search(LLAMA_70B, h100, links, 128)
    plain = [r for r in results if r.layout.tp == r.layout.pp == r.layout.cp == 1 and r.layout.dp_sharding == "ddp"]
    assert plain and not any(r.fits for r in plain)  # 70B x 18 bytes per parameter on every rank
    best, why = choose(results)
    assert best.fits, why
    assert best.layout.tp > 1 and best.layout.tp <= 8, why  # tensor parallel inside the node
    assert best.layout.world == 64


def test_a_70b_model_on_one_node_does_not_fit_and_says_so(h100):
    best, why = choose(search(LLAMA_70B, h100, Links("H100", 8, 1), 16))
    assert not best.fits
    assert why.startswith("nothing fits: ") and "GiB per rank of 80 GiB" in why


def test_bad_layouts_are_refused(h100):
    with pytest.raises(ValueError, match="sharding"):
        Layout(dp_sharding="zero3")
    with pytest.raises(ValueError, match="ranks"):
        price(GPT_125M, Layout(dp=4), h100, Links("H100", 8, 1))
    with pytest.raises(ValueError, match="does not divide"):
        price(GPT_125M, Layout(tp=8), h100, Links("H100", 8, 1))
    assert Layout(tp=8, pp=4, dp=2, dp_sharding="fsdp").label == "tp8 pp4 dp2 fsdp"
    assert Fraction(bubble_fraction(4, 4)).limit_denominator(100) == Fraction(3, 7)


# ---- the plan shows the layout (item 2)

def _strategy(parallelism: str, step_s: float, memory_bytes: int, capacity: int, ckpt: bool = False):
    from sftctl.compiler.sharding import StrategyPrediction

    return StrategyPrediction(parallelism=parallelism, activation_checkpointing=ckpt, world_size=64,
                              compute_time_s=step_s, comm_time_s=0.0, step_time_s=step_s, memory_bytes=memory_bytes,
                              memory_capacity_bytes=capacity, breakdown={})


def test_a_70b_plan_replaces_fsdp_that_does_not_fit_by_a_tensor_parallel_layout(h100):
    from sftctl.compiler.layouts.offering import launch_env, plan_layout

    links = Links("H100", 8, 8, None, 400e9, "aws")
    cap = int(h100.hw.memory_bytes)
    doc, replaced, why = plan_layout(None, h100, _strategy("fsdp", 9.0, 3 * cap, cap), links, 128, shape=LLAMA_70B)
    assert replaced is not None and replaced.fits and replaced.memory_bytes <= cap
    assert doc["source"] == "search" and doc["tp"] > 1 and doc["tp"] * doc["pp"] * doc["cp"] * doc["dp"] == 64
    assert doc["label"].startswith(f"tp{doc['tp']} ") and "would need" in why
    env = launch_env(doc)
    assert env["SFTCTL_TP"] == str(doc["tp"]) and env["SFTCTL_PP"] == str(doc["pp"])
    assert env["SFTCTL_DP"] == str(doc["dp"]) and env["SFTCTL_PP_SCHEDULE"] == doc["schedule"]
    assert env["SFTCTL_DP_SHARDING"] == doc["dp_sharding"]
    # a strategy that fits (by the layout memory model too: checkpointed, one sequence per rank) is
    # compared with the search on the layout model's own price of its dp64 layout: the tensor/pipeline
    # layout wins by more than the margin there, and its seconds are scaled by compiled / own price
    doc, replaced, _ = plan_layout(None, h100, _strategy("fsdp", 1e-3, cap // 2, cap, ckpt=True), links, 64,
                                   shape=LLAMA_70B)
    own = price(LLAMA_70B, Layout(dp=64, dp_sharding="fsdp", micro_batch=1, checkpointing=True), h100, links)
    assert replaced is not None and doc["tp"] > 1
    assert doc["layout_model_step_time_s"] < own.step_time_s * 0.95
    assert replaced.step_time_s == pytest.approx(doc["layout_model_step_time_s"] * 1e-3 / own.step_time_s)
    assert doc["calibration_scale"] == pytest.approx(1e-3 / own.step_time_s)
    lo, hi = doc["step_time_interval_s"]
    assert lo < replaced.step_time_s < hi
    # a 125M model on one node: the search's best is data parallel, the strategy is kept
    kept, none, _ = plan_layout(None, h100, _strategy("ddp", 0.1, cap // 4, cap), Links("H100", 8, 1), 64,
                                shape=GPT_125M)
    assert none is None and kept == {**kept, "label": "dp8", "tp": 1, "pp": 1, "source": "strategy"}
    # the same strategy without checkpointing, two sequences per rank: the compiled step's liveness
    # said it fits (its peak fell where the gradients are); the layout memory model, which the
    # search uses, says it needs more than the GPU, and a layout that fits replaces it
    doc, replaced, why = plan_layout(None, h100, _strategy("fsdp", 1e-3, cap // 2, cap), links, 128,
                                     shape=LLAMA_70B)
    assert replaced is not None and replaced.fits and "would need" in why, why
    need = float(why.split("fsdp would need ")[1].split(" GiB")[0])
    assert need > cap / 2**30, why
    # train.parallelism fixed by the spec: data parallel only
    fixed, none, _ = plan_layout(None, h100, _strategy("fsdp", 9.0, 3 * cap, cap), links, 128, shape=LLAMA_70B,
                                 model_parallel=False)
    assert none is None and fixed["label"] == "dp64 fsdp"
    assert launch_env(None) == {}


def test_the_plan_table_has_a_layout_column():
    import io

    from rich.console import Console

    from sftctl.types import Offering, PlanChoice
    from sftctl.ui import plan_table

    o = Offering(provider="aws", instance_type="p5.48xlarge", accelerator="H100", count=8, region="us-east-1",
                 usd_per_hour=98.0)
    c = PlanChoice(o, 8, 784.0, step_time_s=12.0, peak_memory_bytes=60 * 2**30, hours=1.0, total_usd=784.0,
                   parallelism="ddp", activation_checkpointing=True,
                   layout={"label": "tp8 pp4 dp2", "tp": 8, "pp": 4, "dp": 2, "source": "search"})
    plain = PlanChoice(o, 8, 784.0, step_time_s=13.0, peak_memory_bytes=60 * 2**30, hours=1.0, total_usd=800.0,
                       parallelism="fsdp", layout={"label": "dp64 fsdp", "dp": 64, "source": "strategy"})
    buf = io.StringIO()
    Console(file=buf, width=200, color_system=None).print(plan_table([c, plain], steps=300))
    text = buf.getvalue()
    assert "LAYOUT" in text and "tp8 pp4 dp2+ckpt" in text and "dp64 fsdp" in text, text
    buf = io.StringIO()  # data-parallel rows only: the STRATEGY column as before
    Console(file=buf, width=200, color_system=None).print(plan_table([plain], steps=300))
    assert "STRATEGY" in buf.getvalue() and "LAYOUT" not in buf.getvalue() and " fsdp " in buf.getvalue()
    doc = c.to_dict()
    assert doc["layout"]["tp"] == 8 and PlanChoice.from_dict(doc).layout == doc["layout"]


def test_expert_parallelism_divides_the_experts_memory_and_routes_tokens(h100):
    shape = TransformerShape(layers=2, hidden=512, ffn=1024, heads=8, kv_heads=8, vocab=1000, seq_len=512,
                             experts=8, top_k=2)
    expert = 2 * 2 * 512 * 1024 * 8  # 2 blocks x 2 matrices x h x f x 8 experts
    dense = 2 * (4 * 512 * 512 + 2 * 512) + 2 * 1000 * 512  # attention + norms, embedding and head
    assert memory_per_rank(shape, Layout(dp=8))["weights"] == int((dense + expert) * 4)
    assert memory_per_rank(shape, Layout(dp=8, ep=8))["weights"] == int((dense + expert / 8) * 4)
    # ZeRO-1: dense optimizer state over the 8 data ranks, each expert's over the 8 / ep ranks holding it
    z = memory_per_rank(shape, Layout(dp=8, ep=4, dp_sharding="zero1"))
    assert z["optimizer"] == int(dense * 8 / 8 + expert / 4 * 8 / 2)
    # FSDP gathers one block's dense weights and its local experts, not every expert
    f = memory_per_rank(shape, Layout(dp=8, ep=8, dp_sharding="fsdp"))
    unit = 4 * 512 * 512 + 2 * 512 + 2 * 512 * 1024 * 8 / 8
    assert f["gather"] == int(unit * (2 * 2 + 4))
    links = Links("H100", 8, 1)
    # capacity factor 1.0: exactly the uniform top-k load on every rank
    got = price(shape, Layout(dp=8, ep=8, micro_batch=2), h100, links, capacity_factor=1.0)
    a2a = collective_s("all-to-all", 2 * 512 * 2 * 512 * 2, "H100", 8, 1)  # tokens x top_k x hidden x bf16
    assert got.comm["ep"] == pytest.approx(2 * 4 * a2a, rel=1e-12)  # 2 blocks x dispatch+combine each way
    with pytest.raises(ValueError, match="ep must divide"):
        price(shape, Layout(dp=8, ep=3), h100, links)


# ---- issue 38's done-when picks, and why each wins

MIXTRAL = TransformerShape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=32000, seq_len=4096,
                           gated_mlp=True, experts=8, top_k=2, dropout=False)
LLAMA_70B_32K = TransformerShape(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256,
                                 seq_len=32768, gated_mlp=True, dropout=False)
EFA_P5 = 3200e9 / 8  # p5.48xlarge: 3200 Gbit/s of EFA per node


def test_mixtral_on_8_h100_nodes_picks_expert_parallelism(h100):
    results = search(MIXTRAL, h100, Links("H100", 8, 8, None, EFA_P5, "aws"), 1024)
    best, why = choose(results)
    assert best.fits and best.layout.ep > 1, why
    assert best.layout.tp * best.layout.ep <= 8 or best.layout.tp == 1, why  # the all-to-all stays in a node
    # the fastest layout that fits is an expert-parallel one; the best without is slower
    fastest = min((r for r in results if r.fits), key=lambda r: r.step_time_s)
    no_ep = min((r for r in results if r.fits and r.layout.ep == 1), key=lambda r: r.step_time_s)
    assert fastest.layout.ep > 1 and no_ep.step_time_s > fastest.step_time_s, (no_ep.layout.label, fastest.layout.label)
    lo, hi = best.step_time_interval_s
    assert lo < best.step_time_s < hi and best.to_dict()["step_time_interval_s"] == [lo, hi]


def test_an_moe_blocks_tensor_parallel_pair_around_the_experts_is_exposed(h100):
    """With overlap, a dense block's TP collectives hide under (t-1)/t of its GEMMs; an MoE block's
    pair around the router and experts cannot (the router needs the whole gathered input)."""
    links = Links("H100", 8, 1)
    lay = Layout(tp=8, micro_batch=1, micro_batches=1)
    moe = price(MIXTRAL, lay, h100, links)
    ar = collective_s("all-reduce", 4096 * 4096 * 2, "H100", 8, 1)
    # one block: 2 all-reduce-equivalents each way, the MoE one of them exposed; 32 blocks
    assert moe.comm["tp"] >= 32 * 2 * ar * (1 - 1e-9)
    dense = dataclasses.replace(MIXTRAL, experts=0, top_k=0)
    assert price(dense, lay, h100, links).comm["tp"] < 0.5 * moe.comm["tp"]


def test_a_32k_context_70b_model_picks_context_parallelism_beside_tp_in_the_node(h100):
    best, why = choose(search(LLAMA_70B_32K, h100, Links("H100", 8, 8, None, EFA_P5, "aws"), 128))
    assert best.fits and best.layout.cp > 1, why
    assert 1 < best.layout.tp <= 8, why


def test_llama3_70b_on_h100_8x8_picks_tensor_parallelism_inside_the_node(h100):
    shape = dataclasses.replace(LLAMA_70B, dropout=False)
    best, why = choose(search(shape, h100, Links("H100", 8, 8, None, EFA_P5, "aws"), 512))
    assert best.fits and 1 < best.layout.tp <= 8 and 8 % best.layout.tp == 0, why
    assert best.memory_bytes <= best.memory_capacity_bytes


def test_shape_from_graph_reads_grouped_query_heads():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from sftctl.compiler.frontends import torch as torch_frontend
    from sftctl.compiler.layouts import shape_from_graph

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.o_proj = torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
            self.k_proj, self.v_proj = torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 32, bias=False)
            self.gate_proj, self.up_proj = torch.nn.Linear(64, 160, bias=False), torch.nn.Linear(64, 160, bias=False)
            self.down_proj = torch.nn.Linear(160, 64, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q = self.q_proj(x).view(b, s, 4, 16).transpose(1, 2)
            k, v = (p(x).view(b, s, 2, 16).transpose(1, 2).repeat_interleave(2, dim=1)
                    for p in (self.k_proj, self.v_proj))
            x = x + self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
                                .reshape(b, s, 64))
            return x + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(500, 64)
            self.layers = torch.nn.ModuleList(Block() for _ in range(3))
            self.lm_head = torch.nn.Linear(64, 500, bias=False)

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(x)

    with torch.device("meta"):
        m = Model()
    ids = torch.zeros(2, 128, dtype=torch.long)
    graph, _ = torch_frontend.trace_step(m, (ids, ids), lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1),
                                                                                   b[1].flatten()))
    got = shape_from_graph(graph)
    assert got is not None
    assert (got.layers, got.hidden, got.ffn, got.heads, got.kv_heads, got.vocab, got.seq_len) == (
        3, 64, 160, 4, 2, 500, 128)
    assert got.gated_mlp and not got.tied_embeddings and not got.dropout


def test_train_pipeline_is_the_specs_switch_for_pipeline_layouts(tmp_path, h100):
    """``train.pipeline`` (default false) says the script steps the Pipeline sft.prepare(model,
    loss_fn=...) returns; the planner passes it to plan_layout as ``pipeline``, which leaves out
    every layout with pipeline stages when it is false. A wrong value is one line naming the field."""
    from conftest import write_spec
    from sftctl.compiler.layouts.offering import plan_layout
    from sftctl.errors import SpecError
    from sftctl.spec import load_spec

    base = "name: j\nresources: {accelerators: [cpu:1]}\nrun: echo\n"
    assert load_spec(write_spec(tmp_path / "a.yaml", base)).train.pipeline is False
    assert load_spec(write_spec(tmp_path / "b.yaml", base + "train: {pipeline: true}\n")).train.pipeline is True
    with pytest.raises(SpecError) as e:
        load_spec(write_spec(tmp_path / "c.yaml", base + "train: {pipeline: maybe}\n"))
    assert "train.pipeline" in e.value.message and "\n" not in e.value.message
    # Llama-3-70B on 8 nodes of H100:8, 512 sequences per step: the search's pick has pipeline
    # stages when they are allowed, and none when the spec does not allow them
    links = Links("H100", 8, 8, None, 400e9, "aws")
    cap = int(h100.hw.memory_bytes)
    chosen = _strategy("fsdp", 9.0, 3 * cap, cap)
    with_pp, _, _ = plan_layout(None, h100, chosen, links, 512, shape=LLAMA_70B, pipeline=True)
    without, _, _ = plan_layout(None, h100, chosen, links, 512, shape=LLAMA_70B, pipeline=False)
    assert with_pp["pp"] > 1 and without["pp"] == 1, (with_pp["label"], without["label"])


# ---- context parallelism's load balance, expert parallelism's router load (H8)


def test_context_parallel_attention_is_priced_as_the_split_training_runs(h100):
    """sftctl.train's ring attention cuts the sequence zigzag by default (every rank the mean
    causal share, tests/test_parallel_train.py measures its FLOPs): the price's attention per rank
    is the whole sequence's / cp. The contiguous split (``cp_load_balance=False``) is priced at its
    last rank, (2cp-1)/cp times the mean, and the step is the slowest rank's: its compute grows
    by exactly the extra attention."""
    from sftctl.compiler.fusion import causal_fraction
    from sftctl.compiler.layouts.price import _attention_s, cp_kept_fraction
    from sftctl.train.context_parallel import LOAD_BALANCE, attention_work

    assert LOAD_BALANCE is True  # what the default price assumes
    for cp in (2, 4, 8):
        s = 4096
        n = s // cp
        # the kept share of the slowest rank's n x s rectangle is the pairs training computes there
        assert cp_kept_fraction(s, cp, False) * n * s == pytest.approx(max(attention_work(s, cp, False)), rel=1e-12)
        assert cp_kept_fraction(s, cp, True) * n * s == pytest.approx(max(attention_work(s, cp, True)), rel=1e-12)
        assert cp_kept_fraction(s, cp, True) == causal_fraction(s, s)
    prices = _Prices(h100, "bfloat16")
    whole = _attention_s(LLAMA_70B_32K, Layout(tp=8), prices, "flash")
    for cp in (2, 4, 8):
        lay = Layout(tp=8, cp=cp)
        bal = _attention_s(LLAMA_70B_32K, lay, prices, "flash")
        slow = _attention_s(LLAMA_70B_32K, lay, prices, "flash", cp_load_balance=False)
        for w, b, u in zip(whole, bal, slow):
            assert b * cp == pytest.approx(w, rel=0.02)  # the balanced share: 1/cp of the whole
            assert u / b == pytest.approx((2 * cp - 1) / cp, rel=0.01)
    links = Links("H100", 8, 1)
    lay = Layout(tp=2, cp=4, micro_batches=4)
    even = price(LLAMA_70B_32K, lay, h100, links)
    uneven = price(LLAMA_70B_32K, lay, h100, links, cp_load_balance=False)
    assert even == price(LLAMA_70B_32K, lay, h100, links, cp_load_balance=True)  # the default
    b, u = _attention_s(LLAMA_70B_32K, lay, prices, "flash"), \
        _attention_s(LLAMA_70B_32K, lay, prices, "flash", cp_load_balance=False)
    extra = 4 * 80 * ((u[0] - b[0]) + (u[1] - b[1]))  # micro-batches x blocks x (forward + backward)
    assert uneven.compute_time_s - even.compute_time_s == pytest.approx(extra, rel=1e-9)
    assert uneven.step_time_s > 1.2 * even.step_time_s


def test_expert_load_is_the_busiest_ranks_expected_share_or_the_capacity(h100):
    """Dropless routing (sftctl.train's: no token dropped) puts the step on the expert-parallel
    rank that receives the most tokens; its expected load over the uniform share, for a router
    balanced in expectation, agrees with a Monte Carlo of top-k routing (uniform draws of k
    distinct experts per token, 400 batches) within 10 % of the excess. A capacity factor
    (GShard / Switch buffers) is that factor exactly. The price carries it into the all-to-all."""
    from sftctl.compiler.layouts.memory import CAPACITY_FACTOR, expert_load

    rng = np.random.default_rng(0)
    for experts, k, ep, seq in ((8, 2, 4, 512), (8, 2, 8, 512), (64, 6, 8, 256)):
        shape = TransformerShape(layers=2, hidden=512, ffn=1024, heads=8, kv_heads=8, vocab=1000, seq_len=seq,
                                 experts=experts, top_k=k)
        lay = Layout(dp=ep, ep=ep)
        n = ep * seq  # the tokens the ep ranks route together
        peaks = []
        for _ in range(400):
            idx = rng.random((n, experts)).argsort(-1)[:, :k]
            counts = np.bincount((idx // (experts // ep)).ravel(), minlength=ep)
            peaks.append(counts.max() / (n * k / ep))
        got = expert_load(shape, lay)
        assert got - 1 == pytest.approx(np.mean(peaks) - 1, rel=0.1), (experts, k, ep, got, np.mean(peaks))
        assert expert_load(shape, lay, CAPACITY_FACTOR) == 1.25
        assert expert_load(shape, Layout(dp=ep)) == 1.0  # one rank holds every expert: its total is fixed
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_load(shape, lay, 0.0)
    shape = TransformerShape(layers=2, hidden=512, ffn=1024, heads=8, kv_heads=8, vocab=1000, seq_len=512,
                             experts=8, top_k=2)
    links, lay = Links("H100", 8, 1), Layout(dp=8, ep=8, micro_batch=2)
    dropless = price(shape, lay, h100, links)
    load = expert_load(shape, lay)
    a2a = collective_s("all-to-all", 2 * 512 * 2 * load * 512 * 2, "H100", 8, 1)
    assert dropless.comm["ep"] == pytest.approx(2 * 4 * a2a, rel=1e-12)
    capped = price(shape, lay, h100, links, capacity_factor=CAPACITY_FACTOR)
    a2a = collective_s("all-to-all", 2 * 512 * 2 * 1.25 * 512 * 2, "H100", 8, 1)
    assert capped.comm["ep"] == pytest.approx(2 * 4 * a2a, rel=1e-12)
    uniform = price(shape, lay, h100, links, capacity_factor=1.0)
    assert uniform.step_time_s < dropless.step_time_s < capped.step_time_s
    assert uniform.memory["activations"] < dropless.memory["activations"] < capped.memory["activations"]
