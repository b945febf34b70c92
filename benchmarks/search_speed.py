"""GEMM schedule search speed and quality on the GEMMs of GPT-2 small training.

For each GEMM class of a GPT-2 small training step (batch 8 x 1024 tokens, n_embd 768, 12
heads, MLP 3072, vocab 50257; forward, backward dX and dW, attention bmms) on an H100 and an
A100-80GB (from the accelerator catalog), measures:

* the branch-and-bound search (``search_gemm``, memo bypassed): candidates in the space,
  candidates scored, wall time, candidates per second (space size / search time);
* the exhaustive scoring of the whole space (``exhaustive_gemm``): wall time and raw scoring
  rate; the chosen time must equal the pruned search's (ratio 1.0);
* the best of torch Inductor's default mm configs (scaled to the shape as Inductor does) under
  the same cost model: ratio of our predicted time to it (<= 1.0; < 1 is a predicted gain).

Prints a table and writes benchmarks/results/search_speed.json.

    python benchmarks/search_speed.py [--repeat 5] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from sftctl.compiler import hardware  # noqa: E402
from sftctl.compiler.costmodel import GemmProblem, gemm_breakdown  # noqa: E402
from sftctl.compiler.target import load_target  # noqa: E402
from sftctl.compiler.search.gemm import (  # noqa: E402
    evaluate_configs, exhaustive_gemm, inductor_mm_configs, inductor_scaled_configs, search_gemm,
)

RESULTS = ROOT / "benchmarks" / "results" / "search_speed.json"

def accelerators() -> list[hardware.Accelerator]:
    """H100 and A100-80GB from the accelerator catalog (sftctl/catalog/accelerators.yaml)."""
    return [hardware.get_accelerator("H100"), hardware.get_accelerator("A100-80GB")]


def gpt2_gemms(batch: int = 8, seq: int = 1024, d: int = 768, heads: int = 12, vocab: int = 50257) -> list[tuple[str, GemmProblem]]:
    """(name, problem) of each GEMM class of one GPT-2 small training step (bf16).

    Linear y = x @ W.T with W (out, in) row-major: forward B is K-contiguous (b_transposed);
    dX = dY @ W (B N-contiguous); dW = dY.T @ X (A M-contiguous, B N-contiguous).
    """
    t, hd, bh = batch * seq, d // heads, batch * heads
    out = []
    for name, k_in, n_out in (("qkv", d, 3 * d), ("attn_proj", d, d), ("mlp_fc", d, 4 * d),
                              ("mlp_proj", 4 * d, d), ("lm_head", d, vocab)):
        out.append((f"{name} fwd", GemmProblem(1, t, n_out, k_in, b_transposed=True)))
        out.append((f"{name} dX", GemmProblem(1, t, k_in, n_out)))
        out.append((f"{name} dW", GemmProblem(1, n_out, k_in, t, a_transposed=True)))
    out += [
        ("attn q@k.T fwd", GemmProblem(bh, seq, seq, hd, b_transposed=True)),
        ("attn p@v fwd", GemmProblem(bh, seq, hd, seq)),
        ("attn dP=dO@v.T", GemmProblem(bh, seq, seq, hd, b_transposed=True)),
        ("attn dV=p.T@dO", GemmProblem(bh, seq, hd, seq, a_transposed=True)),
        ("attn dQ=dS@k", GemmProblem(bh, seq, hd, seq)),
        ("attn dK=dS.T@q", GemmProblem(bh, seq, hd, seq, a_transposed=True)),
    ]
    seen, uniq = set(), []
    for name, p in out:  # dP has the q@k.T signature: keep the first name
        if p not in seen:
            seen.add(p)
            uniq.append((name, p))
    return uniq


def timed(fn, repeat: int):
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return result, statistics.median(times)


def short(cfg: dict | None) -> str:
    if not cfg:
        return "-"
    lay = "" if cfg["layout"] == "as_is" else f" {cfg['layout']}"
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
            f" k{cfg['split_k']} g{cfg['GROUP_M']}{lay}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions of the pruned search (median)")
    ap.add_argument("--exhaustive-repeat", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="first 4 shapes only")
    args = ap.parse_args()

    t_import = time.perf_counter()
    raw_inductor = inductor_mm_configs()
    t_import = time.perf_counter() - t_import
    shapes = gpt2_gemms()[: 4 if args.quick else None]
    rows = []
    for hw in accelerators():
        coeffs = load_target(hw).coeffs
        for name, p in shapes:
            search_gemm(p, hw, coeffs, use_cache=False)  # warm-up (numpy dispatch, caches)
            s, s_t = timed(lambda p=p, hw=hw, coeffs=coeffs: search_gemm(p, hw, coeffs, use_cache=False), args.repeat)
            e, e_t = timed(lambda p=p, hw=hw, coeffs=coeffs: exhaustive_gemm(p, hw, coeffs, use_cache=False),
                           args.exhaustive_repeat)
            ind_cfgs = inductor_scaled_configs(p, raw_inductor)
            ind_t = evaluate_configs(p, hw, ind_cfgs, coeffs)
            j = int(np.argmin(ind_t))
            b = gemm_breakdown(p, hw, s.config, coeffs)
            rows.append({
                "accelerator": hw.name, "gemm": name,
                "problem": dataclasses.asdict(p),
                "flops": p.flops,
                "n_candidates": s.n_candidates, "n_scored": s.n_scored,
                "n_groups": s.n_groups, "n_groups_scored": s.n_groups_scored,
                "pruning_ratio": s.n_candidates / s.n_scored,
                "search_s": s_t, "exhaustive_s": e_t,
                "candidates_per_s": s.n_candidates / s_t,
                "scored_per_s_exhaustive": e.n_scored / e_t,
                "config": s.config, "predicted_s": s.time_s,
                "bound": b["bound"], "sm_limiter": b["sm_limiter"],
                "tflops_predicted": p.flops / s.time_s / 1e12,
                "exhaustive_config": e.config, "exhaustive_s_predicted": e.time_s,
                "ratio_vs_exhaustive": s.time_s / e.time_s,
                "same_config_as_exhaustive": s.config == e.config,
                "inductor_n_configs": len(ind_cfgs), "inductor_best_config": ind_cfgs[j],
                "inductor_best_s_predicted": float(ind_t[j]),
                "ratio_vs_inductor": s.time_s / float(ind_t[j]),
            })

    print(f"\nGEMM schedule search, GPT-2 small training GEMMs ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; numpy {np.__version__}; Inductor configs: {len(raw_inductor)}, "
          f"loaded in {t_import:.1f} s)")
    hdr = (f"{'hw':10s} {'gemm':16s} {'b x m x n x k':24s} {'cands':>7s} {'scored':>6s} {'prune':>6s} "
           f"{'search ms':>9s} {'cands/s':>8s} {'exh ms':>7s} {'exh/s':>7s} {'pred us':>9s} {'TF/s':>5s} "
           f"{'bound':7s} {'vs exh':>6s} {'vs ind':>6s}  config")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        pr = r["problem"]
        shape = f"{pr['batch']}x{pr['m']}x{pr['n']}x{pr['k']}"
        print(f"{r['accelerator']:10s} {r['gemm']:16s} {shape:24s} {r['n_candidates']:7d} {r['n_scored']:6d} "
              f"{r['pruning_ratio']:5.0f}x {r['search_s'] * 1e3:9.2f} {r['candidates_per_s'] / 1e6:7.0f}M "
              f"{r['exhaustive_s'] * 1e3:7.1f} {r['scored_per_s_exhaustive'] / 1e6:6.1f}M {r['predicted_s'] * 1e6:9.1f} "
              f"{r['tflops_predicted']:5.0f} {r['bound']:7s} {r['ratio_vs_exhaustive']:6.3f} {r['ratio_vs_inductor']:6.3f}  "
              f"{short(r['config'])}")
    tot_c = sum(r["n_candidates"] for r in rows)
    tot_s = sum(r["search_s"] for r in rows)
    tot_e = sum(r["exhaustive_s"] for r in rows)
    summary = {
        "gemms": len(rows),
        "candidates": tot_c, "scored": sum(r["n_scored"] for r in rows),
        "search_s_total": tot_s, "exhaustive_s_total": tot_e,
        "candidates_per_s": tot_c / tot_s, "scored_per_s_exhaustive": tot_c / tot_e,
        "pruning_ratio_median": statistics.median(r["pruning_ratio"] for r in rows),
        "all_equal_exhaustive": all(r["ratio_vs_exhaustive"] == 1.0 and r["same_config_as_exhaustive"] for r in rows),
        "ratio_vs_inductor_geomean": float(np.exp(np.mean(np.log([r["ratio_vs_inductor"] for r in rows])))),
        "ratio_vs_inductor_min": min(r["ratio_vs_inductor"] for r in rows),
        "aim_candidates_per_s": 1e6,
    }
    print(f"\n{summary['gemms']} GEMM classes: {tot_c:,} candidates in {tot_s * 1e3:.0f} ms pruned "
          f"({summary['candidates_per_s'] / 1e6:.0f}M candidates/s; median pruning {summary['pruning_ratio_median']:.0f}x), "
          f"{tot_e * 1e3:.0f} ms exhaustive ({summary['scored_per_s_exhaustive'] / 1e6:.1f}M scored/s); "
          f"pruned == exhaustive: {summary['all_equal_exhaustive']}; predicted time vs best Inductor default "
          f"config: geomean {summary['ratio_vs_inductor_geomean']:.3f}, best {summary['ratio_vs_inductor_min']:.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "numpy": np.__version__},
        "accelerators": sorted({r["accelerator"] for r in rows}),
        "summary": summary,
        "rows": rows,
    }, indent=2) + "\n")
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
