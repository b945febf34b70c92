"""Trace and compile time of full-size ResNet-50 and ViT-B/16 training steps (224 x 224).

Models are ``examples/vision/model.py`` (``torch.nn``, random weights, built on the meta device:
no memory), global batch 32, bf16 autocast with float32 master weights, AdamW, ResNet-50's
batch norm in train mode (running statistics are step outputs). Each model is traced ``REPEAT``
times with the trace cache off (the first includes torch's warm-up); then fused, every GEMM and
convolution scheduled and every kernel costed for H100 (and H200), with the step predicted in
each execution mode (eager, ``torch.compile`` default, sftensor). Aim: each trace under 20 s
on this 2-core machine.

    python benchmarks/vision_trace.py        # prints a table, writes results/vision_trace.json
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "vision_trace.json"
MODELS = {"resnet50": "examples/vision/model.py:build_resnet50", "vit_b16": "examples/vision/model.py:build_vit_b16"}
BATCH = 32
DTYPE = "bfloat16"
REPEAT = 3


def main() -> None:
    os.environ.setdefault("SFTCTL_HOME", tempfile.mkdtemp(prefix="sftctl-bench-"))
    from sftctl.compiler.driver import trace_model
    from sftctl.compiler.target import load_target
    from sftctl.compiler.step import compile_graph

    rows = []
    for name, entry in MODELS.items():
        times = []
        for _ in range(REPEAT):
            t0 = time.perf_counter()
            graph = trace_model("torch", entry, str(REPO), BATCH, DTYPE, use_cache=False)
            times.append(time.perf_counter() - t0)
        ops = graph.op_counts()
        row = {"model": name, "trace_s": times, "trace_s_median": statistics.median(times), "ir_ops": len(graph.nodes),
               "conv_nodes": ops.get("conv", 0), "dot_nodes": ops.get("dot_general", 0),
               "params": sum(n.type.numel for n in graph.inputs_with_role("param")), "per_accelerator": {}}
        for acc in ("H100", "H200"):
            t0 = time.perf_counter()
            c = compile_graph(graph, load_target(acc))
            by_kind: dict[str, float] = {}
            for k in c.kernels:
                kind = k.label.split()[0] if k.kind == "gemm" else k.kind
                by_kind[kind] = by_kind.get(kind, 0.0) + k.time_s * 1e3
            row["per_accelerator"][acc] = {
                "compile_s": time.perf_counter() - t0, "kernels": len(c.kernels), "step_ms": c.compute_time_s * 1e3,
                "peak_gib": c.peak_memory_bytes / 2**30, "ms_by_kind": by_kind,
                "max_roofline_fraction": max(k.roofline_fraction for k in c.kernels),
                "images_per_s": BATCH / c.compute_time_s,
                "step_ms_by_mode": {m: c.mode_time_s(m) * 1e3 for m in ("eager", "default", "sftensor")},
                "peak_gib_by_mode": {m: c.mode_peak_bytes(m) / 2**30 for m in ("eager", "default", "sftensor")},
            }
        rows.append(row)
    out = {"date": time.strftime("%Y-%m-%d"), "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
           "batch": BATCH, "image": 224, "dtype": DTYPE, "models": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'model':10} {'trace s (median of %d)' % REPEAT:>24} {'IR ops':>7} {'kernels':>8} "
          f"{'H100 ms eager/default/sftensor':>31} {'peak GiB':>9} {'max roofline':>13}")
    for r in rows:
        h = r["per_accelerator"]["H100"]
        ms = "/".join(f"{h['step_ms_by_mode'][m]:.1f}" for m in ("eager", "default", "sftensor"))
        print(f"{r['model']:10} {r['trace_s_median']:>24.1f} {r['ir_ops']:>7} {h['kernels']:>8} {ms:>31} "
              f"{h['peak_gib']:>9.2f} {h['max_roofline_fraction']:>13.2f}")
    print(f"wrote {RESULTS.relative_to(REPO)}", file=sys.stderr)


if __name__ == "__main__":
    main()
