"""Trace time and predictions of full-size Hugging Face transformers training steps.

Models are built from their transformers configs on the meta device (random init, nothing
downloaded, no memory): GPT-2 small (``GPT2Config()``, 124M) at 8 x 1024, TinyLlama-1.1B
(``LlamaConfig`` with TinyLlama's sizes: hidden 2048, 22 layers, 32 heads, 4 kv heads,
intermediate 5632, vocab 32000) at 2 x 2048, BERT-base (``BertConfig()``, masked LM) at 32 x 512.
Each is called as Trainer calls it: ``model.train()`` with the config's dropout, a padded batch
with ``attention_mask`` and ``labels``, bf16 autocast with float32 master weights, AdamW. Both
``attn_implementation="sdpa"`` (attention as one flash-attention op) and ``"eager"`` (matmul,
softmax, matmul, materialized) are traced ``REPEAT`` times; then compiled for H100 and H200
(predicted step time and peak memory). Aim: each trace under 20 s on this 2-core machine.

    python benchmarks/trace_transformers.py     # prints a table, writes results/trace_transformers.json
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "trace_transformers.json"
REPEAT = 2


def _models():
    import transformers as T

    return {
        "gpt2-small": (lambda impl: T.GPT2LMHeadModel(T.GPT2Config(attn_implementation=impl)), 8, 1024, False),
        "tinyllama-1.1b": (lambda impl: T.LlamaForCausalLM(T.LlamaConfig(
            hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
            intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048, attn_implementation=impl)),
            2, 2048, False),
        "bert-base": (lambda impl: T.BertForMaskedLM(T.BertConfig(attn_implementation=impl)), 32, 512, True),
    }


def _batch(b: int, s: int, token_types: bool):
    import torch

    ids = torch.zeros(b, s, dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    if token_types:
        batch["token_type_ids"] = torch.zeros_like(ids)
    return batch


def main() -> None:
    import torch

    from sftctl.compiler.frontends.torch import trace_step
    from sftctl.compiler.target import load_target
    from sftctl.compiler.step import compile_graph

    rows = []
    for name, (build, b, s, types) in _models().items():
        for impl in ("sdpa", "eager"):
            times = []
            for _ in range(REPEAT):
                with torch.device("meta"):
                    model = build(impl)
                model.train()
                t0 = time.perf_counter()
                graph, meta = trace_step(model, _batch(b, s, types), lambda m, x: m(**x).loss, autocast_dtype="bfloat16")
                times.append(time.perf_counter() - t0)
            ops = graph.op_counts()
            row = {"model": name, "attn_implementation": impl, "batch": b, "seq": s, "trace_s": times,
                   "trace_s_median": statistics.median(times), "ir_ops": len(graph.nodes),
                   "attention_ops": ops.get("attention", 0), "dropout_masks": ops.get("rng_bernoulli", 0),
                   "params": meta["n_params"], "per_accelerator": {}}
            for acc in ("H100", "H200"):
                c = compile_graph(graph, load_target(acc))
                by_kind: dict[str, float] = {}
                for k in c.kernels:
                    by_kind[k.kind] = by_kind.get(k.kind, 0.0) + k.time_s * 1e3
                row["per_accelerator"][acc] = {
                    "kernels": len(c.kernels), "step_ms": c.compute_time_s * 1e3,
                    "peak_gib": c.peak_memory_bytes / 2**30, "ms_by_kind": by_kind,
                    "tokens_per_s": b * s / c.compute_time_s,
                }
            rows.append(row)
            print(f"{name} {impl}: trace {row['trace_s_median']:.1f} s", file=sys.stderr)
    out = {"date": time.strftime("%Y-%m-%d"), "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
           "dtype": "bfloat16 autocast, float32 master weights", "models": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'model':16} {'attn':6} {'trace s':>8} {'IR ops':>7} {'kernels':>8} {'H100 ms':>8} {'H200 ms':>8} "
          f"{'peak GiB':>9}")
    for r in rows:
        h, h2 = r["per_accelerator"]["H100"], r["per_accelerator"]["H200"]
        print(f"{r['model']:16} {r['attn_implementation']:6} {r['trace_s_median']:>8.1f} {r['ir_ops']:>7} "
              f"{h['kernels']:>8} {h['step_ms']:>8.1f} {h2['step_ms']:>8.1f} {h['peak_gib']:>9.2f}")
    print(f"wrote {RESULTS.relative_to(REPO)}", file=sys.stderr)


if __name__ == "__main__":
    main()
