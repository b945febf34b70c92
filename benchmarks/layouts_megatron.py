"""Parallel layouts (sftctl.compiler.layouts) against Megatron-LM's published throughputs.

Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021 (arXiv:2104.04473), Table 1: GPT models of 1.7B to 1T parameters on
Selene (DGX A100 80GB: 8 A100s on NVSwitch, 8 x 200 Gbit/s HDR InfiniBand per node), sequence
length 2048, vocabulary 51,200, activation recomputation, mixed precision; teraFLOP/s per GPU
counted with their equation (3): ``F = 96 B s l h^2 (1 + s / (6h) + V / (16 l h))`` per
iteration, so the published seconds per iteration are ``F / (N * TFLOP/s per GPU)``. Nothing here
is fitted to these figures (or to llm-foundry, torchtitan, TinyLlama, nanoGPT, llm.c): the
prediction is the layout model on the catalog's A100-80GB with the calibrated collectives.

For each row the paper's (t, p) is fixed and the search picks the micro-batch size and schedule
(1F1B or interleaved) as Megatron-LM 2021 ran: unfused attention (``attention="gemm"``), no
sequence parallelism, tensor-parallel collectives exposed, the data-parallel all-reduce after the
pipeline flush, activation recomputation on, plain DDP, Megatron's mixed precision (18 bytes per
parameter: :data:`sftctl.compiler.layouts.MEGATRON`). Also printed: the bubble fractions of the
paper's section 2.2 (``(p-1)/m``, ``/ v`` interleaved, as a share of ideal time; ours is of the
step: ``x / (1 + x)``) and the interleaved schedule's predicted gain on GPT-3 175B on 96 GPUs
(tp8 pp12, the paper's Figure 12 setting) against the abstract's "improve throughput by 10+%".

    python benchmarks/layouts_megatron.py        # writes benchmarks/results/layouts_megatron.json
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

# (params B, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU): Table 1 of arXiv:2104.04473
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200
#: Selene's node: 8 HDR InfiniBand NICs of 200 Gbit/s for compute (NVIDIA DGX A100 user guide)
SELENE_NETWORK_BYTES_PER_S = 8 * 200e9 / 8
MEGATRON_2021 = dict(attention="gemm", overlap_grad_reduce=False, tp_comm_overlap=False, sequence_parallel=False)


def megatron_flops(batch: int, layers: int, hidden: int) -> float:
    """Equation (3) of the paper: FLOPs per iteration with activation recomputation."""
    s, h, l_, v = SEQ, hidden, layers, VOCAB
    return 96 * batch * s * l_ * h * h * (1 + s / (6 * h) + v / (16 * l_ * h))


def main() -> int:
    from sftctl.compiler.layouts import MEGATRON, Links, TransformerShape, bubble_fraction, search
    from sftctl.compiler.target import load_target

    target = load_target("A100-80GB")
    rows, t0 = [], time.monotonic()
    print(f"{'params':>8} {'t':>2} {'p':>3} {'GPUs':>5} {'batch':>5}  {'published':>9} {'predicted':>9} "
          f"{'ratio':>6}  layout chosen (micro-batch, schedule)")
    for params, heads, hidden, layers, t, p, gpus, batch, published_tflops in TABLE_1:
        shape = TransformerShape(layers=layers, hidden=hidden, ffn=4 * hidden, heads=heads, kv_heads=heads,
                                 vocab=VOCAB, seq_len=SEQ, tied_embeddings=True, dtype="float16")
        links = Links("A100-80GB", 8, gpus // 8, None, SELENE_NETWORK_BYTES_PER_S, "slurm")
        got = search(shape, target, links, batch, only={"tp": t, "pp": p, "cp": 1, "dp_sharding": "ddp",
                                                         "checkpointing": True}, precision=MEGATRON,
                     **MEGATRON_2021)
        fitting = [r for r in got if r.fits] or got
        best = fitting[0]
        flops = megatron_flops(batch, layers, hidden)
        published_s = flops / (gpus * published_tflops * 1e12)
        predicted_tflops = flops / (gpus * best.step_time_s) / 1e12
        ratio = best.step_time_s / published_s
        lay = best.layout
        print(f"{params:>7.1f}B {t:>2} {p:>3} {gpus:>5} {batch:>5}  {published_tflops:>6} TF {predicted_tflops:>6.0f} TF "
              f"{ratio:>6.2f}  {lay.label} (b={lay.micro_batch}, m={lay.micro_batches}, {lay.schedule}"
              f"{'' if lay.chunks == 1 else f' v={lay.chunks}'}; bubble {best.bubble_fraction:.0%}, "
              f"comm {best.comm_time_s / best.step_time_s:.0%}, {best.memory_bytes / 2**30:.0f} GiB"
              f"{'' if best.fits else ' DOES NOT FIT'})")
        rows.append({"params_b": params, "tp": t, "pp": p, "gpus": gpus, "batch": batch,
                     "published_tflops_per_gpu": published_tflops, "published_step_s": published_s,
                     "predicted_tflops_per_gpu": predicted_tflops, "predicted_step_s": best.step_time_s,
                     "predicted_over_published_step": ratio, "layout": best.to_dict()})
    ratios = [r["predicted_over_published_step"] for r in rows]
    gmean = math.exp(statistics.fmean(math.log(x) for x in ratios))
    print(f"predicted / published step: geometric mean {gmean:.2f}, range {min(ratios):.2f}-{max(ratios):.2f}, "
          f"{sum(0.8 <= x <= 1.25 for x in ratios)}/{len(ratios)} within 0.8-1.25")

    # the bubble: the paper's (p-1)/m of ideal time vs ours of the step
    bubbles = []
    for p_, m_, v_ in ((8, 8, 1), (8, 32, 1), (8, 32, 2), (12, 12, 4)):
        paper = (p_ - 1) / m_ / v_
        ours = bubble_fraction(p_, m_, v_)
        bubbles.append({"pp": p_, "m": m_, "v": v_, "paper_of_ideal": paper, "ours_of_step": ours,
                        "ours_from_paper": paper / (1 + paper)})
        print(f"bubble p={p_} m={m_} v={v_}: paper (p-1)/(v m) = {paper:.4f} of ideal -> {paper / (1 + paper):.4f} "
              f"of the step; ours {ours:.4f}")

    # interleaving's gain, GPT-3 175B on 96 GPUs (tp8 pp12, d=1)
    gpt3 = TransformerShape(layers=96, hidden=12288, ffn=4 * 12288, heads=96, kv_heads=96, vocab=VOCAB,
                            seq_len=SEQ, tied_embeddings=True, dtype="float16")
    links = Links("A100-80GB", 8, 12, None, SELENE_NETWORK_BYTES_PER_S, "slurm")
    gains = []
    for batch in (12, 24, 36, 48, 60):
        got = search(gpt3, target, links, batch, only={"tp": 8, "pp": 12, "micro_batch": 1, "checkpointing": True},
                     precision=MEGATRON, **MEGATRON_2021)
        plain = min((r for r in got if r.layout.schedule == "1f1b"), key=lambda r: r.step_time_s)
        inter = [r for r in got if r.layout.schedule == "interleaved"]
        if not inter:
            continue
        best_i = min(inter, key=lambda r: r.step_time_s)
        gain = plain.step_time_s / best_i.step_time_s - 1
        gains.append({"batch": batch, "one_f_one_b_s": plain.step_time_s, "interleaved_s": best_i.step_time_s,
                      "interleave": best_i.layout.chunks, "gain": gain})
        print(f"GPT-3 175B, 96 GPUs, batch {batch}: 1F1B {plain.step_time_s:.2f} s, interleaved (v={best_i.layout.chunks})"
              f" {best_i.step_time_s:.2f} s: {gain:+.0%} (paper: 10+% at small batches, shrinking as m grows)")
    doc = {"benchmark": "layouts_megatron", "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "source": "Narayanan et al. 2021, arXiv:2104.04473, Table 1, section 2.2, abstract",
           "accelerator": "A100-80GB (catalog)", "settings": MEGATRON_2021, "precision": "megatron", "rows": rows,
           "geometric_mean_ratio": gmean, "bubbles": bubbles, "interleave_gain": gains,
           "wall_s": time.monotonic() - t0}
    out = Path(__file__).resolve().parent / "results" / "layouts_megatron.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out} in {doc['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
