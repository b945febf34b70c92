"""Issue 35.5: predicted peak memory against the peak measured on a real step.

Each case runs a real training step (forward, backward, AdamW foreach step) of a small zoo-style
model on the CPU under torch's profiler (:func:`sftctl.compiler.memory_check.measured_peak`:
every allocation in 512-byte allocator blocks, dropout as CUDA's ``native_dropout``) and compares
the eager mode's predicted peak (:func:`sftctl.compiler.modes.predict_mode`, less the stated CUDA
context and cuBLAS workspace, which a CPU has not) for the same model, batch and precision.

Tolerance: the prediction lies within 10 % of the measured peak either way (so a batch that fits
is not refused for more than 10 % of slack, and one said to fit is not 10 % over).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sftctl.compiler.memory_check import measured_peak, native_dropout_mode  # noqa: E402

TOLERANCE = 0.10


class _MLP(nn.Module):
    """Eight 1024-wide GELU layers: 8.4 M parameters, where AdamW's foreach temporaries weigh most."""

    def __init__(self, d=1024, n=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.out = nn.Linear(d, 10)

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.out(x)


class _CNN(nn.Module):
    """Conv-BN-ReLU blocks with max pooling, global average pool, a linear head (CIFAR shapes)."""

    def __init__(self):
        super().__init__()

        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU())

        self.features = nn.Sequential(block(3, 32), block(32, 32), nn.MaxPool2d(2), block(32, 64), block(64, 64),
                                      nn.MaxPool2d(2), block(64, 128))
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def _classify(m, b):
    return F.cross_entropy(m(b[0]).float(), b[1])


def _hf_loss(m, b):
    return m(**b).loss


SEQ, VOCAB = 128, 1000


def _gpt2(attn, attn_dropout=None):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                  bos_token_id=0, eos_token_id=0, attn_implementation=attn,
                                  # CPU SDPA: its flash kernel only without dropout (with it: the math path)
                                  attn_pdrop=attn_dropout if attn_dropout is not None else 0.0 if attn == "sdpa" else 0.1)
    return transformers.GPT2LMHeadModel(cfg).train()


def _bert(attn, attn_dropout=None):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                                  vocab_size=VOCAB, max_position_embeddings=SEQ, attn_implementation=attn,
                                  attention_probs_dropout_prob=(attn_dropout if attn_dropout is not None
                                                                else 0.0 if attn == "sdpa" else 0.1))
    return transformers.BertForMaskedLM(cfg).train()


def _ids(batch, padded=False):
    ids = torch.randint(0, VOCAB, (batch, SEQ))
    b = {"input_ids": ids, "labels": ids}
    if padded:  # a padded batch: HF builds the additive mask (an all-ones one it drops, which a trace cannot see)
        b["attention_mask"] = torch.ones_like(ids)
        b["attention_mask"][:, -8:] = 0
    return b


MODELS = {
    "mlp": (_MLP, lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,))), _classify),
    "cnn": (_CNN, lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))), _classify),
    "gpt2-eager": (lambda: _gpt2("eager"), _ids, _hf_loss),
    "gpt2-sdpa": (lambda: _gpt2("sdpa"), _ids, _hf_loss),
    "bert-eager": (lambda: _bert("eager"), lambda n: _ids(n, padded=True), _hf_loss),
    "bert-sdpa": (lambda: _bert("sdpa"), lambda n: _ids(n, padded=True), _hf_loss),
    # SDPA's math path (model.attention: math), with attention dropout: predicted as "math"
    "gpt2-math": (lambda: _gpt2("sdpa", 0.1), _ids, _hf_loss),
    "bert-math": (lambda: _bert("sdpa", 0.1), lambda n: _ids(n, padded=True), _hf_loss),
}
CASES = [("mlp", 8, None), ("mlp", 256, "bfloat16"), ("cnn", 8, None), ("cnn", 64, "bfloat16"),
         ("gpt2-eager", 4, None), ("gpt2-eager", 16, "bfloat16"), ("gpt2-sdpa", 16, None),
         ("gpt2-sdpa", 4, "bfloat16"), ("bert-eager", 16, None), ("bert-eager", 4, "bfloat16"),
         ("bert-sdpa", 4, None), ("bert-sdpa", 16, "bfloat16"), ("gpt2-math", 16, None),
         ("bert-math", 16, "bfloat16")]


def _predicted(model, batch, loss_fn, dtype, implementation=None):
    """The eager mode's peak for the step (bytes), less the CUDA context and workspaces;
    ``implementation`` sets the attention's (:func:`sftctl.compiler.attention.with_implementation`)."""
    from sftctl.compiler import modes
    from sftctl.compiler.attention import with_implementation
    from sftctl.compiler.frontends import torch as torch_frontend
    from sftctl.compiler.memory import PeakMemory
    from sftctl.compiler.target import load_target

    graph, _ = torch_frontend.trace_step(model, batch, loss_fn, autocast_dtype=dtype)
    if implementation:
        graph = with_implementation(graph, implementation)
    pm = PeakMemory(**modes.predict_mode(graph, load_target("A100-80GB"), "eager")["peak_memory"])
    return pm.total_bytes - pm.reserve_bytes


