"""benchmarks/published_steps.py's records (issue 20 item 3): each is sourced and quoted, none
comes from the five held-out sources, and each names a model the examples define; and its pick
report (issue 35 item 6): matched groups, each GPU's price, the cost regret of each rule."""

from __future__ import annotations

import ast
import importlib.util

import pytest

from conftest import REPO

HELD_OUT = ("llm-foundry", "torchtitan", "tinyllama", "nanogpt", "llm.c")


def _bench():
    spec = importlib.util.spec_from_file_location("published_steps", REPO / "benchmarks" / "published_steps.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_records_are_sourced_quoted_and_not_held_out():
    mod = _bench()
    recs = mod.RECORDS
    assert len(recs) >= 12 and len({r["gpu"] for r in recs}) >= 2
    for r in recs:
        assert r["source"] and r["quote"], r["name"]
        text = (r["source"] + r["quote"]).lower()
        assert not any(h in text for h in HELD_OUT), r["name"]
        assert mod.measured_s(r) > 0
        path, fn = r["entrypoint"].split(":")
        tree = ast.parse((REPO / path).read_text())
        assert fn in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, r["entrypoint"]
    # throughput converts to seconds per step: tokens per GPU per step / tokens per second per GPU
    r = next(r for r in recs if "tokens_per_s_per_gpu" in r)
    assert mod.measured_s(r) == r["batch_per_gpu"] * r["seq_len"] / r["tokens_per_s_per_gpu"]


def _row(gpu, step_meas, step_pred, *, entry="m.py:f", seq=1000, batch=1, mode="eager", name="m"):
    return {"name": name, "gpu": gpu, "entrypoint": entry, "seq_len": seq, "batch_per_gpu": batch, "dtype": "bfloat16",
            "mode": mode, "measured_step_s": step_meas, "predicted_step_s": step_pred}


def test_matched_groups_hold_the_job_fixed_and_need_two_gpus():
    mod = _bench()
    rows = [_row("A", 1.0, 0.9), _row("B", 0.4, 0.5), _row("B", 0.3, 0.3, mode="default"),
            _row("A", 2.0, 2.0, batch=2), _row("C", 1.0, 1.0, entry="other.py:g")]
    strict = mod.matched_groups(rows, mod.STRICT)
    assert [sorted(g["rows"]) for g in strict] == [["A", "B"]]  # the eager batch-1 job on A and B
    assert strict[0]["rows"]["B"]["mode"] == "eager"
    loose = mod.matched_groups(rows, mod.LOOSE)  # same model and sequence: the first record per GPU
    assert [sorted(g["rows"]) for g in loose] == [["A", "B"]] and loose[0]["rows"]["A"]["batch_per_gpu"] == 1


def test_cost_regret_of_each_rule_on_a_hand_computed_example():
    mod = _bench()
    prices = {"A": 2.0, "B": 4.0, "C": 9.0}     # USD per GPU-hour
    fastest = {"A": 1, "B": 2, "C": 3}          # C is the fastest GPU on paper
    g1 = {"name": "g1", "rows": {"A": _row("A", 1.0, 0.9), "B": _row("B", 0.4, 0.5)}}
    # measured USD per GPU-hour x s: A 2.0, B 1.6 (best); predicted A 1.8 < B 2.0: the pick is A
    g2 = {"name": "g2", "rows": {"A": _row("A", 3.0, 2.5), "B": _row("B", 0.8, 1.0), "C": _row("C", 0.5, 0.6)}}
    # measured A 6.0, B 3.2 (best), C 4.5; predicted A 5.0, B 4.0 (pick), C 5.4
    out = mod.cost_regret([g1, g2], prices, fastest)
    assert [g["choice"] for g in out["groups"]] == [{"sftctl": "A", "price": "A", "fastest": "B"},
                                                    {"sftctl": "B", "price": "A", "fastest": "C"}]
    assert [g["best"] for g in out["groups"]] == ["B", "B"]
    assert out["groups"][0]["regret"] == pytest.approx({"sftctl": 0.25, "price": 0.25, "fastest": 0.0})
    assert out["groups"][1]["regret"] == pytest.approx({"sftctl": 0.0, "price": 0.875, "fastest": 0.40625})
    # USD per million tokens: 2 USD/h x 1 s / 3600 / 1000 tokens x 1e6
    assert out["groups"][0]["measured_usd_per_mtok"]["A"] == pytest.approx(2.0 / 3600 / 1000 * 1e6)
    # throughput per GPU over the cheapest GPU by the hour's (A): g2's C measured 3.0 / 0.5 = 6x,
    # predicted 2.5 / 0.6
    assert out["groups"][1]["throughput_vs"] == "A"
    assert out["groups"][1]["throughput_ratio"]["C"] == pytest.approx({"measured": 6.0, "predicted": 2.5 / 0.6})
    assert out["groups"][0]["throughput_ratio"]["A"] == pytest.approx({"measured": 1.0, "predicted": 1.0})
    s = out["summary"]
    assert s["sftctl"] == pytest.approx({"groups": 2, "right": 1, "mean": 0.125, "max": 0.25})
    assert s["price"] == pytest.approx({"groups": 2, "right": 0, "mean": 0.5625, "max": 0.875})
    assert s["fastest"] == pytest.approx({"groups": 2, "right": 1, "mean": 0.203125, "max": 0.40625})
    assert mod.cost_regret([], prices, fastest)["summary"]["sftctl"] == {"groups": 0, "right": 0, "mean": None,
                                                                         "max": None}


def test_per_gpu_median_and_spread():
    mod = _bench()
    rows = [dict(_row("A", 1, 1), ratio=r) for r in (0.5, 1.0, 2.0)] + [dict(_row("B", 1, 1), ratio=1.1)]
    out = mod.per_gpu(rows)
    assert sorted(out) == ["A", "B"]
    assert out["A"] == pytest.approx({"records": 3, "median": 1.0, "spread": 4.0})
    assert out["B"] == pytest.approx({"records": 1, "median": 1.1, "spread": 1.0})


def test_prices_are_the_cheapest_on_demand_offering_per_gpu():
    from sftctl.catalog import cloud_offerings

    mod = _bench()
    p = mod.on_demand_prices(["H100", "A100-80GB"])
    for gpu in ("H100", "A100-80GB"):
        cheapest = min(o.usd_per_hour / o.count for o in cloud_offerings() if o.accelerator == gpu and o.count)
        assert p[gpu]["usd_per_gpu_hour"] == cheapest and gpu in p[gpu]["offering"]


def test_close_calls_say_the_margin_the_overlap_and_what_the_bias_flips():
    mod = _bench()
    r1 = dict(_row("A", 1, 1, name="r1"), cross={"A": {"predicted_step_s": 1.0}, "B": {"predicted_step_s": 0.45}})
    r2 = dict(_row("B", 1, 1, name="r2"), cross={"A": {"predicted_step_s": 1.0}, "B": {"predicted_step_s": 0.2}})
    r3 = dict(_row("A", 1, 1, name="r3"), cross={"A": {"predicted_step_s": 1.0}, "B": None})  # one GPU: skipped
    out = mod.close_calls([r1, r2, r3], {"A": 2.0, "B": 4.0}, {"A": 1.2, "B": 1.2}, {"A": 1.0, "B": 0.8})
    c1, c2 = out["records"]
    # r1: A 0.5556 USD/Mtok, B 0.5: the pick B by 11.1 %, inside x/1.2; B's prediction is 0.8x measured:
    # corrected, B costs 0.625 and A is cheaper
    assert (c1["pick"], c1["runner_up"], c1["overlap"], c1["pick_after_bias"]) == ("B", "A", True, "A")
    assert c1["margin"] == pytest.approx(1 / 0.9 - 1) and c1["predicted_usd_per_mtok"]["B"] == pytest.approx(0.5)
    # r2: B 0.2222 against A 0.5556, 2.5x: outside the error, and the bias leaves it
    assert (c2["pick"], c2["overlap"], c2["pick_after_bias"]) == ("B", False, "B")
    assert c2["margin"] == pytest.approx(1.5)
    assert out["summary"] == pytest.approx({"records": 2, "overlapping": 1, "flipped_by_bias": 1,
                                            "median_margin": (1 / 0.9 - 1 + 1.5) / 2})


def test_shards_split_every_record_once_and_keep_each_traced_graph_together():
    mod = _bench()
    for n in (1, 2, 3):
        shards = mod._shards(n)
        assert len(shards) == n and sorted(i for s in shards for i in s) == list(range(len(mod.RECORDS)))
        for s in shards:
            keys = {(mod.RECORDS[i]["entrypoint"], mod.RECORDS[i]["batch_per_gpu"]) for i in s}
            others = {(mod.RECORDS[i]["entrypoint"], mod.RECORDS[i]["batch_per_gpu"])
                      for t in shards if t is not s for i in t}
            assert not keys & others


def test_the_fms_pairs_are_strictly_matched_a100_and_h100_groups():
    """fms-fsdp's same scripts on A100 and H100 (README at 5a1ed66): four jobs, each a strict group
    of the two GPUs, with the published throughputs and the node links."""
    mod = _bench()
    pairs = [r for r in mod.RECORDS if "fms-fsdp A100/H100" in r["name"]]
    assert len(pairs) == 8
    rows = [dict(r, measured_step_s=mod.measured_s(r), predicted_step_s=1.0) for r in pairs]
    groups = mod.matched_groups(rows, mod.STRICT)
    assert [sorted(g["rows"]) for g in groups] == [["A100-80GB", "H100"]] * 4
    tok = {(r["name"].split(",")[0], r["gpu"]): r["tokens_per_s_per_gpu"] for r in pairs}
    assert tok[("Llama 2 7B", "A100-80GB")] == 3700 and tok[("Llama 2 7B", "H100")] == 7500
    assert tok[("Llama 2 70B", "A100-80GB")] == 370 and tok[("Llama 2 70B", "H100")] == 800
    assert {r["inter_node_bytes_per_s"] for r in pairs} == {50e9, 100e9}


def test_the_lambda_pairs_are_strictly_matched_a100_and_h100_groups():
    """Lambda's one-GPU ResNet-50 AMP and BERT-large SQuAD FP16 runs on A100 80GB SXM4 and H100 SXM5
    (the same batch and command on both): two strict groups, with the logged throughputs."""
    mod = _bench()
    pairs = [r for r in mod.RECORDS if "(Lambda A100/H100)" in r["name"]]
    assert len(pairs) == 4
    rows = [dict(r, measured_step_s=mod.measured_s(r), predicted_step_s=1.0) for r in pairs]
    groups = mod.matched_groups(rows, mod.STRICT)
    assert [sorted(g["rows"]) for g in groups] == [["A100-80GB", "H100"]] * 2
    step = {(r["name"].split(",")[0], r["gpu"]): mod.measured_s(r) for r in pairs}
    assert step[("ResNet-50", "A100-80GB")] == pytest.approx(1280 / 1582.19)  # images per second
    assert step[("ResNet-50", "H100")] == pytest.approx(1280 / 2615.52)
    assert step[("BERT-large SQuAD", "H100")] == pytest.approx(112 / 301.1002359507717)  # sequences per second


def test_bert_large_squad_has_bert_larges_parameters():
    """examples/bert: BERT-large's 24 post-LN layers of 1024 (16 heads, 4096), 30522 + 512 + 2
    embeddings, and the 2-logit span head; at initialisation the loss is near ln(sequence)."""
    import torch

    from examples.bert.model import BertConfig, build, build_bert_large_squad

    with torch.device("meta"):
        model, batch, _ = build_bert_large_squad(2, "float16")
    h, f, layers = 1024, 4096, 24
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
    expected = (30522 + 512 + 2) * h + 2 * h + layers * per_layer + 2 * h + 2
    assert sum(p.numel() for p in model.parameters()) == expected == 334_094_338
    assert [t.shape for t in batch[:3]] == [(2, 384)] * 3 and batch[3].shape == (2,)
    cfg = BertConfig(vocab_size=50, hidden=32, layers=2, heads=4, ffn=64, seq_len=16)
    model, batch, loss_fn = build(3, "float32", cfg)
    model.eval()
    loss = loss_fn(model, batch)
    assert abs(loss.item() - torch.log(torch.tensor(16.0)).item()) < 1.0


def test_graphs_dir_reuses_a_traced_step_of_the_same_key_and_sources(tmp_path):
    """--graphs DIR: a pickle named by the record's graph key and its sources' hash is read back
    instead of tracing; the sources' hash differs between example directories."""
    import hashlib
    import pickle

    mod = _bench()
    r = next(r for r in mod.RECORDS if r["entrypoint"].endswith("build_llama2_7b"))
    key = (r["entrypoint"], r["batch_per_gpu"], r["dtype"], r.get("attention", "auto"), r.get("torch"))
    src = mod.graph_sources(r["entrypoint"])
    assert len(src) == 16 and src == mod.graph_sources(r["entrypoint"])
    assert src != mod.graph_sources("examples/gpt/model.py:build_gpt2_small")  # another directory's sources
    name = hashlib.sha256(repr((key, src)).encode()).hexdigest()[:24]
    (tmp_path / f"{name}.pkl").write_bytes(pickle.dumps({"stand-in": "graph"}))
    mod.GRAPH_DIR = tmp_path
    assert mod._traced(key, r) == {"stand-in": "graph"}
