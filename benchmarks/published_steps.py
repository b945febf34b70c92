"""Predict published end-to-end training steps and compare: predicted / measured per record, the
median per GPU and the spread (largest / smallest ratio).

Every record is a public figure with its source and a quote. None comes from llm-foundry,
torchtitan, TinyLlama, nanoGPT or llm.c: those five are the held-out check of issue 20 and are
never fitted to or used here. Each record names the model (an entrypoint of ``examples/``), the
per-GPU micro-batch, the execution mode, the GPU and the cluster shape it ran on; the prediction
is ``sftctl.compiler.api``'s for one data-parallel rank on that shape (``parallelism``: the
strategy the record used), in seconds per step.

    python benchmarks/published_steps.py            # prints the table, writes results/published_steps.json

Seconds per step measured = tokens per GPU per step / tokens per second per GPU, where a source
gives throughput.

The pick (issue 35 item 6): for **matched groups**, records of the same job on two or more GPU
types, each GPU's USD per token (the cheapest on-demand offering of that GPU in sftctl's catalog,
per GPU-hour, times the step, over the tokens one GPU takes per step) and the **cost regret**
(the chosen GPU's measured cost per token / the best measured - 1) of three rules: sftctl's pick
(the cheapest *predicted* cost per token), sorting by hourly price (SkyPilot's and dstack's
rule), and always taking the fastest GPU (the highest dense bf16 matrix peak, then HBM
bandwidth). Groups match strictly (:data:`STRICT`: entrypoint, sequence, batch per GPU, dtype,
matmul precision, execution mode: only the GPU differs); where fewer than :data:`MIN_GROUPS`
match, it says so and shows the loose matches too (:data:`LOOSE`: the same model and sequence,
batch, precision, mode and cluster free, compared per token).

    python benchmarks/published_steps.py --report   # the report again from the results' rows, no tracing
    python benchmarks/published_steps.py --only "Llama 3.1"   # a trial of the records so named; writes nothing
    python benchmarks/published_steps.py --shard 0/3 & ... --shard 2/3; python benchmarks/published_steps.py --merge 3
    python benchmarks/published_steps.py --graphs DIR   # keep / reuse the traced steps in DIR (pickles)

``--graphs DIR``: the traced step of each (entrypoint, batch, dtype, attention, torch) is pickled in
DIR and read back by later runs, so a change to the cost model re-prices without re-tracing (the
compiler's own trace cache is keyed by every compiler source and retraces after any change). A
pickle's name hashes the key and the sources a trace depends on (:func:`graph_sources`: the
entrypoint's directory, the torch frontend, the IR, attention), so a change to those retraces.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_FA = ("Dao-AILab/flash-attention, training/README.md 'Training speed' (8 x A100 80GB SXM4 400W with NVLink, one node, bf16, sequence length 2048; https://github.com/Dao-AILab/flash-attention/blob/main/training/README.md); per-GPU micro-batch from training/configs/experiment/pile/<model>-flash.yaml at 80 GB; DDP, ZeRO-1 from 760M (src.utils.ddp_zero1: each GPU updates its optimizer shard, priced as our FSDP); FlashAttention, fused bias+GELU GEMMs, fused dropout+add+LayerNorm, apex cross-entropy and AdamW: priced as our torch.compile ('default') mode, the nearest of ours")
_FMS = ("foundation-model-stack/fms-fsdp README.md (IBM, https://github.com/foundation-model-stack/fms-fsdp), 128 A100 (80 GB, IBM's cluster as in the PyTorch blog 'Maximizing training throughput using PyTorch FSDP'), bf16, 4096 tokens (the repo's seq_length), SDPA flash attention, no torch.compile; HSDP shards within each 8-GPU node (priced as FSDP over one node's 8 GPUs; the cross-node gradient all-reduce is left out), FSDP over all 128; gradients reduce-scattered in bf16 (fms_fsdp/policies/mixed_precision.py: bfSixteen = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, ...), the policy get_policies picks where bf16 is supported)")
_H200 = ("issue 11's brief: our measurement on one H200 (GPT-2 small, batch 8 x 1024, bf16 autocast, torch 2.11.0+cu130); "
         "the brief says 'fused AdamW', PyTorch's default AdamW on CUDA is foreach and is what is priced")


def _gpt3(size: str, fn: str, batch: int, tok_s_node: float, quote: str, zero1: bool = False) -> dict:
    return {"name": f"GPT-3 {size}, 2k, {'ZeRO-1' if zero1 else 'DDP'}", "gpu": "A100-80GB",
            "entrypoint": f"examples/gpt/model.py:{fn}",
            "batch_per_gpu": batch, "seq_len": 2048, "dtype": "bfloat16", "mode": "default", "gpus_per_node": 8,
            "nodes": 1, "parallelism": "fsdp" if zero1 else "ddp", "checkpointing": False, "tokens_per_s_per_gpu": tok_s_node / 8,
            "attention": "flash2", "source": _FA, "quote": quote}


def _fms(size: str, fn: str, batch: int, strategy: str, ac: bool, tok_s: float, quote: str) -> dict:
    return {"name": f"Llama {size}, {strategy}", "gpu": "A100-80GB", "entrypoint": f"examples/llama/model.py:{fn}",
            "batch_per_gpu": batch, "seq_len": 4096, "dtype": "bfloat16", "mode": "eager", "gpus_per_node": 8,
            "nodes": 1 if strategy == "HSDP" else 16, "parallelism": "fsdp", "checkpointing": ac,
            "reduce_dtype": "bfloat16", "tokens_per_s_per_gpu": tok_s, "attention": "flash2", "source": _FMS,
            "quote": quote}


_FMS_X = ("foundation-model-stack/fms-fsdp README.md 'Training throughput benchmarks' at commit 5a1ed66 (2024-03-17; "
          "https://github.com/foundation-model-stack/fms-fsdp/blob/5a1ed66f4603762ffa0a5979563241588f82a115/README.md): "
          "'the exact same scripts and configurations' on 128 A100 80G (400 Gbps per node) and 96 H100 80G (800 Gbps "
          "per node): Llama 2 shapes, 4096 tokens, batch 2 per GPU, bf16, SDPA FlashAttention-2, no torch.compile "
          "(eager). HSDP is priced as FSDP over one node's 8 GPUs (the cross-node gradient all-reduce left out), "
          "FSDP over all the GPUs at the node's link rate. 13B's 'Selective AC' recomputes about half the blocks "
          "(its HFU / MFU is 0.59 / 0.51 on A100 and 0.40 / 0.35 on H100, against 4/3 for full AC): priced as "
          "half the blocks checkpointed (the mean of the step without and with full checkpointing). Gradients are "
          "reduce-scattered in bf16: fms_fsdp/policies/mixed_precision.py at that commit, 'bfSixteen = "
          "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)', "
          "the policy fms_fsdp/utils/train_utils.py get_policies picks when bf16 is supported")


def _fms_x(size: str, fn: str, strategy: str, ac: float, a100: float, h100: float) -> list[dict]:
    """The same fms-fsdp job on A100-80GB and on H100 (:data:`_FMS_X`): a strictly matched group."""
    ac_name = {0.0: "No AC", 0.5: "Selective AC", 1.0: "Full AC"}[ac]
    out = []
    for gpu, gpus, gbit, tok_s in (("A100-80GB", 128, 400, a100), ("H100", 96, 800, h100)):
        out.append({"name": f"Llama {size}, {strategy}, bs 2 (fms-fsdp A100/H100)", "gpu": gpu,
                    "entrypoint": f"examples/llama/model.py:{fn}", "batch_per_gpu": 2, "seq_len": 4096,
                    "dtype": "bfloat16", "mode": "eager", "gpus_per_node": 8,
                    "nodes": 1 if strategy == "HSDP" else gpus // 8, "parallelism": "fsdp", "checkpointing": ac,
                    "reduce_dtype": "bfloat16", "inter_node_bytes_per_s": gbit * 1e9 / 8, "tokens_per_s_per_gpu": tok_s, "attention": "flash2",
                    "source": _FMS_X, "quote": f"| {size.split()[-1].lower()} | {strategy} | {ac_name} | 2 | {a100:.0f} "
                                               f"| {h100:.0f} |"})
    return out


_NEMO = ("NVIDIA/NeMo docs/source/performance/performance_summary.md (NeMo 24.07 container, DGX-H100, FP8 precision "
         "through Transformer Engine; https://github.com/NVIDIA/NeMo): TP 1, PP 1, CP 1 rows only, i.e. data parallel "
         "with Megatron's distributed optimizer (ZeRO-1: each GPU updates its 1/N shard); priced as our FSDP (the "
         "optimizer per shard) in the torch.compile ('default') mode with every bf16 contraction at the FP8 rate "
         "(mma_dtype_map), attention in bf16")


def _nemo(name: str, fn: str, batch: int, seq: int, gpus: int, tok_s: float, quote: str) -> dict:
    return {"name": f"{name}, FP8, ZeRO-1 x{gpus}", "gpu": "H100", "entrypoint": fn, "batch_per_gpu": batch, "seq_len": seq,
            "dtype": "bfloat16", "mode": "default", "gpus_per_node": 8, "nodes": gpus // 8, "parallelism": "fsdp",
            "checkpointing": False, "mma_dtype_map": {"bfloat16": "float8"}, "tokens_per_s_per_gpu": tok_s,
            "attention": "cudnn", "source": _NEMO, "quote": quote}


_DGXC = ("NVIDIA/dgxc-benchmarking llama3.1/README_8b.md (DGX Cloud performance recipe, NeMo 24.09 container, "
         "8 x H100 80GB SXM, one node; https://github.com/NVIDIA/dgxc-benchmarking, commit 35a9aec): Llama 3.1 8B, "
         "sequence 8192, TP 1, PP 1, CP 2, MBS 1, GA 32, GBS 128; Transformer Engine (cuDNN fused attention), "
         "Megatron's distributed optimizer (ZeRO-1: priced as our FSDP, the optimizer per shard) in the torch.compile "
         "('default') mode. CP 2 splits each sequence over two GPUs (load-balanced causal halves): each GPU does half "
         "of each sequence's tokens and half its attention, so tokens per GPU per second carry over to one GPU "
         "running the whole 8192-token sequence; the K/V ring exchange is taken as overlapped (not priced). "
         "Measured step = 8192 tokens / (tokens per second / 8)")


def _dgxc(precision: str, step_s: float, tok_s: float, quote: str) -> dict:
    fp8 = precision == "FP8"
    return {"name": f"Llama 3.1 8B, {precision}, ZeRO-1 x8", "gpu": "H100",
            "entrypoint": "examples/llama/model.py:build_llama3_8b", "batch_per_gpu": 1, "seq_len": 8192,
            "dtype": "bfloat16", "mode": "default", "gpus_per_node": 8, "nodes": 1, "parallelism": "fsdp",
            "checkpointing": False, **({"mma_dtype_map": {"bfloat16": "float8"}} if fp8 else {}),
            "tokens_per_s_per_gpu": tok_s / 8, "attention": "cudnn", "source": _DGXC,
            "quote": quote + f" (step {step_s} s at GBS 128: 8192 x 128 / {step_s} = {tok_s:.0f} tokens/s)"}


_NEMO_A100 = ("NVIDIA/NeMo-Megatron-Launcher (now NeMo-Framework-Launcher) README.md section 7.1.2 'Training "
              "Performance Results' at commit 3579cdb3 (2022-09-07; https://github.com/NVIDIA/NeMo-Framework-Launcher): "
              "GPT-3 5B on one DGX A100 node (8 x A100 80GB), bf16 with megatron_amp_O2; conf/training/gpt3/5b.yaml "
              "at that commit: micro_batch_size 2, TP 1, PP 1, sequence 2048, activations_checkpoint_num_layers 0 "
              "(none), distributed_fused_adam (ZeRO-1: priced as our FSDP). NeMo 22.08 attention: Megatron's fused "
              "scale-mask-softmax between two batched GEMMs (the scores materialised; priced as SDPA's math path), "
              "no FlashAttention; priced in the torch.compile ('default') mode for the fused softmax/bias-GELU "
              "kernels")


_LAMBDA = ("lambdal/deeplearning-benchmark (Lambda's GPU benchmarks), pytorch/results/<GPU>/PyTorch_resnet50_AMP/*.txt "
           "at commit aa5addb (https://github.com/lambdal/deeplearning-benchmark/tree/"
           "aa5addb6a53675a649a80036dad548f1c27cbcc4/pytorch/results): NVIDIA DeepLearningExamples' ResNet-50 v1.5 on "
           "one GPU, the same configuration on both (GLOBAL_BATCH 1280 in benchmark.para; the log's PARAMETER line: "
           "data_backend synthetic, batch_size 1280, amp True, static_loss_scale 256, optimizer sgd, momentum 0.9, "
           "memory_format nchw, jit no, world_size 1); measured = batch / the log's Summary train.total_ips "
           "(images per second). Priced as examples/vision build_resnet50 (224 x 224, 1000 classes; Lambda's fused "
           "SE flag is a no-op for ResNet-50) at dtype float16, our mixed precision as torch.cuda.amp runs it "
           "(float32 master weights, float16 convolutions and matmuls), eager dispatch; seq_len 1: a 'token' is one "
           "image. The step is SGD with momentum, not the AdamW we price (25.6 M parameters: a few ms against a "
           "step of 0.5-0.8 s)")


def _lambda(job: str, entrypoint: str, batch: int, seq_len: int, source: str, gpu: str, log: str,
            tok_s: float, quote: str) -> dict:
    """One of Lambda's one-GPU steps (:data:`_LAMBDA`, :data:`_LAMBDA_BERT`) on ``gpu``: float16 AMP,
    eager, the same command on A100 and H100, so each ``job`` is a strictly matched group;
    ``tok_s``: tokens (images for ResNet-50) per second."""
    return {"name": f"{job} (Lambda A100/H100)", "gpu": gpu, "entrypoint": entrypoint, "batch_per_gpu": batch,
            "seq_len": seq_len, "dtype": "float16", "mode": "eager", "gpus_per_node": 1, "nodes": 1,
            "parallelism": "ddp", "checkpointing": False, "tokens_per_s_per_gpu": tok_s,
            "source": source + f"; log: {log}", "quote": quote}


def _lambda_rn50(gpu: str, log: str, ips: float, quote: str) -> dict:
    """Lambda's ResNet-50 AMP step on one ``gpu`` (:data:`_LAMBDA`)."""
    return _lambda("ResNet-50, AMP, bs 1280", "examples/vision/model.py:build_resnet50", 1280, 1, _LAMBDA,
                   gpu, log, ips, quote)


