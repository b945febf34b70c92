"""Compile time of GPT-2 small's whole training step for every catalog accelerator.

GPT-2 small (124M parameters, random weights, built in code), global batch 8 x 1024 tokens,
bf16 autocast, AdamW: trace once (fake tensors), then fuse, search every GEMM class's schedule
and cost every kernel, for each accelerator, with the disk cache off. The peer in the same run:
exhaustive search of the same GEMM classes (every candidate scored) on one accelerator, which
the pruned search must match exactly. Aim: under 30 s per accelerator.

    python benchmarks/compile_time.py        # prints a table, writes results/compile_time.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "compile_time.json"


def main() -> None:
    os.environ.setdefault("SFTCTL_HOME", tempfile.mkdtemp(prefix="sftctl-bench-"))
    from sftctl.compiler.driver import trace_model
    from sftctl.compiler.fusion import fuse
    from sftctl.compiler.hardware import get_accelerator, load_accelerators
    from sftctl.compiler.search import gemm as gemm_search
    from sftctl.compiler.step import compile_graph
    from sftctl.compiler.target import load_target

    t0 = time.perf_counter()
    graph = trace_model("torch", "examples/gpt/model.py:build_gpt2_small", str(REPO), 8, "bfloat16", use_cache=False)
    trace_s = time.perf_counter() - t0
    rows = []
    for name in load_accelerators():
        hw = get_accelerator(name)
        gemm_search.clear_cache()
        t0 = time.perf_counter()
        c = compile_graph(graph, load_target(hw))
        rows.append({
            "accelerator": name, "compile_s": time.perf_counter() - t0, "kernels": len(c.kernels),
            "candidates": c.candidates, "scored": c.scored, "step_ms": c.compute_time_s * 1e3,
            "peak_gib": c.peak_memory_bytes / 2**30,
            "candidates_per_s": c.candidates / max(c.search_s, 1e-9),
        })
    # peer: exhaustive search of every GEMM class on H200 must give the same times
    hw = get_accelerator("H200")
    coeffs = load_target(hw).coeffs
    # the classes as the benchmark has always searched them: traced dtype, no out_dtype/epilogue FLOPs
    classes = {dataclasses.replace(k.gemm, out_dtype="same", epilogue_flops_per_elem=0.0)
               for k in fuse(graph) if k.kind == "gemm"}
    t_ex = t_pr = 0.0
    mismatches = 0
    scored_ex = 0
    for p in classes:
        gemm_search.clear_cache()
        t0 = time.perf_counter()
        ex = gemm_search.exhaustive_gemm(p, hw, coeffs)
        t_ex += time.perf_counter() - t0
        gemm_search.clear_cache()
        t0 = time.perf_counter()
        pr = gemm_search.search_gemm(p, hw, coeffs)
        t_pr += time.perf_counter() - t0
        scored_ex += ex.n_scored
        mismatches += (ex.config != pr.config) or (ex.time_s != pr.time_s)

    print(f"\nGPT-2 small, batch 8 x 1024, bf16: {len(graph.nodes):,} IR ops, traced in {trace_s:.1f} s "
          f"({platform.machine()}, {os.cpu_count()} cores)")
    print(f"{'accelerator':12s} {'compile s':>9s} {'kernels':>7s} {'candidates':>11s} {'scored':>8s} "
          f"{'cand/s':>10s} {'pred ms/step':>12s} {'peak GiB':>8s}")
    for r in rows:
        print(f"{r['accelerator']:12s} {r['compile_s']:9.2f} {r['kernels']:7d} {r['candidates']:11,d} {r['scored']:8,d} "
              f"{r['candidates_per_s']:10.2e} {r['step_ms']:12.2f} {r['peak_gib']:8.2f}")
    print(f"\nH200, {len(classes)} GEMM classes: exhaustive {t_ex:.2f} s ({scored_ex:,} scored, "
          f"{scored_ex / t_ex:.2e} scored/s), pruned {t_pr:.3f} s: {t_ex / t_pr:.0f}x faster, "
          f"{mismatches} mismatches (must be 0)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        "model": "gpt2-small", "batch": "8x1024", "dtype": "bfloat16", "ir_ops": len(graph.nodes), "trace_s": trace_s,
        "per_accelerator": rows,
        "h200_exhaustive": {"gemm_classes": len(classes), "exhaustive_s": t_ex, "pruned_s": t_pr,
                            "exhaustive_scored": scored_ex, "mismatches": mismatches},
    }, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
