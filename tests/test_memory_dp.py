"""Issue 35.5: memory as the caching allocator counts it, DDP's bucketed all-reduce with its
overlap and contention, GradScaler's per-step work, bf16 where a GPU has no bf16 tensor cores.
Each test is on a real traced step (a BERT-like torch.nn model built here) or on the functions'
arithmetic, and asserts values."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sftctl.compiler import memory, modes, step  # noqa: E402
from sftctl.compiler.collectives import time_s as collective_s  # noqa: E402
from sftctl.compiler.step import compile_graph  # noqa: E402
from sftctl.compiler.target import load_target  # noqa: E402

GIB = 2**30


class _Layer(nn.Module):
    """A BERT encoder layer (post-LN, GELU MLP, dropout 0.1, SDPA attention)."""

    def __init__(self, d, h, f):
        super().__init__()
        self.h = h
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, f), nn.Linear(f, d)
        self.ln1, self.ln2, self.drop = nn.LayerNorm(d), nn.LayerNorm(d), nn.Dropout(0.1)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        x = self.ln1(x + self.drop(self.o(a.transpose(1, 2).reshape(b, s, d))))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class _Bert(nn.Module):
    """BERT with its masked-LM head over every position (BERT-large: 24 x 1024, 16 heads, 4096, 30522)."""

    def __init__(self, layers=24, d=1024, h=16, f=4096, vocab=30522, seq=512):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.ln, self.drop = nn.LayerNorm(d), nn.Dropout(0.1)
        self.layers = nn.ModuleList(_Layer(d, h, f) for _ in range(layers))
        self.head, self.hln = nn.Linear(d, d), nn.LayerNorm(d)
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, ids):
        x = self.drop(self.ln(self.tok(ids) + self.pos.weight[: ids.shape[1]]))
        for layer in self.layers:
            x = layer(x)
        return self.hln(F.gelu(self.head(x))) @ self.tok.weight.t() + self.bias


def _mlm_loss(m, batch):
    ids, labels = batch
    return F.cross_entropy(m(ids).flatten(0, 1).float(), labels.flatten())


def _compile(batch, seq, dtype, accelerator, **shape):
    from sftctl.compiler.frontends import torch as torch_frontend

    with torch.device("meta"):
        m = _Bert(seq=seq, **shape)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    graph, _ = torch_frontend.trace_step(m, (ids, ids), _mlm_loss, autocast_dtype=dtype)
    return graph, compile_graph(graph, load_target(accelerator))


@pytest.fixture(scope="module")
def bert_large_v100():
    return _compile(16, 512, "float16", "V100")


def test_the_runtime_reserve_is_the_stated_context_and_workspace():
    assert memory.RUNTIME_RESERVE_BYTES == memory.CUDA_CONTEXT_BYTES + memory.CUBLAS_WORKSPACE_BYTES
    assert 0.6 * GIB < memory.RUNTIME_RESERVE_BYTES < 0.8 * GIB  # not the 1 GiB guessed before
    assert [memory.allocated_bytes(n) for n in (0, 1, 512, 513, 2048)] == [0, 512, 512, 1024, 2048]


def test_bert_large_at_batch_16_in_fp16_fits_a_16_gb_v100(bert_large_v100):
    _, c = bert_large_v100
    hw = load_target("V100").hw
    p = step.predict(c, load_target("V100"), 1, 1, None, None, mode="eager")
    # parameters, AdamW state (fp32: 4 + 8 bytes per parameter) and the allocator-rounded activations
    n = c.grad_bytes // 4
    assert 330e6 < n < 340e6
    pm = c.modes["eager"]["peak_memory"]
    assert pm["params_bytes"] >= 4 * n and pm["opt_state_bytes"] >= 8 * n
    assert p.fits and p.peak_memory_bytes < hw.memory_bytes - 0.75 * GIB, p.peak_memory_bytes / GIB


def test_a_batch_that_cannot_fit_still_does_not():
    _, c = _compile(64, 512, "float16", "V100", layers=24)
    p = step.predict(c, load_target("V100"), 1, 1, None, None, mode="eager")
    assert not p.fits and p.peak_memory_bytes > 2.5 * 16 * GIB


def test_ddp_buckets_are_torchs():
    b = step.ddp_buckets(60 * 2**20)
    assert b == [2**20, 25 * 2**20, 25 * 2**20, 9 * 2**20]
    assert step.ddp_buckets(0) == []


def test_ddp_exposes_the_last_bucket_and_what_backward_cannot_hide(bert_large_v100):
    """8 V100s: NVLink hides almost all of BERT-large's 1.34 GB of gradients behind backward; the
    exposed part is at least the last bucket's all-reduce and the NCCL SMs' share of the overlap.
    Over PCIe gen3 the all-reduce outlasts backward, and the step pays it."""
    _, c = bert_large_v100
    t = load_target("V100")
    one = step.predict(c, t, 1, 1, None, None, mode="eager")
    nvl = step.predict(c, t, 8, 1, None, None, mode="eager")
    pcie = step.predict(c, t, 8, 1, 16e9, None, mode="eager")
    buckets = step.ddp_buckets(c.grad_bytes, [4 * n for n in c.param_numels])
    copies = step.ddp_grad_copy_s(c.param_numels, t)
    last = collective_s("all-reduce", buckets[-1], "V100", 8)
    assert nvl.allreduce_time_s >= last + copies
    total_nvl = sum(collective_s("all-reduce", b, "V100", 8) for b in buckets)
    backward = one.compute_time_s * step.BACKWARD_SHARE
    slow = step.overlap_slowdown(c.kernels, t.hw.sm_count) - 1  # NCCL's SMs: GEMM waves, the SMs' share else
    assert step.NCCL_OVERLAP_SMS / t.hw.sm_count < slow < 1.0
    contention = min(total_nvl, backward) * slow
    assert nvl.allreduce_time_s == pytest.approx(last + contention + copies, rel=0.35)
    assert 1.01 < nvl.step_time_s / one.step_time_s < 1.2
    total_pcie = sum(collective_s("all-reduce", b, "V100", 8, 1, 16e9) for b in buckets)
    assert total_pcie > backward
    assert pcie.allreduce_time_s == pytest.approx(total_pcie - backward + backward * slow + copies, rel=0.1)
    assert pcie.step_time_s / one.step_time_s > 1.2 > nvl.step_time_s / one.step_time_s


def test_ddp_buckets_are_torchs_assignment_of_whole_parameters():
    """Random parameter lists bucketed as torch's own ``_compute_bucket_assignment_by_size`` does
    over the order backward makes the gradients (reverse registration): 1 MiB first, 25 MiB after,
    a bucket closing once it reaches its cap, no parameter split."""
    import random

    import torch.distributed as dist

    rng = random.Random(35)
    for _ in range(20):
        numels = [rng.choice([rng.randint(1, 4096), rng.randint(10**4, 10**6), rng.randint(10**6, 4 * 10**7)])
                  for _ in range(rng.randint(1, 60))]
        tensors = [torch.empty(n, dtype=torch.float32) for n in reversed(numels)]
        idx, _ = dist._compute_bucket_assignment_by_size(tensors, [dist._DEFAULT_FIRST_BUCKET_BYTES,
                                                                   step.DDP_BUCKET_BYTES], [False] * len(tensors))
        theirs = [sum(4 * tensors[i].numel() for i in b) for b in sorted(idx, key=min)]
        assert step.ddp_buckets(4 * sum(numels), [4 * n for n in numels]) == theirs
    assert step.DDP_FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES


def test_the_embedding_bucket_is_reduced_after_backward(bert_large_v100):
    """BERT's word embedding (30522 x 1024, 125 MB of float32 gradient) is registered first, so its
    gradient is made last and its bucket's all-reduce starts when backward has ended: on 8 GPUs
    the step pays at least that whole all-reduce, and each parameter's copy into its bucket."""
    _, c = bert_large_v100
    t = load_target("V100")
    assert len(c.param_numels) == 24 * 12 + 9 and sum(c.param_numels) * 4 == c.grad_bytes
    buckets = step.ddp_buckets(c.grad_bytes, [4 * n for n in c.param_numels])
    assert sum(buckets) == c.grad_bytes and buckets[0] >= step.DDP_FIRST_BUCKET_BYTES
    assert buckets[-1] >= 4 * 30522 * 1024 > 4 * step.DDP_BUCKET_BYTES
    embedding_ar = collective_s("all-reduce", buckets[-1], "V100", 8)
    nvl = step.predict(c, t, 8, 1, None, None, mode="eager")
    assert nvl.allreduce_time_s >= embedding_ar + step.ddp_grad_copy_s(c.param_numels, t)
    assert embedding_ar > 4 * collective_s("all-reduce", step.DDP_BUCKET_BYTES, "V100", 8)
    # one device: no all-reduce, no copies
    assert step.predict(c, t, 1, 1, None, None, mode="eager").allreduce_time_s == 0.0