_LAMBDA_BERT = ("lambdal/deeplearning-benchmark, pytorch/results/<GPU>/PyTorch_bert_large_squad_FP16/*.txt at commit "
                "aa5addb (https://github.com/lambdal/deeplearning-benchmark/tree/aa5addb6a53675a649a80036dad548f1c27cbcc4/"
                "pytorch/results): NVIDIA DeepLearningExamples' BERT-large (uncased) SQuAD v1.1 fine-tuning on one GPU, "
                "the same command on both (run_squad.py --train_batch_size=112 --max_seq_length=384 --fp16 "
                "--max_steps=100; GLOBAL_BATCH 112 in benchmark.para; n_gpu 1); measured = 112 sequences / the log's "
                "training_sequences_per_second, 384 tokens each. Priced as examples/bert build_bert_large_squad (the "
                "scores materialised as DeepLearningExamples' modeling.py computes them) at dtype float16, our mixed "
                "precision (float32 master weights, float16 matmuls) as its --fp16 AMP runs, eager dispatch; its "
                "fused bias-GELU (TorchScript) and apex LayerNorm / Adam kernels are priced as torch's eager ones")


def _lambda_bert(gpu: str, log: str, seq_s: float, quote: str) -> dict:
    """Lambda's BERT-large SQuAD FP16 step on one ``gpu`` (:data:`_LAMBDA_BERT`); ``seq_s``: sequences per second."""
    return _lambda("BERT-large SQuAD, FP16, bs 112", "examples/bert/model.py:build_bert_large_squad", 112, 384,
                   _LAMBDA_BERT, gpu, log, seq_s * 384, quote)


