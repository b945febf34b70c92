"""Issue 35.6: ``plan`` says when the pick's advantage lies within the prediction's error, in one
line naming both rows with their USD per million tokens, and in ``--json`` as ``close_call``;
issue 35.5: the plan's memory line names the attention its peak assumed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sftctl.compiler import accuracy
from sftctl.types import Offering, Plan, PlanChoice


def _choice(acc: str, count: int, step: float, usd_h: float, nodes: int = 1) -> PlanChoice:
    from sftctl.planner import _calibration

    o = Offering(provider="aws", instance_type=f"{acc}-box", accelerator=acc, count=count, region="r",
                 usd_per_hour=usd_h)
    hours = step * 1000 / 3600
    return dataclasses.replace(PlanChoice(o, nodes, usd_h), step_time_s=step, hours=hours, total_usd=hours * usd_h,
                               **_calibration(acc, step))


def test_a_close_call_names_both_rows_with_usd_per_million_tokens():
    from sftctl.planner import _ranking_notes

    h200, h100 = _choice("H200", 8, 10e-3, 60.0), _choice("H100", 8, 11e-3, 56.0)
    tokens = (8 * 1024.0, "tokens")  # 8 sequences of 1024 tokens a step
    ranked = _ranking_notes([h200, h100], "cost", tokens)
    pick = ranked[0]
    per_mtok = {"H200": 60 * 10e-3 / 3600 / 8192 * 1e6, "H100": 56 * 11e-3 / 3600 / 8192 * 1e6}
    assert pick.ranking_note.endswith(
        f"; per 1M tokens: H200:8 ${per_mtok['H200']:.3g}, H100:8 ${per_mtok['H100']:.3g}")
    assert pick.ranking_note.startswith("may not be the cheapest: H100:8 (aws H100-box, r) is 2.7% more")
    cc = pick.close_call
    assert cc["within_error"] is True and cc["pick"] == "H200:8" and cc["runner_up"] == "H100:8"
    assert cc["runner_up_rank"] == 2 and cc["metric"] == "total_usd"
    assert cc["margin"] == pytest.approx(56 * 11 / (60 * 10) - 1)  # 2.67 %
    assert cc["pick_usd_per_mtok"] == pytest.approx(per_mtok["H200"])
    assert cc["runner_up_usd_per_mtok"] == pytest.approx(per_mtok["H100"])
    assert cc["pick_usd_per_step"] == pytest.approx(60 * 10e-3 / 3600)
    f = accuracy.accuracy("H200")["error"]
    assert cc["pick_interval"] == pytest.approx([h200.total_usd / f, h200.total_usd * f])
    assert ranked[1].close_call is None and ranked[1].ranking_note is None


def test_a_clear_pick_has_a_close_call_that_says_it_is_not_within_the_error():
    from sftctl.planner import _ranking_notes

    h200, l4 = _choice("H200", 8, 10e-3, 60.0), _choice("L4", 1, 2.0, 0.8)  # L4 costs 2.7x
    ranked = _ranking_notes([h200, l4], "cost", (8192.0, "tokens"))
    assert ranked[0].ranking_note is None
    cc = ranked[0].close_call
    assert cc["within_error"] is False and cc["runner_up"] == "L4:1"
    assert cc["margin"] == pytest.approx(0.8 * 2.0 / (60 * 10e-3) - 1)


def test_samples_without_tokens_and_the_step_when_nothing_is_known():
    from sftctl.planner import _ranking_notes

    h200, h100 = _choice("H200", 8, 10e-3, 60.0), _choice("H100", 8, 11e-3, 56.0, nodes=2)
    samples = _ranking_notes([h200, h100], "cost", (256.0, "samples"))[0]
    assert "; per 1M samples: H200:8 $" in samples.ranking_note and "H100:8 x 2" in samples.ranking_note
    assert "pick_usd_per_msample" in samples.close_call and "pick_usd_per_mtok" not in samples.close_call
    bare = _ranking_notes([h200, h100], "cost")[0]
    assert "; per step: H200:8 $0.000167, H100:8 x 2 $0.000171" in bare.ranking_note


def test_close_call_is_in_the_plan_json_and_survives_a_round_trip():
    from sftctl.planner import _ranking_notes

    ranked = _ranking_notes([_choice("H200", 8, 10e-3, 60.0), _choice("H100", 8, 11e-3, 56.0)], "cost",
                            (8192.0, "tokens"))
    plan = Plan(chosen=ranked[0], reason="chose", candidates=ranked)
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["close_call"]["within_error"] is True and doc["close_call"]["runner_up"] == "H100:8"
    assert doc["candidates"][0]["close_call"] == doc["close_call"]
    assert Plan.from_dict(doc).chosen.close_call == doc["close_call"]


BUILD = '''
import torch
import transformers


def _build(batch_size, dtype, attn):
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=256, max_position_embeddings=128, attn_implementation=attn)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg).train()
    ids = torch.randint(0, 256, (batch_size, 128))
    return model, {"input_ids": ids, "labels": ids}, lambda m, b: m(**b).loss


def eager(batch_size=4, dtype="float16"):
    return _build(batch_size, dtype, "eager")


def sdpa(batch_size=4, dtype="float16"):
    return _build(batch_size, dtype, "sdpa")
'''


@pytest.mark.parametrize("impl,expected", [
    ("sdpa", "attention: SDPA memory-efficient (no 128 x 128 scores kept)"),
    ("eager", "attention: eager softmax(QK^T) (128 x 128 scores kept for backward)"),
])
def test_the_memory_line_names_the_attention_it_assumed(tmp_path, impl, expected):
    """On a V100 (no flash attention: sm70) an SDPA BERT's peak assumes the memory-efficient
    kernel; HF's eager attention keeps its S x S probabilities. The plan's line says which."""
    pytest.importorskip("transformers")
    from conftest import write_spec

    from sftctl.planner import plan
    from sftctl.spec import load_spec

    (tmp_path / "bert.py").write_text(BUILD)
    spec = load_spec(write_spec(tmp_path / "job.yaml", (
        f"name: bert\nworkdir: .\nmodel: {{framework: torch, entrypoint: 'bert.py:{impl}', batch_size: 4, "
        "dtype: float16}\ntrain: {steps: 10}\nresources: {accelerators: [V100:1], clouds: [aws]}\nrun: 'true'\n")))
    p = plan(spec, usable={"aws": None})
    assert expected in p.chosen.parallelism_reason
    assert expected in p.reason


BERT_LARGE = '''
import torch
import transformers


def build(batch_size=16, dtype="float16"):
    """BERT-large (24 x 1024, 16 heads, 4096, vocab 30522) masked LM at 512 tokens, SDPA."""
    cfg = transformers.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                  intermediate_size=4096, vocab_size=30522, max_position_embeddings=512,
                                  attn_implementation="sdpa")
    model = transformers.BertForMaskedLM(cfg).train()
    ids = torch.zeros(batch_size, 512, dtype=torch.long)
    return model, {"input_ids": ids, "labels": ids}, lambda m, b: m(**b).loss
'''


def test_bert_large_at_batch_16_and_512_tokens_is_not_refused_a_16_gb_v100(tmp_path):
    """NVIDIA's DeepLearningExamples train BERT-large at 512 tokens, batch 16, fp16 on 16 GB V100s.
    With SDPA (the memory-efficient kernel on a V100: no 512 x 512 scores) the plan keeps the V100
    and its memory line says which attention it assumed."""
    pytest.importorskip("transformers")
    from conftest import write_spec

    from sftctl.planner import plan
    from sftctl.spec import load_spec

    (tmp_path / "bert_large.py").write_text(BERT_LARGE)
    spec = load_spec(write_spec(tmp_path / "job.yaml", (
        "name: bert-large\nworkdir: .\nmodel: {framework: torch, entrypoint: 'bert_large.py:build', batch_size: 16, "
        "dtype: float16}\ntrain: {steps: 10, parallelism: ddp, activation_checkpointing: false}\n"
        "resources: {accelerators: [V100:1], clouds: [aws]}\nrun: 'true'\n")))
    p = plan(spec, usable={"aws": None})
    v100 = p.chosen
    assert v100.rejected is None and v100.devices_needed == 1
    assert 12 * 2**30 < v100.peak_memory_bytes < 16 * 2**30
    assert "attention: SDPA memory-efficient (no 512 x 512 scores kept)" in v100.parallelism_reason


def test_a_refusal_for_memory_names_eager_attention(tmp_path, monkeypatch):
    """Where the peak that does not fit keeps eager attention's S x S scores, the refusal says so
    (a fused kernel keeps none); with SDPA's memory-efficient kernel it does not."""
    pytest.importorskip("transformers")
    from conftest import write_spec

    import sftctl.compiler.target as target_mod
    from sftctl.errors import InfeasibleError
    from sftctl.planner import plan
    from sftctl.spec import load_spec

    real = target_mod.load_target
    v100 = real("V100")
    tiny = dataclasses.replace(v100, hw=dataclasses.replace(v100.hw, memory_bytes=2**28))  # 256 MiB
    monkeypatch.setattr(target_mod, "load_target", lambda name: tiny if name.lower() == "v100" else real(name))
    (tmp_path / "bert.py").write_text(BUILD)
    messages = {}
    for impl in ("eager", "sdpa"):
        spec = load_spec(write_spec(tmp_path / f"{impl}.yaml", (
            f"name: bert\nworkdir: .\nmodel: {{framework: torch, entrypoint: 'bert.py:{impl}', batch_size: 4, "
            "dtype: float16}\ntrain: {steps: 10, parallelism: ddp, activation_checkpointing: false}\n"
            "resources: {accelerators: [V100:1], clouds: [aws]}\nrun: 'true'\n")))
        with pytest.raises(InfeasibleError) as e:
            plan(spec, usable={"aws": None})
        messages[impl] = next(c.rejected.message for c in e.value.candidates if c.rejected.code.name == "DOES_NOT_FIT")
    assert "nothing fits: ddp needs" in messages["eager"]
    assert "; eager attention keeps its S x S scores (a fused SDPA or flash kernel keeps none)" in messages["eager"]
    assert "S x S" not in messages["sdpa"] and "nothing fits: ddp needs" in messages["sdpa"]


