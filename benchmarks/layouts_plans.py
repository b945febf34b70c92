"""The layouts the search picks (sftctl.compiler.layouts) for Llama-3-8B, Llama-3-70B (8k and a
32k context), Mixtral-8x7B and a 405B-class model on the catalog's 8-GPU offerings, with step time,
its interval (the accelerator's calibrated error factor for the step's share of exposed
communication, sftctl.compiler.accuracy), memory per rank and $ per million tokens (the offering's
cheapest hourly price in the catalog; its interval the step's).

Shapes are the models' published configurations (HF ``config.json`` of meta-llama/Meta-Llama-3-8B,
-70B, Llama-3.1-405B and mistralai/Mixtral-8x7B-v0.1; no dropout); sequence length 8192 (Mixtral
4096), global batch 4M tokens (Llama 3's pre-training batch, Dubey et al. 2024, section 3.4.1)
rounded to sequences. The run is priced as sftctl.train keeps it (torch mixed precision, 16 bytes
per parameter, eager kernels: :data:`sftctl.compiler.layouts.TORCH_AMP`; context parallelism's
zigzag split; dropless MoE routing at the busiest expert-parallel rank's expected load). For each
context-parallel pick the same layout is also priced with the contiguous split (its slowest
rank), and for each MoE pick with a 1.25 capacity factor (GShard / Switch buffers), to show what
each choice costs. Predictions, not measurements; the links are each offering's catalog figures.

Printed at the end: the closing-note table (per model and node count, the cheapest offering's
plan: layout, step time and interval, $ per 1M tokens and interval) in Markdown, and issue 38's
"Plans" done-when checks (Llama-3-70B on H100:8 x 8 picks tensor parallelism inside the node and
fits; Mixtral-8x7B picks expert parallelism; the 32k-context model picks context parallelism),
each on every H100:8 offering at 8 nodes; the json keeps every row and the checks.

    python benchmarks/layouts_plans.py          # writes benchmarks/results/layouts_plans.json
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

MODELS = {
    "Llama-3-8B": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, seq_len=8192,
                       gated_mlp=True),
    "Llama-3-70B": dict(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256, seq_len=8192,
                        gated_mlp=True),
    "Llama-3-70B-32k": dict(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256,
                            seq_len=32768, gated_mlp=True),
    "Mixtral-8x7B": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=32000, seq_len=4096,
                         gated_mlp=True, experts=8, top_k=2),
    "Llama-3.1-405B": dict(layers=126, hidden=16384, ffn=53248, heads=128, kv_heads=8, vocab=128256, seq_len=8192,
                           gated_mlp=True),
}
NODES = {"Llama-3-8B": (1, 2), "Llama-3-70B": (8, 16), "Llama-3-70B-32k": (8,), "Mixtral-8x7B": (2, 8),
         "Llama-3.1-405B": (32, 64)}
TOKENS_PER_STEP = 4 * 2**20


def main() -> int:
    from sftctl.catalog import cloud_offerings
    from sftctl.compiler.layouts import Links, TransformerShape, choose, price, search
    from sftctl.compiler.layouts.memory import CAPACITY_FACTOR
    from sftctl.compiler.target import load_target

    offerings = {}
    for o in cloud_offerings():
        if o.count == 8 and o.accelerator in ("H100", "H200", "A100-80GB"):
            key = (o.provider, o.instance_type)
            if key not in offerings or o.usd_per_hour < offerings[key].usd_per_hour:
                offerings[key] = o
    rows, t0 = [], time.monotonic()
    for name, dims in MODELS.items():
        shape = TransformerShape(**dims, dropout=False)
        batch = TOKENS_PER_STEP // shape.seq_len
        for nodes in NODES[name]:
            for (provider, itype), o in sorted(offerings.items()):
                target = load_target(o.accelerator)
                links = Links(o.accelerator, 8, nodes, o.intra_node_bytes_per_s, o.inter_node_bytes_per_s,
                              f"{provider}:{itype}")
                best, why = choose(search(shape, target, links, batch))
                if best is None:
                    continue
                usd_per_step_s = o.usd_per_hour * nodes / 3600 / (TOKENS_PER_STEP / 1e6)  # $/1M tokens per s/step
                lo, hi = best.step_time_interval_s
                row = {"model": name, "offering": f"{provider} {itype}", "accelerator": o.accelerator,
                       "nodes": nodes, "fits": best.fits, "why": why,
                       "usd_per_1m_tokens": usd_per_step_s * best.step_time_s,
                       "usd_per_1m_tokens_interval": [usd_per_step_s * lo, usd_per_step_s * hi], **best.to_dict()}
                if best.layout.cp > 1:  # what the contiguous split would cost (its last rank)
                    row["step_time_s_contiguous_cp"] = price(shape, best.layout, target, links,
                                                             cp_load_balance=False).step_time_s
                if shape.experts:  # dropless (priced) against GShard / Switch capacity buffers
                    row["step_time_s_capacity_factor_1.25"] = price(shape, best.layout, target, links,
                                                                    capacity_factor=CAPACITY_FACTOR).step_time_s
                rows.append(row)
                print(f"{name:>15} {provider:>4} {itype:<16} {o.accelerator:<9} x{nodes:<3} "
                      f"{best.layout.label + ('+ckpt' if best.layout.checkpointing else ''):<26} "
                      f"{best.step_time_s:7.2f} s/step [{lo:.2f}-{hi:.2f}]  {best.memory_bytes / 2**30:5.1f} GiB  "
                      f"${usd_per_step_s * best.step_time_s:6.2f}/1M tok{'' if best.fits else '  DOES NOT FIT'}", flush=True)
    checks = done_when(rows)
    table = closing_table(rows)
    print("\n" + table)
    for c in checks:
        print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['check']} (aws p5.48xlarge; every H100 offering: "
              f"{'yes' if c['every_h100_offering'] else 'no'}): {c['got']}")
    doc = {"benchmark": "layouts_plans", "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "tokens_per_step": TOKENS_PER_STEP, "moe_routing": "dropless (expected busiest expert-parallel rank)",
           "cp_split": "zigzag (load-balanced)", "rows": rows, "closing_table_markdown": table, "checks": checks,
           "wall_s": time.monotonic() - t0}
    out = Path(__file__).resolve().parent / "results" / "layouts_plans.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out} in {doc['wall_s']:.0f} s")
    return 0 if all(c["ok"] for c in checks) else 1


def closing_table(rows: list[dict]) -> str:
    """Markdown: per model and node count, the fitting plan with the lowest $ per 1M tokens."""
    lines = ["| model | offering | GPUs | layout | step s [interval] | $ / 1M tokens [interval] | GiB/rank |",
             "|---|---|---|---|---|---|---|"]
    seen: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["nodes"])
        if r["fits"] and (key not in seen or r["usd_per_1m_tokens"] < seen[key]["usd_per_1m_tokens"]):
            seen[key] = r
    for (model, nodes), r in seen.items():
        lo, hi = r["step_time_interval_s"]
        ulo, uhi = r["usd_per_1m_tokens_interval"]
        label = r["layout"] + (" +ckpt" if r["checkpointing"] else "")
        lines.append(f"| {model} | {r['offering']} ({r['accelerator']}) | {8 * nodes} | {label} | "
                     f"{r['step_time_s']:.1f} [{lo:.1f}-{hi:.1f}] | {r['usd_per_1m_tokens']:.2f} "
                     f"[{ulo:.2f}-{uhi:.2f}] | {r['memory_bytes'] / 2**30:.0f} |")
    return "\n".join(lines)


def done_when(rows: list[dict]) -> list[dict]:
    """Issue 38's "Plans" items at 8 nodes: ``ok`` on aws p5.48xlarge (H100:8, 3200 Gbit/s EFA:
    the offering tests/test_layouts.py pins), ``every_h100_offering`` whether it holds on each
    H100 8-GPU offering of the catalog, ``got`` each one's layout."""
    def at(model: str) -> list[dict]:
        return [r for r in rows if r["model"] == model and r["nodes"] == 8 and r["accelerator"] == "H100"]

    out = []
    for model, check, ok in (
            ("Llama-3-70B", "Llama-3-70B on H100:8 x 8 picks TP inside the node and fits",
             lambda r: r["fits"] and 1 < r["tp"] <= 8),
            ("Mixtral-8x7B", "Mixtral-8x7B on H100:8 x 8 picks expert parallelism", lambda r: r["fits"] and r["ep"] > 1),
            ("Llama-3-70B-32k", "a 32k-context model (Llama-3-70B) on H100:8 x 8 picks context parallelism",
             lambda r: r["fits"] and r["cp"] > 1)):
        got = at(model)
        pinned = [r for r in got if r["offering"] == "aws p5.48xlarge"]
        out.append({"check": check, "ok": bool(pinned) and all(ok(r) for r in pinned),
                    "every_h100_offering": bool(got) and all(ok(r) for r in got),
                    "got": {r["offering"]: r["layout"] for r in got}})
    return out


if __name__ == "__main__":
    sys.exit(main())