RECORDS = [
    {
        "name": "GPT-2 124M, eager", "gpu": "H200", "entrypoint": "examples/gpt/model.py:build_gpt2_small",
        "batch_per_gpu": 8, "seq_len": 1024, "dtype": "bfloat16", "mode": "eager", "gpus_per_node": 1, "nodes": 1,
        "parallelism": "ddp", "checkpointing": False, "measured_step_s": 25.9e-3, "torch": "2.11", "source": _H200,
        "quote": "GPT-2 small (8x1024, bf16) on an H200 ... the same step measured 25.9 ms eager and 22.4 ms under "
                 "torch.compile",
    },
    {
        "name": "GPT-2 124M, torch.compile", "gpu": "H200", "entrypoint": "examples/gpt/model.py:build_gpt2_small",
        "batch_per_gpu": 8, "seq_len": 1024, "dtype": "bfloat16", "mode": "default", "gpus_per_node": 1, "nodes": 1,
        "parallelism": "ddp", "checkpointing": False, "measured_step_s": 22.4e-3, "torch": "2.11", "source": _H200,
        "quote": "GPT-2 small (8x1024, bf16) on an H200 ... the same step measured 25.9 ms eager and 22.4 ms under "
                 "torch.compile",
    },
    _gpt3("125M", "build_gpt3_125m", 32, 1310e3, "| GPT3-125M | 0.5M | 1310k | 0.21 |"),
    _gpt3("355M", "build_gpt3_355m", 16, 503e3, "| GPT3-355M | 0.5M | 503k | 0.55 |"),
    _gpt3("760M", "build_gpt3_760m", 16, 245e3, "| GPT3-760M | 0.5M | 245k | 1.13 |", zero1=True),
    _gpt3("1.3B", "build_gpt3_1_3b", 8, 169e3, "| GPT3-1.3B | 1M | 169k | 1.64 |", zero1=True),
    _gpt3("2.7B", "build_gpt3_2_7b", 4, 85e3, "| GPT3-2.7B | 1M | 85k | 3.27 |", zero1=True),
    _fms("2 7B", "build_llama2_7b", 2, "HSDP", False, 3760,
         "| 7b | 128 * A100 | HSDP | False | 2 | **3760 token/gpu/sec** |"),
    _fms("2 13B", "build_llama2_13b", 1, "HSDP", False, 1700,
         "| 13b | 128 * A100 | HSDP | False | 1 | **1700 token/gpu/sec** |"),
    _fms("34B", "build_llama_34b", 8, "FSDP", True, 772,
         "| 34b | 128 * A100 | FSDP | True | 8 | **772 token/gpu/sec** |"),
    _fms("2 70B", "build_llama2_70b", 6, "FSDP", True, 380,
         "| 70b | 128 * A100 | FSDP | True | 6 | **380 token/gpu/sec** |"),
    _nemo("Llama 2 7B", "examples/llama/model.py:build_llama2_7b", 1, 4096, 8, 16847,
          "| LLAMA2-7B | 8 | 128 | 1 | 4096 | 1 | 1 | 1 | 1 | 16847 | 776 |"),
    _nemo("GPT-3 5B", "examples/gpt/model.py:build_gpt3_5b", 4, 2048, 64, 22521,
          "| GPT3-5B | 64 | 2048 | 4 | 2048 | 1 | 1 | 1 | 1 | 22521 | 736 |"),
    _dgxc("BF16", 12.91, 81222, "| Llama 3.1 8b 24.09 BF16 (TP=1, PP=1, CP=2, MBS=1, GA=32) | Throughput on 8x H100 GPUs "
          "(GBS=128) | ... | Training step time (seconds per step) | 12.91 | ... | Throughput in tokens per second | "
          "81222 |"),
    _dgxc("FP8", 9.67, 108436, "| Llama 3.1 8b 24.09 FP8 (TP=1, PP=1, CP=2, MBS=1, GA=32) | Throughput on 8x H100 GPUs "
          "(GBS=128) | ... | Training step time (seconds per step) | 9.67 | ... | Throughput in tokens per second | "
          "108436 |"),
    {"name": "GPT-3 5B, ZeRO-1 x8", "gpu": "A100-80GB", "entrypoint": "examples/gpt/model.py:build_gpt3_5b",
     "batch_per_gpu": 2, "seq_len": 2048, "dtype": "bfloat16", "mode": "default", "gpus_per_node": 8, "nodes": 1,
     "parallelism": "fsdp", "checkpointing": False, "tokens_per_s_per_gpu": 40345 / 8, "attention": "math",
     "source": _NEMO_A100,
     "quote": "|      |                                 | 1      | 2      | 4      | 8      | 16     | 32      | ... "
              "|      | Tokens per Second               | 40345  | 79815  | ... (5B, 1 node)"},
    *_fms_x("2 7B", "build_llama2_7b", "HSDP", 0.0, 3700, 7500),
    *_fms_x("2 13B", "build_llama2_13b", "FSDP", 0.5, 1800, 3800),
    *_fms_x("34B", "build_llama_34b", "FSDP", 1.0, 700, 1550),
    *_fms_x("2 70B", "build_llama2_70b", "FSDP", 1.0, 370, 800),
    _lambda_rn50("A100-80GB", "A100_80GB_SXM4_v1/PyTorch_resnet50_AMP/19-11-2022_18-30-46.txt", 1582.19,
                 "Summary: train.loss : 4.01066 None train.compute_ips : 1582.44 images/s train.total_ips : "
                 "1582.19 images/s"),
    _lambda_rn50("H100", "H100_80GB_SXM5_v1/PyTorch_resnet50_AMP/14-02-2023_05-07-45.txt", 2615.52,
                 "Summary: train.loss : 3.91063 None train.compute_ips : 2616.25 images/s train.total_ips : "
                 "2615.52 images/s"),
    _lambda_bert("A100-80GB", "A100_80GB_SXM4_v1/PyTorch_bert_large_squad_FP16/19-11-2022_18-45-37.txt", 152.8532966587673,
                 "e2e_train_time : 73.27287173271179  training_sequences_per_second : 152.8532966587673"),
    _lambda_bert("H100", "H100_80GB_SXM5_v1/PyTorch_bert_large_squad_FP16/14-02-2023_05-22-57.txt", 301.1002359507717,
                 "e2e_train_time : 37.1969153881073  training_sequences_per_second : 301.1002359507717"),
]