def _rendered(table) -> str:
    import io

    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=250, color_system=None).print(table)
    return buf.getvalue()


def test_the_note_names_the_row_the_grouped_table_shows_not_the_candidate_rank():
    """``plan`` groups an offering's regions into one row: the runner-up ranked 3rd among the
    candidates is the table's row #2, and the note must say #2 (it said #3, a row showing
    something else). Left out of the rows shown, the note names the offering and says so."""
    from sftctl.planner import _ranking_notes
    from sftctl.ui import plan_table

    h200 = _choice("H200", 8, 10e-3, 60.0)
    h200_r2 = dataclasses.replace(h200, offering=dataclasses.replace(h200.offering, region="r2"), usd_per_hour=61.0,
                                  total_usd=h200.total_usd * 61 / 60)
    h100 = _choice("H100", 8, 11e-3, 56.0)
    ranked = _ranking_notes([h200, h200_r2, h100], "cost", (8192.0, "tokens"))
    assert ranked[0].close_call["runner_up_rank"] == 3
    # the plan's own note (plan --json) names the offering, no rank number
    assert ranked[0].ranking_note.startswith("may not be the cheapest: H100:8 (aws H100-box, r) is 2.7% more")
    assert "#" not in ranked[0].ranking_note
    assert ranked[0].close_call["runner_up_offering"] == {"provider": "aws", "instance_type": "H100-box",
                                                          "region": "r"}
    out = _rendered(plan_table(ranked, 1000, top=10))
    rows = {line.split()[0]: line.split()[1:4] for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert rows["2"] == ["aws", "H100-box", "H100:8"]  # the runner-up's row as the reader sees it
    note = next(line for line in out.splitlines() if "may not be" in line)
    assert "#1: may not be the cheapest: #2 H100:8 (aws H100-box, r) is 2.7% more" in note
    # --all: every candidate its own row: the runner-up is row #3
    out = _rendered(plan_table(ranked, 1000, top=None))
    assert "#1: may not be the cheapest: #3 H100:8 (aws H100-box, r) is" in out
    # top 1: the runner-up is not shown; the note names it and says so
    out = _rendered(plan_table(ranked, 1000, top=1))
    assert ("may not be the cheapest: H100:8 (aws H100-box, r; not among the rows shown, --all lists it) is"
            in " ".join(out.split()))
