"""A boolean causal mask is priced as causal attention (issue 35 item 4).

transformers builds the causal mask itself on traced (meta) tensors, ``key position <= query
position`` AND the padding mask, because it cannot see that an unpadded batch lets it drop the
mask and call SDPA with ``is_causal=True``, which is what runs. Pricing that mask as a full score
matrix doubled the attention FLOPs of every HF Llama record (benchmarks/published_steps.py)."""

from __future__ import annotations

import pytest
from _sdpa_layer import trace_masked_layer

from sftctl.compiler.fusion import attention_flops, attention_shape

T = 256


def _trace(mask_kind: str | None):
    """One traced SDPA layer whose mask is ``mask_kind`` (tests/_sdpa_layer.py)."""
    return trace_masked_layer(mask_kind, T)[0]


def _shapes(graph) -> dict[str, dict]:
    return {n.op: attention_shape(graph, n) for n in graph.nodes if n.op in ("attention", "attention_grad")}


def test_hfs_boolean_causal_mask_is_priced_as_is_causal():
    """Forward and backward: causal, about half the scores kept, the FLOPs of ``is_causal=True``
    (to 1e-9), and still a boolean mask (no float bias: flash runs)."""
    masked, plain = _shapes(_trace("causal")), _shapes(_trace("is_causal"))
    assert set(masked) == {"attention", "attention_grad"}
    for op, a in masked.items():
        assert a["causal"] and a["masked"] and not a["bias"], op
        assert a["kept_fraction"] == pytest.approx((T + 1) / (2 * T))
        assert attention_flops(a) == pytest.approx(attention_flops(plain[op]), rel=1e-9)


@pytest.mark.parametrize("kind", ["anticausal", "padding", None])
def test_other_masks_keep_every_score(kind):
    """A mask that keeps keys after the query, or a padding mask alone, is not causal: the full
    score matrix is priced (twice the causal FLOPs, to within the diagonal)."""
    shapes, causal = _shapes(_trace(kind)), _shapes(_trace("causal"))
    for op, a in shapes.items():
        assert not a["causal"] and a["kept_fraction"] == 1.0, (kind, op)
        assert attention_flops(a) / attention_flops(causal[op]) == pytest.approx(2 * T / (T + 1))


def test_the_hf_llama_example_traces_causal_attention():
    """examples/llama (transformers' LlamaForCausalLM with SDPA, an all-ones attention_mask):
    every attention node of the traced step is causal."""
    pytest.importorskip("transformers")
    from conftest import REPO

    from sftctl.compiler import api

    graph = api.trace("torch", "examples/llama/model.py:build", str(REPO), 2, "float32", use_cache=False)
    shapes = _shapes(graph)
    assert shapes and all(a["causal"] for a in shapes.values())