def measured_s(r: dict) -> float:
    if "measured_step_s" in r:
        return r["measured_step_s"]
    return r["batch_per_gpu"] * r["seq_len"] / r["tokens_per_s_per_gpu"]


_GRAPHS: dict[tuple, Any] = {}  # (entrypoint, batch, dtype) -> traced step: traced once per record
GRAPH_DIR: Path | None = None  # --graphs DIR: traced steps pickled there and reused across runs


def graph_sources(entrypoint: str) -> str:
    """SHA-256 (16 hex digits) of the sources a traced step depends on: the ``.py`` files of the
    entrypoint's directory, of ``sftctl/compiler/frontends``, ``ir.py`` and ``attention.py``."""
    import hashlib

    h = hashlib.sha256()
    comp = ROOT / "sftctl" / "compiler"
    files = [*sorted((ROOT / entrypoint.split(":")[0]).parent.glob("*.py")),
             *sorted((comp / "frontends").rglob("*.py")), comp / "ir.py", comp / "attention.py"]
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _traced(key: tuple, r: dict):
    """Record ``r``'s traced step (``key``: its graph key), from :data:`GRAPH_DIR` when a pickle of
    the same key and sources is there, else traced (and pickled there when :data:`GRAPH_DIR` is set)."""
    import hashlib
    import pickle

    from sftctl.compiler import api
    from sftctl.compiler.attention import with_implementation

    path = None
    if GRAPH_DIR is not None:
        name = hashlib.sha256(repr((key, graph_sources(r["entrypoint"]))).encode()).hexdigest()[:24]
        path = GRAPH_DIR / f"{name}.pkl"
        if path.exists():
            return pickle.loads(path.read_bytes())
    graph = with_implementation(api.trace("torch", r["entrypoint"], str(ROOT), r["batch_per_gpu"], r["dtype"]),
                                r.get("attention", "auto"), r.get("torch"))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{id(graph)}")
        tmp.write_bytes(pickle.dumps(graph))
        tmp.replace(path)
    return graph