#: oneDNN runs a bf16 convolution natively only with AVX512-BF16 / AMX; on an AVX2-only CPU it
#: converts to fp32 through buffers of its own (an AVX2-only AMD EPYC measured 55.3 MiB for
#: cnn-b64-bf16 against the predicted 40.5 MiB, which earlier CI hosts matched within 10 %); no GPU's
#: cuDNN allocates those
NATIVE_BF16_CONV = torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _case(name, batch, dtype):
    skip = name == "cnn" and dtype == "bfloat16" and not NATIVE_BF16_CONV
    return pytest.param(name, batch, dtype, id=f"{name}-b{batch}-{dtype or 'float32'}", marks=pytest.mark.skipif(
        skip, reason="this CPU has no native bf16 convolution (oneDNN's fp32 fallback allocates its own buffers)"))


@pytest.mark.parametrize("name,batch,dtype", [_case(*c) for c in CASES])
def test_predicted_peak_is_within_10_percent_of_the_measured(name, batch, dtype):
    make, make_batch, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model, b = make(), make_batch(batch)
    predicted = _predicted(model, b, loss_fn, dtype, "math" if name.endswith("-math") else None)
    measured = measured_peak(model, b, loss_fn, getattr(torch, dtype) if dtype else None).total_bytes
    ratio = predicted / measured
    assert 1 - TOLERANCE <= ratio <= 1 + TOLERANCE, (
        f"{name} batch {batch} {dtype or 'float32'}: predicted {predicted / 2**20:.2f} MiB, "
        f"measured {measured / 2**20:.2f} MiB, ratio {ratio:.3f}")


def test_the_measurement_sees_adamw_foreach_temporaries():
    """AdamW's foreach ``sqrt`` list: the MLP's measured transients exceed its gradients by about
    its parameters' bytes (float32), which a per-parameter optimizer would not show."""
    torch.manual_seed(0)
    model, b = _MLP(), (torch.randn(8, 1024), torch.randint(0, 10, (8,)))
    params = sum(p.numel() for p in model.parameters()) * 4
    got = measured_peak(model, b, _classify)
    assert got.resident_bytes == pytest.approx(3 * params + 8 * 1024 * 4 + 8 * 8, rel=0.01)
    assert got.transient_peak_bytes == pytest.approx(2 * params, rel=0.02)


def test_native_dropout_keeps_a_bool_mask():
    """Under the mode, training dropout is ``native_dropout``: the output scaled by 1/(1-p), zeros
    where dropped, about p of them."""
    torch.manual_seed(0)
    x = torch.ones(100_000)
    with native_dropout_mode():
        y = F.dropout(x, 0.25, training=True)
        z = F.dropout(x, 0.25, training=False)
    assert torch.unique(y).tolist() == [0.0, pytest.approx(1 / 0.75)]
    assert (y == 0).double().mean().item() == pytest.approx(0.25, abs=0.01)
    assert torch.equal(z, x)


def test_foreach_temporaries_are_the_step_peak_at_a_small_batch_and_fsdp_shards_them():
    """The 8.4 M-parameter MLP at batch 1: AdamW's foreach list (4 bytes a parameter) outweighs the
    activations, so the eager peak is at the optimizer; under FSDP over 4 devices each holds a
    quarter of the list, and the activations (the forward/backward peak) are not inflated by it."""
    from sftctl.compiler import sharding
    from sftctl.compiler.frontends import torch as torch_frontend
    from sftctl.compiler.memory import PeakMemory
    from sftctl.compiler.step import compile_graph
    from sftctl.compiler.target import load_target

    model = _MLP()
    n = sum(p.numel() for p in model.parameters())
    graph, _ = torch_frontend.trace_step(model, (torch.randn(1, 1024), torch.randint(0, 10, (1,))), _classify)
    target = load_target("L4")
    compiled = compile_graph(graph, target)
    pm = PeakMemory(**compiled.modes["eager"]["peak_memory"])
    assert pm.optimizer_transient_bytes > pm.transient_peak_bytes
    assert pm.optimizer_transient_bytes == pytest.approx(8 * n, rel=0.01)  # gradients + the sqrt list
    assert pm.total_bytes == pm.resident_bytes + pm.optimizer_transient_bytes + pm.reserve_bytes
    by = {s.parallelism: s for s in sharding.predict_strategies(compiled, target, 4, 1, 25e9, 5e9, mode="eager",
                                                                 checkpointing=(False,))}
    acts = pm.transient_peak_bytes - compiled.grad_bytes
    foreach = pm.optimizer_transient_bytes - compiled.grad_bytes
    assert by["ddp"].breakdown["activations"] == acts
    assert by["ddp"].breakdown["optimizer_temporaries"] == foreach - acts
    assert by["ddp"].memory_bytes == pm.total_bytes
    assert by["fsdp"].breakdown["optimizer_temporaries"] == int(max(0.0, foreach / 4 - acts))