def test_ddp_copies_each_gradient_into_its_bucket():
    """One copy kernel per parameter, 8 bytes per element (read and write float32) at the copy
    class's bandwidth plus its fixed time: against the sum written out."""
    t = load_target("H100")
    c = t.peers.classes["copy"]
    numels = [30522 * 1024, 1024, 4096 * 1024, 7]
    want = sum(c.fixed_s + 8.0 * n / (t.hw.hbm_bytes_per_s * c.hbm_fraction) for n in numels)
    assert step.ddp_grad_copy_s(numels, t) == pytest.approx(want, rel=1e-12)
    assert step.ddp_grad_copy_s(numels, t) > 8.0 * sum(numels) / t.hw.hbm_bytes_per_s
    assert step.ddp_grad_copy_s([], t) == 0.0


def test_grad_scaler_is_a_fixed_cost_that_weighs_most_at_micro_batch_1():
    """fp16 pays GradScaler's unscale pass and its host sync each step, bf16 does not: the same
    seconds at micro-batch 1 and 8, so a larger share of the small step."""
    out = {}
    for dtype in ("float16", "bfloat16"):
        for batch in (1, 8):
            g, c = _compile(batch, 128, dtype, "H100", layers=4, d=768, h=12, f=3072)
            out[dtype, batch] = c.modes["eager"]
            assert modes.uses_grad_scaler(g) == (dtype == "float16")
    for batch in (1, 8):
        assert out["float16", batch]["by_kind"]["grad scaler (fp16)"] > 0
        assert "grad scaler (fp16)" not in out["bfloat16", batch]["by_kind"]
    extra = {b: out["float16", b]["compute_time_s"] - out["bfloat16", b]["compute_time_s"] for b in (1, 8)}
    assert extra[1] > 0 and extra[1] == pytest.approx(extra[8], rel=0.5)
    share = {b: extra[b] / out["float16", b]["compute_time_s"] for b in (1, 8)}
    assert share[1] > share[8]