#: bytes of a record's ``reduce_dtype`` (torch's FSDP ``MixedPrecision.reduce_dtype``: the dtype its
#: gradients are reduce-scattered in; float32 where a record does not say, as sftctl's prepare runs)
REDUCE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def predict(r: dict, gpu: str | None = None) -> dict:
    """``sftctl.compiler.api``'s prediction of record ``r``'s step (seconds) on its GPU, or on
    ``gpu`` (the same job, cluster shape and strategy on another GPU: the close calls)."""
    from sftctl.compiler import api

    gpu = gpu or r["gpu"]
    key = (r["entrypoint"], r["batch_per_gpu"], r["dtype"], r.get("attention", "auto"), r.get("torch"))
    if key not in _GRAPHS:
        _GRAPHS[key] = _traced(key, r)
    target = api.load_target(gpu)
    compiled = api.compile(_GRAPHS[key], target, matmul_precision="highest", mma_dtype_map=r.get("mma_dtype_map"))
    link = {1: None}.get(r["gpus_per_node"], 450e9 if gpu.startswith("H") else 300e9)
    inter = r.get("inter_node_bytes_per_s", 200e9) if r["nodes"] > 1 else None
    ac = float(r["checkpointing"])  # a fraction of the blocks checkpointed: the step is the mix of none and all

    def step(checkpointing: bool):
        p = api.predict(compiled, target, gpus_per_node=r["gpus_per_node"], nodes=r["nodes"],
                        intra_node_bytes_per_s=link, inter_node_bytes_per_s=inter, mode=r["mode"],
                        param_dtype_bytes=2 if r["dtype"] in ("bfloat16", "float16") else 4,
                        reduce_dtype_bytes=REDUCE_DTYPE_BYTES[r.get("reduce_dtype", "float32")],
                        parallelisms=(r["parallelism"],), checkpointing=(checkpointing,), provider="slurm")
        return p.chosen

    parts = [(w, step(c)) for w, c in ((1 - ac, False), (ac, True)) if w > 0]
    return {k: sum(w * getattr(c, attr) for w, c in parts)
            for k, attr in (("predicted_step_s", "step_time_s"), ("compute_s", "compute_time_s"),
                            ("comm_s", "comm_time_s"))}


#: every record is also predicted on these GPUs (the records' GPUs, all sold on demand): the close calls
CLOSE_CALL_GPUS = ("A100-80GB", "H100", "H200")


