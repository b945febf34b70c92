"""BERT-large (Hugging Face ``transformers``, fp16 autocast, AdamW) as issue 35.5 names it: the peak
memory sftctl predicts per attention implementation and sequence on a 16 GB V100, and the step on
8 H100s (DDP over NVLink) against one.

    python benchmarks/bert_large.py        # prints the table, writes results/bert_large.json

Memory is the eager mode's peak (``torch.cuda.max_memory_allocated``'s view plus the stated CUDA
context and cuBLAS workspace, :mod:`sftctl.compiler.memory`). ``eager`` attention keeps each
layer's S x S softmax (float32: the mask add promotes it), its dropout mask and its float16 copy
for the second matmul; ``sdpa`` on a V100 is torch's memory-efficient kernel (no S x S).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30
#: (head, sequence, batch per GPU, attention implementation)
MEMORY = [("qa", 384, 16, "eager"), ("qa", 384, 16, "sdpa"), ("mlm", 512, 16, "sdpa"), ("pretraining", 128, 16, "eager")]
DDP = [("pretraining", 128, 32, "sdpa"), ("qa", 384, 16, "sdpa")]


def bert_large_step(head: str, seq: int, batch: int, attention: str):
    """The traced training step of BERT-large (24 x 1024, 16 heads, 4096, vocab 30522) with ``head``
    (``qa``, ``mlm``, ``pretraining``), fp16 autocast."""
    import torch
    import transformers

    from sftctl.compiler.frontends import torch as torch_frontend

    cfg = transformers.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                  intermediate_size=4096, vocab_size=30522, max_position_embeddings=512,
                                  attn_implementation=attention)
    cls = {"qa": transformers.BertForQuestionAnswering, "mlm": transformers.BertForMaskedLM,
           "pretraining": transformers.BertForPreTraining}[head]
    with torch.device("meta"):
        model = cls(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    if head == "qa":
        b |= {"start_positions": torch.zeros(batch, dtype=torch.long), "end_positions": torch.zeros(batch, dtype=torch.long)}
    else:
        b |= {"labels": ids}
        if head == "pretraining":
            b |= {"next_sentence_label": torch.zeros(batch, dtype=torch.long)}
    graph, _ = torch_frontend.trace_step(model.train(), b, lambda m, bb: m(**bb).loss, autocast_dtype="float16")
    return graph


def main() -> int:
    from sftctl.compiler import step
    from sftctl.compiler.collectives import time_s as collective_s
    from sftctl.compiler.memory import attention_assumed
    from sftctl.compiler.target import load_target

    rows = {"memory": [], "ddp": []}
    v100 = load_target("V100")
    for head, seq, batch, attn in MEMORY:
        t0 = time.perf_counter()
        graph = bert_large_step(head, seq, batch, attn)
        c = step.compile_graph(graph, v100)
        pm = c.modes["eager"]["peak_memory"]
        total = c.modes["eager"]["peak_bytes"]
        rows["memory"].append({"head": head, "seq": seq, "batch": batch, "attention": attn, "gpu": "V100",
                               "peak_gib": total / GIB, "activations_gib": pm["transient_peak_bytes"] / GIB,
                               "capacity_gib": v100.hw.memory_bytes / GIB, "fits": total <= v100.hw.memory_bytes,
                               "attention_assumed": attention_assumed(graph, "V100"),
                               "s": round(time.perf_counter() - t0, 1)})
        r = rows["memory"][-1]
        print(f"V100 {head:11s} seq {seq} x {batch} {attn:5s}: peak {r['peak_gib']:.2f} GiB (activations, gradients, "
              f"temporaries {r['activations_gib']:.2f}) of {r['capacity_gib']:.0f}: {'fits' if r['fits'] else 'refused'}"
              f" (attention: {r['attention_assumed']})",
              flush=True)
    h100 = load_target("H100")
    for head, seq, batch, attn in DDP:
        c = step.compile_graph(bert_large_step(head, seq, batch, attn), h100)
        one = step.predict(c, h100, 1, 1, None, None, mode="eager")
        eight = step.predict(c, h100, 8, 1, 450e9, None, mode="eager")
        buckets = step.ddp_buckets(c.grad_bytes, [4 * n for n in c.param_numels])
        slowdown = step.overlap_slowdown(c.kernels, h100.hw.sm_count)
        # the same all-reduce with the SMs' share as the only contention (before the waves were priced)
        share = step.ddp_allreduce_exposed_s(c.grad_bytes, one.step_time_s * step.BACKWARD_SHARE, "H100",
                                             h100.hw.sm_count, 8, 1, 450e9, step.DEFAULT_INTER_NODE_BYTES_PER_S,
                                             param_bytes=[4 * n for n in c.param_numels])
        share += step.ddp_grad_copy_s(c.param_numels, h100)
        allreduce_ms = sum(collective_s("all-reduce", b, "H100", 8, 1, 450e9) for b in buckets) * 1e3
        rows["ddp"].append({"head": head, "seq": seq, "batch": batch, "attention": attn, "gpu": "H100",
                            "one_gpu_ms": one.step_time_s * 1e3, "eight_gpu_ms": eight.step_time_s * 1e3,
                            "ratio": eight.step_time_s / one.step_time_s, "exposed_ms": eight.allreduce_time_s * 1e3,
                            "grad_copy_ms": step.ddp_grad_copy_s(c.param_numels, h100) * 1e3,
                            "buckets": len(buckets), "last_bucket_mb": buckets[-1] / 1e6,
                            "overlap_slowdown": slowdown, "allreduce_total_ms": allreduce_ms,
                            "ratio_sm_share_only": (one.step_time_s + share) / one.step_time_s})
        r = rows["ddp"][-1]
        print(f"H100 {head:11s} seq {seq} x {batch} {attn}: 1 GPU {r['one_gpu_ms']:.1f} ms, 8 GPUs (DDP, NVLink) "
              f"{r['eight_gpu_ms']:.1f} ms = {r['ratio']:.3f}x (exposed {r['exposed_ms']:.2f} ms: {r['buckets']} buckets, "
              f"the last {r['last_bucket_mb']:.0f} MB, {r['allreduce_total_ms']:.1f} ms of all-reduce; compute "
              f"{r['overlap_slowdown']:.3f}x slower while overlapped (SM share alone: {r['ratio_sm_share_only']:.3f}x); "
              f"gradient copies {r['grad_copy_ms']:.2f} ms)", flush=True)
    out = ROOT / "benchmarks" / "results" / "bert_large.json"
    out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
