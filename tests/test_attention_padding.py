"""A padded batch's attention is priced as SDPA runs it (issue 35 leftovers, item 2).

transformers (``attn_implementation="sdpa"``) drops an attention mask that pads nothing and calls
SDPA with ``is_causal=True`` (FlashAttention, the masked tiles skipped); a batch whose
``attention_mask`` has zeros reaches SDPA as a boolean mask, which rules out flash and cuDNN (torch
``sdp_utils``' ``check_for_attn_mask``): the memory-efficient kernel computes every tile. Traced,
both are the same graph (a causal ``and`` padding mask); the mask's value on the traced batch
tells them apart, and where the trace has none the plan says it priced the batch unpadded."""

from __future__ import annotations

import pytest
from _sdpa_layer import trace_masked_layer

from sftctl.compiler.fusion import attention_flops, attention_shape

T = 128


def _gpt2(kind: str):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=256, n_positions=T,
                                  attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 256, (4, T))
    batch = {"input_ids": ids, "labels": ids}
    if kind != "none":
        mask = torch.ones(4, T, dtype=torch.long)
        if kind == "padded":
            mask[:, 100:] = 0  # the last 28 positions of every row are padding
        batch["attention_mask"] = mask
    return model, batch, lambda m, b: m(**b).loss


def _shapes(kind: str) -> dict[str, dict]:
    from sftctl.compiler.frontends.torch import trace_step

    graph, _ = trace_step(*_gpt2(kind), autocast_dtype="bfloat16")  # float32 would rule out flash
    return {n.op: attention_shape(graph, n) for n in graph.nodes if n.op in ("attention", "attention_grad")}


def test_a_padded_batch_is_priced_as_sdpa_with_a_mask_an_unpadded_one_as_causal_flash():
    from sftctl.compiler.attention import attention_time_s, source
    from sftctl.compiler.target import load_target

    h100 = load_target("H100")
    shapes = {k: _shapes(k) for k in ("none", "ones", "padded")}
    for kind in ("none", "ones"):  # transformers drops the mask: causal, flash
        for op, a in shapes[kind].items():
            assert a["causal"] and not a["bias"] and a["padding"] in (None, "none"), (kind, op)
            assert a["kept_fraction"] == pytest.approx((T + 1) / (2 * T))
    assert shapes["ones"]["attention"]["padding"] == "none"
    for op, a in shapes["padded"].items():  # SDPA gets the mask: every tile, the memory-efficient kernel
        assert a["padding"] == "padded" and not a["causal"] and a["bias"] and a["kept_fraction"] == 1.0, op
        assert attention_flops(a) / attention_flops(shapes["ones"][op]) == pytest.approx(2 * T / (T + 1))
    pad, ones = shapes["padded"]["attention"], shapes["ones"]["attention"]
    assert source("H100", pad["implementation"], bias=pad["bias"])["implementation"] == "efficient"
    assert source("H100", ones["implementation"], bias=ones["bias"])["implementation"] in ("flash2", "cudnn")
    for op in ("attention", "attention_grad"):  # 8192 sequences: past the launch latency, the FLOPs decide
        big = {k: {**shapes[k][op], "batch": 8192} for k in shapes}
        assert attention_time_s(big["padded"], h100) > 1.5 * attention_time_s(big["ones"], h100)
        assert attention_time_s(big["none"], h100) == pytest.approx(attention_time_s(big["ones"], h100))


def test_mask_padding_reads_the_masks_value():
    torch = pytest.importorskip("torch")
    from sftctl.compiler.frontends.torch.attention import mask_padding

    keep = torch.ones(6, 6, dtype=torch.bool).tril()
    assert mask_padding(torch.ones(2, 1, 6, 6, dtype=torch.bool)) == "none"
    assert mask_padding(keep.expand(2, 1, 6, 6)) == "none"
    padded = keep.clone()
    padded[:, 4:] = False  # keys 4 and 5 are padding
    assert mask_padding(padded.expand(2, 1, 6, 6)) == "padded"
    window = keep & torch.ones(6, 6, dtype=torch.bool).triu(-2)  # a sliding window of 3 keys
    assert mask_padding(window) == "padded"
    assert mask_padding(keep, is_causal=True) == "none" and mask_padding(padded, is_causal=True) == "padded"
    assert mask_padding(torch.ones(2, 1, 6, 6, dtype=torch.bool, device="meta")) == "unknown"


BUILD = '''
import torch
import transformers


def build(batch_size=4, dtype="float32", pad=True):
    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=256, n_positions=128,
                                  attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.zeros(batch_size, 128, dtype=torch.long)
    mask = torch.ones(batch_size, 128, dtype=torch.long)
    if pad:
        mask[:, 100:] = 0
    return model, {"input_ids": ids, "labels": ids, "attention_mask": mask}, lambda m, b: m(**b).loss


def unpadded(batch_size=4, dtype="float32"):
    return build(batch_size, dtype, pad=False)
'''


@pytest.mark.parametrize("entry,padding,words", [
    ("build", "padded", "the batch pads: SDPA gets the mask and computes every tile"),
    ("unpadded", "none", None),
])
def test_an_entrypoint_built_on_meta_reads_its_mask_from_the_real_build(tmp_path, entry, padding, words):
    """trace_entrypoint builds on meta (no values); the mask's value comes from the entrypoint
    built for real (the representative batch), and the plan's attention line says what it saw."""
    pytest.importorskip("transformers")
    from sftctl.compiler.frontends.torch import trace_entrypoint
    from sftctl.compiler.memory import attention_assumed

    (tmp_path / "gpt.py").write_text(BUILD)
    graph, meta = trace_entrypoint(f"gpt.py:{entry}", str(tmp_path), 4, "bfloat16")
    assert meta["built_on"] == "meta"
    assert {n.attrs.get("padding") for n in graph.nodes if n.op == "attention"} == {padding}
    line = attention_assumed(graph, "H100")
    assert line.startswith("SDPA memory-efficient") == (padding == "padded"), line
    assert (words in line) if words else ("pads" not in line and "unknown" not in line)


def test_a_mask_with_no_value_is_priced_unpadded_and_said_so():
    """A batch on meta and no real build: the two cannot be told apart at trace time; priced
    unpadded (causal), and the trace's assumptions and the plan's attention line say so."""
    from sftctl.compiler.attention import PADDING_UNKNOWN
    from sftctl.compiler.memory import attention_assumed

    graph, meta = trace_masked_layer("causal", T)  # HF's causal AND padding mask, on meta
    a = next(attention_shape(graph, n) for n in graph.nodes if n.op == "attention")
    assert a["padding"] == "unknown" and a["causal"] and not a["bias"]
    assert PADDING_UNKNOWN in meta["assumptions"]
    assert "the mask's values are unknown at trace time: priced unpadded" in attention_assumed(graph, "H100")