def close_calls(rows: list[dict], usd_per_gpu_hour: dict[str, float], error: dict[str, float],
                bias: dict[str, float]) -> dict:
    """How close sftctl's pick is for each record, among the GPUs it is predicted on
    (``row["cross"]``: GPU -> ``{"predicted_step_s"}``, the record's own GPU included).

    Per record: predicted USD per million tokens per GPU, the pick and the runner-up, the margin
    (runner-up / pick - 1), whether their cost intervals (``/`` and ``x`` the GPU's ``error``
    factor) overlap (``plan`` then prints its note), and whether the pick changes when each GPU's
    prediction is divided by its measured median predicted / measured (``bias``: the records'
    own, an inspection, not a fit). Summary: records, overlapping, flipped by the bias, median
    margin."""
    out = []
    for r in rows:
        cross = {g: v for g, v in (r.get("cross") or {}).items() if v and g in usd_per_gpu_hour}
        if len(cross) < 2:
            continue
        tokens = r["batch_per_gpu"] * r["seq_len"]
        cost = {g: usd_per_mtok(v["predicted_step_s"], tokens, usd_per_gpu_hour[g]) for g, v in cross.items()}
        order = sorted(cost, key=cost.get)
        pick, runner = order[0], order[1]
        a, b = cost[pick], cost[runner]
        overlap = a * error[pick] >= b / error[runner]
        debiased = {g: c / bias.get(g, 1.0) for g, c in cost.items()}
        out.append({"name": r["name"], "gpu": r["gpu"], "predicted_usd_per_mtok": cost, "pick": pick,
                    "runner_up": runner, "margin": b / a - 1, "overlap": overlap,
                    "pick_after_bias": min(debiased, key=debiased.get)})
    return {"records": out, "summary": {
        "records": len(out), "overlapping": sum(c["overlap"] for c in out),
        "flipped_by_bias": sum(c["pick_after_bias"] != c["pick"] for c in out),
        "median_margin": statistics.median([c["margin"] for c in out]) if out else None}}


#: a strict match: the same job, only the GPU differs ("precision": the matmuls' dtype, FP8 where mapped)
STRICT = ("entrypoint", "seq_len", "batch_per_gpu", "dtype", "precision", "mode")
#: a loose match, shown when strict groups are too few: the same model and sequence, per token
LOOSE = ("entrypoint", "seq_len")
#: fewer strict groups than this and the report says the data cannot measure the pick
MIN_GROUPS = 5
RULES = {"sftctl": "sftctl's pick (cheapest predicted USD per token)",
         "price": "sorting by hourly price (SkyPilot, dstack)",
         "fastest": "always the fastest GPU (dense bf16 peak, then HBM bandwidth)"}


def _field(r: dict, name: str):
    if name == "precision":
        return (r.get("mma_dtype_map") or {}).get(r["dtype"], r["dtype"])
    return r[name]


def matched_groups(rows: list[dict], key: tuple[str, ...]) -> list[dict]:
    """Rows grouped by the fields of ``key`` (:data:`STRICT` or :data:`LOOSE`), groups that hold
    two or more GPU types only, in the order of their first record: ``{"name", "match": {field:
    value}, "rows": {gpu: row}}``; where a GPU has several records in a group, its first counts."""
    by: dict[tuple, dict] = {}
    for r in rows:
        k = tuple(_field(r, f) for f in key)
        g = by.setdefault(k, {"name": r["name"], "match": dict(zip(key, k)), "rows": {}})
        g["rows"].setdefault(r["gpu"], r)
    return [g for g in by.values() if len(g["rows"]) >= 2]


def usd_per_mtok(step_s: float, tokens_per_gpu_step: int, usd_per_gpu_hour: float) -> float:
    """USD per million tokens on one GPU: ``usd_per_gpu_hour / 3600 x step_s / tokens x 1e6``."""
    return usd_per_gpu_hour / 3600 * step_s / tokens_per_gpu_step * 1e6


def cost_regret(groups: list[dict], usd_per_gpu_hour: dict[str, float], fastest: dict) -> dict:
    """Each rule's choice in each group and its cost regret (measured USD per token of the choice /
    the group's best measured - 1; 0 when the rule takes the best GPU).

    Args:
        groups: :func:`matched_groups`' groups; each row has ``measured_step_s``,
            ``predicted_step_s``, ``batch_per_gpu`` and ``seq_len``.
        usd_per_gpu_hour: GPU -> on-demand USD per GPU-hour.
        fastest: GPU -> a sortable key, larger is faster.

    Returns ``{"groups": [{"name", "match", "measured_usd_per_mtok", "predicted_usd_per_mtok",
    "best", "choice": {rule: gpu}, "regret": {rule: fraction}, "throughput_vs": the cheapest GPU by
    the hour, "throughput_ratio": {gpu: {"measured", "predicted"}}: tokens per second per GPU over
    that GPU's}], "summary": {rule: {"groups",
    "right", "mean", "max"}}}`` (``mean``/``max`` None without groups). Raises KeyError for a GPU
    without a price or a speed key."""
    out = []
    for g in groups:
        rows = g["rows"]
        tokens = {gpu: r["batch_per_gpu"] * r["seq_len"] for gpu, r in rows.items()}
        meas = {gpu: usd_per_mtok(r["measured_step_s"], tokens[gpu], usd_per_gpu_hour[gpu]) for gpu, r in rows.items()}
        pred = {gpu: usd_per_mtok(r["predicted_step_s"], tokens[gpu], usd_per_gpu_hour[gpu]) for gpu, r in rows.items()}
        best = min(meas, key=meas.get)
        choice = {"sftctl": min(pred, key=pred.get), "price": min(rows, key=lambda gpu: usd_per_gpu_hour[gpu]),
                  "fastest": max(rows, key=lambda gpu: fastest[gpu])}
        base = choice["price"]  # throughput per GPU relative to the cheapest-by-the-hour GPU, per token
        speed = {gpu: {kind: (tokens[gpu] / r[key]) / (tokens[base] / rows[base][key])
                       for kind, key in (("measured", "measured_step_s"), ("predicted", "predicted_step_s"))}
                 for gpu, r in rows.items()}
        out.append({"name": g["name"], "match": g.get("match"), "measured_usd_per_mtok": meas,
                    "predicted_usd_per_mtok": pred, "best": best, "choice": choice,
                    "regret": {rule: meas[gpu] / meas[best] - 1 for rule, gpu in choice.items()},
                    "throughput_vs": base, "throughput_ratio": speed})
    summary = {}
    for rule in RULES:
        regrets = [g["regret"][rule] for g in out]
        summary[rule] = {"groups": len(out), "right": sum(g["choice"][rule] == g["best"] for g in out),
                         "mean": statistics.fmean(regrets) if regrets else None, "max": max(regrets, default=None)}
    return {"groups": out, "summary": summary}