def test_bf16_on_a_t4_is_priced_on_the_cuda_cores():
    """The T4 (sm_75) has fp16 tensor cores, none for bf16: bf16 GEMMs run at the fp32 CUDA-core
    rate, so a bf16 step is priced well above the fp16 one; on an A100 both have tensor cores."""
    t4, a100 = load_target("T4").hw, load_target("A100-80GB").hw
    assert not modes.has_tensor_cores(t4, "bfloat16") and modes.has_tensor_cores(t4, "float16")
    assert modes.has_tensor_cores(a100, "bfloat16")
    times = {}
    for dtype in ("float16", "bfloat16"):
        _, c = _compile(8, 128, dtype, "T4", layers=4, d=768, h=12, f=3072)
        times[dtype] = c
    gemm = {d: sum(k.time_s for k in times[d].kernels if k.kind == "gemm") for d in times}
    assert gemm["bfloat16"] > 3 * gemm["float16"]
    # every bf16 GEMM kernel is at or below the fp32 vector peak, none at a tensor-core rate
    assert all(k.flops / k.time_s <= t4.vector_peak("float32") * 1.0001
               for k in times["bfloat16"].kernels if k.kind == "gemm" and k.time_s > 0)
    assert times["bfloat16"].mode_time_s("eager") > 2 * times["float16"].mode_time_s("eager")


def test_activations_live_at_backward_are_what_autograd_saves():
    """The liveness model against torch itself: a real HF BERT (eager attention, its S x S
    softmax kept for backward) run forward on the CPU with ``saved_tensors_hooks`` counting every
    storage autograd saves (parameters aside); the traced step's tensors live when the first
    backward kernel runs hold the same bytes (the model frees nothing autograd keeps, keeps
    nothing autograd frees)."""
    transformers = pytest.importorskip("transformers")
    from sftctl.compiler.frontends import torch as torch_frontend

    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                                  vocab_size=1000, max_position_embeddings=128, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="eager")
    m = transformers.BertForMaskedLM(cfg).train()
    ids = torch.randint(0, 1000, (4, 128))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids),
             "labels": ids}
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(**batch)  # the forward runs for what it saves
    graph, _ = torch_frontend.trace_step(m, batch, lambda mm, bb: mm(**bb).loss)
    kernels = modes.eager_kernels(graph)
    phase, _ = modes.node_phases_modules(graph)
    outputs, last = set(graph.outputs), {}
    for i, k in enumerate(kernels):
        for r in k.reads:
            last[r] = i
    start = next(i for i, k in enumerate(kernels) if phase[k.anchor] == "backward")
    live = sum(graph.nodes[w].type.nbytes for i, k in enumerate(kernels[:start]) for w in k.writes
               if w not in outputs and last.get(w, i) >= start)
    assert sum(saved.values()) > 4 * 4 * 4 * 128 * 128 * 4  # the four layers' fp32 softmax alone
    assert live == pytest.approx(sum(saved.values()), rel=0.01)