def per_gpu(rows: list[dict]) -> dict[str, dict]:
    """GPU -> ``{"records", "median", "spread"}`` of predicted / measured (``ratio``): the median and
    the largest / smallest ratio on that GPU."""
    by: dict[str, list[float]] = {}
    for row in rows:
        by.setdefault(row["gpu"], []).append(row["ratio"])
    return {g: {"records": len(v), "median": statistics.median(v), "spread": max(v) / min(v)} for g, v in by.items()}


def on_demand_prices(gpus) -> dict[str, dict]:
    """GPU -> its cheapest on-demand offering in sftctl's catalog (:func:`sftctl.catalog.cloud_offerings`),
    per GPU: ``{"usd_per_gpu_hour", "offering", "source"}``. Raises KeyError for a GPU no cloud sells."""
    from sftctl.catalog import cloud_offerings

    out = {}
    for gpu in gpus:
        offers = [o for o in cloud_offerings() if o.accelerator == gpu and o.count]
        o = min(offers, key=lambda o: o.usd_per_hour / o.count) if offers else None
        if o is None:
            raise KeyError(f"no cloud in sftctl's catalog sells {gpu}")
        out[gpu] = {"usd_per_gpu_hour": o.usd_per_hour / o.count,
                    "offering": f"{o.provider} {o.instance_type} ({gpu}:{o.count}) in {o.region} at "
                                f"${o.usd_per_hour:,.2f}/h on demand", "source": o.source}
    return out


def fastest_key(gpu: str) -> tuple[float, float]:
    """How fast ``gpu`` is on paper: (dense bf16 matrix peak FLOP/s, HBM bytes/s)."""
    from sftctl.catalog.accelerators import get_accelerator

    a = get_accelerator(gpu)
    return a.matrix_peak("bfloat16"), a.hbm_bytes_per_s


def pick_report(rows: list[dict]) -> dict:
    """The per-GPU accuracy and the cost regret of each rule on the strict groups, and on the loose
    ones when the strict are fewer than :data:`MIN_GROUPS`; prints it."""
    gpus = sorted({r["gpu"] for r in rows})
    prices = on_demand_prices(gpus)
    usd = {g: p["usd_per_gpu_hour"] for g, p in prices.items()}
    speed = {g: fastest_key(g) for g in gpus}
    gpu_stats = per_gpu(rows)
    for g, st in gpu_stats.items():
        print(f"{g:10s} {st['records']:2d} records  median predicted/measured {st['median']:.2f}  "
              f"spread (largest / smallest) {st['spread']:.2f}x  price ${usd[g]:.3f}/GPU-h: {prices[g]['offering']}")
    report = {"per_gpu": gpu_stats, "prices": prices, "rules": RULES}
    from sftctl.compiler.accuracy import factor

    cc_gpus = sorted({g for r in rows for g in (r.get("cross") or {})} | set(gpus))
    cc_usd = {g: p["usd_per_gpu_hour"] for g, p in on_demand_prices(cc_gpus).items()}
    cc = close_calls(rows, cc_usd, {g: factor(g) for g in cc_gpus},
                     {g: st["median"] for g, st in gpu_stats.items()})
    report["close_calls"] = cc
    if cc["records"]:
        print(f"close calls: each record predicted on {', '.join(cc_gpus)} (cost intervals from "
              "calibrations/accuracy/<gpu>.json)")
        for c in cc["records"]:
            costs = ", ".join(f"{g} ${v:.3g}" for g, v in c["predicted_usd_per_mtok"].items())
            flip = c["pick_after_bias"] != c["pick"]
            print(f"  {c['name']:28s} predicted USD/Mtok {costs}: pick {c['pick']}, runner-up {c['runner_up']} "
                  f"{c['margin']:+.1%}{', within the error' if c['overlap'] else ''}"
                  f"{'; the per-GPU median bias flips it to ' + c['pick_after_bias'] if flip else ''}")
        s = cc["summary"]
        print(f"  {s['overlapping']} of {s['records']} picks lie within the prediction's error of the runner-up; "
              f"median margin {s['median_margin']:.1%}; the measured per-GPU median bias flips {s['flipped_by_bias']}")
    for label, key in (("strict", STRICT), ("loose", LOOSE)):
        groups = matched_groups(rows, key)
        res = cost_regret(groups, usd, speed)
        report[label] = dict(res, match=list(key))
        print(f"{label} matched groups (same {', '.join(key)}; two or more GPU types): {len(groups)}")
        for g in res["groups"]:
            costs = ", ".join(f"{gpu} ${c:.3g}/Mtok (predicted ${g['predicted_usd_per_mtok'][gpu]:.3g})"
                              for gpu, c in g["measured_usd_per_mtok"].items())
            regrets = ", ".join(f"{rule} {g['choice'][rule]} {g['regret'][rule]:+.1%}" for rule in RULES)
            speeds = ", ".join(f"{gpu} {v['predicted']:.2f} predicted / {v['measured']:.2f} measured"
                               for gpu, v in g["throughput_ratio"].items() if gpu != g["throughput_vs"])
            print(f"  {g['name']}: {costs}; best {g['best']}; {regrets}; throughput over {g['throughput_vs']}'s: "
                  f"{speeds}")
        for rule, s in res["summary"].items():
            if s["groups"]:
                print(f"  {RULES[rule]}: right in {s['right']} of {s['groups']}, mean regret {s['mean']:.1%}, "
                      f"max {s['max']:.1%}")
        if label == "strict" and len(groups) >= MIN_GROUPS:
            break
        if label == "strict":
            print(f"  too few strict matches to measure the pick ({len(groups)} < {MIN_GROUPS}); the loose matches "
                  "below may differ in batch, precision, mode or cluster, so their regret mixes the GPU with the "
                  "software")
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = ROOT / "benchmarks" / "results" / "published_steps.json"
    if "--report" in argv:  # the pick's report again from the recorded rows, without tracing
        doc = json.loads(out.read_text())
        doc["pick"] = pick_report(doc["rows"])
        doc["summary"]["per_gpu"] = doc["pick"]["per_gpu"]
        out.write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    only = argv[argv.index("--only") + 1] if "--only" in argv else None  # a trial: these records, nothing written
    if "--graphs" in argv:
        global GRAPH_DIR
        GRAPH_DIR = Path(argv[argv.index("--graphs") + 1])
    if "--merge" in argv:  # the shards' rows (below), in RECORDS order, into the results
        n = int(argv[argv.index("--merge") + 1])
        shards = [out.with_name(f"published_steps.shard{i}of{n}.json") for i in range(n)]
        by_name = {(r["name"], r["gpu"]): r for f in shards for r in json.loads(f.read_text())}
        rows = [by_name[(r["name"], r["gpu"])] for r in RECORDS]
        for f in shards:
            f.unlink()
        return _finish(rows, out)
    shard = tuple(int(v) for v in argv[argv.index("--shard") + 1].split("/")) if "--shard" in argv else None
    mine = _shards(shard[1])[shard[0]] if shard else set(range(len(RECORDS)))
    rows = []
    for idx, r in enumerate(RECORDS):
        if (only and only not in r["name"]) or idx not in mine:
            continue
        rows.append(_row(r))
    if shard:  # one process of several (--shard i/n, then --merge n): its rows only
        out.with_name(f"published_steps.shard{shard[0]}of{shard[1]}.json").write_text(json.dumps(rows) + "\n")
        return 0
    return _finish(rows, None if only else out)


def _shards(n: int) -> list[set[int]]:
    """Record indexes split into ``n`` shards of about equal tracing work: the records of one traced
    graph (entrypoint, batch) stay together, each group weighed by its model's size in the name."""
    import re

    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(RECORDS):
        groups.setdefault((r["entrypoint"], r["batch_per_gpu"]), []).append(i)
    load, out = [0.0] * n, [set() for _ in range(n)]

    def weight(key: tuple) -> float:
        m = re.search(r"(\d+)b", key[0].split(":")[1])
        return (int(m.group(1)) if m else 1) ** 0.5 * (1 + len(groups[key]))

    for key in sorted(groups, key=weight, reverse=True):
        j = load.index(min(load))
        load[j] += weight(key)
        out[j].update(groups[key])
    return out


def _row(r: dict) -> dict:
    """Record ``r`` predicted on its GPU and on the :data:`CLOSE_CALL_GPUS`: its results row."""
    t0 = time.perf_counter()
    pred = predict(r)
    meas = measured_s(r)
    cross = {r["gpu"]: {"predicted_step_s": pred["predicted_step_s"]}}
    for gpu in CLOSE_CALL_GPUS:
        if gpu != r["gpu"]:
            try:
                cross[gpu] = {"predicted_step_s": predict(r, gpu)["predicted_step_s"]}
            except Exception as e:  # noqa: BLE001 e.g. FP8 matmuls on a GPU without them: no close call there
                cross[gpu] = None
                print(f"  {r['name']} on {gpu}: not predicted ({type(e).__name__}: {str(e)[:80]})")
    row = dict(r, measured_step_s=meas, **pred, ratio=pred["predicted_step_s"] / meas,
               predict_s=round(time.perf_counter() - t0, 1), cross=cross)
    print(f"{r['name']:28s} {r['gpu']:10s} predicted {pred['predicted_step_s'] * 1e3:9.1f} ms  "
          f"measured {meas * 1e3:9.1f} ms  predicted/measured {row['ratio']:.2f}", flush=True)
    return row


def _finish(rows: list[dict], out: Path | None) -> int:
    """Summary and pick report of ``rows``; written to ``out`` unless None (a trial)."""
    by_gpu: dict[str, list[float]] = {}
    for row in rows:
        by_gpu.setdefault(row["gpu"], []).append(row["ratio"])
    ratios = [row["ratio"] for row in rows]
    summary = {"median_per_gpu": {g: statistics.median(v) for g, v in by_gpu.items()},
               "median": statistics.median(ratios), "spread": max(ratios) / min(ratios), "records": len(rows)}
    for g, m in summary["median_per_gpu"].items():
        print(f"median predicted/measured on {g}: {m:.2f}")
    print(f"all: median {summary['median']:.2f}, spread (largest / smallest) {summary['spread']:.2f}x")
    pick = pick_report(rows)
    summary["per_gpu"] = pick["per_gpu"]
    if out is None:
        return 0
    out.write_text(json.dumps({"summary": summary, "pick": pick, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
